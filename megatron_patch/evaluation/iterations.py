"""`mpatch eval --all-iterations`: every iteration a training run saved, evaluated in turn, and each metric drawn
against the iteration next to the run's training loss (``log/metrics.jsonl`` beside its ``checkpoint/``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_patch.checkpoint_files.layout import ITERATION_DIR
from megatron_patch.errors import UserError

# matplotlib (0.5-1 s) is imported inside ``plot``: `mpatch eval` without --all-iterations never draws.

PLOT = "metrics.png"
SUMMARY = "all_iterations.json"
# The largest value drawn: matplotlib's axis ticks fail on values near float's maximum (a log's loss of 1e308:
# "arange: cannot compute length"), and no loss or metric worth drawing comes near it.
DRAWABLE = 1e300


def saved_iterations(load_dir: str | Path) -> list[tuple[int, Path]]:
    """(iteration, its folder) of every ``iter_XXXXXXX`` under a run's checkpoint folder, in order (partial
    folders are hidden names, never listed)."""
    folder = Path(load_dir)
    found = sorted((int(match.group(1)), entry) for entry in (folder.iterdir() if folder.is_dir() else ())
                   if entry.is_dir() and (match := ITERATION_DIR.fullmatch(entry.name)))
    # a run folder is untrusted: an iteration that is a link is another folder's weights under this run's number
    # (`mpatch verify` refuses one leading outside as well)
    linked = next((entry for _, entry in found if entry.is_symlink()), None)
    if linked is not None:
        raise UserError(f"--all-iterations: {linked} is a symlink (to {linked.resolve()}): a run's iterations are "
                        "folders of its own; evaluate that folder alone with --load-dir, or copy it in")
    if not found:
        raise UserError(f"--all-iterations: {load_dir} holds no saved iteration (iter_XXXXXXX): give a training "
                        "run's checkpoint/ folder")
    return found


def training_losses(load_dir: str | Path) -> dict[int, float]:
    """The loss of each iteration in the run's ``log/metrics.jsonl`` (the folder above ``load_dir``); the later
    record of an iteration written twice wins (a resumed run drops the records it trains again, but a log copied
    together from two runs may hold both). Lines that do not read are skipped; {} without a log."""
    path = Path(load_dir).absolute().parent / "log" / "metrics.jsonl"
    losses: dict[int, float] = {}
    if not path.is_file():
        return losses
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("iteration"), int) \
                    and isinstance(record.get("loss"), (int, float)):
                losses[record["iteration"]] = float(record["loss"])
    return losses


def plot(points: list[dict], losses: dict[int, float], path: Path) -> list[str]:
    """One panel per metric: its value at each evaluated iteration, the training loss on a second axis. Values it
    cannot draw (not finite, or beyond ``DRAWABLE``) are left out; returns a note for each series that lost any."""
    notes = []

    def drawable(what: str, series: list[tuple[int, float]]) -> list[tuple[int, float]]:
        left = [i for i, v in series if not (math.isfinite(v) and abs(v) <= DRAWABLE)]
        if left:
            notes.append(f"the plot leaves out {what} at iteration {', '.join(map(str, left))}: not finite, or "
                         f"beyond {DRAWABLE:g}")
        return [(i, v) for i, v in series if i not in left]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = sorted({name for point in points for name in point["metrics"]})
    columns = max(1, min(3, len(names)))
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.6 * rows), squeeze=False)
    loss = drawable("the training loss", sorted(losses.items()))
    for ax, name in zip(axes.flat, names):
        shown = drawable(name, [(p["iteration"], p["metrics"][name]) for p in points if name in p["metrics"]])
        ax.plot([i for i, _ in shown], [v for _, v in shown], "o-", color="tab:blue", label=name)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if loss:
            loss_ax = ax.twinx()
            loss_ax.plot([i for i, _ in loss], [v for _, v in loss], "-", color="tab:gray", linewidth=0.8,
                         alpha=0.7, label="training loss")
            loss_ax.set_ylabel("training loss", color="tab:gray", fontsize=8)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return notes

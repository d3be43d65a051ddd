"""The on-disk layout of Megatron checkpoints, shared by everything that reads or writes one.

    ROOT/latest_checkpointed_iteration.txt   "release" (converted or exported weights) or the newest
                                             complete iteration, one line
    ROOT/release/                            the weights of a converted or exported checkpoint
    ROOT/iter_0000010/                       one training checkpoint per saved iteration

Folders appear complete or not at all: everything is written under a hidden sibling
``.NAME.mpatch-partial.PID`` and renamed onto its name once complete; the tracker moves last. A
failure removes the partial folder; an interrupted run (even ``kill -9``) leaves at most a folder
whose name says it is partial, which the next writer removes once its process is gone.

Also here: the torch_dist model loader every reader uses, which tolerates the transformer-engine
``_extra_state`` objects a checkpoint written without TE does not hold.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import Iterator

from megatron_patch.errors import UserError

TRACKER_NAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"
ITERATION_DIR = re.compile(r"iter_(\d{7})")
PARTIAL_TAG = ".mpatch-partial."


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def is_iteration_dir(folder: str | Path) -> bool:
    return ITERATION_DIR.fullmatch(Path(folder).name) is not None


def read_tracker(root: str | Path) -> int | str | None:
    """What ``root``'s tracker says: ``"release"``, an iteration number, or None without a tracker."""
    tracker = Path(root) / TRACKER_NAME
    if not tracker.is_file():
        return None
    try:
        text = tracker.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{tracker} is unreadable ({exc}): the checkpoint is damaged")
    if text == RELEASE:
        return RELEASE
    if text.isdigit():
        return int(text)
    raise UserError(f"{tracker} says '{text[:40]}', neither 'release' nor an iteration number: the checkpoint is damaged")


def write_tracker(root: str | Path, value: int | str) -> None:
    """Point ``root``'s tracker at an iteration or at ``"release"``; written aside, then renamed."""
    if value != RELEASE and not isinstance(value, int):
        raise ValueError(f"a tracker holds 'release' or an iteration number, not {value!r}")
    tracker = Path(root) / TRACKER_NAME
    tmp = tracker.with_name(f".{TRACKER_NAME}.tmp.{os.getpid()}")
    tmp.write_text(str(value))  # as Megatron-LM writes it: no newline
    os.replace(tmp, tracker)


# --- folders that appear complete or not at all --------------------------------------------------

def partial_dir(target: str | Path, pid: int | None = None) -> Path:
    """The hidden sibling ``target`` is written in by process ``pid`` (default: this one)."""
    target = Path(target)
    return target.parent / f".{target.name}{PARTIAL_TAG}{pid or os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(target: str | Path) -> None:
    """Remove partial folders of ``target`` whose writing process is gone."""
    target = Path(target)
    for p in target.parent.glob(f".{target.name}{PARTIAL_TAG}*"):
        try:
            pid = int(p.name.rsplit(".", 1)[-1])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def publish(tmp: str | Path, target: str | Path) -> None:
    """Make the finished folder ``tmp`` the ``target``; an old ``target`` is replaced only now."""
    tmp, target = Path(tmp), Path(target)
    if target.exists():
        old = target.parent / f".{target.name}.mpatch-replaced.{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a fresh partial folder that becomes ``target`` when the block finishes without error."""
    target = Path(target)
    remove_stale_partials(target)
    tmp = partial_dir(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --- torch_dist model weights ----------------------------------------------------------------------

def without_missing_extra_state(sharded: dict, stored_keys: set[str]) -> dict:
    """``sharded`` (a model's sharded state dict, possibly nested) without the transformer-engine
    ``_extra_state`` objects the checkpoint does not hold: they carry only FP8 bookkeeping, which
    starts afresh, and a checkpoint written with the local spec (on CPU) has none."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out = {}
    for key, value in sharded.items():
        if isinstance(value, dict):
            out[key] = without_missing_extra_state(value, stored_keys)
        elif not (isinstance(value, ShardedObject) and key.endswith("_extra_state") and value.unique_key not in stored_keys):
            out[key] = value
    return out


def load_models_torch_dist(models: list, folder: str | Path) -> None:
    """Fill a rank's model chunks (GPTModels; one without a virtual pipeline) from the torch_dist
    weights in ``folder``, at whatever layout they were saved. All chunks load in one
    ``dist_checkpointing.load``: its integrity check wants the request of all ranks together to cover
    every stored shard, which one chunk alone does not."""
    from megatron.core import dist_checkpointing

    from megatron_patch.convert.torch_dist import TorchDistReader

    stored = TorchDistReader(folder).keys()
    request = {f"model{i}": without_missing_extra_state(m.sharded_state_dict(), stored) for i, m in enumerate(models)}
    state = dist_checkpointing.load(request, str(folder))
    for i, model in enumerate(models):
        missing, unexpected = model.load_state_dict(state[f"model{i}"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            where = f" (model chunk {i})" if len(models) > 1 else ""
            raise UserError(f"the torch_dist checkpoint in {folder} does not fit the model{where}: "
                            f"missing {missing[:5]}, unexpected {unexpected[:5]}")

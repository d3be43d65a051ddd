"""report.json (every number), report.md (verdict and tables) and error_by_layer.png.

``mpatch align --report-dir`` writes them into a partial folder that is published whole (``cli/align.py``,
docs/outputs.md), so a report folder never holds a half-written report.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from megatron_patch.align.bounds import FP32_REL_L2, fp32_rel_l2_limit
from megatron_patch.align.points import EVERY_EXPERT, EVERY_ID, every_expert_point, router_point

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.

PLOT_NAME = "error_by_layer.png"


def _fmt(x, spec=".2e") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return format(x, spec)


def _short(name: str) -> str:
    if name.startswith("layers."):
        _, i, p = name.split(".")
        return f"L{i} {'all-E' if p == EVERY_EXPERT else p[:4]}"
    return {"embedding": "embed", EVERY_ID: "all ids", "final_norm": "norm", "logits": "logits"}[name]


def plot(result: dict, path: Path) -> None:
    # matplotlib (0.3 s to import) only where a plot is drawn
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): no display is looked for

    v = result["verdict"]
    points = v["points"]
    xs = list(range(len(points)))
    tiny = 1e-12  # log axis: exact agreement (and a point no token was left to judge) is drawn at the bottom
    test = [max(p["metrics"].get("rel_l2", 0.0), tiny) for p in points]
    fig, ax = plt.subplots(figsize=(max(8, len(points) * 0.32), 4.8))
    tested = result["compared"]["tested"].split(" (")[0].split(" from ")[0]
    ax.semilogy(xs, test, "o-", color="tab:blue", label=f"{tested} vs HF fp32", zorder=3)
    floor = [max((p["floor"] or {}).get("rel_l2", 0.0), tiny) for p in points]
    if v["dtype"] != "fp32":
        ax.semilogy(xs, floor, "s--", color="tab:gray", label=f"noise floor: HF {v['dtype']} vs HF fp32")
        ax.semilogy(xs, [f * v["tolerance"] for f in floor], ":", color="tab:red", label=f"limit: {v['tolerance']:g}x floor")
    elif v.get("fp32_floor"):  # the fp32 run judged against transformers' own fp32 rounding (verdict.py)
        ax.semilogy(xs, floor, "s--", color="tab:gray", label="floor: HF fp32 vs HF fp64")
        ax.semilogy(xs, [fp32_rel_l2_limit(f, v["tolerance"]) for f in floor], ":", color="tab:red",
                    label=f"limit: the larger of {FP32_REL_L2:g} and {v['tolerance']:g}x floor")
    else:
        ax.axhline(FP32_REL_L2, color="tab:red", linestyle=":", label=f"limit: rel_l2 {FP32_REL_L2:g}")
    for row in result.get("ablations", []):
        if row["status"] == "ran" and row["name"] != "baseline":
            ax.semilogy(xs, [max(e, tiny) for e in row["series"]], "-", linewidth=0.8, alpha=0.55,
                        label=f"ablation: {row['name']}")
    if v["first_failure"]:
        # a routing failure is drawn at its layer's MLP point, a key-selection failure at its attention point
        at = v["first_failure"].replace(".routing", ".mlp").replace(".selection", ".attention")
        i = next(k for k, p in enumerate(points) if p["name"] == at)
        ax.axvline(i, color="tab:red", alpha=0.4, linewidth=6)
        ax.annotate(f"first divergence: {v['first_failure']}", (i, test[i]), textcoords="offset points",
                    xytext=(6, 8), color="tab:red")
    ax.set_xticks(xs)
    ax.set_xticklabels([_short(p["name"]) for p in points], rotation=70, fontsize=8)
    ax.set_ylabel("relative L2 error vs HF fp32")
    m = result["model"]
    ax.set_title(f"{m['family']}, {v['dtype']}: {'ALIGNED' if v['aligned'] else 'NOT ALIGNED'}",
                 color="tab:green" if v["aligned"] else "tab:red")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict, command: str | None = None) -> str:
    v = result["verdict"]
    fp32_floor = bool(v.get("fp32_floor"))
    floor_on = v["dtype"] != "fp32" or fp32_floor
    out = [f"# Alignment report: {result['model']['family']} ({v['dtype']})", ""]
    out += [f"**Verdict: {'ALIGNED' if v['aligned'] else 'NOT ALIGNED'}.** {v['summary']}", ""]
    runs = v.get("runs") or {}
    if len(runs) > 1:  # fp32 first, then the training dtype: what each said, which one decided, whose tables follow
        out += [f"- {dt} run{' (certifies the conversion)' if dt == 'fp32' else ''}: "
                f"{'aligned' if r['aligned'] else 'NOT aligned at ' + str(r['first_failure'])}"
                + (" (decided the verdict; the tables below are this run's)" if dt == v.get("decided_by") else
                   " (the tables below are this run's)" if dt == v["dtype"] else "")
                for dt, r in runs.items()] + [""]
    c = result["compared"]
    out += [f"- reference: {c['reference']}"]
    if c["floor"] and fp32_floor:
        out += [f"- floor: {c['floor']} against the reference (transformers' own fp32 rounding, per point: measured "
                "because the fp32 run went over 1e-5, as fp32 rounding that adds up with depth can)"]
    elif c["floor"]:
        out += [f"- noise floor: {c['floor']} (HF's own {v['dtype']} rounding error, per point)"]
    out += [f"- tested: {c['tested']}"]
    if result.get("attention"):
        out += [f"- attention: {result['attention']}"]
    out += [f"- inputs: {result['inputs']['tokens']}, "
            f"batch {result['inputs']['batch']} x {result['inputs']['seq_len']} tokens",
            "- rule: " + (f"each point's rel_l2 <= the larger of 1e-5 and {v['tolerance']:g}x the floor (logits: KL "
                           f"<= the larger of 1e-10 and {v['tolerance'] ** 2:g}x); the first point over the line is "
                           "named" if fp32_floor else
                           f"each point's rel_l2 <= {v['tolerance']:g}x the floor (logits: KL <= "
                           f"{v['tolerance'] ** 2:g}x); the first point over the line is named"
                           if floor_on else "each point's rel_l2 <= 1e-5, logits KL <= 1e-10; "
                           "the first point over the line is named")]
    if command:
        out += [f"- command: `{command}`"]
    out += ["", f"![error by layer]({PLOT_NAME})", ""]
    if result["config_differences"]:
        out += ["## config.json differences (reference vs tested)", "", "| key | reference | tested |", "| --- | --- | --- |"]
        out += [f"| {d['key']} | {d['reference']} | {d['tested']} |" for d in result["config_differences"]]
        out += [""]
    flips_floor = v["dtype"] != "fp32"  # fp32 allows a share of the tokens, with or without a floor
    if v.get("routing"):
        out += _flips_table("## Routing (MoE layers)",
                            "Tokens whose top-k expert set differs from HF fp32's. A near tie between two experts' "
                            "scores can flip either way under rounding; HF's own flips in the same dtype are the "
                            "floor. The points below are compared on the tokens no flip reached (the 'tokens' "
                            "column). A layer routed by token id (a table: DeepSeek-V4's hash layers) has no tie "
                            "to flip and must agree exactly.", v["routing"], v["dtype"], flips_floor, agreement=False)
    if v.get("selection"):
        out += _flips_table("## Key selection (sparse-attention layers)",
                            "Tokens whose indexer kept other keys, or blocks of keys (among those they may see), "
                            "than HF fp32's indexer; agreement is the share that kept the same ones. A near tie between two keys' "
                            "index scores can flip under rounding; HF's own flips in the same dtype are the floor. "
                            "Tokens a flip reached are left out of the points below from that layer's attention "
                            "output on.", v["selection"], v["dtype"], flips_floor, agreement=True)
    out += ["## Per point", ""]
    head = ("| point | tokens | rel_l2 | max_abs | cosine |" + (" floor rel_l2 | ratio |" if floor_on else "")
            + " limit | ok |")
    out += [head, "|" + " --- |" * (head.count("|") - 1)]
    for p in v["points"]:
        m = p["metrics"]
        tokens = "all" if p.get("tokens") is None else str(p["tokens"])
        if not m:
            out.append(f"| {p['name']} | 0 |" + " - |" * (5 if floor_on else 3) + f" {p['limit']} | - |")
            continue
        streams = p.get("streams") or []
        out.append(_point_row(p["name"] + (" (all streams)" if streams else ""), tokens, p, floor_on))
        # a layer's residual streams (hyper-connections), each judged as the point is: the point passes with all
        out += [_point_row(f"{p['name']} stream {r['stream']}", tokens, {**r, "limit": p["limit"]}, floor_on)
                for r in streams]
    lg = v["points"][-1]
    if lg["metrics"]:
        floor_head = " floor (HF fp32 vs fp64) |" if fp32_floor else " floor (HF dtype vs fp32) |"
        out += ["", "## Logits", "", "| | tested vs HF fp32 |" + (floor_head if floor_on else ""),
                "| --- | --- |" + (" --- |" if floor_on else "")]
        for key, spec in (("rel_l2", ".2e"), ("kl", ".2e"), ("top1", ".4f"), ("top5", ".4f"), ("max_abs", ".2e")):
            out.append(f"| {key} | {_fmt(lg['metrics'][key], spec)} |"
                       + (f" {_fmt(lg['floor'][key], spec)} |" if floor_on else ""))
    if result.get("ablations"):
        out += ["", "## Ablations: known sources of HF/MCore difference", "",
                f"Each variant changes one thing in the MCore model and runs on the same inputs. "
                f"'diff to HF {v['dtype']}' is the logits' rel_l2 against HF in the same dtype: 0 means the "
                f"variant computes exactly what HF computes.", "",
                f"| variant | source | change | logits rel_l2 vs HF fp32 | x floor | diff to HF {v['dtype']} | vs baseline |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in result["ablations"]:
            if r["status"] != "ran":
                out.append(f"| {r['name']} | {r['source']} | {r['change']} | skipped: {r['reason']} | | | |")
                continue
            out.append(f"| {r['name']} | {r['source']} | {r['change']} | {_fmt(r['logits_rel_l2'])} | "
                       f"{_fmt(r['ratio_to_floor'], '.2f')} | {_fmt(r['diff_to_hf_same_dtype'])} | "
                       f"{r['change_vs_baseline'] * 100:+.1f}% |")
    out += ["", f"Device: {result['device']}; {result['seconds']} s."]
    return "\n".join(out) + "\n"


def _point_row(label: str, tokens: str, p: dict, floor_on: bool) -> str:
    m = p["metrics"]
    row = f"| {label} | {tokens} | {_fmt(m['rel_l2'])} | {_fmt(m['max_abs'])} | {_fmt(m['cosine'], '.6f')} |"
    if floor_on:
        row += f" {_fmt(p['floor']['rel_l2'])} | {_fmt(p['ratio'], '.2f')}x |"
    return row + f" {p['limit']} | {'yes' if p['passed'] else '**NO**'} |"


def _flips_table(title: str, text: str, rows: list[dict], dtype: str, floor_on: bool, agreement: bool) -> list[str]:
    """A routing or key-selection section: per layer, the tokens that flipped (and HF's own, in bf16/fp16)."""
    head = "| layer | tokens |" + (" agreement |" if agreement else "") + " flipped (tested) |" \
        + (f" flipped (HF {dtype}) | ratio |" if floor_on else "") + " limit | ok |"
    out = [title, "", text, "", head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        row = f"| {r['layer']} | {r['tokens']} |" + (f" {r['agreement']:.1%} |" if agreement else "") + f" {r['flipped']} |"
        if floor_on:  # a choice held exact (routed by token id) has no ratio
            row += f" {r['floor_flipped']} | {_fmt(r['ratio'], '.2f')}{'x' if r['ratio'] is not None else ''} |"
        out.append(row + f" {r['limit']} | {'yes' if r['passed'] else '**NO**'} |")
    return out + [""]


def write_report(result: dict, report_dir: str | Path, command: str | None = None) -> dict[str, Path]:
    folder = Path(report_dir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"json": folder / "report.json", "md": folder / "report.md", "png": folder / PLOT_NAME}
    plot(result, paths["png"])
    data = {**result, "command": command}
    paths["json"].write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    paths["md"].write_text(markdown(result, command), encoding="utf-8")
    return paths


def print_summary(result: dict, file=None) -> None:
    """The per-layer table on the terminal: one row per decoder layer plus the ends."""

    file = file or sys.stdout
    v = result["verdict"]
    floor_on = v["dtype"] != "fp32" or bool(v.get("fp32_floor"))
    by_name = {p["name"]: p for p in v["points"]}
    n = result["model"]["num_layers"]
    rows = [("all ids", [by_name[EVERY_ID]])] if EVERY_ID in by_name else []
    rows += [("embedding", [by_name["embedding"]])]
    for i in range(n):
        rows.append((f"layer {i}", [by_name[f"layers.{i}.{k}"] for k in ("attention", "mlp", "output")]))
        if every_expert_point(i) in by_name:  # its router's logits, its MoE block with tokens sent to every expert
            rows.append(("router+allE", [by_name[router_point(i)], by_name[every_expert_point(i)]]))
    rows += [("final_norm", [by_name["final_norm"]]), ("logits", [by_name["logits"]])]
    print(f"{'point':<11} {'rel_l2 (attn/mlp/out)':<32} " + ("worst x floor" if floor_on else "") + "  ok", file=file)
    routing = {r["layer"]: r for r in v.get("routing", [])}
    selection = {r["layer"]: r for r in v.get("selection", [])}
    for label, ps in rows:
        errs = "/".join(_fmt(p["metrics"].get("rel_l2"), ".1e") for p in ps)
        ratios = [p["ratio"] for p in ps if p["ratio"] is not None]
        ratio = f"{max(ratios):>8.2f}x" if floor_on and ratios else ""
        layer = None if label == "router+allE" else ps[0]["layer"]  # the layer's own row carries its flips
        r = routing.get(layer)
        sel = selection.get(layer)
        ok = "yes" if all(p["passed"] for p in ps) and all(c is None or c["passed"] for c in (r, sel)) else "NO"
        by_token = " (by token id, held exact)" if r is not None and r.get("exact") else ""
        flips = f"  routing flips {r['flipped']}" + (f" (HF {r['floor_flipped']})" if r["floor_flipped"] is not None else "") \
            + by_token if r is not None else ""
        if sel is not None:
            flips += f"  selection agreement {sel['agreement']:.1%}" + (
                f" (HF {1 - sel['floor_flipped'] / max(sel['tokens'], 1):.1%})" if sel["floor_flipped"] is not None else "")
        streams = [f"{r['stream']}" for p in ps for r in p.get("streams") or [] if not r["passed"]]
        if streams:
            flips += f"  streams over the line: {', '.join(streams)}"
        print(f"{label:<11} {errs:<32} {ratio:>13}  {ok}{flips}", file=file)
    print(("ALIGNED: " if v["aligned"] else "") + v["summary"], file=file)

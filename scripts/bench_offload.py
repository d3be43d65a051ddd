#!/usr/bin/env python
"""Optimizer offload on one GPU: static 0.0..1.0 against auto, on the largest Llama-3.1-shaped model
that fits only with offload; exact numerics on real CPU/GPU tiers; megatron-core's own step counter.

    python scripts/bench_offload.py [--out DIR] [--seq-len 4096] [--iters 6] [--layers N] [--dry-run]
    scripts/gpu_suite.sh --only bench-offload          (the same, as an optional step of the GPU suite)

Phases (each writes DIR/<phase>.json and a line in DIR/summary.md):

- model: the memory plan (training/memory_plan.py, transformer-engine layers) picks the largest
  published Llama-3.1 size that fits this GPU with OPTIMIZER_OFFLOAD=static (everything on the host)
  and not with OPTIMIZER_OFFLOAD=false: Llama-3.1-8B on an 80 GiB GPU at 4K tokens, as in the
  reference article. ``--deepest`` takes the most layers of the 8B shape that fit (then only full
  offload fits), ``--layers N`` that many;
- sweep: OPTIMIZER_OFFLOAD = 0.0 (false), 0.1, ..., 1.0 and auto, each a real run through the launcher
  (ENV=dsw, bf16, selective recompute, the distributed optimizer, MP_OFFLOAD_TIMING=true). Per run:
  peak memory, iteration time and its parts (forward/backward, gradients to the host, CPU Adam,
  parameters back, device Adam), tokens/s, the share on the host; a ratio the plan says cannot fit is
  recorded as refused (the launcher refuses it too);
- exact: a tiny model with MP_OFFLOAD_NUMERICS=exact, a scripted probe forcing evictions and
  promotions, against exact numerics without offload: losses, grad norms and final weights must be
  bit-identical with the tiers on two different devices;
- upstream-step: megatron-core's HybridDeviceOptimizer with no parameter on the CPU, stepped, saved,
  loaded and stepped again: does its Adam step count (bias correction) go on or freeze?

--dry-run (CPU, CI): picks the model with MP_GPU_MEMORY_GB (default 80) and validates every launch
through the launcher's own dry run; nothing trains.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RATIOS = [round(0.1 * i, 1) for i in range(11)]
MODES = [("false" if r == 0 else f"{r:g}") for r in RATIOS] + ["auto"]


def launcher_argv(work: Path, mode: str, seq: int, iters: int, gbs: int, out: Path, size: str = "8B") -> list[str]:
    """The 25 positional arguments: ENV=dsw on one GPU, a Llama-3.1 shape, random init, no checkpoints."""
    return ["dsw", size, "1", str(gbs), "1e-4", "1e-5", str(seq), str(seq), "bf16", "1", "1", "1", "false", "true",
            "false", "false", "sel", mode, "1000", str(work / "data" / "corpus_text_document"), "none", "none",
            str(iters * gbs * seq), str(gbs * seq), str(out)]


def run_env(layers: int, extra: dict | None = None) -> dict:
    return {"GPUS_PER_NODE": "1", "MP_NUM_LAYERS": str(layers), "MP_SAVE": "false", "MP_EVAL_INTERVAL": "0",
            "MP_OFFLOAD_TIMING": "true", **(extra or {})}


def resolve_cfg(argv: list[str], env: dict):
    from megatron_patch.training.validation import resolve

    return resolve("llama3_1", argv, env={**os.environ, **env}, check_paths=False)


def pick_model(work: Path, seq: int, gbs: int, capacity_gb: float | None, wanted: int | None,
               deepest: bool = False) -> dict:
    """The model: the largest published Llama-3.1 size (70B, 8B) that fits this GPU with every optimizer
    chunk on the host and not without offload, at its own depth (``deepest``: the most layers of the
    8B shape that still fit, which leaves only full offload; ``wanted``: that many layers)."""
    from megatron_patch.training.memory_plan import plan_memory

    extra = {"MP_GPU_MEMORY_GB": str(capacity_gb)} if capacity_gb else {}

    def plans(size, layers):
        env = run_env(layers, extra) if layers else {k: v for k, v in run_env(1, extra).items() if k != "MP_NUM_LAYERS"}
        argv = launcher_argv(work, "false", seq, 4, gbs, work / "x", size)
        off = plan_memory(resolve_cfg(argv, env), "te")
        argv[17] = "static"
        return off, plan_memory(resolve_cfg(argv, env), "te"), off.stages[0].layers

    def row(size, layers, how):
        off, full, n = plans(size, layers)
        shares = [r / 10 for r in range(11)]
        fits = []
        for r in shares:
            argv = launcher_argv(work, "false" if r == 0 else f"{r:g}", seq, 4, gbs, work / "x", size)
            env = run_env(n, extra)
            fits.append(plan_memory(resolve_cfg(argv, env), "te").problem() is None)
        return {"size": size, "layers": n, "chosen_by": how, "fits_without_offload": off.problem() is None,
                "fits_with_offload": full.problem() is None, "capacity_gib": (full.capacity or 0) / 2**30,
                "smallest_static_share_that_fits": next((r for r, ok in zip(shares, fits) if ok), None)}

    if wanted:
        return row("8B", wanted, "--layers")
    if deepest:
        best = None
        for n in range(1, 129):
            off, full, _ = plans("8B", n)
            if full.problem() is not None:
                break
            if off.problem() is not None:
                best = n
        if best is None:
            raise SystemExit("no depth of the 8B shape fits only with offload here: check MP_GPU_MEMORY_GB / the GPU")
        return row("8B", best, "the most 8B-shaped layers that fit (memory plan)")
    for size in ("70B", "8B"):
        off, full, _ = plans(size, None)
        if full.problem() is None and off.problem() is not None:
            return row(size, None, "largest published size that fits only with offload (memory plan)")
    raise SystemExit("neither Llama-3.1-70B nor 8B fits this GPU only with offload: pass --layers N")


def prepare_corpus(work: Path) -> None:
    if (work / "data" / "corpus_text_document.idx").is_file():
        return
    from megatron_patch.training.preprocess import preprocess
    from megatron_patch.demo_data import make_texts, make_tokenizer

    texts = make_texts(1000, seed=0)
    tok = make_tokenizer(work / "data" / "tokenizer", texts, vocab_size=200)
    with open(work / "data" / "corpus.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    preprocess(work / "data" / "corpus.jsonl", str(work / "data" / "corpus"), tok, progress=False, force=True)


def dry_check(argv: list[str], env: dict) -> str:
    """The launcher's own validation (MP_DRY_RUN=json), in this process."""
    from megatron_patch.cli import main

    saved = dict(os.environ)
    os.environ.update({**env, "MP_DRY_RUN": "json"})
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["train", "llama3_1", *argv])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if code != 0:
        return "error: " + (err.getvalue().strip().splitlines() or ["?"])[-1]
    report = json.loads(out.getvalue())
    problems = [p for p in report["machine_problems"] if "memory plan" in p]
    return "refused by the memory plan" if problems else "ok"


def summarize_run(out: Path) -> dict:
    metrics = [json.loads(l) for l in (out / "log" / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    steady = [m for m in metrics if not m.get("warmup")] or metrics

    def mean(key):
        vals = [m[key] for m in steady if m.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    return {"iterations": len(metrics), "iteration_s": mean("iteration_s"), "tokens_per_s": mean("tokens_per_s"),
            "peak_memory_gib": max(m["memory_gib"] for m in metrics), "host_share": steady[-1].get("offload_share"),
            "fwd_bwd_s": mean("offload_fwd_bwd_s"), "d2h_s": mean("offload_d2h_s"),
            "cpu_adam_s": mean("offload_cpu_adam_s"), "h2d_s": mean("offload_h2d_s"),
            "device_adam_s": mean("offload_device_adam_s"), "moved_bytes": sum(m.get("offload_moved_bytes", 0) for m in metrics),
            "loss_last": metrics[-1]["loss"]}


def phase_sweep(work: Path, results: Path, model: dict, seq: int, iters: int, gbs: int, dry: bool) -> list[dict]:
    rows = []
    for mode in MODES:
        out = work / "sweep" / mode
        argv = launcher_argv(work, mode, seq, iters, gbs, out, model["size"])
        env = run_env(model["layers"])
        if dry:
            env.setdefault("MP_GPU_MEMORY_GB", os.environ.get("MP_GPU_MEMORY_GB", "80"))
            rows.append({"mode": mode, "check": dry_check(argv, env)})
            continue
        proc = launch(argv, env, out, results / "logs" / f"sweep-{mode}.log", timeout=900)
        if proc.returncode == 2 and "memory plan needs" in proc.stderr:
            rows.append({"mode": mode, "status": "refused by the memory plan",
                         "why": proc.stderr.strip().splitlines()[-1]})
        elif proc.returncode != 0:
            rows.append({"mode": mode, "status": f"failed (exit {proc.returncode})",
                         "why": (proc.stderr.strip().splitlines() or ["?"])[-1][-300:]})
        else:
            rows.append({"mode": mode, "status": "ok", **summarize_run(out)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def launch(argv: list[str], env: dict, out: Path, log: Path, timeout: int) -> subprocess.CompletedProcess:
    """The Llama launcher into a fresh ``out``, its output kept in ``log``."""
    shutil.rmtree(out, ignore_errors=True)
    proc = subprocess.run(["bash", str(REPO / "examples" / "llama3_1" / "run_mcore_llama3_1.sh"), *argv],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    return proc


EXACT_SCRIPT = {"device_fraction": {"1": 1.0, "3": 0.4, "7": 1.0, "9": 0.3, "10": 1.0, "11": 0.3, "12": 1.0}}


def phase_exact(work: Path, results: Path, dry: bool) -> dict:
    """Tiny Llama, exact numerics: the scripted schedule against no offload, bit for bit, on GPU + CPU tiers."""
    script = work / "exact" / "script.json"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(json.dumps(EXACT_SCRIPT))
    runs = {}
    for name, mode, extra in (("off", "false", {}), ("scripted", "auto", {"MP_OFFLOAD_PROBE_SCRIPT": str(script),
                                                                         "MP_OFFLOAD_PATIENCE": "2",
                                                                         "MP_OFFLOAD_COOLDOWN": "2"})):
        out = work / "exact" / name
        argv = ["dsw", "tiny", "2", "8", "3e-3", "3e-4", "64", "64", "bf16", "1", "1", "1", "false", "true", "false",
                "false", "none", mode, "7", str(work / "data" / "corpus_text_document"), "none", "none",
                str(14 * 8 * 64), str(2 * 8 * 64), str(out)]
        env = {"GPUS_PER_NODE": "1", "MP_OFFLOAD_NUMERICS": "exact", **extra}
        if dry:
            runs[name] = dry_check(argv, env)
            continue
        proc = launch(argv, env, out, results / "logs" / f"exact-{name}.log", timeout=600)
        if proc.returncode != 0:
            return {"status": f"failed (exit {proc.returncode})", "run": name}
        runs[name] = [json.loads(l) for l in (out / "log" / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    if dry:
        return {"status": "dry run", "checks": runs}
    a, b = runs["off"], runs["scripted"]
    same = all(x[k] == y[k] for x, y in zip(a, b) for k in ("loss", "grad_norm", "lr")) and len(a) == len(b)
    from megatron_patch.checkpoint_files.torch_dist import TorchDistReader
    import torch

    fa, fb = (TorchDistReader(work / "exact" / run / "final" / "release").read_all() for run in ("off", "scripted"))
    weights = fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    moves = [m["offload_action"] for m in b if m["offload_action"] != "hold"]
    return {"status": "bit-identical" if same and weights else "DIFFERENT", "losses_grad_norms_lr_equal": same,
            "final_weights_equal": weights, "moves": moves}


def phase_upstream_step(dry: bool) -> dict:
    """megatron-core's HybridDeviceOptimizer, offload_fraction=0: step 3x, save, load into a fresh one, step."""
    if dry:
        return {"status": "dry run (needs CUDA)"}
    try:
        return _upstream_step()
    except Exception as exc:  # noqa: BLE001 - a diagnostic: report what upstream did
        return {"status": f"error: {type(exc).__name__}: {exc}"[:300]}


def _upstream_step() -> dict:
    import torch
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    torch.manual_seed(0)
    start = torch.randn(4096, device="cuda")
    grads = [torch.randn(4096, device="cuda") for _ in range(4)]

    def make(p):
        return HybridDeviceOptimizer([p], offload_fraction=0.0, cpu_optimizer_cls=torch.optim.AdamW,
                                     gpu_optimizer_cls=torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=0.0)

    ref = torch.nn.Parameter(start.clone())
    opt = make(ref)
    for g in grads:
        ref.grad = g.clone()
        opt.step()
    p = torch.nn.Parameter(start.clone())
    first = make(p)
    for g in grads[:3]:
        p.grad = g.clone()
        first.step()
    saved = first.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    second = make(q)
    second.load_state_dict(saved)
    q.grad = grads[3].clone()
    second.step()
    steps = [float(s["step"]) for s in second.state.values() if "step" in s] if hasattr(second, "state") else []
    return {"status": "resumes" if torch.equal(q.detach(), ref.detach()) else "DIFFERS after a load",
            "max_abs_diff": float((q.detach() - ref.detach()).abs().max()), "step_after_load": steps,
            "expected_step": 4}


def write_summary(results: Path, report: dict) -> None:
    lines = ["# Optimizer offload benchmark", "", f"- device: {report.get('device')}",
             f"- model: Llama-3.1-{report['model']['size']} shape, {report['model']['layers']} layers "
             f"({report['model']['chosen_by']}; the plan says static >= "
             f"{report['model']['smallest_static_share_that_fits']} fits), "
             f"sequence {report['seq_len']}, micro-batch 1, GBS {report['gbs']}, bf16, AC=sel", "",
             "| OPTIMIZER_OFFLOAD | status | peak GiB | iteration s | fwd/bwd s | to host s | CPU Adam s | back s | "
             "device Adam s | tokens/s | host share |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v, fmt="{:.3f}"):
        return "" if v is None else fmt.format(v)

    for r in report.get("sweep", []):
        if "check" in r:
            lines.append(f"| {r['mode']} | dry run: {r['check']} |||||||||")
            continue
        lines.append(f"| {r['mode']} | {r['status']} | {f(r.get('peak_memory_gib'), '{:.1f}')} | {f(r.get('iteration_s'))} | "
                     f"{f(r.get('fwd_bwd_s'))} | {f(r.get('d2h_s'))} | {f(r.get('cpu_adam_s'))} | {f(r.get('h2d_s'))} | "
                     f"{f(r.get('device_adam_s'))} | {f(r.get('tokens_per_s'), '{:.0f}')} | "
                     f"{f(r.get('host_share'), '{:.2f}')} |")
    lines += ["", f"- exact numerics (tiny model, scripted evictions/promotions vs no offload): "
                  f"{json.dumps(report.get('exact'))}",
              f"- megatron-core HybridDeviceOptimizer step after a load: {json.dumps(report.get('upstream_step'))}"]
    (results / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-offload-results", help="results folder (summary.md, report.json, logs/)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--layers", type=int, default=None, help="that many layers of the 8B shape")
    ap.add_argument("--deepest", action="store_true", help="the most 8B-shaped layers that fit (only with full offload)")
    ap.add_argument("--phases", default="model,sweep,exact,upstream-step")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: validate every launch, train nothing")
    args = ap.parse_args(argv)
    import torch

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("bench_offload.py needs a CUDA GPU (use --dry-run to check it on CPU)", file=sys.stderr)
        return 2
    results = Path(args.out).resolve()
    work = results / "work"
    work.mkdir(parents=True, exist_ok=True)
    prepare_corpus(work)
    phases = args.phases.split(",")
    capacity = float(os.environ.get("MP_GPU_MEMORY_GB", "80")) if dry else None
    report = {"seq_len": args.seq_len, "gbs": args.gbs, "dry_run": dry,
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (dry run)"}
    report["model"] = pick_model(work, args.seq_len, args.gbs, capacity, args.layers, args.deepest)
    print(f"model: {json.dumps(report['model'])}", flush=True)
    if "sweep" in phases:
        report["sweep"] = phase_sweep(work, results, report["model"], args.seq_len, args.iters, args.gbs, dry)
    if "exact" in phases:
        report["exact"] = phase_exact(work, results, dry)
    if "upstream-step" in phases:
        report["upstream_step"] = phase_upstream_step(dry)
    (results / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_summary(results, report)
    bad = [r for r in report.get("sweep", []) if str(r.get("status", r.get("check", ""))).startswith(("failed", "error"))]
    bad += [report["exact"]] if report.get("exact", {}).get("status") in ("DIFFERENT",) or \
        str(report.get("exact", {}).get("status", "")).startswith("failed") else []
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Benchmark `mpatch convert`: each whole command against a durable `cp -r` in the same run.

Synthesizes a Llama-style bf16 HF checkpoint (default: 0.86B parameters, 1.7 GB, one safetensors file;
`--preset 3gb` is the 3.0 GB shape of earlier runs, `--preset 8b` Llama-3.1-8B's, 16 GB) and a tiny one,
then runs as separate processes, for each worker count (`--workers 1,2`) and page-cache state of the HF
input (`--cache warm,cold`), one pass after the other (`--repeat`, default 3):

    cp -r HF COPY                                       (the input warm: read once after a cache drop)
    cp -r HF COPY, then sync of every copied file      ("cp -r + sync": a durable copy, the baseline)
    the same with the page cache dropped first          (the baseline of the dropped-cache read)
    for --format legacy and torch_dist, at --tp 2 --pp 2:
      mpatch convert hf2mcore   (first)     an empty skeleton cache: an architecture new to this machine
      mpatch convert mcore2hf               of the checkpoint just written, as a user does after training
      mpatch convert mcore2hf   (dropped)   of the same checkpoint, the page cache dropped first
      mpatch convert hf2mcore   (repeated)  the skeleton cache as the first conversion left it

timing each and sampling the resident memory of its whole process tree (every 20 ms), with Python's
bytecode compiled once beforehand, as an installed package has it. Before each step
the dirty pages of the previous one are written out (`sync`, not timed); cp and hf2mcore start from
the same memory (the page cache dropped, `echo 3 > /proc/sys/vm/drop_caches`, which needs root, then
for `warm` the HF folder read once); mcore2hf reads the checkpoint as hf2mcore left it (or, for
"dropped", after a drop). Without root the script says so and skips the dropped-cache steps.

Reported per step: the median wall and CPU time over the passes (the largest peak RSS), and the target's
ratio, taken within each pass (a slow minute of a shared machine slows both) and then the median: the
whole command over that pass's "cp -r + sync" (a dropped-cache read over the dropped-cache copy).
The tiny model's numbers are the fixed start-up. The load average is printed before every pass; with
`--quiet-load L` each pass first waits (up to `--max-wait` s) for the 1-minute load average to fall
below L. Targets:

    each conversion's whole wall time   <= 1.5 x cp -r + sync (issue 18)
    marginal peak RSS                   <= 10% of the checkpoint's bytes
    tiny model (start-up)               <= 3 s

Each step's CPU time (user + system) is measured too: converted bytes over the marginal CPU time
is what one core converts per second, which is what spreads over workers (independent tasks). From
it the script projects, for a 32-core conversion node, the time of Llama-3.1-70B (bf16) and
DeepSeek-V3 (from its FP8 hub checkpoint, whose weights are dequantized through torch: that rate is
measured here too, on one thread, for an expert-sized weight): the CPU's time over 32 cores or the
storage's (`--node-storage-gbps`, assumed), whichever is longer. Each round trip is
checked tensor by tensor against the original: bit-identical.

    python scripts/bench_convert.py [--preset bench|3gb|8b] [--workers 1,2] [--cache warm,cold] [--repeat 3]
                                    [--quiet-load 2 --max-wait 900] [--json out.json] [--node-storage-gbps 4]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PRESETS = {  # hidden, layers, ffn, heads, kv heads, vocab
    "bench": (2048, 12, 8192, 32, 8, 32000),
    "3gb": (2048, 16, 8192, 32, 8, 128256),
    "8b": (4096, 32, 14336, 32, 8, 128256),
}


def tiny_dims(tp: int, pp: int) -> tuple:
    """The untimed warm-up model: tiny, with heads and layers that split at the benchmarked TP and PP (a fixed
    4-head model failed --tp 4, the reason hidden: the perf audit)."""
    kv_heads = max(2, tp)
    return 32 * kv_heads, max(4, 2 * pp), 64 * kv_heads, 2 * kv_heads, kv_heads, 256


def _check_layout(ap, config: dict, tp: int, pp: int) -> None:
    from megatron_patch.errors import UserError
    from megatron_patch.models.description.arch import validate_layout
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime.distributed import ParallelLayout

    try:
        validate_layout(parse_arch(config), ParallelLayout(tp=tp, pp=pp), uneven_pipelines=False)
    except UserError as exc:
        ap.error(f"--tp {tp} --pp {pp}: {exc}")


def _untimed(command: list[str], env: dict) -> None:
    """A warm-up command; its own error said where it fails (it was captured and dropped: the perf audit)."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command[3:5])} of the warm-up model failed: {done.stderr.strip()[-2000:]}")


def llama_config(hidden: int, layers: int, ffn: int, heads: int, kv_heads: int, vocab: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hidden // heads, "hidden_act": "silu",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }


def synthesize(folder: Path, config: dict, shard_bytes: int = 5 * 10**9) -> int:
    """Write a random bf16 Llama checkpoint, one tensor at a time; return its tensor bytes."""
    import torch

    from megatron_patch.convert.hf_writer import SafetensorsShardWriter

    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    entries = [("model.embed_tokens.weight", (v, h))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        entries += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.self_attn.q_proj.weight", (h, h)),
                    (f"{p}.self_attn.k_proj.weight", (kv, h)), (f"{p}.self_attn.v_proj.weight", (kv, h)),
                    (f"{p}.self_attn.o_proj.weight", (h, h)), (f"{p}.post_attention_layernorm.weight", (h,)),
                    (f"{p}.mlp.gate_proj.weight", (f, h)), (f"{p}.mlp.up_proj.weight", (f, h)),
                    (f"{p}.mlp.down_proj.weight", (h, f))]
    entries += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    shutil.rmtree(folder, ignore_errors=True)  # a rerun in the same --work-dir writes it again (the perf audit)
    folder.mkdir(parents=True)
    writer = SafetensorsShardWriter(folder, [(n, s, torch.bfloat16) for n, s in entries], shard_bytes)
    gen = torch.Generator().manual_seed(0)
    for name, shape in entries:
        writer.write(name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.close()
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192}))
    return writer.total_bytes


def measure(cmd: list[str], env: dict) -> dict:
    """Wall time, CPU time (user + system, the process and the helpers it waited for) and peak resident
    memory (sum over the process tree, sampled) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = 0
    root = psutil.Process(proc.pid)

    def sample():
        nonlocal peak
        while proc.poll() is None:
            try:
                total = 0
                for p in [root] + root.children(recursive=True):
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                peak = max(peak, total)
            except psutil.Error:
                pass
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    t.join()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{err.decode()[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss": peak}


def combine(passes: list[dict]) -> dict:
    """One result per step over the passes: the median wall and CPU time, the largest peak RSS, and
    every pass's wall time."""
    return {name: {"wall_s": statistics.median(p[name]["wall_s"] for p in passes),
                   "cpu_s": statistics.median(p[name]["cpu_s"] for p in passes),
                   "peak_rss": max(p[name]["peak_rss"] for p in passes),
                   "wall_s_passes": [p[name]["wall_s"] for p in passes]}
            for name in passes[0]}


def drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def warm(folder: Path) -> None:
    """Read every file under ``folder`` once, so that it is in the page cache."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.read(64 << 20):
                    pass


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def verify(original: Path, copy: Path) -> None:
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    src, back = HFCheckpointReader(original), HFCheckpointReader(copy)
    if back.keys() != src.keys():
        raise SystemExit(f"{copy}: tensor names differ from the original")
    for name in src.keys():
        if (src.dtype(name), src.shape(name)) != (back.dtype(name), back.shape(name)) or \
                src.read_bytes(name) != back.read_bytes(name):
            raise SystemExit(f"{copy}: {name} differs from the original")


BASELINE, DROPPED_BASELINE = "cp -r + sync", "cp -r + sync, dropped cache"


def run_suite(hf: Path, work: Path, env: dict, args, workers: int, cache: str, check: bool, can_drop: bool) -> dict:
    """The steps of one pass for one model, worker count and cache state; outputs removed as soon as read."""
    mpatch = [sys.executable, "-m", "megatron_patch", "convert"]
    common = ["--quiet", "--workers", str(workers)]
    results = {}

    def step(name: str, cmd: list[str], inputs: list[Path] | None, step_env: dict = env) -> None:
        """``inputs``: read once after a cache drop (warm) or left dropped (cold); None: the page cache is
        left as the previous step left it (a checkpoint just written)."""
        subprocess.run(["sync"], check=True)
        if inputs is not None:
            drop_caches()
            if cache == "warm":
                for folder in inputs:
                    warm(folder)
        results[name] = measure(cmd, step_env)

    def dropped(name: str, cmd: list[str]) -> None:
        subprocess.run(["sync"], check=True)
        drop_caches()
        results[name] = measure(cmd, env)

    copy = work / "copy"
    durable = ["sh", "-c", f'cp -r "{hf}" "{copy}" && find "{copy}" -type f -exec sync {{}} + && sync "{copy}"']
    step("cp -r", ["cp", "-r", str(hf), str(copy)], [hf])
    shutil.rmtree(copy)
    step(BASELINE, durable, [hf])
    shutil.rmtree(copy)
    if can_drop:
        dropped(DROPPED_BASELINE, durable)
        shutil.rmtree(copy)
    for fmt in args.formats:
        ckpt, again, back = work / fmt, work / f"{fmt}-again", work / f"hf_from_{fmt}"
        hf2mcore = mpatch + ["hf2mcore", "--hf-dir", str(hf), "--tp", str(args.tp), "--pp", str(args.pp),
                             "--format", fmt] + common
        mcore2hf = mpatch + ["mcore2hf", "--load-dir", str(ckpt)] + common
        # An empty skeleton cache: the architecture is new to this machine.
        first = dict(env, MPATCH_CACHE_DIR=tempfile.mkdtemp(prefix="skeletons-", dir=work))
        step(f"hf2mcore {fmt} (first)", hf2mcore + ["--save-dir", str(ckpt)], [hf], first)
        step(f"mcore2hf {fmt}", mcore2hf + ["--save-dir", str(back)], None)
        if check:
            verify(hf, back)
        shutil.rmtree(back)
        if can_drop:
            dropped(f"mcore2hf {fmt}, dropped cache", mcore2hf + ["--save-dir", str(back)])
            shutil.rmtree(back)
        if args.manifest_steps:  # what the manifest costs: its check alone, and mcore2hf without it
            step(f"verify {fmt}", [sys.executable, "-m", "megatron_patch", "verify", str(ckpt), "--quiet"], [ckpt])
            step(f"mcore2hf {fmt} --no-verify", mcore2hf + ["--save-dir", str(work / "unverified"), "--no-verify"],
                 [ckpt])
            shutil.rmtree(work / "unverified")
        shutil.rmtree(ckpt)
        step(f"hf2mcore {fmt} (repeated)", hf2mcore + ["--save-dir", str(again)], [hf], first)
        shutil.rmtree(again)
        shutil.rmtree(first["MPATCH_CACHE_DIR"])
    return results


def wait_for_quiet(limit: float | None, max_wait: float) -> tuple[float, float, float]:
    """Wait (up to ``max_wait`` s) until the 1-minute load average is below ``limit``; the load average then."""
    deadline = time.monotonic() + max_wait
    while limit is not None and os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(10)
    return os.getloadavg()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", help="where to write (default: a new temporary folder, removed afterwards)")
    ap.add_argument("--preset", choices=["bench", "3gb", "8b"], default="bench",
                    help="the large model's shape (default bench: 1.7 GB)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    ap.add_argument("--cache", default="warm,cold", help="page-cache states: warm, cold or both (default both)")
    ap.add_argument("--formats", default="legacy,torch_dist", help="MCore formats (default legacy,torch_dist)")
    ap.add_argument("--repeat", type=int, default=3, help="passes over the steps; medians are reported (default 3)")
    ap.add_argument("--no-verify", action="store_true", help="skip the tensor-by-tensor round-trip check")
    ap.add_argument("--manifest-steps", action="store_true",
                    help="also time 'mpatch verify' of each checkpoint and mcore2hf --no-verify (the manifest's cost)")
    ap.add_argument("--quiet-load", type=float, help="before each pass, wait for the 1-minute load average to fall "
                    "below this (a shared machine)")
    ap.add_argument("--max-wait", type=float, default=900, help="the longest wait for --quiet-load, in seconds (900)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--node-storage-gbps", type=float, default=4.0,
                    help="write rate assumed for the projected conversion node's storage (default 4 GB/s)")
    args = ap.parse_args()
    args.formats = args.formats.split(",")
    try:
        worker_counts = [int(w) for w in args.workers.split(",")]
    except ValueError:
        ap.error(f"--workers must be worker counts separated by commas, got {args.workers!r}")
    caches = args.cache.split(",")
    # each refused in one line, before gigabytes are synthesized (the perf audit: a traceback, or a misspelt cache
    # state measured as a cold one)
    if min(worker_counts) < 1 or args.repeat < 1 or args.tp < 1 or args.pp < 1:
        ap.error("--workers, --repeat, --tp and --pp must be at least 1")
    if set(caches) - {"warm", "cold"} or set(args.formats) - {"legacy", "torch_dist"}:
        ap.error(f"--cache takes warm and cold, --formats legacy and torch_dist; got {args.cache!r}, "
                 f"{','.join(args.formats)!r}")
    tiny = tiny_dims(args.tp, args.pp)
    for dims in (tiny, PRESETS[args.preset]):
        _check_layout(ap, llama_config(*dims), args.tp, args.pp)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["MPATCH_CACHE_DIR"] = str(work / "skeleton-cache")
    # As installed (pip compiles the package's bytecode): where the environment forbids writing bytecode,
    # it is kept in the work folder, written by the untimed runs before the first pass.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    try:
        can_drop = drop_caches()
        if not can_drop:
            print("cannot drop the page cache here (needs root): cold-cache runs and dropped-cache steps skipped",
                  flush=True)
            caches = [c for c in caches if c != "cold"]
        report = {"machine": {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)},
                  "layout": {"tp": args.tp, "pp": args.pp}, "preset": args.preset, "verified": not args.no_verify,
                  "repeat": args.repeat,
                  "load_average": {"start": os.getloadavg(), "passes": []}, "runs": {}}
        print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)", flush=True)
        models = {}
        for label, dims in (("tiny", tiny), ("large", PRESETS[args.preset])):
            hf = work / label / "hf"
            t = time.perf_counter()
            nbytes = synthesize(hf, llama_config(*dims))
            models[label] = (hf, nbytes)
            report[label] = {"parameters": nbytes // 2, "bytes": nbytes}
            print(f"{label}: {nbytes / 2 / 1e9:.3f}B parameters, {nbytes / 2**30:.2f} GiB bf16 "
                  f"(synthesized in {time.perf_counter() - t:.1f} s)", flush=True)
        hf, _ = models["tiny"]
        for fmt in args.formats:  # untimed: every module the commands import is compiled once
            _untimed([sys.executable, "-m", "megatron_patch", "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir",
                      str(work / "compile"), "--format", fmt, "--tp", str(args.tp), "--pp", str(args.pp), "--quiet"], env)
            _untimed([sys.executable, "-m", "megatron_patch", "convert", "mcore2hf", "--load-dir", str(work / "compile"),
                      "--save-dir", str(work / "compile-hf"), "--quiet"], env)
            shutil.rmtree(work / "compile")
            shutil.rmtree(work / "compile-hf")
        for cache in caches:
            for workers in worker_counts:
                key = f"{cache} cache, {workers} worker{'s' if workers > 1 else ''}"
                passes = {label: [] for label in models}
                for i in range(args.repeat):
                    load = wait_for_quiet(args.quiet_load, args.max_wait)
                    report["load_average"]["passes"].append(load)
                    print(f"{key}, pass {i + 1}: load average {' '.join(f'{x:.2f}' for x in load)}", flush=True)
                    for label, (hf, _) in models.items():
                        passes[label].append(run_suite(hf, work / label, env, args, workers, cache,
                                                       check=label == "large" and i == 0 and not args.no_verify,
                                                       can_drop=can_drop))
                runs = {label: combine(p) for label, p in passes.items()}
                report["runs"][key] = runs
                print(f"{key}: " + ", ".join(f"{s} {runs['large'][s]['wall_s']:.2f} s" for s in runs["large"]), flush=True)
        report["fp8_dequantize"] = fp8_dequantize_rate()
        report["load_average"]["end"] = os.getloadavg()
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        ok = summarize(report)
        if any(k.startswith("warm cache, 1 worker /") for k in report["summary"]):
            project(report, args.node_storage_gbps)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return 0 if ok else 1
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def fp8_dequantize_rate() -> dict:
    """One thread's rate of turning a DeepSeek-V3 expert weight (2048 x 7168, FP8 with 128 x 128 block
    scales) into bf16, as the converter does (``convert.fp8.dequantize``, then the cast): best of 3."""
    import torch

    from megatron_patch.convert.fp8 import dequantize

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 7168, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(16, 56, generator=gen)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        dequantize(weight, scale, (128, 128)).to(torch.bfloat16)
        best = min(best, time.perf_counter() - t)
    out_bytes = weight.numel() * 2
    return {"seconds": best, "bf16_bytes": out_bytes, "gb_per_s": out_bytes / 1e9 / best}


# Bytes of the models projected: Llama-3.1-70B has 70.55e9 parameters; DeepSeek-V3 671e9 (the MTP
# layer aside), of which all but about 15e9 (embedding, head, norms, routers) are FP8 in the hub's files.
PROJECTIONS = {"Llama-3.1-70B": (70.55e9 * 2, 0.0), "DeepSeek-V3 (FP8 hub -> bf16)": (15e9 * 2, 656e9 * 2)}
NODE_CORES = 32


def project(report: dict, storage_gbps: float) -> dict:
    """What one core converts per second (converted bytes over the marginal CPU time of the warm runs;
    the work is split into independent tasks, so it spreads over cores), and the time of the projected
    models' conversions on a ``NODE_CORES``-core node: the CPU's time or the storage's
    (``storage_gbps``, an assumption: the node's write rate), whichever is longer."""
    fp8 = report["fp8_dequantize"]["gb_per_s"]
    out = {}
    for key, row in report["summary"].items():
        if not key.startswith("warm cache, 1 worker /") or " / cp -r" in key or "(first)" in key or "dropped" in key \
                or "verify" in key:
            continue
        step = key.split(" / ", 1)[1]
        per_core = row["gb_per_s_per_cpu_s"]
        times = {}
        for model, (copied, dequantized) in PROJECTIONS.items():
            through_fp8 = dequantized if step.startswith("hf2mcore") else 0.0
            cpu = (copied + dequantized - through_fp8) / 1e9 / per_core + through_fp8 / 1e9 / fp8
            times[model] = max(cpu / NODE_CORES, (copied + dequantized) / 1e9 / storage_gbps)
        out[step] = {"gb_per_cpu_s": per_core, "projected_s": times}
    walls = {k: v["gb_per_s"] for k, v in report["summary"].items() if k.startswith("warm cache")}
    print(f"\nper core (converted GB per CPU-second, warm cache, 1 worker), and projected on a {NODE_CORES}-core node "
          f"whose storage writes {storage_gbps:g} GB/s (FP8 dequantization: {fp8:.2f} GB/s of bf16 per core)")
    for step, row in out.items():
        one, two = walls.get(f"warm cache, 1 worker / {step}"), walls.get(f"warm cache, 2 workers / {step}")
        scaling = f"; wall GB/s 1 worker {one:.2f}, 2 workers {two:.2f}" if one and two else ""
        times = ", ".join(f"{m} {t / 60:.1f} min" for m, t in row["projected_s"].items())
        print(f"  {step:<26} {row['gb_per_cpu_s']:.2f} GB per CPU-s{scaling}; {times}")
    report["projection"] = {"node_cores": NODE_CORES, "storage_gb_per_s": storage_gbps, "steps": out}
    return out


def pass_ratio(steps: dict, name: str, baseline: str) -> float:
    """Wall time of step ``name`` over ``baseline``'s in the same pass, the median over passes: a slow minute
    of the machine slows both, so it cancels in the ratio."""
    walls, base = steps[name]["wall_s_passes"], steps[baseline]["wall_s_passes"]
    return statistics.median(w / b for w, b in zip(walls, base))


def summarize(report: dict) -> bool:
    size = report["large"]["bytes"]
    loads = [p[0] for p in report["load_average"]["passes"]]
    print(f"\ncheckpoint {size / 2**30:.2f} GiB ({size / 1e9:.2f} GB); layout TP={report['layout']['tp']} "
          f"PP={report['layout']['pp']}; round trips {'bit-identical' if report['verified'] else 'not checked'}; "
          f"1-minute load average {min(loads):.2f}-{max(loads):.2f} at the passes' starts, "
          f"{report['load_average']['end'][0]:.2f} at the end; median of {report['repeat']} passes")
    header = (f"{'run':<24} {'step':<34} {'wall (s)':>8} {'x base':>6} {'tiny (s)':>8} {'marginal':>8} {'CPU s':>6} "
              f"{'peak RSS':>9} {'/ ckpt':>6}  verdict")
    print(header)
    print("-" * len(header))
    ok = True
    report["summary"] = {}
    for key, runs in report["runs"].items():
        large, tiny = runs["large"], runs["tiny"]
        for name, step in large.items():
            base = tiny[name]
            baseline = DROPPED_BASELINE if "dropped cache" in name else BASELINE
            extra = step["wall_s"] - base["wall_s"]
            extra_rss = step["peak_rss"] - base["peak_rss"]
            extra_cpu = step["cpu_s"] - base["cpu_s"]
            x_base = pass_ratio(large, name, baseline)
            conversion = name.startswith(("hf2mcore", "mcore2hf"))
            checks = [x_base <= 1.5, extra_rss <= 0.10 * size, base["wall_s"] <= 3.0] if conversion else []
            passed = all(checks)
            ok &= passed
            report["summary"][f"{key} / {name}"] = {
                "wall_s": step["wall_s"], "x_baseline": x_base, "baseline": baseline, "tiny_wall_s": base["wall_s"],
                "marginal_s": extra, "gb_per_s": size / 1e9 / step["wall_s"], "cpu_s": step["cpu_s"],
                "marginal_cpu_s": extra_cpu, "gb_per_s_per_cpu_s": size / 1e9 / max(extra_cpu, 1e-9),
                "peak_rss": step["peak_rss"], "marginal_rss": extra_rss, "marginal_rss_fraction": extra_rss / size,
                "pass": passed}
            print(f"{key:<24} {name:<34} {step['wall_s']:8.2f} {x_base:6.2f} {base['wall_s']:8.2f} {extra:8.2f} "
                  f"{step['cpu_s']:6.2f} {step['peak_rss'] / 2**20:8.0f}M {extra_rss / size:6.3f}  "
                  f"{('PASS' if passed else 'FAIL') if conversion else ''}")
    return ok


if __name__ == "__main__":
    sys.exit(main())

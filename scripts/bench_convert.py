#!/usr/bin/env python
"""Benchmark `mpatch convert`: wall time, throughput and peak memory against a plain `cp -r`.

Synthesizes a Llama-style bf16 HF checkpoint (default about 1.5B parameters, 2.8 GiB, sharded
safetensors; `--preset 8b` is Llama-3.1-8B's shape, 16 GB) and a tiny one, then runs as separate
processes, for each page-cache state (`--cache warm,cold`) and worker count (`--workers 1,2`):

    cp -r HF COPY
    cp -r HF COPY, then fsync every file (the converters fsync their output before publishing it)
    mpatch convert hf2mcore --format legacy     --tp 2 --pp 2 --workers N
    mpatch convert mcore2hf  (from it)
    mpatch convert hf2mcore --format torch_dist --tp 2 --pp 2 --workers N
    mpatch convert mcore2hf  (from it)

timing each and sampling the resident memory of its whole process tree (every 20 ms). The whole
sequence runs `--repeat` times (default 3), one pass after the other, and each step's median wall and
CPU time (and its largest peak RSS) are reported: on a virtual machine the same `cp -r` varies by
+-30% from one moment to the next, and a single run compares moments as much as programs. The
"x cp" ratio (the target's) is taken within each pass, against that pass's `cp -r`, and its median
over passes is reported. Before each step the dirty pages of the previous one are written out
(`sync`, not timed) and the page cache is dropped (`echo 3 > /proc/sys/vm/drop_caches`, which needs
root; without it the script says so, skips cold, and warm steps start from whatever is cached);
then, for `warm`, the step's inputs are read once so they are in the page cache. The tiny model's
numbers are the fixed start-up cost; the large model's minus the tiny one's are what converting
the weights costs. Targets (issue 13):

    marginal wall time   <= 2 x the copy's (warm cache)
    marginal peak RSS    <= 10% of the checkpoint's bytes
    tiny model (start-up) <= 3 s (the model skeleton cached, as after the first conversion of an architecture)

The first conversion of an architecture computes megatron's model skeleton (a helper process that
imports megatron-core); that one-time cost is measured and printed separately.

Each step's CPU time (user + system) is measured too: converted bytes over the marginal CPU time
is what one core converts per second, which is what spreads over workers (independent tasks). From
it the script projects, for a 32-core conversion node, the time of Llama-3.1-70B (bf16) and
DeepSeek-V3 (from its FP8 hub checkpoint, whose weights are dequantized through torch: that rate is
measured here too, on one thread, for an expert-sized weight): the CPU's time over 32 cores or the
storage's (`--node-storage-gbps`, assumed), whichever is longer. Each round trip is
checked tensor by tensor against the original: bit-identical. The load average is printed at the
start and the end: on a shared machine, numbers taken under load are not comparable.

    python scripts/bench_convert.py [--preset bench|8b] [--workers 1,2] [--cache warm,cold] [--repeat 3]
                                    [--json out.json] [--node-storage-gbps 4]
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
    "bench": (2048, 16, 8192, 32, 8, 128256),
    "8b": (4096, 32, 14336, 32, 8, 128256),
    "tiny": (64, 4, 128, 4, 2, 256),
}


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
    from megatron_patch.convert.hf_reader import HFCheckpointReader

    src, back = HFCheckpointReader(original), HFCheckpointReader(copy)
    if back.keys() != src.keys():
        raise SystemExit(f"{copy}: tensor names differ from the original")
    for name in src.keys():
        if (src.dtype(name), src.shape(name)) != (back.dtype(name), back.shape(name)) or \
                src.read_bytes(name) != back.read_bytes(name):
            raise SystemExit(f"{copy}: {name} differs from the original")


def run_suite(hf: Path, work: Path, env: dict, args, workers: int, cache: str, check: bool) -> dict:
    """The five steps for one model, worker count and cache state; outputs removed as soon as read."""
    mpatch = [sys.executable, "-m", "megatron_patch", "convert"]
    common = ["--quiet", "--workers", str(workers)]
    results = {}

    def step(name: str, cmd: list[str], inputs: list[Path]) -> None:
        subprocess.run(["sync"], check=True)
        # Every step starts from the same memory: nothing cached (where allowed: main() runs cold steps
        # only then), then, for warm, its inputs read once, whoever wrote them last.
        drop_caches()
        if cache == "warm":
            for folder in inputs:
                warm(folder)
        results[name] = measure(cmd, env)

    step("cp -r", ["cp", "-r", str(hf), str(work / "copy")], [hf])
    shutil.rmtree(work / "copy")
    copy = work / "copy"
    step("cp -r + fsync", ["sh", "-c", f'cp -r "{hf}" "{copy}" && find "{copy}" -type f -exec sync {{}} + && sync "{copy}"'],
         [hf])
    shutil.rmtree(copy)
    for fmt in args.formats:
        ckpt, back = work / fmt, work / f"hf_from_{fmt}"
        step(f"hf2mcore {fmt}", mpatch + ["hf2mcore", "--hf-dir", str(hf), "--save-dir", str(ckpt), "--tp", str(args.tp),
                                           "--pp", str(args.pp), "--format", fmt] + common, [hf])
        step(f"mcore2hf {fmt}", mpatch + ["mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(back)] + common, [ckpt])
        if args.manifest_steps:  # what the manifest costs: its check alone, and mcore2hf without it
            step(f"verify {fmt}", [sys.executable, "-m", "megatron_patch", "verify", str(ckpt), "--quiet"], [ckpt])
            step(f"mcore2hf {fmt} --no-verify", mpatch + ["mcore2hf", "--load-dir", str(ckpt), "--save-dir",
                                                          str(work / "unverified"), "--no-verify"] + common, [ckpt])
            shutil.rmtree(work / "unverified")
        shutil.rmtree(ckpt)
        if check:
            verify(hf, back)
        shutil.rmtree(back)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", help="where to write (default: a new temporary folder, removed afterwards)")
    ap.add_argument("--preset", choices=["bench", "8b"], default="bench", help="the large model's shape (default bench: 1.5B)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    ap.add_argument("--cache", default="warm,cold", help="page-cache states: warm, cold or both (default both)")
    ap.add_argument("--formats", default="legacy,torch_dist", help="MCore formats (default legacy,torch_dist)")
    ap.add_argument("--repeat", type=int, default=3, help="passes over the steps; medians are reported (default 3)")
    ap.add_argument("--no-verify", action="store_true", help="skip the tensor-by-tensor round-trip check")
    ap.add_argument("--manifest-steps", action="store_true",
                    help="also time 'mpatch verify' of each checkpoint and mcore2hf --no-verify (the manifest's cost)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--node-storage-gbps", type=float, default=4.0,
                    help="write rate assumed for the projected conversion node's storage (default 4 GB/s)")
    args = ap.parse_args()
    args.formats = args.formats.split(",")
    worker_counts = [int(w) for w in args.workers.split(",")]
    caches = args.cache.split(",")

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["MPATCH_CACHE_DIR"] = str(work / "skeleton-cache")  # starts empty: the first conversion is measured
    try:
        if "cold" in caches and not drop_caches():
            print("cannot drop the page cache here (needs root): cold-cache runs skipped", flush=True)
            caches = [c for c in caches if c != "cold"]
        report = {"machine": {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)},
                  "layout": {"tp": args.tp, "pp": args.pp}, "preset": args.preset, "verified": not args.no_verify,
                  "repeat": args.repeat,
                  "load_average": {"start": os.getloadavg()}, "runs": {}}
        print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)", flush=True)
        models = {}
        for label, dims in (("tiny", PRESETS["tiny"]), ("large", PRESETS[args.preset])):
            hf = work / label / "hf"
            t = time.perf_counter()
            nbytes = synthesize(hf, llama_config(*dims))
            models[label] = (hf, nbytes)
            report[label] = {"parameters": nbytes // 2, "bytes": nbytes}
            print(f"{label}: {nbytes / 2 / 1e9:.3f}B parameters, {nbytes / 2**30:.2f} GiB bf16 "
                  f"(synthesized in {time.perf_counter() - t:.1f} s)", flush=True)
        # The first conversion of each architecture asks megatron-core for its model skeleton.
        for label, (hf, _) in models.items():
            first = measure([sys.executable, "-m", "megatron_patch", "convert", "hf2mcore", "--hf-dir", str(hf),
                             "--save-dir", str(work / "first"), "--tp", str(args.tp), "--pp", str(args.pp), "--quiet"], env)
            shutil.rmtree(work / "first")
            report[label]["first_conversion"] = first
            print(f"{label}: first conversion of the architecture (skeleton computed by megatron-core): "
                  f"{first['wall_s']:.2f} s", flush=True)
        for cache in caches:
            for workers in worker_counts:
                key = f"{cache} cache, {workers} worker{'s' if workers > 1 else ''}"
                passes = {label: [] for label in models}
                for i in range(args.repeat):
                    for label, (hf, _) in models.items():
                        passes[label].append(run_suite(hf, work / label, env, args, workers, cache,
                                                       check=label == "large" and i == 0 and not args.no_verify))
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
        if not key.startswith("warm cache, 1 worker /") or " / cp -r" in key:
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
        print(f"  {step:<20} {row['gb_per_cpu_s']:.2f} GB per CPU-s{scaling}; {times}")
    report["projection"] = {"node_cores": NODE_CORES, "storage_gb_per_s": storage_gbps, "steps": out}
    return out


def pass_ratio(large: dict, tiny: dict, name: str) -> float:
    """Marginal time of step ``name`` over the marginal time of `cp -r` in the same pass, the median
    over passes: a slow minute of the machine slows both, so it cancels in the ratio."""
    def marginal(step, i):
        return large[step]["wall_s_passes"][i] - tiny[step]["wall_s_passes"][i]
    return statistics.median(marginal(name, i) / marginal("cp -r", i) for i in range(len(large[name]["wall_s_passes"])))


def summarize(report: dict) -> bool:
    size = report["large"]["bytes"]
    print(f"\ncheckpoint {size / 2**30:.2f} GiB ({size / 1e9:.2f} GB); layout TP={report['layout']['tp']} "
          f"PP={report['layout']['pp']}; round trips {'bit-identical' if report['verified'] else 'not checked'}; "
          f"load average {report['load_average']['start'][0]:.2f} at the start, {report['load_average']['end'][0]:.2f} at the end; "
          f"median of {report['repeat']} passes")
    header = (f"{'run':<24} {'step':<20} {'wall (s)':>8} {'tiny (s)':>8} {'marginal':>8} {'x cp':>5} {'GB/s':>6} {'CPU s':>6} "
              f"{'peak RSS':>9} {'marg. RSS':>9} {'/ ckpt':>6}  verdict")
    print(header)
    print("-" * len(header))
    ok = True
    report["summary"] = {}
    for key, runs in report["runs"].items():
        large, tiny = runs["large"], runs["tiny"]
        for name, step in large.items():
            base = tiny[name]
            extra = step["wall_s"] - base["wall_s"]
            extra_rss = step["peak_rss"] - base["peak_rss"]
            extra_cpu = step["cpu_s"] - base["cpu_s"]
            x_copy = pass_ratio(large, tiny, name)
            checks = []
            if not name.startswith("cp -r"):
                if key.startswith("warm"):
                    checks.append(x_copy <= 2)
                checks += [extra_rss <= 0.10 * size, base["wall_s"] <= 3.0]
            passed = all(checks)
            ok &= passed
            report["summary"][f"{key} / {name}"] = {
                "wall_s": step["wall_s"], "tiny_wall_s": base["wall_s"], "marginal_s": extra, "x_copy": x_copy,
                "gb_per_s": size / 1e9 / extra, "cpu_s": step["cpu_s"], "marginal_cpu_s": extra_cpu,
                "gb_per_s_per_cpu_s": size / 1e9 / max(extra_cpu, 1e-9), "peak_rss": step["peak_rss"], "marginal_rss": extra_rss,
                "marginal_rss_fraction": extra_rss / size, "pass": passed}
            print(f"{key:<24} {name:<20} {step['wall_s']:8.2f} {base['wall_s']:8.2f} {extra:8.2f} {x_copy:5.2f} "
                  f"{size / 1e9 / extra:6.2f} {extra_cpu:6.2f} {step['peak_rss'] / 2**20:8.0f}M {extra_rss / 2**20:8.0f}M "
                  f"{extra_rss / size:6.3f}  {'' if name.startswith('cp -r') else 'PASS' if passed else 'FAIL'}")
    return ok


if __name__ == "__main__":
    sys.exit(main())

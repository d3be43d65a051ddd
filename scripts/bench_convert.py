#!/usr/bin/env python
"""Benchmark `mpatch convert`: wall time and peak memory against a plain `cp -r` of the same folder.

Synthesizes a Llama-style HF checkpoint (default about 1.5B parameters in bf16, sharded safetensors)
and a tiny one, then for each runs, as separate processes:

    cp -r HF COPY
    mpatch convert hf2mcore --format legacy     --tp 2 --pp 2
    mpatch convert hf2mcore --format torch_dist --tp 2 --pp 2
    mpatch convert mcore2hf  (from each of the two)

timing each and sampling the resident memory of its whole process tree (every 20 ms). The tiny
model's numbers are the fixed start-up cost (interpreter, imports, helper process); the large
model's numbers minus the tiny one's are what the conversion itself costs, compared with the copy:

    extra wall time  <= 2 x the copy's wall time
    extra peak RSS   <  1/4 of the checkpoint's bytes

Finally the round-tripped HF folders are compared with the original, tensor by tensor.

    python scripts/bench_convert.py [--work-dir DIR] [--hidden 2048 --layers 16 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]


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


def synthesize(folder: Path, config: dict, shard_bytes: int = 2 * 10**9) -> int:
    """Write a random bf16 Llama checkpoint, one tensor at a time; return its tensor bytes."""
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
    """Wall time and peak resident memory (sum over the process tree, sampled) of one command."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    peak = 0
    root = psutil.Process(proc.pid)

    def sample():
        nonlocal peak
        while proc.poll() is None:
            try:
                procs = [root] + root.children(recursive=True)
                total = 0
                for p in procs:
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
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{err.decode()[-2000:]}")
    return {"wall_s": wall, "peak_rss": peak}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def run_suite(hf: Path, work: Path, env: dict, tp: int, pp: int) -> dict:
    mpatch = [sys.executable, "-m", "megatron_patch", "convert"]
    steps = {
        "cp -r": ["cp", "-r", str(hf), str(work / "copy")],
        "hf2mcore legacy": mpatch + ["hf2mcore", "--hf-dir", str(hf), "--save-dir", str(work / "legacy"),
                                     "--tp", str(tp), "--pp", str(pp), "--format", "legacy", "--quiet"],
        "hf2mcore torch_dist": mpatch + ["hf2mcore", "--hf-dir", str(hf), "--save-dir", str(work / "torch_dist"),
                                         "--tp", str(tp), "--pp", str(pp), "--format", "torch_dist", "--quiet"],
        "mcore2hf legacy": mpatch + ["mcore2hf", "--load-dir", str(work / "legacy"), "--save-dir",
                                     str(work / "hf_from_legacy"), "--quiet"],
        "mcore2hf torch_dist": mpatch + ["mcore2hf", "--load-dir", str(work / "torch_dist"), "--save-dir",
                                         str(work / "hf_from_torch_dist"), "--quiet"],
    }
    results = {}
    for name, cmd in steps.items():
        results[name] = measure(cmd, env)
        print(f"  {name:<22} {results[name]['wall_s']:7.2f} s   peak RSS {results[name]['peak_rss'] / 2**20:8.0f} MiB",
              flush=True)
    return results


def verify(original: Path, copies: list[Path]) -> None:
    from megatron_patch.convert.hf_reader import HFCheckpointReader

    src = HFCheckpointReader(original)
    for folder in copies:
        back = HFCheckpointReader(folder)
        assert back.keys() == src.keys(), folder
        for name in src.keys():
            if not torch.equal(src.get(name), back.get(name)):
                raise SystemExit(f"{folder}: {name} differs from the original")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", help="where to write (default: a new temporary folder, removed afterwards)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--json", help="also write the results as JSON here")
    args = ap.parse_args()

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    try:
        sizes = {"tiny": llama_config(64, 4, 128, 4, 2, 256),
                 "large": llama_config(args.hidden, args.layers, args.ffn, args.heads, args.kv_heads, args.vocab)}
        report = {"machine": {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1)},
                  "layout": {"tp": args.tp, "pp": args.pp}, "load_average": {"start": os.getloadavg()}}
        # Other work on the machine (load above our own one process) makes the timings unreliable.
        print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)", flush=True)
        for label, config in sizes.items():
            hf = work / label / "hf"
            t = time.perf_counter()
            nbytes = synthesize(hf, config)
            params = nbytes // 2
            print(f"{label}: {params / 1e9:.3f}B parameters, {nbytes / 2**30:.2f} GiB bf16 "
                  f"(synthesized in {time.perf_counter() - t:.1f} s)", flush=True)
            report[label] = {"parameters": params, "bytes": nbytes, "steps": run_suite(hf, work / label, env, args.tp, args.pp)}
            if label == "large":
                t = time.perf_counter()
                verify(hf, [work / label / "hf_from_legacy", work / label / "hf_from_torch_dist"])
                print(f"  round trips bit-identical ({time.perf_counter() - t:.1f} s to check)", flush=True)
                report[label]["output_bytes"] = {k: folder_bytes(work / label / k) for k in ("legacy", "torch_dist")}
        report["load_average"]["end"] = os.getloadavg()
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        large, tiny = report["large"], report["tiny"]
        copy = large["steps"]["cp -r"]["wall_s"]
        print(f"\ncheckpoint {large['bytes'] / 2**30:.2f} GiB; cp -r {copy:.2f} s; layout TP={args.tp} PP={args.pp}")
        header = f"{'step':<22} {'wall (s)':>9} {'extra wall (s)':>15} {'x copy':>7} {'peak RSS (MiB)':>15} " \
                 f"{'extra RSS (MiB)':>16} {'/ ckpt':>7}  verdict"
        print(header)
        print("-" * len(header))
        report["summary"] = {}
        for name, step in large["steps"].items():
            base = tiny["steps"][name]
            extra_wall = step["wall_s"] - base["wall_s"]
            extra_rss = step["peak_rss"] - base["peak_rss"]
            ok = name == "cp -r" or (extra_wall <= 2 * copy and extra_rss < large["bytes"] / 4)
            report["summary"][name] = {"wall_s": step["wall_s"], "extra_wall_s": extra_wall, "x_copy": extra_wall / copy,
                                       "peak_rss": step["peak_rss"], "extra_rss": extra_rss,
                                       "extra_rss_fraction": extra_rss / large["bytes"], "pass": ok}
            print(f"{name:<22} {step['wall_s']:9.2f} {extra_wall:15.2f} {extra_wall / copy:7.2f} "
                  f"{step['peak_rss'] / 2**20:15.0f} {extra_rss / 2**20:16.0f} {extra_rss / large['bytes']:7.3f}  "
                  f"{'' if name == 'cp -r' else 'PASS' if ok else 'FAIL'}")
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return 0 if all(s["pass"] for s in report["summary"].values()) else 1
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

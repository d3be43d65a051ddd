#!/usr/bin/env python
"""Benchmark the converter's MXFP4 path (gpt-oss's hub experts -> bf16), the numbers in docs/performance.md.

1. Dequantization alone, one thread: one gpt-oss expert's ``gate_up_proj`` (5760 rows of 2880 values,
   codes and scales random) through ``convert/mxfp4.py:dequantize`` and through transformers' own
   ``convert_moe_packed_tensors`` on the same codes (the two are checked equal, bit for bit, after the
   cast to bf16); the median of ``--repeat`` runs, in GB/s of bf16 written.
2. End to end: a synthetic one-layer MXFP4 checkpoint shaped as gpt-oss-20b's layers (32 experts of
   2880 x 2880, a small vocabulary so that the experts are nearly all of it) converted by
   ``mpatch convert hf2mcore --dtype bf16 --format torch_dist --workers N`` in a child process: wall time,
   CPU time (user + system) and peak RSS, and the bf16 expert bytes written per second of wall and of CPU.

The load average is printed at the start and the end: numbers taken under load are not comparable.

    python scripts/bench_mxfp4.py [--repeat 5] [--workers 1,2] [--layers 1]
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
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_patch.convert.mxfp4 import dequantize  # noqa: E402

HIDDEN, FFN, EXPERTS = 2880, 2880, 32


def _expert(g: torch.Generator, rows: int, cols: int):
    return (torch.randint(0, 256, (rows, cols // 32, 16), dtype=torch.uint8, generator=g),
            torch.randint(118, 130, (rows, cols // 32), dtype=torch.uint8, generator=g))


def dequantization_rate(repeat: int) -> dict:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.set_num_threads(1)
    blocks, scales = _expert(torch.Generator().manual_seed(0), 2 * FFN, HIDDEN)
    out_bytes = 2 * FFN * HIDDEN * 2  # bf16
    ours, theirs = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        mine = dequantize(blocks, scales).to(torch.bfloat16)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        ref = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.bfloat16)[0]
        theirs.append(time.perf_counter() - t)
    assert torch.equal(mine.view(torch.int16), ref.view(torch.int16)), "not transformers' values"
    return {"expert_gb": out_bytes / 1e9, "ours_s": statistics.median(ours), "transformers_s": statistics.median(theirs),
            "ours_gbps": out_bytes / 1e9 / statistics.median(ours),
            "transformers_gbps": out_bytes / 1e9 / statistics.median(theirs)}


def synthetic_checkpoint(folder: Path, layers: int) -> int:
    """A gpt-oss-20b-shaped MXFP4 checkpoint of ``layers`` layers; returns the bf16 bytes of its experts."""
    from safetensors.torch import save_file

    from megatron_patch.models.description.registry import get_family

    config = dict(get_family("gpt_oss").presets["20B-A3.6B"])
    config.update(num_hidden_layers=layers, layer_types=config["layer_types"][:layers], vocab_size=1024,
                  quantization_config={"quant_method": "mxfp4"})
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(1)
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]

    def w(*shape):
        return (0.02 * torch.randn(*shape, generator=g)).to(torch.bfloat16)

    for layer in range(layers):
        p, t = f"model.layers.{layer}", {}
        t.update({f"{p}.input_layernorm.weight": w(HIDDEN), f"{p}.post_attention_layernorm.weight": w(HIDDEN),
                  f"{p}.self_attn.q_proj.weight": w(heads * hd, HIDDEN), f"{p}.self_attn.q_proj.bias": w(heads * hd),
                  f"{p}.self_attn.k_proj.weight": w(kv * hd, HIDDEN), f"{p}.self_attn.k_proj.bias": w(kv * hd),
                  f"{p}.self_attn.v_proj.weight": w(kv * hd, HIDDEN), f"{p}.self_attn.v_proj.bias": w(kv * hd),
                  f"{p}.self_attn.o_proj.weight": w(HIDDEN, heads * hd), f"{p}.self_attn.o_proj.bias": w(HIDDEN),
                  f"{p}.self_attn.sinks": w(heads), f"{p}.mlp.router.weight": w(EXPERTS, HIDDEN),
                  f"{p}.mlp.router.bias": w(EXPERTS), f"{p}.mlp.experts.gate_up_proj_bias": w(EXPERTS, 2 * FFN),
                  f"{p}.mlp.experts.down_proj_bias": w(EXPERTS, HIDDEN)})
        for name, rows, cols in (("gate_up_proj", 2 * FFN, HIDDEN), ("down_proj", HIDDEN, FFN)):
            pairs = [_expert(g, rows, cols) for _ in range(EXPERTS)]
            t[f"{p}.mlp.experts.{name}_blocks"] = torch.stack([b for b, _ in pairs])
            t[f"{p}.mlp.experts.{name}_scales"] = torch.stack([s for _, s in pairs])
        save_file(t, str(folder / f"layer{layer}.safetensors"), metadata={"format": "pt"})
    save_file({"model.embed_tokens.weight": w(1024, HIDDEN), "lm_head.weight": w(1024, HIDDEN),
               "model.norm.weight": w(HIDDEN)}, str(folder / "ends.safetensors"), metadata={"format": "pt"})
    return layers * EXPERTS * 3 * FFN * HIDDEN * 2


def convert(hf: Path, out: Path, workers: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "megatron_patch", "convert", "hf2mcore", "--hf-dir", str(hf),
                    "--save-dir", str(out), "--dtype", "bf16", "--format", "torch_dist", "--workers", str(workers),
                    "--quiet"], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "peak_rss_mib": after.ru_maxrss / 1024}


def main() -> None:
    from megatron_patch.runtime.known_warnings import quiet_known_warnings

    quiet_known_warnings()  # as mpatch does (torchao's import notices, megatron-core's fallbacks)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    print(f"load average at the start: {os.getloadavg()[0]:.2f}")
    rate = dequantization_rate(args.repeat)
    print(f"dequantize one expert ({rate['expert_gb']:.3f} GB bf16), one thread: ours {rate['ours_s']:.3f} s "
          f"({rate['ours_gbps']:.2f} GB/s), transformers' {rate['transformers_s']:.3f} s "
          f"({rate['transformers_gbps']:.2f} GB/s); equal bit for bit")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        hf = Path(tmp) / "hf"
        expert_bytes = synthetic_checkpoint(hf, args.layers)
        convert(hf, Path(tmp) / "warm-up", 1)  # the model skeleton, computed once and cached
        for workers in [int(w) for w in args.workers.split(",")]:
            r = convert(hf, Path(tmp) / "mcore", workers)
            print(f"hf2mcore torch_dist --dtype bf16 --workers {workers}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, "
                  f"peak RSS {r['peak_rss_mib']:.0f} MiB; experts {expert_bytes / 1e9:.2f} GB bf16 -> "
                  f"{expert_bytes / 1e9 / r['wall_s']:.2f} GB/s wall, {expert_bytes / 1e9 / r['cpu_s']:.2f} GB per CPU-second")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

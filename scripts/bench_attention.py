#!/usr/bin/env python
"""The SDPA core attention against megatron-core's unfused one: time and peak memory of one layer's core
attention, forward and backward, at several sequence lengths.

Each case runs in a fresh process (megatron's CPU layer, one rank), on random q, k, v shaped as the model
feeds them ([s, b, heads, dim], keys and values grouped), causal. Time: the median of --repeat forward+
backward passes after one warm-up. Peak memory: what one forward+backward needs above what the process held
with its inputs (the unfused attention's [b, heads, s, s] scores and softmax, SDPA's O(s) working set): on
CPU the resident set sampled every millisecond (with glibc returning every block of 64 KiB or more on free,
so that it follows what is live), on a GPU torch's peak allocation. Prints the load
average before and after (the development machine is shared: times are only comparable within one run).

    python scripts/bench_attention.py [--device cpu|cuda] [--seq 2048,4096] [--dtype fp32,bf16] [--heads 8]
                                      [--kv-heads 2] [--head-dim 64] [--batch 1] [--repeat 3] [--json FILE]

The CPU defaults are a small model's attention (8 heads of 64, 2 key/value groups) so 4k tokens of the
unfused attention fit a shared machine; on a GPU, Llama-3.1-8B's (--heads 32 --kv-heads 8 --head-dim 128).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_patch.runtime.distributed import ParallelLayout  # noqa: E402
from megatron_patch.runtime.launch import run_local  # noqa: E402
from cli_types import comma_list, positive_int  # noqa: E402  (scripts/, beside this one)

PAGE = os.sysconf("SC_PAGE_SIZE")


def _config(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=kv_heads, kv_channels=head_dim, attention_dropout=0.0,
                             hidden_dropout=0.0, attention_softmax_in_fp32=True, params_dtype=dtype,
                             bf16=dtype == torch.bfloat16, use_cpu_initialization=True)


class ResidentPeak:
    """The largest resident set of this process while the block runs, sampled every millisecond (torch's CPU
    kernels release the GIL, so the sampler sees their allocations), less the resident set before it."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.resident())
            time.sleep(0.001)

    def __enter__(self):
        self.base = self.peak = self.resident()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.resident())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def case_worker(kind: str, seq: int, dtype_name: str, heads: int, kv_heads: int, head_dim: int, batch: int,
                repeat: int, device_name: str) -> dict:
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_patch.models.blocks.sdpa_attention import SDPAttention
    from megatron_patch.runtime import init_model_parallel

    init_model_parallel(ParallelLayout())
    device = torch.device(device_name)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    cls = SDPAttention if kind == "sdpa" else DotProductAttention
    module = cls(_config(heads, kv_heads, head_dim, dtype), layer_number=1, attn_mask_type=AttnMaskType.causal,
                 attention_type="self").to(device)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(seq, batch, heads, head_dim, generator=gen).to(device, dtype).requires_grad_()
    k, v = (torch.randn(seq, batch, kv_heads, head_dim, generator=gen).to(device, dtype).requires_grad_()
            for _ in range(2))
    grad = torch.randn(seq, batch, heads * head_dim, generator=gen).to(device, dtype)

    def step():
        module(q, k, v, None).backward(grad)
        q.grad = k.grad = v.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    seconds, extra = measure(step, device, repeat)
    return {"attention": kind, "seq": seq, "dtype": dtype_name, "seconds": seconds, "peak_extra_bytes": extra,
            "threads": torch.get_num_threads()}


def measure(step, device: torch.device, repeat: int) -> tuple[float, int]:
    """(median seconds of ``repeat`` calls of ``step``, the peak memory one call needs above what was held before
    it) after one warm-up call (kernel choice, allocator)."""
    step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step()
        extra = torch.cuda.max_memory_allocated(device) - base
    else:
        with ResidentPeak() as peak:
            step()
        extra = peak.extra
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times), extra


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--seq", type=comma_list(item=positive_int), default="2048,4096")
    ap.add_argument("--dtype", type=comma_list(("fp32", "bf16")), default="fp32,bf16")
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--head-dim", type=int)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeat", type=positive_int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per case (default: torch's choice)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_attention.py: --device cuda and this machine has no GPU", file=sys.stderr)
        return 2
    gpu = args.device == "cuda"
    heads = args.heads or (32 if gpu else 8)
    kv_heads = args.kv_heads or (8 if gpu else 2)
    head_dim = args.head_dim or (128 if gpu else 64)
    # Every allocation of 64 KiB or more its own mapping, returned on free: the resident set then follows what
    # is live (glibc would otherwise keep freed blocks of the warm-up pass and hide the measured pass's needs).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    else:  # run_local pins its ranks to one thread unless told otherwise
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    where = torch.cuda.get_device_name(0) if gpu else f"CPU ({torch.backends.cpu.get_cpu_capability()})"
    print(f"torch {torch.__version__} on {where}; {heads} heads of {head_dim}, {kv_heads} key/value groups, batch "
          f"{args.batch}, causal, forward+backward, median of {args.repeat}; load average {os.getloadavg()}",
          flush=True)
    rows = []
    for dtype in args.dtype:
        for seq in args.seq:
            for kind in ("unfused", "sdpa"):
                r = run_local(case_worker, 1, kind, seq, dtype, heads, kv_heads, head_dim, args.batch, args.repeat,
                              args.device, timeout=1800)[0]
                rows.append(r)
                print(f"  {dtype:<5} {seq:>6} tokens  {kind:<8} {r['seconds'] * 1e3:9.1f} ms  peak +"
                      f"{r['peak_extra_bytes'] / 2**20:8.1f} MiB  ({r['threads']} threads)", flush=True)
            unfused, sdpa = rows[-2], rows[-1]
            print(f"  {dtype:<5} {seq:>6} tokens  sdpa/unfused: time {sdpa['seconds'] / unfused['seconds']:.2f}x, "
                  f"peak memory {sdpa['peak_extra_bytes'] / max(unfused['peak_extra_bytes'], 1):.2f}x", flush=True)
    print(f"load average after: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": where, "torch": torch.__version__, "heads": heads,
                                               "kv_heads": kv_heads, "head_dim": head_dim, "batch": args.batch,
                                               "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Steady-state throughput of a run, from its per-iteration metrics.

The first iteration after a start (or a resume) carries one-off costs: CUDA context and allocator
growth, cuDNN/cuBLAS autotuning, transformer-engine's first FP8 scales, compilation of fused kernels
not covered by the warm-up. Its tokens/s and MFU say little about the run, so it is recorded with
``"warmup": true`` and left out of the summary, as Megatron-LM leaves its first iteration out of
its throughput log.
"""

from __future__ import annotations

WARMUP_ITERATIONS = 1
# Dense peak TFLOP/s per GPU for MFU (bf16/fp16; fp8 doubles, though training measures fp8 runs against bf16's peak
# too, so that their MFU compares directly), by a name the device's name contains.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak MFU is measured against, fp8 runs included (the useful FLOPs are the same, so an fp8
    run's MFU reads directly against bf16's: docs/fp8.md), for a GPU named ``device_name``
    (``torch.cuda.get_device_name()``); None for a GPU this table does not know (the summary then gives no MFU)."""
    for key, value in PEAK_TFLOPS.items():
        if key in device_name:
            return value
    return None


def summarize(records: list[dict], peak_tflops: float | None = None) -> dict | None:
    """Totals over the training iterations not flagged as warm-up; None if there are none."""
    steady = [r for r in records if "loss" in r and not r.get("warmup")]
    if not steady:
        return None
    seconds = sum(r["iteration_s"] for r in steady)
    tokens = sum(r["tokens"] for r in steady)
    # None: the model's FLOPs are not counted (loop.flops_per_iteration)
    counted = all(r["tflops_per_gpu"] is not None for r in steady)
    tflops = sum(r["tflops_per_gpu"] * r["iteration_s"] for r in steady) / seconds if counted else None
    out = {"iterations": [steady[0]["iteration"], steady[-1]["iteration"]], "count": len(steady),
           "warmup_excluded": sum(1 for r in records if r.get("warmup")), "seconds": seconds,
           "tokens_per_s": tokens / seconds, "tflops_per_gpu": tflops,
           "peak_memory_gib": max(r["memory_gib"] for r in steady), "peak_tflops": peak_tflops,
           "mfu": tflops / peak_tflops if peak_tflops and tflops is not None else None}
    return out


def tflops_text(tflops: float) -> str:
    """Three significant digits below 10 TFLOP/s: a CPU rank's 0.002 must not read as 0.00."""
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"


def describe(summary: dict | None, per: str = "GPU") -> str:
    """``per``: what one rank runs on, "GPU" or "process" (a CPU rank), as the iteration lines say it."""
    if summary is None:
        return "throughput: only warm-up iterations ran, nothing to summarise"
    first, last = summary["iterations"]
    mfu = f", MFU {summary['mfu']:.1%} of {summary['peak_tflops']:.0f}" if summary["mfu"] is not None else ""
    return (f"throughput over iterations {first}..{last} ({summary['warmup_excluded']} warm-up iteration(s) left out): "
            f"{summary['tokens_per_s']:.0f} tokens/s, "
            + (f"{tflops_text(summary['tflops_per_gpu'])} TFLOP/s per {per}{mfu}, "
               if summary["tflops_per_gpu"] is not None else "TFLOP/s not counted, ")
            + f"peak memory {summary['peak_memory_gib']:.2f} GiB")

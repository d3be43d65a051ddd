#!/usr/bin/env python
"""What the exact AdamW formula costs on this CPU, and what its correctly rounded square root adds.

Times one update of a chunk-sized span (default 16 Mi elements, 64 MiB of fp32 per tensor) with:
torch's AdamW (the ``fast`` formula's CPU path), the ``exact`` formula, and the exact formula with
torch's float32 square root in place of the float64 one (the pre-fix formula, which is not correctly
rounded on every CPU). Also counts how many of a million uniform values torch's float32 sqrt rounds
differently from IEEE here. Prints medians over --repeat runs and the load average.

    python scripts/bench_adam_formula.py [--elements N] [--repeat R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from unittest import mock

import numpy as np
import torch

from megatron_patch.training.offload import adam

from cli_types import positive_int  # scripts/, beside this one

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _inputs(n: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2,
            torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5]


def _time(update, n: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        p, g, m, v = _inputs(n)
        start = time.perf_counter()
        update([p], [g], [m], [v], step=3, **HYPER)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=positive_int, default=16 * 2**20)
    ap.add_argument("--repeat", type=positive_int, default=5)
    args = ap.parse_args()
    n = args.elements

    x = torch.rand(1_000_000, generator=torch.Generator().manual_seed(1))
    misses = int((torch.sqrt(x) != torch.from_numpy(np.sqrt(x.numpy()))).sum())
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads, load average {os.getloadavg()}")
    print(f"torch float32 sqrt: {misses} of 1,000,000 uniform values differ from IEEE on this CPU")

    fast = _time(lambda *a, **k: adam.torch_adamw_(*a, fused=False, **k), n, args.repeat)
    exact = _time(adam.exact_adamw_, n, args.repeat)
    with mock.patch.object(adam, "correctly_rounded_sqrt", torch.sqrt):
        exact_f32 = _time(adam.exact_adamw_, n, args.repeat)
    for name, t in (("torch AdamW (fast)", fast), ("exact, float64 sqrt", exact),
                    ("exact, float32 sqrt (old)", exact_f32)):
        print(f"{name:28s} {t * 1e3:8.1f} ms  {n / t / 1e6:7.1f} M elements/s")
    print(f"the float64 square root costs {exact / exact_f32:.2f}x the float32 one in the exact formula; "
          f"exact is {exact / fast:.2f}x fast")


if __name__ == "__main__":
    main()

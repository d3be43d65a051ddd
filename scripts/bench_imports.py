"""What importing the heavy dependencies costs a fresh process: the reason some modules import them inside
functions (docs/architecture.md, "Imports and what each process pays for").

Each module is imported by a new interpreter ``--repeat`` times; the best wall time is printed (the others
pay for other processes on the machine), with the load average before the runs.

    python scripts/bench_imports.py --repeat 5
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

MODULES = ("megatron_patch.cli", "megatron_patch.training.run_state", "numpy", "transformers", "torch",
           "megatron_patch.training.checkpointing", "megatron.core.models.gpt")
# What every mpatch process (each rank of a launch) pays for megatron-core: its torch.compile decorations deferred
# to their first call (megatron_patch/runtime/deferred_compile.py).
DEFERRED = ("megatron.core.models.gpt, compile deferred",
            "from megatron_patch.runtime.deferred_compile import defer_megatron_compile\n"
            "defer_megatron_compile()\nimport megatron.core.models.gpt")


def best_import_seconds(code: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    empty = best_import_seconds("import sys", args.repeat)
    print(f"{'interpreter start':42s} {empty:6.2f} s")
    for label, code in [*((m, f"import {m}") for m in MODULES), DEFERRED]:
        total = best_import_seconds(code, args.repeat)
        print(f"{label:42s} {total:6.2f} s  ({total - empty:.2f} s beyond the interpreter's start)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

MODULES = ("megatron_patch.cli", "numpy", "transformers", "torch", "megatron.core.models.gpt")


def best_import_seconds(module: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True, capture_output=True)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    empty = best_import_seconds("sys", args.repeat)
    print(f"{'interpreter start':28s} {empty:6.2f} s")
    for module in MODULES:
        total = best_import_seconds(module, args.repeat)
        print(f"{module:28s} {total:6.2f} s  ({total - empty:.2f} s beyond the interpreter's start)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

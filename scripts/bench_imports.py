"""What importing the heavy dependencies costs a fresh process: the reason some modules import them inside
functions (docs/architecture.md, "Imports and what each process pays for").

Each module is imported by a new interpreter ``--repeat`` times; the best wall time is printed (the others
pay for other processes on the machine), with the load average before the runs.

    python scripts/bench_imports.py --repeat 5

The last two lines: what a rank imports of the project itself, compiled from source (no bytecode cache, as where
PYTHONDONTWRITEBYTECODE=1 and nothing wrote one) and from the caches compileall writes (tests/conftest.py does that
once per test session). Both from a copy of the package in a temporary folder, so the checkout is left as it is.
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODULES = ("megatron_patch.cli", "megatron_patch.training.run_state", "numpy", "transformers", "torch",
           "megatron_patch.training.checkpointing", "megatron.core.models.gpt")
# What every mpatch process (each rank of a launch) pays for megatron-core: its torch.compile decorations deferred
# to their first call (megatron_patch/runtime/deferred_compile.py).
DEFERRED = ("megatron.core.models.gpt, compile deferred",
            "from megatron_patch.runtime.deferred_compile import defer_megatron_compile\n"
            "defer_megatron_compile()\nimport megatron.core.models.gpt")


# What a training rank imports of the project (after megatron-core, which the first import below brings in).
PROJECT = ("import megatron.core.models.gpt; import time; t = time.perf_counter(); "
           "import megatron_patch.cli.train, megatron_patch.training.loop, megatron_patch.training.lora_run; "
           "print(time.perf_counter() - t)")


def best_import_seconds(code: str, repeat: int, env: dict | None = None) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=env)
        best = min(best, time.perf_counter() - start)
    return best


def best_project_import_seconds(package: Path, repeat: int) -> float:
    """The best time of PROJECT's own imports, the package found in ``package``'s folder, no cache written."""
    env = {**os.environ, "PYTHONPATH": str(package.parent), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPYCACHEPREFIX", None)
    return min(float(subprocess.run([sys.executable, "-c", PROJECT], check=True, capture_output=True, text=True,
                                    env=env, cwd=package.parent).stdout.split()[-1]) for _ in range(repeat))


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
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "megatron_patch"
        shutil.copytree(Path(__file__).resolve().parents[1] / "megatron_patch", package,
                        ignore=shutil.ignore_patterns("__pycache__"))
        source = best_project_import_seconds(package, args.repeat)
        compileall.compile_dir(package, quiet=1)
        cached = best_project_import_seconds(package, args.repeat)
    print(f"{'the project (a rank), compiled from source':42s} {source:6.2f} s")
    print(f"{'the project (a rank), from bytecode caches':42s} {cached:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

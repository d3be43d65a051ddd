"""What importing the heavy dependencies costs a fresh process: the reason some modules import them inside
functions (docs/architecture.md, "Imports and what each process pays for").

Each module is imported by a new interpreter ``--repeat`` times; the best wall time is printed (the others
pay for other processes on the machine), with the load average before the runs.

    python scripts/bench_imports.py --repeat 5

The two "the project" lines: what a rank imports of the project itself, compiled from source (no bytecode
cache, as where PYTHONDONTWRITEBYTECODE=1 and nothing wrote one) and from the caches compileall writes
(tests/conftest.py does that once per test session). Both from a copy of the package in a temporary folder, so the
checkout is left as it is.

The "first call" lines: what the first call of one of megatron-core's jit-fused functions costs a process on CPU
where it is compiled (MP_COMPILE_FUSIONS=true; before, always): the router's expert-bias update, as a no-op (no
expert bias: traced, nothing to build) and as DeepSeek-V3 runs it (a C++ kernel built); against eager, the default
on CPU (runtime/deferred_compile.py).
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


# megatron-core's router's _apply_expert_bias, deferred as in a rank; argv: expert bias 0/1, compiled 0/1.
FIRST_CALL = """
import sys, time, torch
from megatron_patch.runtime.deferred_compile import deferred_compile, set_megatron_fusions
set_megatron_fusions(sys.argv[2] == "1")
class Router(torch.nn.Module):
    def __init__(self, enable):
        super().__init__()
        self.enable_expert_bias = enable
        self.register_buffer("local_tokens_per_expert", torch.zeros(8))
    @deferred_compile
    def _apply_expert_bias(self, routing_map):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                self.local_tokens_per_expert += routing_map.sum(dim=0)
router, routing_map = Router(sys.argv[1] == "1"), torch.rand(16, 8) > 0.5
t = time.perf_counter()
router._apply_expert_bias(routing_map)
print(time.perf_counter() - t)
"""


def best_first_call_seconds(expert_bias: bool, compiled: bool, repeat: int) -> float:
    return min(float(subprocess.run([sys.executable, "-c", FIRST_CALL, str(int(expert_bias)), str(int(compiled))],
                                    check=True, capture_output=True, text=True).stdout.split()[-1])
               for _ in range(repeat))


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
    for bias in (False, True):
        what = "DeepSeek-V3's expert bias" if bias else "no expert bias"
        for compiled in (True, False):
            seconds = best_first_call_seconds(bias, compiled, args.repeat)
            print(f"{f'first call, {what}, ' + ('compiled' if compiled else 'eager'):50s} {seconds:6.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

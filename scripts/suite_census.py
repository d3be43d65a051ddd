"""Where the test suite's CPU goes, by kind of Python process: every interpreter the tests start (launchers, their
ranks, dry runs, helpers, fork servers) records its own CPU time when it exits, and the table sums them.

The suite is CPU-bound on 2 cores (README, "the suite's time"), so its wall time follows the CPU its processes
spend; this says which processes to make fewer or cheaper. A ``sitecustomize`` module on PYTHONPATH does the
recording, only while this script runs the tests (MP_CENSUS_LOG names the log); a process that ends without
running its exit handlers (os._exit: multiprocessing's forked workers, a SIGKILL) is not counted, and neither is
a process whose environment a test replaced whole.

    PYTHONPATH=. python scripts/suite_census.py -- -n 2 -m "not slow" tests
    PYTHONPATH=. python scripts/suite_census.py --log /tmp/census.jsonl   # the table of an earlier run's log
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECORDER = '''
import atexit, json, os, sys, time
_log, _start = os.environ.get("MP_CENSUS_LOG"), time.time()
def _record():
    t = os.times()
    entry = {"pid": os.getpid(), "ppid": os.getppid(), "argv": list(getattr(sys, "orig_argv", sys.argv))[:8],
             "rank": os.environ.get("RANK") if "TORCHELASTIC_RUN_ID" in os.environ else None,
             "dry_run": os.environ.get("MP_DRY_RUN"), "cpu": t.user + t.system, "wall": time.time() - _start}
    try:
        with open(_log, "a") as f:
            f.write(json.dumps(entry) + "\\n")
    except OSError:
        pass
if _log:
    atexit.register(_record)
'''


def kind_of(entry: dict) -> str:
    argv = entry.get("argv") or []
    while len(argv) > 1 and argv[1] in ("-B", "-u", "-E", "-s", "-O", "-I"):  # the interpreter's own switches
        argv = argv[:1] + argv[2:]
    if entry.get("rank") is not None:
        return "training rank (torchrun)"
    if argv[1:2] == ["-c"]:
        if len(argv) > 2 and "multiprocessing" in argv[2].split("\n")[0]:
            return "multiprocessing (fork server, spawned ranks)"
        if len(argv) > 2 and argv[2].startswith("import sys;exec(eval(sys.stdin.readline()))"):
            return "pytest and its workers"  # xdist's workers (execnet)
        return "python -c (tests' helper processes)"
    if argv[1:2] == ["-m"] and len(argv) > 2:
        module = argv[2]
        if module.split(".")[0] in ("pytest", "xdist", "execnet"):
            return "pytest and its workers"
        if module == "pip":
            return "pip"
        if module in ("megatron_patch", "mpatch") and len(argv) > 3:  # python -m megatron_patch COMMAND
            return _mpatch(argv[3], entry)
    if len(argv) > 2 and Path(argv[1]).name == "mpatch":  # the console script
        return _mpatch(argv[2], entry)
    if len(argv) > 1 and argv[1].startswith("-mpip"):
        return "pip"
    script = next((a for a in argv[1:3] if a.endswith(".py")), None)
    if script is not None and "scripts" in Path(script).parts:
        return f"scripts/{Path(script).name}"
    return "other Python process"


def _mpatch(command: str, entry: dict) -> str:
    if command == "train":
        return "launcher dry run" if entry.get("dry_run") not in (None, "", "0", "false") else "launcher"
    return f"mpatch {command}"


def table(log: Path, total_cpu: float | None = None) -> str:
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    kinds: dict[str, list] = collections.defaultdict(list)
    for entry in entries:
        kinds[kind_of(entry)].append(entry["cpu"])
    total = sum(sum(v) for v in kinds.values())
    lines = [f"{'kind of process':46s} {'count':>6s} {'CPU s':>8s} {'share':>6s} {'mean s':>7s}"]
    for kind, cpus in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{kind:46s} {len(cpus):6d} {sum(cpus):8.0f} {sum(cpus) / total:6.1%} {sum(cpus) / len(cpus):7.2f}")
    lines.append(f"{'all recorded':46s} {len(entries):6d} {total:8.0f}")
    if total_cpu is not None:  # what the OS counted for pytest and every descendant it waited for
        lines.append(f"{'unrecorded (pytest workers, forked workers)':46s} {'':6s} {total_cpu - total:8.0f}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", type=Path, help="print the table of this census log instead of running the tests")
    ap.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments (default: -n 2 tests)")
    args = ap.parse_args()
    if args.log:
        print(table(args.log))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sitecustomize.py").write_text(RECORDER)
        log = Path(tmp) / "census.jsonl"
        env = {**os.environ, "MP_CENSUS_LOG": str(log),
               "PYTHONPATH": os.pathsep.join(p for p in (tmp, os.environ.get("PYTHONPATH")) if p)}
        print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, Python {sys.version.split()[0]}")
        start, before = time.perf_counter(), os.times()
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                *(args.pytest_args or ["-n", "2", "tests"])], env=env)
        after = os.times()
        cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
        print(f"pytest exited {code} after {time.perf_counter() - start:.0f} s, {cpu:.0f} s of CPU in all")
        if log.exists():
            print(table(log, cpu))
            kept = Path(tempfile.gettempdir()) / f"suite-census-{os.getpid()}.jsonl"
            kept.write_bytes(log.read_bytes())
            print(f"the log: {kept} (--log {kept} prints this table again)")
        return code


if __name__ == "__main__":
    sys.exit(main())

"""What one launch costs before and around its training: the Llama launcher (ENV=cpu, the tiny model, no checkpoint
written) run for 1 and for 20 iterations at TP=1 and TP=2, as the tests run it, with its ranks forked from the
launcher's preloaded fork server (the default on CPU) and as fresh interpreters (``MP_LOCAL_START=spawn``, what a
GPU machine runs). The 1-iteration launch is mostly fixed cost: importing torch and megatron-core
(scripts/bench_imports.py), once per fork server or once per fresh rank, which is what the test suite pays per
launch (README, "the suite's time").

Each case runs ``--repeat`` times; the best wall time is printed with the CPU the whole machine spent during that
run (``/proc/stat``: a forked rank's CPU is its fork server's child's, which no ``os.times`` of the launcher
counts, so run it on an otherwise idle machine), after the load average before the runs.

    PYTHONPATH=. python scripts/bench_launch_cost.py --repeat 2 [--env dlc]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from cli_types import positive_int  # scripts/, beside this one


def machine_cpu_seconds() -> float:
    """CPU seconds every core has spent busy since boot (Linux's /proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=positive_int, default=2)
    ap.add_argument("--env", choices=("cpu", "dlc"), default="cpu",
                    help="the launcher's ENV: dlc as one CPU node of Pai's lines (forked as cpu is since ddeeafa)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megatron_patch.runtime.distributed import free_port
    from tests.training_helpers import GBS, SEQ, launch, make_corpus, pretrain_args

    print(f"ENV={args.env}, load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, "
          f"Python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = make_corpus(root / "corpus", 200)
        for tp in (1, 2):
            for iters in (1, 20):
                for ranks, start in (("forked", {}), ("fresh", {"MP_LOCAL_START": "spawn"})):
                    runs = []
                    for attempt in range(args.repeat):
                        out = root / f"out-{tp}-{iters}-{ranks}-{attempt}"
                        cpu, start_time = machine_cpu_seconds(), time.perf_counter()
                        run_args = pretrain_args(corpus, out, ENV=args.env, TP=str(tp),
                                                 TRAIN_TOKENS_OR_ITERS=str(iters * GBS * SEQ), WARMUP_TOKENS_OR_ITERS="0")
                        # ENV=cpu runs one rank per model-parallel rank, ENV=dlc one per GPUS_PER_NODE
                        node = {"GPUS_PER_NODE": str(tp), "WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                                "MASTER_PORT": str(free_port())} if args.env == "dlc" else {}
                        proc = launch(run_args, env={"MP_SAVE": "false", **node, **start})
                        runs.append((time.perf_counter() - start_time, machine_cpu_seconds() - cpu))
                        if proc.returncode != 0:
                            print(proc.stderr[-2000:], file=sys.stderr)
                            return 1
                    wall, cpu = min(runs)
                    print(f"TP={tp} {iters:2d} iteration(s), {ranks:6} ranks: {wall:5.1f} s wall, {cpu:5.1f} s CPU "
                          f"(best of {args.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

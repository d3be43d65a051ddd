"""What one launch costs before and around its training: the Llama launcher (ENV=cpu, the tiny model, no checkpoint
written) run for 1 and for 20 iterations at TP=1 and TP=2, as the tests run it. The 1-iteration launch is mostly
fixed cost (each rank's interpreter importing torch and megatron-core: scripts/bench_imports.py), which is what the
test suite pays per launch (README, "the suite's time").

Each case runs ``--repeat`` times; the best wall time and the CPU seconds of that run (user + system of the launcher
and its ranks) are printed, with the load average before the runs.

    PYTHONPATH=. python scripts/bench_launch_cost.py --repeat 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.training_helpers import GBS, SEQ, launch, make_corpus, pretrain_args

    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = make_corpus(root / "corpus", 200)
        for tp in (1, 2):
            for iters in (1, 20):
                runs = []
                for attempt in range(args.repeat):
                    out = root / f"out-{tp}-{iters}-{attempt}"
                    before, start = os.times(), time.perf_counter()
                    proc = launch(pretrain_args(corpus, out, TP=str(tp), TRAIN_TOKENS_OR_ITERS=str(iters * GBS * SEQ),
                                                WARMUP_TOKENS_OR_ITERS="0"), env={"MP_SAVE": "false"})
                    wall, after = time.perf_counter() - start, os.times()
                    if proc.returncode != 0:
                        print(proc.stderr[-2000:], file=sys.stderr)
                        return 1
                    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
                    runs.append((wall, cpu))
                wall, cpu = min(runs)
                print(f"TP={tp} {iters:2d} iteration(s): {wall:5.1f} s wall, {cpu:5.1f} s CPU (best of {args.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

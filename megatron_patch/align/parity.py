"""Logit parity of an HF checkpoint and the MCore model this package builds from it."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_patch.align.metrics import compare_logits
from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
from megatron_patch.checkpoint.model_io import load_hf_weights
from megatron_patch.models.blocks.builder import build_model
from megatron_patch.models.blocks.inference import forward_logits, place_on_rank_device
from megatron_patch.models.description.hf_model import load_causal_lm
from megatron_patch.models.description.registry import parse_arch
from megatron_patch.runtime import init_model_parallel
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.runtime.launch import run_local

# fp32 bounds from the project's requirements: relative L2 error and mean per-token KL.
FP32_REL_L2 = 1e-5
FP32_KL = 1e-10


def random_tokens(vocab_size: int, batch: int = 2, seq: int = 32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen)


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    model = load_causal_lm(hf_dir, dtype)
    model.eval()
    with torch.no_grad():
        return model(tokens, use_cache=False).logits.float()  # one forward (see capture_hf)


def mcore_logits_worker(hf_dirs: list[str], layout: ParallelLayout, tokens: list[torch.Tensor], dtype=torch.float32):
    """Runs on every rank: for each HF folder, build the model at ``layout``, map the weights in, and
    return its logits (last pipeline stage; None elsewhere)."""
    out = []
    for hf_dir, toks in zip(hf_dirs, tokens):
        arch = parse_arch(hf_dir)
        init_model_parallel(layout)
        model = build_model(arch, layout, dtype)
        load_hf_weights(model, arch, layout, HFCheckpointReader(hf_dir))
        out.append(forward_logits(place_on_rank_device(model), toks, arch.vocab_size))
        del model
    return out


def mcore_logits(hf_dirs: list[str | Path], layout: ParallelLayout, tokens: list[torch.Tensor], dtype=torch.float32,
                 world_size: int | None = None) -> list[torch.Tensor]:
    """Logits of each MCore model at ``layout``, computed in one set of local processes (one per rank)."""
    world = world_size or layout.world_size
    results = run_local(mcore_logits_worker, world, [str(d) for d in hf_dirs], layout, tokens, dtype)
    return [next(r[i] for r in results if r[i] is not None) for i in range(len(hf_dirs))]


def check_parity_all(hf_dirs: list[str | Path], layout: ParallelLayout = ParallelLayout(), *, seed: int = 0,
                     batch: int = 2, seq: int = 32) -> list[dict[str, float]]:
    """fp32 logit parity of several HF folders at one layout (their MCore twins share one process start)."""
    tokens = [random_tokens(parse_arch(d).vocab_size, batch, seq, seed) for d in hf_dirs]
    tests = mcore_logits(hf_dirs, layout, tokens)
    out = []
    for hf_dir, toks, test in zip(hf_dirs, tokens, tests):
        metrics = compare_logits(hf_logits(hf_dir, toks), test)
        metrics["passed"] = metrics["rel_l2"] <= FP32_REL_L2 and metrics["kl"] <= FP32_KL
        out.append(metrics)
    return out


def check_parity(hf_dir: str | Path, layout: ParallelLayout = ParallelLayout(), *, seed: int = 0,
                 batch: int = 2, seq: int = 32) -> dict[str, float]:
    return check_parity_all([hf_dir], layout, seed=seed, batch=batch, seq=seq)[0]

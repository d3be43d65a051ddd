"""Logit parity of an HF checkpoint and the MCore model this package builds from it."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_patch.align.metrics import compare_logits
from megatron_patch.runtime.distributed import ParallelLayout

# fp32 bounds from the project's requirements: relative L2 error and mean per-token KL.
FP32_REL_L2 = 1e-5
FP32_KL = 1e-10


def random_tokens(vocab_size: int, batch: int = 2, seq: int = 32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen)


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def mcore_logits_worker(hf_dir: str, layout: ParallelLayout, tokens: torch.Tensor, dtype=torch.float32):
    """Runs on every rank: build the model at ``layout``, map the HF weights in, return logits."""
    from megatron_patch.convert.hf_reader import HFCheckpointReader
    from megatron_patch.convert.model_io import load_hf_weights
    from megatron_patch.models.registry import parse_arch
    from megatron_patch.models.builder import build_model
    from megatron_patch.models.inference import forward_logits
    from megatron_patch.runtime import init_model_parallel

    arch = parse_arch(hf_dir)
    init_model_parallel(layout)
    model = build_model(arch, layout, dtype)
    load_hf_weights(model, arch, layout, HFCheckpointReader(hf_dir))
    return forward_logits(model, tokens, arch.vocab_size)


def mcore_logits(hf_dir: str | Path, layout: ParallelLayout, tokens: torch.Tensor, dtype=torch.float32,
                 world_size: int | None = None) -> torch.Tensor:
    """Logits of the MCore model at ``layout``, computed in local processes (one per rank)."""
    from megatron_patch.runtime.launch import run_local

    world = world_size or layout.world_size
    results = run_local(mcore_logits_worker, world, str(hf_dir), layout, tokens, dtype)
    return next(r for r in results if r is not None)


def check_parity(hf_dir: str | Path, layout: ParallelLayout = ParallelLayout(), *, seed: int = 0,
                 batch: int = 2, seq: int = 32) -> dict[str, float]:
    from megatron_patch.models.registry import parse_arch

    arch = parse_arch(hf_dir)
    tokens = random_tokens(arch.vocab_size, batch, seq, seed)
    ref = hf_logits(hf_dir, tokens)
    test = mcore_logits(hf_dir, layout, tokens)
    metrics = compare_logits(ref, test)
    metrics["passed"] = metrics["rel_l2"] <= FP32_REL_L2 and metrics["kl"] <= FP32_KL
    return metrics

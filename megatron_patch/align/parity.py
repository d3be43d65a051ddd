"""Logit parity of an HF checkpoint and the MCore model this package builds from it."""

from __future__ import annotations

import math
from pathlib import Path

import psutil
import torch

from megatron_patch.align.bounds import FP32_KL, FP32_REL_L2, fp32_kl_limit, fp32_rel_l2_limit
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

def fp64_unaffordable(hf_dir: str | Path) -> str | None:
    """Why transformers' fp64 model of ``hf_dir`` is not loaded (twice fp32's memory: its weights alone would not fit
    in free memory, and an out-of-memory kill would lose the whole result), or None where it fits."""
    reader = HFCheckpointReader(hf_dir)
    need = 8 * sum(math.prod(reader.shape(name)) for name in reader.keys())
    free = psutil.virtual_memory().available
    if need <= free:
        return None
    return (f"its HF fp64 run needs about {need / 2**30:,.1f} GiB for the weights, and {free / 2**30:,.1f} GiB are "
            "free")


def random_tokens(vocab_size: int, batch: int = 2, seq: int = 32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=gen)


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    model = load_causal_lm(hf_dir, dtype)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, use_cache=False).logits  # one forward (see capture_hf)
        return logits if dtype == torch.float64 else logits.float()  # the fp32 floor's kept in float64


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
        ref = hf_logits(hf_dir, toks)
        metrics = compare_logits(ref, test)
        metrics.update(limit_rel_l2=FP32_REL_L2, limit_kl=FP32_KL)
        over = not (metrics["rel_l2"] <= FP32_REL_L2 and metrics["kl"] <= FP32_KL)
        unaffordable = fp64_unaffordable(hf_dir) if over else None
        if unaffordable:
            metrics["floor_not_measured"] = unaffordable
        elif over:  # run HF fp64 only where it decides
            own = compare_logits(hf_logits(hf_dir, toks, torch.float64), ref)
            metrics.update(floor_rel_l2=own["rel_l2"], floor_kl=own["kl"],
                           limit_rel_l2=fp32_rel_l2_limit(own["rel_l2"]), limit_kl=fp32_kl_limit(own["kl"]))
        metrics["passed"] = metrics["rel_l2"] <= metrics["limit_rel_l2"] and metrics["kl"] <= metrics["limit_kl"]
        out.append(metrics)
    return out


def check_parity(hf_dir: str | Path, layout: ParallelLayout = ParallelLayout(), *, seed: int = 0,
                 batch: int = 2, seq: int = 32) -> dict[str, float]:
    return check_parity_all([hf_dir], layout, seed=seed, batch=batch, seq=seq)[0]

"""Agreement numbers between a reference and a test tensor (logits or hidden states)."""

from __future__ import annotations

import torch


def compare(ref: torch.Tensor, test: torch.Tensor) -> dict[str, float]:
    ref, test = ref.double(), test.double()
    diff = test - ref
    out = {
        "max_abs": diff.abs().max().item(),
        "mean_abs": diff.abs().mean().item(),
        "rel_l2": (diff.norm() / ref.norm().clamp_min(1e-30)).item(),
        "cosine": torch.nn.functional.cosine_similarity(ref.flatten(), test.flatten(), dim=0).item(),
    }
    return out


def compare_logits(ref: torch.Tensor, test: torch.Tensor) -> dict[str, float]:
    """``compare`` plus KL(ref || test) per token (mean) and top-1 / top-5 agreement."""
    out = compare(ref, test)
    logp_ref = torch.log_softmax(ref.double(), -1)
    logp_test = torch.log_softmax(test.double(), -1)
    out["kl"] = (logp_ref.exp() * (logp_ref - logp_test)).sum(-1).mean().item()
    out["top1"] = (ref.argmax(-1) == test.argmax(-1)).double().mean().item()
    k = min(5, ref.shape[-1])
    top_ref, top_test = ref.topk(k, -1).indices.sort(-1).values, test.topk(k, -1).indices.sort(-1).values
    out["top5"] = (top_ref == top_test).all(-1).double().mean().item()
    return out

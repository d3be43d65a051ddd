"""Gradients a module's own arithmetic leaves per tensor-parallel rank, summed over the TP group in autograd.

A weight every TP rank holds whole but applies to its own heads only (a norm shared by all heads, the RoPE key
shared by all heads of multi-latent attention) gets, on each rank, the part of its gradient that rank's heads
give. megatron's finalize step sums only what it recognises (sequence-parallel norms, parameters named q/k
layernorm) and only under sequence parallelism; passing such a tensor through ``SumOverTP`` makes its gradient
the whole sum on every rank, at any TP, with or without sequence parallelism.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state


class SumOverTP(torch.autograd.Function):
    """Identity forward; the gradient all-reduced over the TP group. (megatron's own such op,
    ``copy_to_tensor_model_parallel_region``, all-reduces ``grad.contiguous()`` and returns ``grad``: a gradient
    that arrives as a strided slice, as a split's does, comes back unreduced.)"""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        group = parallel_state.get_tensor_model_parallel_group()
        grad = grad.contiguous()
        if group.size() > 1:
            torch.distributed.all_reduce(grad, group=group)
        return grad


def summed_over_tp(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, its gradient summed over TP ranks (as it is where TP > 1 and a TP group exists)."""
    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_tensor_model_parallel_world_size() == 1:
        return tensor
    return SumOverTP.apply(tensor)

"""MiniMax-M2's layers on megatron-core: its attention with q/k RMSNorms over the whole projected width.

transformers' ``MiniMaxM2Attention`` normalises the query projection as one vector of num_heads * head_dim
values (and the keys as one of num_kv_heads * head_dim), not head by head as megatron-core's
``qk_layernorm`` does. Under tensor parallelism a rank holds only its heads, so ``WholeWidthRMSNorm``
sums the squares of its own part, adds the other ranks' sums (an all-reduce over the TP group, and the
same in backward: every rank's output depends on every rank's input) and divides by the whole width.

Its weight is whole on every TP rank, each rank scaling its heads by its slice of it: megatron-core's
``finalize_model_grads`` sums the gradients of every ``q_layernorm`` / ``k_layernorm`` parameter over the
TP group (its per-head norms are replicated and each rank sees only its heads), which makes each rank's
slice-only gradient the whole one. A weight split over TP would get its neighbours' slices added to its
own there. With sequence parallelism the norm sees the whole sequence (linear_qkv gathers it) and the same
sum applies.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from megatron_patch.models.blocks.builder import layer_spec as standard_layer_spec
from megatron_patch.models.blocks.spec_edits import submodules_of, with_submodules
from megatron_patch.models.description.arch import Arch


class _SumOverTP(torch.autograd.Function):
    """All-reduce (sum) over the tensor-parallel group, forward and backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class WholeWidthRMSNorm(torch.nn.Module):
    """RMSNorm over all heads of a projection ([..., heads here, head_dim] in, the same out), computed as
    transformers' ``MiniMaxM2RMSNorm``: float32 statistics, the normalised input cast back, then times this
    rank's slice of the weight."""

    heads_field = ""  # the TransformerConfig field that counts the projection's heads (set by a subclass)

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.eps = eps
        self.tp_size = config.tensor_model_parallel_size
        self.width = getattr(config, self.heads_field) * hidden_size
        self.weight = torch.nn.Parameter(torch.ones(self.width, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, local = x.dtype, x.shape[-2] * x.shape[-1]
        y = x.float()
        squares = y.pow(2).sum(dim=(-2, -1), keepdim=True)
        weight = self.weight
        if self.tp_size > 1:
            squares = _SumOverTP.apply(squares, parallel_state.get_tensor_model_parallel_group())
            rank = parallel_state.get_tensor_model_parallel_rank()
            weight = weight[rank * local:(rank + 1) * local]
        y = y * torch.rsqrt(squares / self.width + self.eps)
        return weight.view(x.shape[-2], x.shape[-1]) * y.to(dtype)


class QueryNorm(WholeWidthRMSNorm):
    heads_field = "num_attention_heads"


class KeyNorm(WholeWidthRMSNorm):
    heads_field = "num_query_groups"


def _with_whole_width_norms(layer):
    attention = submodules_of(layer).self_attention
    return with_submodules(layer, self_attention=with_submodules(attention, q_layernorm=QueryNorm,
                                                                 k_layernorm=KeyNorm))


def layer_spec(arch: Arch, config, use_te: bool, vp_stage, core_attention: str | None):
    """The standard spec (TE or local), with the whole-width q/k norms in place of the per-head ones."""
    spec = standard_layer_spec(arch, config, use_te, vp_stage, core_attention, family_spec=False)
    if hasattr(spec, "layer_specs"):  # a block of per-layer specs
        spec.layer_specs = [_with_whole_width_norms(s) for s in spec.layer_specs]
        return spec
    return _with_whole_width_norms(spec)

"""MiniMax-M2's layers on megatron-core: its attention with q/k RMSNorms over the whole projected width.

transformers' ``MiniMaxM2Attention`` normalises the query projection as one vector of num_heads * head_dim
values (and the keys as one of num_kv_heads * head_dim), not head by head as megatron-core's
``qk_layernorm`` does. Under tensor parallelism a rank holds only its heads, so ``WholeWidthRMSNorm``
sums the squares of its own part, adds the other ranks' sums (an all-reduce over the TP group, and the
same in backward: every rank's output depends on every rank's input) and divides by the whole width. Its
weight is split over TP with the heads (checkpointed as one tensor of the whole width, whatever the TP).

With sequence parallelism the norm sees the whole sequence (linear_qkv gathers it) and only its heads, so
its weight's gradient is complete on each rank: it is a tensor-parallel parameter, not a sequence-parallel
one whose gradient is summed over the TP group.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_patch.models.arch import Arch
from megatron_patch.models.spec_edits import submodules_of, with_submodules


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
    """RMSNorm over all heads of a projection ([..., heads, head_dim] in, the same out), computed as
    transformers' ``MiniMaxM2RMSNorm``: float32 statistics, the normalised input cast back, then times the
    weight. ``heads``: the projection's heads over all TP ranks (set by a subclass)."""

    heads_field = ""  # the TransformerConfig field that counts the projection's heads

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.eps = eps
        self.head_dim = hidden_size
        self.tp_size = config.tensor_model_parallel_size
        heads = getattr(config, self.heads_field)
        self.width = heads * hidden_size
        self.weight = torch.nn.Parameter(torch.ones(self.width // self.tp_size, dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        squares = y.pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.tp_size > 1:
            squares = _SumOverTP.apply(squares, parallel_state.get_tensor_model_parallel_group())
        y = y * torch.rsqrt(squares / self.width + self.eps)
        return self.weight.view(x.shape[-2], x.shape[-1]) * y.to(dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The weight as one tensor of the whole width, each TP rank holding its heads' part."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {"weight": 0}, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group")
            or parallel_state.get_data_parallel_group(with_context_parallel=True))


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
    from megatron_patch.models.builder import layer_spec as standard_layer_spec

    spec = standard_layer_spec(arch, config, use_te, vp_stage, core_attention, family_spec=False)
    if hasattr(spec, "layer_specs"):  # a block of per-layer specs
        spec.layer_specs = [_with_whole_width_norms(s) for s in spec.layer_specs]
        return spec
    return _with_whole_width_norms(spec)

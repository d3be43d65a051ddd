"""Gemma 4's MoE block (``enable_moe_block``: the 26B-A4B), as transformers 5.24's Gemma4TextDecoderLayer computes
it: in every layer the dense MLP and the experts run side by side on the same residual r,

    h1 = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(r)))
    h2 = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(r), router(r)))
    out = post_feedforward_layernorm(h1 + h2)

built on megatron-core's MoELayer (its token dispatcher, its local experts, expert parallelism):

- the dense MLP is the MoELayer's shared expert (``mlp.shared_experts``, of ``intermediate_size``: transformers'
  converter calls it so), its own norms before and after it; megatron-core adds its output to the experts';
- the router (``Gemma4Router``, a TopKRouter) reads the raw residual: a weightless RMSNorm, times ``router.scale``
  and hidden**-0.5, ``router.proj``; softmax over all experts, top-k renormalised (megatron-core's top-k then
  softmax: the same), times ``router.per_expert_scale`` of each chosen expert;
- the experts' own pre-norm is applied to the tokens as they are dispatched: it is per token, so before or after
  the dispatcher's permutation is the same, and the router still sees the residual; its weight stays out of the
  experts (it is no expert parameter: replicated, its gradient summed over data parallelism like a dense one's);
- the norm after the experts, then the sum, then ``post_layernorm`` (transformers' post_feedforward_layernorm,
  named as in a dense layer); the layer's own pre-MLP norm is an identity (each branch has its own).

GeGLU experts (``gelu_pytorch_tanh``), megatron-core's [gate; up] ``linear_fc1`` and ``linear_fc2`` per expert.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

from megatron_patch.models.blocks.spec_edits import submodules_of, with_module, with_submodules
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.gemma4.layers import PostNorm, _rms
from megatron_patch.models.gemma4.layers import layer_spec as dense_layer_spec


class Gemma4Router(TopKRouter):
    """transformers' Gemma4TextRouter on megatron-core's TopKRouter: ``weight`` is ``router.proj``; ``scale``
    [hidden] and ``per_expert_scale`` [experts] its own."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.scale = torch.nn.Parameter(torch.ones(config.hidden_size, dtype=config.params_dtype))
        self.per_expert_scale = torch.nn.Parameter(torch.ones(config.num_moe_experts, dtype=config.params_dtype))
        for p in (self.scale, self.per_expert_scale):  # each TP rank routes its own tokens under SP
            p.sequence_parallel = config.sequence_parallel

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        # as transformers: the norm in float32 back to the input's dtype, then the scales in that dtype
        normed = _rms(input.float(), self.config.layernorm_epsilon).type_as(input)
        return super().gating(normed * self.scale * self.config.hidden_size ** -0.5)

    def routing(self, logits: torch.Tensor, *args, **kwargs):
        probs, routing_map = super().routing(logits, *args, **kwargs)
        # probs are zero off the chosen experts: scaling every column scales the chosen ones
        return probs * self.per_expert_scale.to(probs.dtype), routing_map


class Gemma4DenseBranch(SharedExpertMLP):
    """The MoE layer's dense MLP, as megatron-core's shared expert: its own norm before it
    (pre_feedforward_layernorm) and after it (post_feedforward_layernorm_1)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.pre_layernorm = PostNorm(self.config, config.hidden_size, eps=config.layernorm_epsilon)
        self.post_layernorm = PostNorm(self.config, config.hidden_size, eps=config.layernorm_epsilon)
        self.pre_layernorm.tp_group = self.post_layernorm.tp_group = self.tp_group

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.post_layernorm(super().forward(self.pre_layernorm(hidden_states)))


class Gemma4MoELayer(MoELayer):
    """megatron-core's MoELayer with Gemma 4's norms: the experts' own before them (``pre_experts_layernorm``,
    pre_feedforward_layernorm_2) and after them (``post_experts_layernorm``, post_feedforward_layernorm_2), and
    after the sum with the dense branch (``post_layernorm``, post_feedforward_layernorm)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        norms = [PostNorm(config, config.hidden_size, eps=config.layernorm_epsilon) for _ in range(3)]
        self.pre_experts_layernorm, self.post_experts_layernorm, self.post_layernorm = norms
        for norm in norms:
            norm.tp_group = self.tp_group

    def dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        # the router has read the residual (route); the experts read it normalised, token by token
        return super().dispatch(self.pre_experts_layernorm(hidden_states), probs)

    def postprocess(self, output: torch.Tensor, shared_expert_output: torch.Tensor | None):
        experts = self.post_experts_layernorm(super().postprocess(output, None))
        return experts if shared_expert_output is None else experts + shared_expert_output

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return self.post_layernorm(output), bias


def _with_moe_block(layer):
    """A Gemma 4 layer spec whose MLP is the MoE block (and whose own pre-MLP norm is an identity)."""
    moe = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False, qk_layernorm=True,
                                   normalization="RMSNorm").submodules.mlp
    parts = submodules_of(moe)
    moe = with_submodules(moe, router=Gemma4Router, shared_experts=with_module(parts.shared_experts, Gemma4DenseBranch))
    keys = {k: v for k, v in submodules_of(layer).sharded_state_dict_keys_map.items()
            if not k.startswith("pre_mlp_layernorm")}
    return with_submodules(layer, pre_mlp_layernorm=IdentityOp, mlp=with_module(moe, Gemma4MoELayer),
                           sharded_state_dict_keys_map=keys)


def layer_spec(arch: Arch, config, vp_stage, core_attention: str | None = None):
    """This pipeline stage's block of Gemma 4 layers, each with the MoE block beside its dense MLP."""
    block = dense_layer_spec(arch, config, vp_stage, core_attention)
    block.layer_specs = [_with_moe_block(s) for s in block.layer_specs]
    return block

"""Gemma 3 on megatron-core: its layer spec and the model-level pieces around megatron-core's GPTModel
(``finish_model``), from torch and megatron-core's local modules, on CPU and GPU alike.

- each decoder layer is megatron-core's ``TransformerLayer`` with zero-centred RMSNorms
  (``ZeroCenteredRMSNorm``, Qwen3-Next's) before the attention and the MLP and as q/k norms, an attention
  (``Gemma3SelfAttention``) and MLP (``Gemma3MLP``) whose outputs pass through a norm of their own before the
  residual adds them (transformers' ``post_attention_layernorm`` and ``post_feedforward_layernorm``), GeGLU with
  tanh-approximated GELU (``gelu_tanh``), and a sliding window on the layers ``layer_types`` marks;
- ``finish_model`` scales the embedding's output by sqrt(hidden_size) rounded to its dtype, as transformers
  does, and installs a rotary embedding per layer type (``models/blocks/layer_rotary.py``): the full-attention layers
  keep the frequencies the builder installed (``rope_theta`` and its scaling), the sliding-window layers get
  ``rope_local_base_freq``'s.

Checkpoints keep transformer-engine's names for the fused norms (``sharded_state_dict_keys_map``); the norms
after the attention and the MLP are ``self_attention.post_layernorm`` and ``mlp.post_layernorm``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_patch.models.blocks import rope
from megatron_patch.models.blocks.core_attention import core_attention_class
from megatron_patch.models.blocks.layer_rotary import RotaryOfLayerType, install_per_layer_type, layer_type_order
from megatron_patch.models.blocks.norms import ZeroCenteredRMSNorm
from megatron_patch.models.blocks.spec_edits import submodules_of, with_module, with_submodules
from megatron_patch.models.description.arch import SLIDING_ATTENTION, Arch
from megatron_patch.models.gemma3.settings import settings


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh``."""
    return F.gelu(x, approximate="tanh")


class PostNorm(ZeroCenteredRMSNorm):
    """The norm after the attention or the MLP: replicated over TP, and a module megatron-core's MLP can ask for its
    sharded state dict (it asks every child)."""

    def __init__(self, config, tp_group):
        super().__init__(config, config.hidden_size, eps=config.layernorm_epsilon)
        self.tp_group = tp_group  # its TP ranks hold replicas: the checkpoint's replica ids say which is the main one

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


class Gemma3SelfAttention(RotaryOfLayerType, SelfAttention):
    """megatron-core's self-attention with its layer type's rotary embedding, its output normalised
    (``post_layernorm``) before the residual adds it."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = PostNorm(config, self.tp_group)

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return self.post_layernorm(output), bias


class Gemma3MLP(MLP):
    """megatron-core's MLP, its output normalised (``post_layernorm``) before the residual adds it."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = PostNorm(config, self.tp_group)

    def forward(self, hidden_states, *args, **kwargs):
        output, bias = super().forward(hidden_states, *args, **kwargs)
        return self.post_layernorm(output), bias



def _layer(arch: Arch, layer: int, core_attention: str | None):
    spec = get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    parts = submodules_of(spec)
    attention = with_submodules(parts.self_attention, q_layernorm=ZeroCenteredRMSNorm, k_layernorm=ZeroCenteredRMSNorm,
                                core_attention=core_attention_class(core_attention, mla=False))
    attention = with_module(attention, Gemma3SelfAttention, layer_type=arch.attention_type(layer),
                             layer_types=layer_type_order(arch))
    keys = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    return with_submodules(spec, input_layernorm=ZeroCenteredRMSNorm, pre_mlp_layernorm=ZeroCenteredRMSNorm,
                           self_attention=attention, mlp=with_module(parts.mlp, Gemma3MLP),
                           sharded_state_dict_keys_map=keys)


def layer_spec(arch: Arch, config, vp_stage, core_attention: str | None = None):
    """This pipeline stage's block: each layer with its attention type's rotary embedding (the same modules with or
    without transformer-engine)."""
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    return TransformerBlockSubmodules(layer_specs=[_layer(arch, i, core_attention) for i in layers],
                                      layer_norm=ZeroCenteredRMSNorm)


def _scale_embedding(module, inputs, output: torch.Tensor) -> torch.Tensor:
    # transformers multiplies by the factor cast to the embedding's dtype first (bf16's sqrt(hidden) is not fp32's)
    return output * torch.tensor(module.config.hidden_size ** 0.5, dtype=output.dtype, device=output.device)


def finish_model(model, arch: Arch) -> None:
    """The embedding's scale and the sliding-window layers' own RoPE, on a model the builder built."""
    if getattr(model, "pre_process", False):
        model.embedding.register_forward_hook(_scale_embedding)
    if getattr(model, "rotary_pos_emb", None) is None:
        return
    local = settings(arch)
    freqs = {t: model.rotary_pos_emb.inv_freq for t in layer_type_order(arch)}
    if SLIDING_ATTENTION in freqs:
        freqs[SLIDING_ATTENTION] = rope.inv_freq(dataclasses.replace(arch, rope_theta=local.local_rope_theta,
                                                                     rope_scaling=local.local_rope_scaling))
    install_per_layer_type(model, arch, freqs)

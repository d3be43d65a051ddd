"""Gemma 3 on megatron-core: its layer spec and the model-level pieces around megatron-core's GPTModel
(``finish_model``), from torch and megatron-core's local modules, on CPU and GPU alike.

- each decoder layer is a sandwich-norm layer (``models/blocks/sandwich_norms.py``) with zero-centred RMSNorms
  (``ZeroCenteredRMSNorm``): before the attention and the MLP, as q/k norms, and after the attention
  (``Gemma3SelfAttention``) and the MLP (``Gemma3MLP``); GeGLU with tanh-approximated GELU, and a sliding window on
  the layers ``layer_types`` marks;
- ``finish_model`` scales the embedding's output by sqrt(hidden_size) rounded to its dtype, as transformers
  does, and installs a rotary embedding per layer type (``models/blocks/layer_rotary.py``): the full-attention layers
  keep the frequencies the builder installed (``rope_theta`` and its scaling), the sliding-window layers get
  ``rope_local_base_freq``'s.
"""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP

from megatron_patch.models.blocks import rope
from megatron_patch.models.blocks.layer_rotary import RotaryOfLayerType, install_per_layer_type, layer_type_order
from megatron_patch.models.blocks.norms import ZeroCenteredRMSNorm
from megatron_patch.models.blocks.sandwich_norms import OutputNormed, ReplicatedOverTP, sandwich_block, scale_embedding
from megatron_patch.models.description.arch import SLIDING_ATTENTION, Arch
from megatron_patch.models.gemma3.settings import settings


class PostNorm(ReplicatedOverTP, ZeroCenteredRMSNorm):
    """The norm after the attention or the MLP."""


class Gemma3SelfAttention(OutputNormed, RotaryOfLayerType, SelfAttention):
    """megatron-core's self-attention with its layer type's rotary embedding, its output normalised."""

    output_norm = PostNorm


class Gemma3MLP(OutputNormed, MLP):
    """megatron-core's MLP (GeGLU), its output normalised."""

    output_norm = PostNorm


def layer_spec(arch: Arch, config, vp_stage, core_attention: str | None = None):
    """This pipeline stage's block of Gemma 3 layers."""
    return sandwich_block(arch, config, vp_stage, core_attention, norm=ZeroCenteredRMSNorm,
                          attention=Gemma3SelfAttention, mlp=Gemma3MLP)


def finish_model(model, arch: Arch) -> None:
    """The embedding's scale and the sliding-window layers' own RoPE, on a model the builder built."""
    if getattr(model, "pre_process", False):
        model.embedding.register_forward_hook(scale_embedding)
    if getattr(model, "rotary_pos_emb", None) is None:
        return
    local = settings(arch)
    freqs = {t: model.rotary_pos_emb.inv_freq for t in layer_type_order(arch)}
    if SLIDING_ATTENTION in freqs:
        freqs[SLIDING_ATTENTION] = rope.inv_freq(dataclasses.replace(arch, rope_theta=local.local_rope_theta,
                                                                     rope_scaling=local.local_rope_scaling))
    install_per_layer_type(model, arch, freqs)

"""Gemma 4 on megatron-core: its layer spec and the model-level pieces around megatron-core's GPTModel
(``finish_model``), from torch and megatron-core's local modules, on CPU and GPU alike.

- each decoder layer (``Gemma4Layer``) is a sandwich-norm layer (``models/blocks/sandwich_norms.py``) with float32
  RMSNorms of a plain weight (``Gemma4RMSNorm``) before the attention and the MLP, as q/k norms, and after the
  attention (``Gemma4SelfAttention``: its layer type's rotary embedding and attention shape, the full-attention
  layers' heads of their own size and count, a weightless norm over each value head; with ``attention_k_eq_v``,
  ``Gemma4KeysAsValuesAttention``, whose full-attention layers take their values from the key projection)
  and the MLP (``Gemma4MLP``: GeGLU), and the layer's output times its stored scalar (``layer_scalar``);
- ``finish_model`` scales the embedding's output by sqrt(hidden_size) rounded to its dtype, soft-caps the
  logits, and installs a rotary embedding per layer type (``models/blocks/layer_rotary.py``): the sliding-window
  layers keep the default RoPE the builder installed, the full-attention layers get proportional RoPE's
  frequencies over their own head size (the pairs past ``partial_rotary_factor`` at frequency 0: they pass through
  unrotated, as in transformers, whose rotation pairs dimension i with i + head_dim / 2 exactly as megatron-core's
  does).

The layer's scalar is checkpointed as ``layer_scalar.weight``.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from megatron_patch.models.blocks.layer_rotary import (
    OwnAttentionShape, RotaryOfLayerType, install_per_layer_type, layer_type_order)
from megatron_patch.models.blocks.sandwich_norms import OutputNormed, ReplicatedOverTP, sandwich_block, scale_embedding
from megatron_patch.models.blocks.spec_edits import submodules_of, with_params, with_submodules
from megatron_patch.models.description.arch import FULL_ATTENTION, Arch
from megatron_patch.models.gemma4 import per_layer_inputs
from megatron_patch.models.gemma4.kv_sharing import SharesKeysValues, share_store
from megatron_patch.models.gemma4.per_layer_inputs import PerLayerInput
from megatron_patch.models.gemma4.settings import settings


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' Gemma4RMSNorm: pow(-0.5), not rsqrt (its comment: compiler differences with JAX)
    return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)


def _value_norm(value: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``v_norm``: a weightless RMSNorm over each value head, in float32."""
    return _rms(value.float(), eps).type_as(value)


class Gemma4RMSNorm(torch.nn.Module):
    """RMSNorm in float32 times a plain weight (``norm(x) * weight``)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:  # its gradient is summed over the TP group (finalize_model_grads)
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms(x.float(), self.eps) * self.weight.float()).type_as(x)


class PostNorm(ReplicatedOverTP, Gemma4RMSNorm):
    """The norm after the attention or the MLP."""


class LayerScalar(ReplicatedOverTP, torch.nn.Module):
    """The layer's stored output scale (transformers' ``layer_scalar`` buffer): checkpointed, never trained."""

    def __init__(self, config, tp_group):
        super().__init__()
        self.tp_group = tp_group
        self.register_buffer("weight", torch.ones(1, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Gemma4SelfAttention(OutputNormed, RotaryOfLayerType, OwnAttentionShape, SelfAttention):
    """megatron-core's self-attention with its layer type's rotary embedding and attention shape and a weightless
    RMSNorm over each value head, its output normalised."""

    output_norm = PostNorm

    keys_are_values = False  # Gemma4KeysAsValuesAttention's full-attention layers

    def get_query_key_value_tensors(self, *args, **kwargs):
        get = self._keys_as_values if self.keys_are_values else super().get_query_key_value_tensors
        out = get(*args, **kwargs)
        if not isinstance(out, tuple) or len(out) != 3 or isinstance(out[1], list):
            raise NotImplementedError("gemma4's value norm needs the query, key and value split")
        query, key, value = out
        return query, key, _value_norm(value, self.config.layernorm_epsilon)

    def _keys_as_values(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        """megatron-core's split of ``linear_qkv``'s output for a layer without value rows ([q heads; k] per query
        group): the values are the keys before their norm (and before RoPE, which the attention applies later)."""
        if output_gate or not split_qkv:
            raise NotImplementedError("gemma4's keys-as-values attention has no output gate and splits q and k")
        mixed, _ = self.linear_qkv(hidden_states)
        hn, groups = self.hidden_size_per_attention_head, self.num_query_groups_per_partition
        per_group = self.num_attention_heads_per_partition // groups
        # validate_layout: TP divides the key/value heads, so each rank holds whole query groups
        mixed = mixed.view(*mixed.shape[:-1], groups, (per_group + 1) * hn)
        query, key = torch.split(mixed, [per_group * hn, hn], dim=3)
        query = query.reshape(*query.shape[:2], -1, hn)
        return self.q_layernorm(query), self.k_layernorm(key), key


class Gemma4KeysAsValuesAttention(Gemma4SelfAttention):
    """Gemma 4's attention with ``attention_k_eq_v``: on a full-attention layer ``linear_qkv`` has no value rows
    (megatron-core sizes it for q, k and v: the builder it is given drops them) and the key projection's output
    doubles as the values; a sliding-window layer is ``Gemma4SelfAttention``'s."""

    def __init__(self, config, submodules, *args, **kwargs):
        keys_are_values = kwargs["layer_type"] == FULL_ATTENTION
        if keys_are_values:
            shape = kwargs.get("attention_shape")  # the layer's own, else the model's
            values = shape.num_kv_heads * shape.head_dim if shape else config.num_query_groups * config.kv_channels
            linear = submodules.linear_qkv
            submodules = dataclasses.replace(
                submodules, linear_qkv=lambda size, rows, **kw: linear(size, rows - values, **kw))
        super().__init__(config, submodules, *args, **kwargs)
        self.keys_are_values = keys_are_values


class Gemma4SharingKVAttention(SharesKeysValues, Gemma4SelfAttention):
    """``Gemma4SelfAttention`` in a model with KV sharing (kv_sharing.py)."""


class Gemma4SharingKVKeysAsValuesAttention(SharesKeysValues, Gemma4KeysAsValuesAttention):
    """``Gemma4KeysAsValuesAttention`` in a model with KV sharing (kv_sharing.py)."""


class Gemma4MLP(OutputNormed, MLP):
    """megatron-core's MLP (GeGLU), its output normalised; ``ffn_hidden_size`` (a spec parameter: the double-wide
    MLP of a KV-shared layer) also in a copy of the config, whose ffn_hidden_size sizes fc2."""

    output_norm = PostNorm

    def __init__(self, config, *args, ffn_hidden_size: int | None = None, **kwargs):
        if ffn_hidden_size is not None and ffn_hidden_size != config.ffn_hidden_size:
            config = copy.copy(config)
            config.ffn_hidden_size = ffn_hidden_size
        super().__init__(config, *args, ffn_hidden_size=ffn_hidden_size or config.ffn_hidden_size, **kwargs)


class Gemma4Layer(TransformerLayer):
    """megatron-core's layer, its output times the stored ``layer_scalar``."""

    def __init__(self, config, *args, per_layer_input_size: int = 0, **kwargs):
        super().__init__(config, *args, **kwargs)
        tp_group = self.self_attention.tp_group
        # per-layer input embeddings (per_layer_inputs.py): this layer's, from the block's context
        self.per_layer_input = PerLayerInput(config, per_layer_input_size, PostNorm, tp_group) \
            if per_layer_input_size else None
        self.layer_scalar = LayerScalar(config, tp_group)

    def forward(self, *args, **kwargs):
        output, context = super().forward(*args, **kwargs)
        if self.per_layer_input is not None:
            output = self.per_layer_input(output, context, self.layer_number - 1)
        return self.layer_scalar(output), context


def layer_spec(arch: Arch, config, vp_stage, core_attention: str | None = None):
    """This pipeline stage's block of Gemma 4 layers, each with its part in KV sharing (its MLP twice as wide where
    it reuses keys and values, with ``use_double_wide_mlp``) and its per-layer input."""
    own = settings(arch)
    attention = Gemma4KeysAsValuesAttention if own.full_keys_are_values else Gemma4SelfAttention
    if own.kv_sharing:
        attention = {Gemma4SelfAttention: Gemma4SharingKVAttention,
                     Gemma4KeysAsValuesAttention: Gemma4SharingKVKeysAsValuesAttention}[attention]
    block = sandwich_block(arch, config, vp_stage, core_attention, norm=Gemma4RMSNorm, attention=attention,
                           mlp=Gemma4MLP, layer_class=Gemma4Layer)
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    block.layer_specs = [_own_layer(spec, own, first + i, config) for i, spec in enumerate(block.layer_specs)]
    return block


def _own_layer(spec, own, layer: int, config):
    """A layer's spec with what Gemma 4's E models give each layer of its own."""
    parts = submodules_of(spec)
    changes = {}
    if own.kv_sharing:
        changes["self_attention"] = with_params(parts.self_attention, kv_sharing=own.kv_sharing[layer])
        if own.double_wide_mlp and own.reuses_kv(layer):
            changes["mlp"] = with_params(parts.mlp, ffn_hidden_size=2 * config.ffn_hidden_size)
    spec = with_submodules(spec, **changes) if changes else spec
    return with_params(spec, per_layer_input_size=own.per_layer_input_size) if own.per_layer_input_size else spec


def _soft_cap(cap: float):
    def hook(module, inputs, output):
        logits, bias = output
        return torch.tanh(logits / cap) * cap, bias
    return hook


def proportional_inv_freq(theta: float, head_dim: int, partial: float, factor: float) -> torch.Tensor:
    """transformers' proportional RoPE: the first ``partial`` of the head_dim / 2 pairs at theta's frequencies
    (exponents over the whole head_dim), the rest at 0."""
    rotated = int(partial * head_dim // 2)
    freqs = 1.0 / theta ** (torch.arange(0, 2 * rotated, 2, dtype=torch.int64).float() / head_dim)
    return torch.cat([freqs, torch.zeros(head_dim // 2 - rotated)]) / factor


def finish_model(model, arch: Arch) -> None:
    """The embedding's scale, the logits' soft cap and the full-attention layers' own RoPE, on a model the builder
    built."""
    own = settings(arch)
    if getattr(model, "pre_process", False):
        model.embedding.register_forward_hook(scale_embedding)
    if own.per_layer_input_size:
        per_layer_inputs.install(model, arch, PostNorm)
    share_store(model)
    if getattr(model, "post_process", False) and own.final_logit_softcapping is not None:
        model.output_layer.register_forward_hook(_soft_cap(float(own.final_logit_softcapping)))
    if getattr(model, "rotary_pos_emb", None) is None:
        return
    freqs = {t: model.rotary_pos_emb.inv_freq for t in layer_type_order(arch)}
    if FULL_ATTENTION in freqs:
        full = next(i for i, t in enumerate(arch.layer_types) if t == FULL_ATTENTION)
        freqs[FULL_ATTENTION] = proportional_inv_freq(own.full_rope_theta, arch.attention_shape(full).head_dim,
                                                      own.full_partial_rotary_factor, own.full_rope_factor)
    install_per_layer_type(model, arch, freqs)

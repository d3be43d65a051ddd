"""Gemma 4 on megatron-core: its layer spec and the model-level pieces around megatron-core's GPTModel
(``finish_model``), from torch and megatron-core's local modules, on CPU and GPU alike.

- each decoder layer (``Gemma4Layer``) is megatron-core's ``TransformerLayer`` with float32 RMSNorms of a plain
  weight (``Gemma4RMSNorm``) before the attention and the MLP and as q/k norms, an attention
  (``Gemma4SelfAttention``: its layer type's rotary embedding, a weightless norm over each value head) and MLP
  (``Gemma4MLP``: GeGLU) whose outputs pass through a norm of their own before the residual adds them, and the
  layer's output times its stored scalar (``layer_scalar``);
- ``finish_model`` scales the embedding's output by sqrt(hidden_size) rounded to its dtype, soft-caps the
  logits, and installs a rotary embedding per layer type (``models/blocks/layer_rotary.py``): the sliding-window
  layers keep the default RoPE the builder installed, the full-attention layers get proportional RoPE's
  frequencies (the pairs past ``partial_rotary_factor`` at frequency 0: they pass through unrotated, as in
  transformers, whose rotation pairs dimension i with i + head_dim / 2 exactly as megatron-core's does).

Checkpoints keep transformer-engine's names for the fused norms (``sharded_state_dict_keys_map``); the norms
after the attention and the MLP are ``self_attention.post_layernorm`` and ``mlp.post_layernorm``, the layer's
scalar ``layer_scalar.weight``.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_patch.models.blocks.core_attention import core_attention_class
from megatron_patch.models.blocks.layer_rotary import RotaryOfLayerType, install_per_layer_type, layer_type_order
from megatron_patch.models.blocks.spec_edits import submodules_of, with_module, with_submodules
from megatron_patch.models.description.arch import FULL_ATTENTION, Arch
from megatron_patch.models.gemma4.settings import settings


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh``."""
    return F.gelu(x, approximate="tanh")


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


class _Replicated:
    """A module whose TP ranks hold replicas: the checkpoint's replica ids (its TP group) say which is the main
    one, and megatron-core's MLP can ask it for its sharded state dict (it asks every child)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


class PostNorm(_Replicated, Gemma4RMSNorm):
    """The norm after the attention or the MLP."""

    def __init__(self, config, tp_group):
        super().__init__(config, config.hidden_size, eps=config.layernorm_epsilon)
        self.tp_group = tp_group


class LayerScalar(_Replicated, torch.nn.Module):
    """The layer's stored output scale (transformers' ``layer_scalar`` buffer): checkpointed, never trained."""

    def __init__(self, config, tp_group):
        super().__init__()
        self.tp_group = tp_group
        self.register_buffer("weight", torch.ones(1, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Gemma4SelfAttention(RotaryOfLayerType, SelfAttention):
    """megatron-core's self-attention with its layer type's rotary embedding and a weightless RMSNorm over each
    value head, its output normalised (``post_layernorm``) before the residual adds it."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = PostNorm(config, self.tp_group)

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if not isinstance(out, tuple) or len(out) != 3 or isinstance(out[1], list):
            raise NotImplementedError("gemma4's value norm needs the query, key and value split")
        query, key, value = out
        return query, key, _value_norm(value, self.config.layernorm_epsilon)

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return self.post_layernorm(output), bias


class Gemma4MLP(MLP):
    """megatron-core's MLP, its output normalised (``post_layernorm``) before the residual adds it."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = PostNorm(config, self.tp_group)

    def forward(self, hidden_states, *args, **kwargs):
        output, bias = super().forward(hidden_states, *args, **kwargs)
        return self.post_layernorm(output), bias


class Gemma4Layer(TransformerLayer):
    """megatron-core's layer, its output times the stored ``layer_scalar``."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.layer_scalar = LayerScalar(config, self.self_attention.tp_group)

    def forward(self, *args, **kwargs):
        output, context = super().forward(*args, **kwargs)
        return self.layer_scalar(output), context



def _layer(arch: Arch, layer: int, core_attention: str | None):
    spec = get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    parts = submodules_of(spec)
    attention = with_submodules(parts.self_attention, q_layernorm=Gemma4RMSNorm, k_layernorm=Gemma4RMSNorm,
                                core_attention=core_attention_class(core_attention, mla=False))
    attention = with_module(attention, Gemma4SelfAttention, layer_type=arch.attention_type(layer),
                             layer_types=layer_type_order(arch))
    keys = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    spec = with_module(spec, Gemma4Layer)
    return with_submodules(spec, input_layernorm=Gemma4RMSNorm, pre_mlp_layernorm=Gemma4RMSNorm,
                           self_attention=attention, mlp=with_module(parts.mlp, Gemma4MLP),
                           sharded_state_dict_keys_map=keys)


def layer_spec(arch: Arch, config, vp_stage, core_attention: str | None = None):
    """This pipeline stage's block: each layer with its attention type's rotary embedding (the same modules with or
    without transformer-engine)."""
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    return TransformerBlockSubmodules(layer_specs=[_layer(arch, i, core_attention) for i in layers],
                                      layer_norm=Gemma4RMSNorm)


def _scale_embedding(module, inputs, output: torch.Tensor) -> torch.Tensor:
    # transformers multiplies by the factor cast to the embedding's dtype first (bf16's sqrt(hidden) is not fp32's)
    return output * torch.tensor(module.config.hidden_size ** 0.5, dtype=output.dtype, device=output.device)


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
        model.embedding.register_forward_hook(_scale_embedding)
    if getattr(model, "post_process", False) and own.final_logit_softcapping is not None:
        model.output_layer.register_forward_hook(_soft_cap(float(own.final_logit_softcapping)))
    if getattr(model, "rotary_pos_emb", None) is None:
        return
    freqs = {t: model.rotary_pos_emb.inv_freq for t in layer_type_order(arch)}
    if FULL_ATTENTION in freqs:
        freqs[FULL_ATTENTION] = proportional_inv_freq(own.full_rope_theta, arch.head_dim,
                                                      own.full_partial_rotary_factor, own.full_rope_factor)
    install_per_layer_type(model, arch, freqs)

"""Layers with "sandwich" norms, as Gemma 3 and Gemma 4 build them: megatron-core's local ``TransformerLayer`` whose
attention and MLP outputs each pass through a norm of their own before the residual adds them (transformers'
``post_attention_layernorm`` and ``post_feedforward_layernorm``), GeGLU with tanh-approximated GELU, and the
embedding's output times sqrt(hidden_size). Each family brings its own norm class and its attention, MLP and layer
classes (``OutputNormed`` mixed in; where the model's layer types have attention shapes of their own, the attention
takes its layer's as ``attention_shape``: ``OwnAttentionShape``); the block of layers is built here.

Checkpoints keep transformer-engine's names for the fused norms (``sharded_state_dict_keys_map``); the norms after
the attention and the MLP are ``self_attention.post_layernorm`` and ``mlp.post_layernorm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_patch.models.blocks.core_attention import core_attention_class
from megatron_patch.models.blocks.layer_rotary import layer_type_order
from megatron_patch.models.blocks.spec_edits import submodules_of, with_module, with_submodules
from megatron_patch.models.description.arch import Arch


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh``."""
    return F.gelu(x, approximate="tanh")


def scale_embedding(module, inputs, output: torch.Tensor) -> torch.Tensor:
    """A forward hook on the embedding: its output times sqrt(hidden_size)."""
    # transformers multiplies by the factor cast to the embedding's dtype first (bf16's sqrt(hidden) is not fp32's)
    return output * torch.tensor(module.config.hidden_size ** 0.5, dtype=output.dtype, device=output.device)


class ReplicatedOverTP:
    """Mixed into a module whose TP ranks hold replicas (``tp_group``): the checkpoint's replica ids say which is
    the main one, and megatron-core's MLP can ask it for its sharded state dict (it asks every child)."""

    tp_group = None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


class OutputNormed:
    """Mixed into megatron-core's self-attention or MLP: its output normalised by ``post_layernorm``, a replicated
    ``output_norm`` (the family's norm class, built as ``norm(config, hidden_size, eps=...)``)."""

    output_norm: type

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = self.output_norm(config, config.hidden_size, eps=config.layernorm_epsilon)
        self.post_layernorm.tp_group = self.tp_group

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return self.post_layernorm(output), bias


def _layer(arch: Arch, layer: int, core_attention: str | None, norm: type, attention: type, mlp: type,
           layer_class: type | None):
    spec = get_gpt_layer_local_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    parts = submodules_of(spec)
    self_attention = with_submodules(parts.self_attention, q_layernorm=norm, k_layernorm=norm,
                                     core_attention=core_attention_class(core_attention, mla=False))
    # a layer's own attention shape, for a model that has one (its attention class is then ``OwnAttentionShape``)
    shape = {"attention_shape": arch.attention_shape(layer)} if arch.own_attention_shapes else {}
    self_attention = with_module(self_attention, attention, layer_type=arch.attention_type(layer),
                                 layer_types=layer_type_order(arch), **shape)
    keys = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    if layer_class is not None:
        spec = with_module(spec, layer_class)
    return with_submodules(spec, input_layernorm=norm, pre_mlp_layernorm=norm, self_attention=self_attention,
                           mlp=with_module(parts.mlp, mlp), sharded_state_dict_keys_map=keys)


def sandwich_block(arch: Arch, config, vp_stage, core_attention: str | None, *, norm: type, attention: type,
                   mlp: type, layer_class: type | None = None) -> TransformerBlockSubmodules:
    """This pipeline stage's block: each layer with ``norm`` before the attention and the MLP, as q/k norms and
    as the final norm, ``attention`` (taking its layer type's rotary embedding) and ``mlp``, built as
    ``layer_class`` where given (else megatron-core's layer); the same modules with or without transformer-engine."""
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    return TransformerBlockSubmodules(
        layer_specs=[_layer(arch, i, core_attention, norm, attention, mlp, layer_class) for i in layers],
        layer_norm=norm)

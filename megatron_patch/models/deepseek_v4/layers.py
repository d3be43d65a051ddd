"""DeepSeek-V4 on megatron-core's GPTModel: its layer spec and the model-level pieces around it (``finish_model``).

The residual is ``hc_mult`` streams (hyper_connections.py). Between layers and pipeline stages they travel folded
into the batch, ``[s, b * hc_mult, h]`` (a view of the contiguous ``[s, b, hc_mult, h]``), so that megatron-core's
block, its schedules and their stage-to-stage buffers carry them unchanged (the schedules are given
``micro_batch_size * hc_mult``: ``model.pipeline_batch_factor``, read by ``builder.pipeline_batch_factor``):

- ``finish_model`` expands the embedding's output into the streams on the first stage, sets the factor, and binds
  the forward's ``input_ids`` for the hash-routed layers (``moe.routing_token_ids``) on every stage: every
  schedule call in the project gives the model its tokens on every stage;
- each decoder layer (``DeepseekV4Layer``) unfolds the streams, runs the hyper-connections around its attention
  (``DeepseekV4Attention`` of its ``layer_types`` entry) and its MoE block (``moe_spec`` of its
  ``mlp_layer_types`` entry), and folds them back;
- the block's final norm is ``CollapseAndNorm``: ``hc_head`` collapses the streams ([s, b * n, h] -> [s, b, h]),
  then the model's final RMSNorm (its ``weight`` is ``decoder.final_layernorm.weight``, as every family's).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import make_viewless_tensor

from megatron_patch.models.blocks.precision import keep_in_float32
from megatron_patch.errors import UserError
from megatron_patch.models.deepseek_v4.attention import DeepseekV4Attention, V4AttentionSettings
from megatron_patch.models.deepseek_v4.config import DEFAULTS, FULL_RECOMPUTE_NEEDS_0_16
from megatron_patch.models.deepseek_v4.hyper_connections import (
    HyperConnection, HyperHead, RMSNorm, expand_streams, hyper_connected, stage_input_to_streams,
    streams_to_stage_output)
from megatron_patch.models.deepseek_v4.moe import bound_token_ids, moe_config_kwargs, moe_spec, routing_token_ids
from megatron_patch.models.deepseek_v4.settings import DeepseekV4Settings, settings
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.hf_defaults import hf_values


# transformers' ``_keep_in_fp32_modules_strict`` under megatron-core's names: the hyper-connections, the attention's
# sinks and compressor position biases, and every norm (the router's expert bias is a float32 buffer already)
FLOAT32_MODULES = DeepseekV4Settings.float32_parameters


def _replicated_over(module: torch.nn.Module, tp_group) -> None:
    """The hyper-connection modules are replicas on every TP rank: their checkpoint replica ids need the group."""
    for child in module.modules():
        if hasattr(type(child), "tp_group"):
            child.tp_group = tp_group


class DeepseekV4Layer(MegatronModule):
    """One decoder layer: ``input_layernorm``, ``attn_hc``, ``self_attention``, ``pre_mlp_layernorm``, ``ffn_hc``,
    ``mlp``. ``forward(hidden_states [s, b * n, h], ...) -> ([s, b * n, h], context)``, as megatron-core's block
    calls its layers (the mask and rotary embedding it passes are not used: the attention has its own)."""

    def __init__(self, config, submodules=None, layer_number: int = 1, arch: Arch | None = None,
                 vp_stage: int | None = None, **kwargs):
        super().__init__(config=config)
        own = settings(arch)
        # global, 1-based, as megatron-core's TransformerLayer numbers it (the block's sharded state dict reads it)
        self.layer_number = layer_number + get_transformer_layer_offset(config, vp_stage=vp_stage)
        index = self.layer_number - 1
        self.hc_mult = own.hc_mult
        # HyperConnectedLayer's pieces, made in its order, held here under its names
        input_layernorm, attn_hc = RMSNorm(config), HyperConnection(config, own)
        pre_mlp_layernorm, ffn_hc = RMSNorm(config), HyperConnection(config, own)
        self.input_layernorm, self.attn_hc = input_layernorm, attn_hc
        self.self_attention = DeepseekV4Attention(config, V4AttentionSettings.from_hf(arch.hf_config),
                                                  arch.layer_types[index], self.layer_number)
        self.pre_mlp_layernorm, self.ffn_hc = pre_mlp_layernorm, ffn_hc
        spec = moe_spec(own.mlp_layer_types[index], own.scoring_func, arch.vocab_size)
        build = spec if isinstance(spec, functools.partial) else functools.partial(build_module, spec)
        self.mlp = build(config=config, layer_number=self.layer_number)
        _replicated_over(self, self.self_attention.linear_q_up_proj.tp_group)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, context=None, **kwargs):
        # ``context`` (no cross-attention here) carries the token ids under full recompute, a checkpointed argument
        # the recompute hands back (keep_token_ids_through_full_recompute); bound again for the hash layers
        with routing_token_ids(context) if context is not None else contextlib.nullcontext():
            streams = stage_input_to_streams(hidden_states, self.hc_mult)
            attention = functools.partial(self.self_attention, inference_context=kwargs.get("inference_context"))
            streams = hyper_connected(self.attn_hc, self.input_layernorm, lambda x: attention(x)[0], streams)
            streams = hyper_connected(self.ffn_hc, self.pre_mlp_layernorm, lambda x: self.mlp(x)[0], streams)
        output = streams_to_stage_output(streams)
        return make_viewless_tensor(output, requires_grad=output.requires_grad, keep_graph=True), context


class CollapseAndNorm(RMSNorm):
    """The block's final norm: the streams [s, b * n, h] collapsed by ``hc_head`` into [s, b, h], then the model's
    RMSNorm (``weight``)."""

    def __init__(self, config, hidden_size: int | None = None, eps: float | None = None, *, own=None, **kwargs):
        super().__init__(config, hidden_size, eps)
        self.hc_mult = own.hc_mult
        self.hc_head = HyperHead(config, own)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.hc_head(stage_input_to_streams(x, self.hc_mult)))


def layer_spec(arch: Arch, config, use_te=None, vp_stage=None, core_attention=None) -> TransformerBlockSubmodules:
    """This pipeline stage's block: its layers (each picks its attention and MoE types by its global number) and
    the collapse-and-norm after the last. The same modules with or without transformer-engine."""
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    layer = ModuleSpec(module=DeepseekV4Layer, params={"arch": arch})
    return TransformerBlockSubmodules(layer_specs=[layer] * count,
                                      layer_norm=ModuleSpec(module=CollapseAndNorm, params={"own": settings(arch)}))


def transformer_config_kwargs(arch: Arch) -> dict:
    """V4's MoE block settings; ``moe_layer_freq`` as a list so that megatron-core checkpoints each layer under its
    own keys (the layers differ in their attention and router: they cannot stack on one layer axis)."""
    # num_query_groups is nominal (the attention has one key/value head, whole on every TP rank): megatron-core
    # asks TP to divide it
    # the MoE fields config.json leaves out at transformers' defaults, as parse_config read them
    return {**moe_config_kwargs(hf_values(arch.hf_config, DEFAULTS)), "moe_layer_freq": [1] * arch.num_layers,
            "num_query_groups": arch.num_heads}


def _expand_into_streams(hc_mult: int):
    def hook(module, inputs, output: torch.Tensor) -> torch.Tensor:
        s, b, h = output.shape
        return expand_streams(output, hc_mult).view(s, b * hc_mult, h)
    return hook


def bind_token_ids(model) -> None:
    """The model's forward runs inside ``routing_token_ids(input_ids)``, on every pipeline stage."""
    forward = model.forward

    @functools.wraps(forward)
    def bound(*args, **kwargs):
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else (args[0] if args else None)
        with routing_token_ids(input_ids):
            return forward(*args, **kwargs)

    model.forward = bound


def keep_token_ids_through_full_recompute(block) -> None:
    """Full-layer recompute (``recompute_granularity="full"``) re-runs the block's layers in the backward, after the
    forward unbound the token ids: megatron-core's checkpoint saves the block's ``context`` argument with the hidden
    states and hands it to every layer it recomputes (0.16's ``_checkpointed_forward``, 0.19's
    ``recompute.checkpointed_forward`` alike), so the block is given the bound ids as ``context`` (the layer binds
    them)."""
    if block.config.recompute_granularity == "full" and not hasattr(block, "_checkpointed_forward"):
        # 0.19's recompute.checkpointed_forward hands context only to TransformerLayer instances, not to this layer
        raise UserError(FULL_RECOMPUTE_NEEDS_0_16)  # refused before launch too (config.recompute_refused)
    forward = block.forward

    @functools.wraps(forward)
    def with_token_ids(*args, **kwargs):
        if kwargs.get("context") is None:  # GPTModel calls its decoder with keywords and no context
            kwargs["context"] = bound_token_ids()
        return forward(*args, **kwargs)

    block.forward = with_token_ids


def finish_model(model, arch: Arch) -> None:
    """The streams expanded after the embedding (first stage), folded into the batch between stages, and the token
    ids bound for hash routing (every stage, and through full recompute); the float32 parameters declared so (``FLOAT32_MODULES``)."""
    own = settings(arch)
    if getattr(model, "pre_process", False):
        model.embedding.register_forward_hook(_expand_into_streams(own.hc_mult))
    model.pipeline_batch_factor = own.hc_mult
    head = getattr(model.decoder, "final_layernorm", None)
    if head is not None:  # built by the block, which does not hand it its TP group
        _replicated_over(head, model.decoder.tp_group)
    bind_token_ids(model)
    keep_token_ids_through_full_recompute(model.decoder)
    keep_in_float32(model, FLOAT32_MODULES)

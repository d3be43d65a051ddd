"""MiniMax-M2 (``minimax_m2``) config.json -> Arch and the megatron-core settings of its attention and MoE.

- GQA without biases, with RMSNorms of the queries and of the keys each over the whole projected width
  (``layers.py``: megatron-core's per-head ``qk_layernorm`` would compute something else);
- RoPE on the first ``rotary_dim`` dimensions of each head, the legacy field the hub's config.json gives
  (transformers reads it as ``partial_rotary_factor = rotary_dim / head_dim`` when that is absent);
- an MoE block in every layer: sigmoid scores, a score-correction bias (``e_score_correction_bias``) that
  only chooses the experts, the chosen scores renormalised; no shared expert; experts of
  ``intermediate_size``.

What transformers' MiniMaxM2 does not compute either is refused in one line (a config that asks for it would
be converted into a model that behaves otherwise): q/k norms per head or none, routing other than sigmoid,
shared experts, layers of another attention type (MiniMax-01's lightning attention).
"""

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.decoder import DECODER_KEYS, parse_decoder_config
from megatron_patch.models.blocks.routing import sigmoid_routing_kwargs
from megatron_patch.models.description.arch import Arch, require, rope_source
from megatron_patch.models.description.config_checks import (
    Flag, MAX_EXPERTS, MAX_LAYERS, MAX_WIDTH, Real, Text, Whole, WholeList)
from megatron_patch.models.description.hf_defaults import reads_hf_defaults

# transformers' MiniMaxM2Config defaults where the shared parser's fallbacks differ (hf_defaults.py): its head_dim is
# 128 whatever hidden_size / num_attention_heads is.
HF_DEFAULTS = {"minimax_m2": {"head_dim": 128, "max_position_embeddings": 196608, "rope_theta": 5e6,
                              "num_key_value_heads": 8}}


def with_rotary_dim(raw: dict) -> dict:
    """config.json with ``rotary_dim`` read as transformers reads it: ``partial_rotary_factor`` (in
    ``rope_parameters`` or at the top) wins, else rotary_dim / head_dim."""
    rotary_dim = raw.get("rotary_dim")
    params = rope_source(raw)
    if rotary_dim is None or "partial_rotary_factor" in params or raw.get("partial_rotary_factor") is not None:
        return raw
    head_dim = raw.get("head_dim") or require(raw, "hidden_size") // require(raw, "num_attention_heads")
    if rotary_dim > head_dim or rotary_dim % 2:
        raise UserError(f"config.json rotary_dim={rotary_dim} must be an even number of at most head_dim={head_dim}")
    return raw | {"partial_rotary_factor": rotary_dim / head_dim}


def check_supported(raw: dict) -> None:
    if raw.get("use_qk_norm") is False:
        raise UserError("use_qk_norm=false is not supported for MiniMax-M2: its attention normalises queries and keys")
    if raw.get("qk_norm_type", "per_layer") != "per_layer":
        raise UserError(f"qk_norm_type '{raw['qk_norm_type']}' is not supported: MiniMax-M2's q/k norms span the "
                        "whole projection (per_layer)")
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        raise UserError(f"scoring_func '{raw['scoring_func']}' is not supported: MiniMax-M2 routes by sigmoid scores")
    if raw.get("use_routing_bias") is False:
        raise UserError("use_routing_bias=false is not supported: MiniMax-M2 chooses experts with its "
                        "e_score_correction_bias")
    if raw.get("shared_intermediate_size"):
        raise UserError(f"shared_intermediate_size={raw['shared_intermediate_size']} is not supported: MiniMax-M2 "
                        "has no shared expert")
    kinds = set(raw.get("attn_type_list") or [1])
    if kinds != {1}:
        raise UserError(f"attn_type_list has {sorted(kinds)}: only full attention (1) is supported for MiniMax-M2, "
                        "not MiniMax-01's lightning attention (0)")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise UserError("attention or MLP biases are not supported for MiniMax-M2: its layers have none")


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    check_supported(raw)
    # the hub's config.json gives top-level rope_theta and rotary_dim; transformers 5 writes rope_parameters
    arch = parse_decoder_config(with_rotary_dim(raw), "minimax_m2", qkv_bias=False, partial_rope=1.0)
    experts_ffn = require(raw, "intermediate_size")
    return dataclasses.replace(
        arch, hf_config=raw,
        num_experts=require(raw, "num_local_experts", aliases=("num_experts",)),
        moe_topk=require(raw, "num_experts_per_tok"), moe_ffn_hidden_size=experts_ffn,
        norm_topk_prob=True, router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
    )


def transformer_config_kwargs(arch: Arch) -> dict:
    return dict(
        # the spec's q/k norms are the family's whole-width ones (layers.py); megatron-core builds them under this
        qk_layernorm=True,
        **sigmoid_routing_kwargs(),
    )


def layer_spec(arch: Arch, config, use_te: bool, vp_stage, core_attention: str | None):
    # megatron-core is imported here, when a model is built, not when the converter reads the family
    from megatron_patch.models.minimax_m2.layers import layer_spec as whole_width_norm_spec

    return whole_width_norm_spec(arch, config, use_te, vp_stage, core_attention)


# A tiny MiniMax-M2: RoPE on half of each head (rotary_dim 16 of head_dim 32, apart from hidden/heads), q/k
# norms over 4 query and 2 key heads (split over TP=2), 4 experts (top-2, sigmoid with a correction bias);
# 2 layers so that PP=2 splits it.
TINY_CONFIG = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
    "vocab_size": 200, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rotary_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2, "scoring_func": "sigmoid", "use_routing_bias": True,
    "use_qk_norm": True, "qk_norm_type": "per_layer", "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
    "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 5000000.0,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
}


# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {
    **DECODER_KEYS, "attention_bias": Flag(), "attn_type_list": WholeList(0, 1, longest=MAX_LAYERS),
    "num_local_experts": Whole(0, MAX_EXPERTS), "num_experts": Whole(0, MAX_EXPERTS), "rotary_dim": Whole(1, MAX_WIDTH), "use_qk_norm": Flag(),
    "qk_norm_type": Text(), "use_routing_bias": Flag(), "scoring_func": Text(),
    "shared_intermediate_size": Whole(0, MAX_WIDTH), "router_jitter_noise": Real(0, closed=True),
    "num_experts_per_tok": Whole(1, MAX_EXPERTS), "router_aux_loss_coef": Real(0, closed=True),
}

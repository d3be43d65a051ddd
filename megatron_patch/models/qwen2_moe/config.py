"""Qwen2-MoE config.json -> Arch: routed experts, a shared expert behind a sigmoid gate."""

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.decoder import (
    DECODER_KEYS, QWEN_DENSE_LAYER_KEYS, QWEN_WINDOW_KEYS, parse_decoder_config, qwen_dense_layers,
    qwen_expert_count, qwen_windowed_layers)
from megatron_patch.models.description.arch import Arch, require
from megatron_patch.models.description.hf_defaults import reads_hf_defaults
from megatron_patch.models.description.config_checks import MAX_EXPERTS, MAX_WIDTH, Flag, Real, Whole


# transformers' Qwen2MoeConfig defaults where the family's fallbacks differ (hf_defaults.py): a config.json without
# shared_expert_intermediate_size has a gated shared expert of 5632.
HF_DEFAULTS = {"qwen2_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 16,
                             "shared_expert_intermediate_size": 5632}}


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    windowed = qwen_windowed_layers(raw, slides=lambda i, max_window_layers: i % 2 == 0 and i < max_window_layers)
    if windowed:
        raise UserError(f"use_sliding_window=true with sliding-window layers ({len(windowed)}, from layer "
                        f"{windowed[0]}: max_window_layers, layer_types) is not supported: Qwen2-MoE models here use "
                        "full attention")
    arch = parse_decoder_config(raw, "qwen2_moe", qkv_bias=bool(raw.get("qkv_bias", True)))
    if not qwen_expert_count(raw):
        return arch  # every layer dense, without a shared expert, as transformers builds it
    shared = raw.get("shared_expert_intermediate_size") or 0
    return dataclasses.replace(
        arch,
        num_experts=qwen_expert_count(raw),
        moe_topk=require(raw, "num_experts_per_tok"),
        moe_ffn_hidden_size=require(raw, "moe_intermediate_size"),
        shared_expert_ffn_hidden_size=shared,
        shared_expert_gate=shared > 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
        dense_layers=qwen_dense_layers(raw),
    )


def transformer_config_kwargs(arch: Arch) -> dict:
    # Qwen2-MoE routes by softmax over all experts then top-k; renormalising the top-k
    # (norm_topk_prob) equals MCore's top-k-then-softmax.
    return {"moe_router_pre_softmax": not arch.norm_topk_prob}


# A tiny Qwen2-MoE: 4 experts, top-2, shared expert with its gate, q/k/v bias, untied.
TINY_CONFIG = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
    "vocab_size": 200, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 96, "num_experts": 4, "num_experts_per_tok": 2,
    "norm_topk_prob": False, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
    "router_aux_loss_coef": 0.001, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {
    **DECODER_KEYS, **QWEN_DENSE_LAYER_KEYS, **QWEN_WINDOW_KEYS, "num_experts": Whole(0, MAX_EXPERTS),
    "num_local_experts": Whole(0, MAX_EXPERTS), "moe_intermediate_size": Whole(1, MAX_WIDTH), "shared_expert_intermediate_size": Whole(0, MAX_WIDTH),
    "norm_topk_prob": Flag(), "qkv_bias": Flag(),
    "num_experts_per_tok": Whole(1, MAX_EXPERTS), "router_aux_loss_coef": Real(0, closed=True),
}

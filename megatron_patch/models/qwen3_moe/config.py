"""Qwen3-MoE config.json -> Arch: Qwen3's attention, top-k experts (renormalised when norm_topk_prob),
no shared expert, dense MLPs in the layers mlp_only_layers / decoder_sparse_step name."""

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.decoder import (
    DECODER_KEYS, QWEN_DENSE_LAYER_KEYS, QWEN_WINDOW_KEYS, parse_decoder_config, qwen_dense_layers,
    qwen_expert_count, qwen_windowed_layers)
from megatron_patch.models.description.arch import Arch, require
from megatron_patch.models.description.hf_defaults import reads_hf_defaults
from megatron_patch.models.description.config_checks import MAX_EXPERTS, MAX_WIDTH, Flag, Real, Whole


# transformers' Qwen3MoeConfig defaults where the family's fallbacks differ (hf_defaults.py).
HF_DEFAULTS = {"qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4}}


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    # transformers' Qwen3-MoE slides every layer with a window, and reads no layer_types
    if qwen_windowed_layers(raw, slides=lambda i, _: True, read_layer_types=False):
        raise UserError("use_sliding_window=true with a sliding_window is not supported: Qwen3-MoE models here use "
                        "full attention")
    if raw.get("attention_bias"):
        raise UserError("attention_bias=true is not supported for Qwen3-MoE: megatron-core would put biases on the "
                        "MLPs too")
    arch = parse_decoder_config(raw, "qwen3_moe", qkv_bias=False)
    if not qwen_expert_count(raw):
        return arch  # every layer dense, as transformers builds it
    return dataclasses.replace(
        arch,
        num_experts=qwen_expert_count(raw),
        moe_topk=require(raw, "num_experts_per_tok"),
        moe_ffn_hidden_size=require(raw, "moe_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
        dense_layers=qwen_dense_layers(raw),
    )


def transformer_config_kwargs(arch: Arch) -> dict:
    # Softmax over all experts, then top-k; renormalising the top-k (norm_topk_prob) equals megatron-core's
    # top-k-then-softmax. q_norm / k_norm are megatron-core's qk_layernorm.
    return {"qk_layernorm": True, "moe_router_pre_softmax": not arch.norm_topk_prob}


# A tiny Qwen3-MoE: 4 experts, top-2 renormalised, head_dim apart from hidden/heads, and layer 0 dense
# (mlp_only_layers) so that mixed dense/MoE models are covered by every family test.
TINY_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 200, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu",
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [0], "use_sliding_window": False, "attention_bias": False,
    "router_aux_loss_coef": 0.001, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {
    **DECODER_KEYS, **QWEN_DENSE_LAYER_KEYS, **QWEN_WINDOW_KEYS, "attention_bias": Flag(),
    "num_experts": Whole(0, MAX_EXPERTS), "num_local_experts": Whole(0, MAX_EXPERTS),
    "moe_intermediate_size": Whole(1, MAX_WIDTH), "norm_topk_prob": Flag(),
    "num_experts_per_tok": Whole(1, MAX_EXPERTS), "router_aux_loss_coef": Real(0, closed=True),
}

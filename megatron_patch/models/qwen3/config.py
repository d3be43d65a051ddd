"""Qwen3 config.json -> Arch: per-head q/k RMSNorm, an explicit head_dim, no q/k/v bias."""

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.decoder import (
    DECODER_KEYS, QWEN_WINDOW_KEYS, parse_decoder_config, qwen_windowed_layers)
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.hf_defaults import reads_hf_defaults
from megatron_patch.models.description.config_checks import Flag


# transformers' Qwen3Config defaults where the shared parser's fallbacks differ (hf_defaults.py): its head_dim is
# 128 whatever hidden_size / num_attention_heads is.
HF_DEFAULTS = {"qwen3": {"head_dim": 128, "max_position_embeddings": 32768, "num_key_value_heads": 32}}


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    # layer_types' sliding entries are refused whatever use_sliding_window says (without it transformers' masks
    # would be asked for a window of None)
    sliding = [t for t in raw.get("layer_types") or [] if t != "full_attention"]
    if qwen_windowed_layers(raw) or sliding:
        raise UserError("use_sliding_window=true (sliding-window layers) is not supported: Qwen3 models here use full "
                        "attention in every layer")
    if raw.get("attention_bias"):
        raise UserError("attention_bias=true is not supported for Qwen3: megatron-core would put biases on the MLP too")
    return parse_decoder_config(raw, "qwen3", qkv_bias=False)


def transformer_config_kwargs(arch: Arch) -> dict:
    # q_norm / k_norm: RMSNorm over each head's dimensions, applied before RoPE, as megatron-core's
    # qk_layernorm does.
    return {"qk_layernorm": True}


# A tiny Qwen3: head_dim 32 although hidden/heads is 16 (as in Qwen3-0.6B: 1024/16 heads, head_dim 128),
# GQA with 2 groups, tied embeddings, a vocabulary that needs padding.
TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu",
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {**DECODER_KEYS, **QWEN_WINDOW_KEYS, "attention_bias": Flag()}

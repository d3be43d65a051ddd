"""Qwen2 / Qwen2.5 config.json -> Arch: q/k/v always carry a bias; small models tie embeddings."""

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.decoder import (
    DECODER_KEYS, QWEN_WINDOW_KEYS, parse_decoder_config, qwen_windowed_layers)
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.hf_defaults import reads_hf_defaults


# transformers' Qwen2Config defaults where the shared parser's fallbacks differ (hf_defaults.py).
HF_DEFAULTS = {"qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32}}


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    windowed = qwen_windowed_layers(raw)
    if windowed:
        raise UserError(f"use_sliding_window=true with sliding-window layers ({len(windowed)} from layer "
                        f"{windowed[0]}, max_window_layers) is not supported: Qwen2 models here use full attention")
    return parse_decoder_config(raw, "qwen2", qkv_bias=True)


# A tiny Qwen2.5: q/k/v bias, GQA with 2 groups, tied embeddings as on 0.5B-3B, padded vocabulary.
TINY_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "vocab_size": 250, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "use_sliding_window": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {**DECODER_KEYS, **QWEN_WINDOW_KEYS}

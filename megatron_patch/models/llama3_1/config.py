"""Llama-architecture config.json -> Arch: Llama 3 / 3.1 / 3.2 and any LlamaForCausalLM or
MistralForCausalLM. RoPE (default, linear, llama3, yarn) is read, never assumed; tied embeddings, an
explicit head_dim and linear biases are taken as given. Mistral's ``sliding_window`` (Mistral-7B-v0.1: 4096)
makes every layer a sliding-window layer, as transformers' Mistral attends; megatron-core's ``window_size``
(the same settings as gpt-oss's windowed layers)."""

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.decoder import (
    DECODER_KEYS, parse_decoder_config, sliding_every_layer, sliding_window_kwargs)
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.hf_defaults import reads_hf_defaults
from megatron_patch.models.description.config_checks import MAX_POSITIONS, Flag, Whole


# transformers' LlamaConfig and MistralConfig defaults where the shared parser's fallbacks differ (hf_defaults.py).
HF_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096},
}


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    # transformers' Mistral has no biases and reads neither flag: a config.json that carries them builds none
    read = raw | {"attention_bias": False, "mlp_bias": False} if raw.get("model_type") == "mistral" else raw
    attention_bias, mlp_bias = bool(read.get("attention_bias")), bool(read.get("mlp_bias"))
    if attention_bias != mlp_bias:
        raise UserError(f"attention_bias={str(attention_bias).lower()} with mlp_bias={str(mlp_bias).lower()} cannot be "
                        "built: megatron-core puts a bias on every linear layer or on none (add_bias_linear)")
    arch = dataclasses.replace(parse_decoder_config(read, "llama3_1", qkv_bias=False, linear_bias=attention_bias),
                               hf_config=raw)
    window = raw.get("sliding_window")
    # use_sliding_window is Qwen2's switch: transformers' Mistral has no such field and attends within any
    # sliding_window it is given; for a Llama config, false says the window it ignores is not meant either
    if window is None or (raw.get("model_type") != "mistral" and not raw.get("use_sliding_window", True)):
        return arch
    if raw.get("model_type") != "mistral":
        # transformers' Llama has no window and ignores the field: which of the two was meant is not known
        raise UserError(f"sliding_window={window} in a {raw.get('model_type')!r} config.json: transformers' Llama "
                        "attends to every earlier token and ignores it; remove the field (full attention) or give "
                        "model_type mistral (a sliding window)")
    return sliding_every_layer(arch, window)


def transformer_config_kwargs(arch: Arch) -> dict:
    return sliding_window_kwargs(arch)


# A tiny Llama-3.1: GQA (4 heads, 2 groups), llama3 RoPE scaling with non-default factors so a
# hard-coded value would show, untied embeddings, a vocabulary that needs padding.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 200, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                     "high_freq_factor": 8.0, "original_max_position_embeddings": 64},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {
    **DECODER_KEYS, "attention_bias": Flag(), "sliding_window": Whole(1, MAX_POSITIONS), "use_sliding_window": Flag(),
}

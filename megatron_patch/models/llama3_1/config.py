"""Llama-architecture config.json -> Arch: Llama 3 / 3.1 / 3.2 and any LlamaForCausalLM or
MistralForCausalLM (without a sliding window). RoPE (default, linear, llama3, yarn) is read, never
assumed; tied embeddings, an explicit head_dim and linear biases are taken as given."""

from megatron_patch.errors import UserError
from megatron_patch.models.arch import Arch
from megatron_patch.models.decoder import parse_decoder_config


def parse_config(raw: dict) -> Arch:
    window = raw.get("sliding_window")
    if window is not None and raw.get("use_sliding_window", True):
        raise UserError(f"sliding_window={window} (attention over the last {window} tokens only) is not supported: "
                        "megatron-core's attention here is full causal attention, so only checkpoints with "
                        "sliding_window null convert exactly")
    attention_bias, mlp_bias = bool(raw.get("attention_bias")), bool(raw.get("mlp_bias"))
    if attention_bias != mlp_bias:
        raise UserError(f"attention_bias={str(attention_bias).lower()} with mlp_bias={str(mlp_bias).lower()} cannot be "
                        "built: megatron-core puts a bias on every linear layer or on none (add_bias_linear)")
    return parse_decoder_config(raw, "llama3_1", qkv_bias=False, linear_bias=attention_bias)


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

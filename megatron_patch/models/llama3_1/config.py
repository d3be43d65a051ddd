"""Llama 3 / 3.1 config.json -> Arch. RoPE scaling (rope_type llama3) is read, never assumed."""

from megatron_patch.errors import UserError
from megatron_patch.models.arch import Arch
from megatron_patch.models.decoder import parse_decoder_config


def parse_config(raw: dict) -> Arch:
    if raw.get("attention_bias"):
        raise UserError("attention_bias=true is not supported for Llama models")
    return parse_decoder_config(raw, "llama3_1", qkv_bias=False)


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

"""Published gpt-oss sizes as HF config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``."""

from megatron_patch.models.gpt_oss.config import DEFAULT_ROPE, TINY_CONFIG


def _gpt_oss(layers, experts):
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": layers, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "attention_bias": True,
        "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)],
        "sliding_window": 128, "num_local_experts": experts, "num_experts_per_tok": 4, "swiglu_limit": 7.0,
        "router_aux_loss_coef": 0.9, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 150000, "rope_scaling": dict(DEFAULT_ROPE), "tie_word_embeddings": False,
        "eos_token_id": 200002, "pad_token_id": 199999, "torch_dtype": "bfloat16",
    }


PRESETS = {
    "20B-A3.6B": _gpt_oss(24, 32),
    "120B-A5.1B": _gpt_oss(36, 128),
    "tiny": TINY_CONFIG,
}

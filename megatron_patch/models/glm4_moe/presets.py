"""Published GLM-4.5 sizes as HF config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``. GLM-4.6 and
4.7 have GLM-4.5's shape with a longer context (``max_position_embeddings`` 202752)."""

from megatron_patch.models.glm4_moe.config import TINY_CONFIG


def _glm45(hidden, ffn, moe_ffn, layers, experts, dense, scale, qk_norm):
    return {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552,
        "hidden_size": hidden, "intermediate_size": ffn, "moe_intermediate_size": moe_ffn,
        "num_hidden_layers": layers, "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
        "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": qk_norm,
        "n_routed_experts": experts, "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": scale, "norm_topk_prob": True, "first_k_dense_replace": dense,
        "num_nextn_predict_layers": 1, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000, "tie_word_embeddings": False, "pad_token_id": 151329,
        "eos_token_id": [151329, 151336, 151338], "torch_dtype": "bfloat16",
    }


PRESETS = {
    "355B-A32B": _glm45(5120, 12288, 1536, 92, 160, 3, 2.5, True),
    "Air-106B-A12B": _glm45(4096, 10944, 1408, 46, 128, 1, 1.0, False),
    "tiny": TINY_CONFIG,
}

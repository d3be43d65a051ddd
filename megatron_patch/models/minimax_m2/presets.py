"""Published MiniMax-M2 sizes as HF config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``. MiniMax-M2.1
and M2.5 have MiniMax-M2's shape (230B total, 10B active); the hub stores their weights in FP8 (128x128
blocks), which the converter dequantizes."""

from megatron_patch.models.minimax_m2.config import TINY_CONFIG

PRESETS = {
    "230B-A10B": {
        "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "vocab_size": 200064,
        "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48,
        "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64, "num_local_experts": 256,
        "num_experts_per_tok": 8, "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
        "qk_norm_type": "per_layer", "shared_intermediate_size": 0, "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0, "hidden_act": "silu", "max_position_embeddings": 196608, "rms_norm_eps": 1e-6,
        "rope_theta": 5000000, "tie_word_embeddings": False, "bos_token_id": 200034, "eos_token_id": 200020,
        "torch_dtype": "bfloat16",
    },
    "tiny": TINY_CONFIG,
}

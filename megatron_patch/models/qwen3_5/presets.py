"""Published Qwen3.5 sizes as HF config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``.

Only the language model's numbers matter to a run (the vision tower travels beside it); the 397B-A17B's
are those of its hub text_config."""

from megatron_patch.models.qwen3_5.config import TINY_CONFIG

PRESETS = {
    "397B-A17B": {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 4096, "num_hidden_layers": 60,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
            "moe_intermediate_size": 1024, "shared_expert_intermediate_size": 1024, "intermediate_size": 10240,
            "router_aux_loss_coef": 0.001, "hidden_act": "silu", "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "attention_bias": False, "mtp_num_hidden_layers": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        },
        "torch_dtype": "bfloat16",
    },
    "tiny": TINY_CONFIG,
}

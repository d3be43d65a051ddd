"""Published DeepSeek-V3 / V2 sizes as HF config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``."""

from megatron_patch.models.deepseek_v3.config import TINY_CONFIG

_YARN_40 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
           "kv_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "moe_layer_freq": 1,
           "aux_loss_alpha": 0.001, "seq_aux": True, "torch_dtype": "bfloat16"}

PRESETS = {
    "671B": {
        **_COMMON, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
        "n_routed_experts": 256, "routed_scaling_factor": 2.5, "q_lora_rank": 1536, "topk_method": "noaux_tc",
        "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {**_YARN_40, "mscale": 1.0, "mscale_all_dim": 1.0}, "bos_token_id": 0, "eos_token_id": 1,
    },
    "V2-Lite-16B": {
        **_COMMON, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "routed_scaling_factor": 1.0, "q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "norm_topk_prob": False, "scoring_func": "softmax",
        "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {**_YARN_40, "mscale": 0.707, "mscale_all_dim": 0.707}, "bos_token_id": 100000,
        "eos_token_id": 100001,
    },
    "Moonlight-16B-A3B": {
        **_COMMON, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 163840,
        "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "routed_scaling_factor": 2.446, "q_lora_rank": None, "topk_method": "noaux_tc", "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "norm_topk_prob": True, "scoring_func": "sigmoid",
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": None,
        "bos_token_id": 163584, "eos_token_id": 163585,
    },
    # Kimi-K2 (Base and Instruct; Instruct-0905 and Thinking have YaRN factor 64 and a 262144 context): DeepSeek-V3's
    # architecture with 384 experts and 64 heads, read from its own config.json values (model_type kimi_k2).
    "Kimi-K2-1T-A32B": {
        **_COMMON, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "vocab_size": 163840,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_nextn_predict_layers": 0, "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1,
        "n_routed_experts": 384, "routed_scaling_factor": 2.827, "q_lora_rank": 1536, "topk_method": "noaux_tc",
        "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "scoring_func": "sigmoid", "max_position_embeddings": 131072, "rope_theta": 50000.0,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "bos_token_id": 163584, "eos_token_id": 163585,
    },
    "tiny": TINY_CONFIG,
}

"""Published DeepSeek-V3.2 and GLM-5 sizes as HF config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``.

DeepSeek-V3.2 and V3.2-Exp are DeepSeek-V3's 671B shape (``deepseek_v3/presets.py``) with an indexer of 64
heads of 128 keeping 2048 keys. GLM-5's values are transformers' ``GlmMoeDsaConfig`` defaults, which are
zai-org/GLM-5's config.json; GLM-5.1 and 5.2 keep GLM-5's shape (their hub configs were not among the
sources this was written from: check a download's config.json, which the converter reads anyway).
"""

from megatron_patch.models.deepseek_v3.presets import PRESETS as V3_PRESETS
from megatron_patch.models.deepseek_v32.config import GLM_TINY_CONFIG, TINY_CONFIG

_INDEXER = {"index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}

DEEPSEEK_V32_PRESETS = {
    "671B": {**{k: v for k, v in V3_PRESETS["671B"].items() if k not in ("topk_method", "scoring_func")},
             "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", **_INDEXER},
    "tiny": TINY_CONFIG,
}

GLM_MOE_DSA_PRESETS = {
    "744B-A40B": {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "vocab_size": 154880,
        "hidden_size": 6144, "intermediate_size": 12288, "moe_intermediate_size": 2048, "num_hidden_layers": 78,
        "num_attention_heads": 64, "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 2048, "qk_rope_head_dim": 64,
        "v_head_dim": 256, "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "first_k_dense_replace": 3, "num_nextn_predict_layers": 1, "hidden_act": "silu",
        "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 32, "attention_bias": False,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    },
    "tiny": GLM_TINY_CONFIG,
}

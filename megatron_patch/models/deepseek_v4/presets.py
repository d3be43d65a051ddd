"""DeepSeek-V4 sizes (MODEL_SIZE in the launcher), as the hub's config.json gives them (the legacy names transformers
folds in: ``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, a flat YaRN ``rope_scaling`` for the
compressed layers), and ``tiny``. The hub's checkpoints are FP8 with FP4 experts (``quantization_config``,
``expert_dtype``), which a preset leaves out: a preset describes the model, not how a checkpoint stores it.

- Flash (284B, 13B active): 43 layers of 4096, two sliding-window layers then CSA and HCA alternating (the last
  CSA); the trailing entry of ``compress_ratios`` is the MTP layer's, which transformers cuts off.
- Pro (1.6T, 49B active): 61 layers of 7168, two HCA layers then CSA and HCA alternating (the last CSA).

Values read from the published config.json files as quoted in public repositories (the Flash one in a test that
pins the official file's hash, the Pro one in a report of its files and tensors), not downloaded from the hub."""

from megatron_patch.models.deepseek_v4.config import TINY_CONFIG

_COMMON = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu", "index_head_dim": 128, "index_n_heads": 64,
    "initializer_range": 0.02, "max_position_embeddings": 1048576, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_experts_per_tok": 6, "num_hash_layers": 3, "num_key_value_heads": 1, "num_nextn_predict_layers": 1,
    "o_lora_rank": 1024, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "scoring_func": "sqrtsoftplus", "sliding_window": 128, "swiglu_limit": 10.0,
    "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 129280, "compress_rope_theta": 160000,
}

PRESETS = {
    "Flash": {
        **_COMMON, "hidden_size": 4096, "index_topk": 512, "moe_intermediate_size": 2048, "n_routed_experts": 256,
        "num_attention_heads": 64, "num_hidden_layers": 43, "o_groups": 8, "q_lora_rank": 1024,
        "routed_scaling_factor": 1.5, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    },
    "Pro": {
        **_COMMON, "hidden_size": 7168, "index_topk": 1024, "moe_intermediate_size": 3072, "n_routed_experts": 384,
        "num_attention_heads": 128, "num_hidden_layers": 61, "o_groups": 16, "q_lora_rank": 1536,
        "routed_scaling_factor": 2.5, "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
    },
    "tiny": TINY_CONFIG,
}

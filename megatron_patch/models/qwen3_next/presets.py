"""Published Qwen3-Next sizes as HF config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``."""

from megatron_patch.models.qwen3_next.config import TINY_CONFIG

PRESETS = {
    "80B-A3B": {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25, "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "mtp_num_hidden_layers": 1, "hidden_act": "silu",
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "rope_theta": 10000000, "tie_word_embeddings": False,
        "attention_bias": False, "router_aux_loss_coef": 0.001, "bos_token_id": 151643, "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "tiny": TINY_CONFIG,
}

"""Published Qwen3-MoE sizes as HF config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``."""

from megatron_patch.models.qwen3_moe.config import TINY_CONFIG


def _qwen3_moe(hidden, ffn, moe_ffn, layers, heads):
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
        "hidden_size": hidden, "intermediate_size": ffn, "moe_intermediate_size": moe_ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "use_sliding_window": False,
        "attention_bias": False, "router_aux_loss_coef": 0.001,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    }


PRESETS = {
    "30B-A3B": _qwen3_moe(2048, 6144, 768, 48, 32),
    "235B-A22B": _qwen3_moe(4096, 12288, 1536, 94, 64),
    "tiny": TINY_CONFIG,
}

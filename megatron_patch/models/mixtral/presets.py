"""Published Mixtral sizes as HF config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``."""

from megatron_patch.models.mixtral.config import TINY_CONFIG


def _mixtral(vocab, hidden, ffn, layers, heads, positions):
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "hidden_act": "silu", "max_position_embeddings": positions,
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0, "sliding_window": None,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }


PRESETS = {
    "8x7B": _mixtral(32000, 4096, 14336, 32, 32, 32768),
    "8x22B": _mixtral(32768, 6144, 16384, 56, 48, 65536),
    "tiny": TINY_CONFIG,
}

"""Published Qwen3 sizes as HF config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``."""

from megatron_patch.models.qwen3.config import TINY_CONFIG


def _qwen3(hidden, ffn, layers, heads, *, tie):
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": tie, "attention_bias": False, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
    }


PRESETS = {
    "0.6B": _qwen3(1024, 3072, 28, 16, tie=True),
    "1.7B": _qwen3(2048, 6144, 28, 16, tie=True),
    "4B": _qwen3(2560, 9728, 36, 32, tie=True),
    "8B": _qwen3(4096, 12288, 36, 32, tie=False),
    "14B": _qwen3(5120, 17408, 40, 40, tie=False),
    "32B": _qwen3(5120, 25600, 64, 64, tie=False),
    "tiny": TINY_CONFIG,
}

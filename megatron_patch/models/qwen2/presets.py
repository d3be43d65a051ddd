"""Published Qwen2/Qwen2.5 sizes as HF config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``."""

from megatron_patch.models.qwen2.config import TINY_CONFIG


def _qwen2(hidden, ffn, layers, heads, kv, *, tie, vocab=152064, eps=1e-6):
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": eps, "rope_theta": 1000000.0,
        "tie_word_embeddings": tie, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16",
    }


PRESETS = {
    "0.5B": _qwen2(896, 4864, 24, 14, 2, tie=True, vocab=151936),
    "1.5B": _qwen2(1536, 8960, 28, 12, 2, tie=True, vocab=151936),
    "3B": _qwen2(2048, 11008, 36, 16, 2, tie=True, vocab=151936),
    "7B": _qwen2(3584, 18944, 28, 28, 4, tie=False),
    "14B": _qwen2(5120, 13824, 48, 40, 8, tie=False, eps=1e-5),
    "32B": _qwen2(5120, 27648, 64, 40, 8, tie=False, eps=1e-5),
    "72B": _qwen2(8192, 29568, 80, 64, 8, tie=False, eps=1e-5),
    "tiny": TINY_CONFIG,
}

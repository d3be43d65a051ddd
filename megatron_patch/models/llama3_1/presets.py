"""Published Llama 3.1 / 3.2 sizes, and Mistral-7B (Llama layers with a sliding window), as HF config.json dicts
(MODEL_SIZE in the launcher), plus ``tiny``."""

from megatron_patch.models.llama3_1.config import TINY_CONFIG

_BASE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "num_key_value_heads": 8, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
# Llama 3.2 1B / 3B: tied embeddings, RoPE scaling factor 32.
_LLAMA32 = {**_BASE, "tie_word_embeddings": True, "intermediate_size": 8192,
            "rope_scaling": {**_BASE["rope_scaling"], "factor": 32.0}}

PRESETS = {
    "1B": {**_LLAMA32, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "head_dim": 64},
    "3B": {**_LLAMA32, "hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128},
    "8B": {**_BASE, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32},
    "70B": {**_BASE, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64},
    "405B": {**_BASE, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
             "num_attention_heads": 128},
    # Mistral-7B-v0.1 (Pai-Megatron-Patch's Mistral launcher calls it 7B): every layer attends to the last 4096 tokens.
    "Mistral-7B": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    },
    "tiny": TINY_CONFIG,
}

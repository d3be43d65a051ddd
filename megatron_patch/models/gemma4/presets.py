"""Gemma 4 sizes (MODEL_SIZE in the launcher): the 31B's and the 26B-A4B's language models, as transformers'
``convert_gemma4_weights.py`` configures them (text only: Gemma4ForCausalLM), and ``tiny``. Its full-attention layers
have heads of 512 (``global_head_dim``) and, keys doubling as values (``attention_k_eq_v``), 4 key/value heads
(``num_global_key_value_heads``) beside the sliding layers' 16 of 256; every 6th layer is full attention (the
reader's default ``layer_types``, as the converter writes them). The other published sizes still need what this
model refuses in one line (config.py): E2B and E4B per-layer input embeddings (``hidden_size_per_layer_input=256``)
and KV sharing (``num_kv_shared_layers`` 20 and 18). The 26B-A4B has the MoE block in every layer (128 experts of 704,
top 8, beside a dense MLP of 2112), its full-attention layers 2 key/value heads of 512 doubling as values."""

from megatron_patch.models.gemma4.config import TINY_CONFIG

PRESETS = {
    "31B": {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "attention_bias": False,
        "attention_k_eq_v": True, "bos_token_id": 2, "enable_moe_block": False, "eos_token_id": 1,
        "final_logit_softcapping": 30.0, "global_head_dim": 512, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 5376, "hidden_size_per_layer_input": 0,
        "intermediate_size": 21504, "max_position_embeddings": 262144, "num_attention_heads": 32,
        "num_global_key_value_heads": 4, "num_hidden_layers": 60, "num_key_value_heads": 16,
        "num_kv_shared_layers": 0, "pad_token_id": 0, "rms_norm_eps": 1e-06,
        "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                               "rope_type": "proportional"},
                            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": 1024, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_bidirectional_attention": "vision", "vocab_size": 262144,
    },
    "26B-A4B": {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "attention_bias": False,
        "attention_k_eq_v": True, "bos_token_id": 2, "enable_moe_block": True, "eos_token_id": 1,
        "final_logit_softcapping": 30.0, "global_head_dim": 512, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2816, "hidden_size_per_layer_input": 0,
        "intermediate_size": 2112, "max_position_embeddings": 262144, "moe_intermediate_size": 704,
        "num_attention_heads": 16, "num_experts": 128, "num_global_key_value_heads": 2, "num_hidden_layers": 30,
        "num_key_value_heads": 8, "num_kv_shared_layers": 0, "pad_token_id": 0, "rms_norm_eps": 1e-06,
        "rope_parameters": {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                                               "rope_type": "proportional"},
                            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
        "sliding_window": 1024, "tie_word_embeddings": True, "top_k_experts": 8, "torch_dtype": "bfloat16",
        "use_bidirectional_attention": "vision", "vocab_size": 262144,
    },
    "tiny": TINY_CONFIG,
}

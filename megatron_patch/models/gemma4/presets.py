"""Gemma 4 sizes (MODEL_SIZE in the launcher): the language models of 31B, 26B-A4B, E2B and E4B, as transformers'
``convert_gemma4_weights.py`` configures them (text only: Gemma4ForCausalLM), and ``tiny``.

31B: full-attention layers with heads of 512 (``global_head_dim``) and, keys doubling as values
(``attention_k_eq_v``), 4 key/value heads (``num_global_key_value_heads``) beside the sliding layers' 16 of 256;
every 6th layer is full attention (the reader's default ``layer_types``, as the converter writes them).
26B-A4B: the MoE block in every layer (128 experts of 704, top 8, beside a dense MLP of 2112), its full-attention
layers 2 key/value heads of 512 doubling as values.
E2B and E4B (the on-device sizes): per-layer input embeddings of 256 per layer (``hidden_size_per_layer_input``), the
last 20 and 18 layers reusing earlier layers' keys and values (``num_kv_shared_layers``), E2B's with a double-wide
MLP (``use_double_wide_mlp``); every 5th (E2B) or 6th (E4B) layer is full attention, with heads of 512. They run at
PP=1 only (per_layer_inputs.py)."""

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

_ROPE = PRESETS["31B"]["rope_parameters"]
# The on-device sizes' language models (convert_gemma4_weights.py's gemma-4-e2b and gemma-4-e4b text configs; the
# rest transformers' Gemma4TextConfig defaults: heads of 256, full-attention ones of 512, a window of 512, per-layer
# embeddings of the whole vocabulary).
PRESETS["E2B"] = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "attention_bias": False,
    "attention_k_eq_v": False, "bos_token_id": 2, "enable_moe_block": False, "eos_token_id": 1,
    "final_logit_softcapping": 30.0, "global_head_dim": 512, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1536, "hidden_size_per_layer_input": 256, "intermediate_size": 6144,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7, "max_position_embeddings": 131072,
    "num_attention_heads": 8, "num_hidden_layers": 35, "num_key_value_heads": 1, "num_kv_shared_layers": 20,
    "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_parameters": _ROPE, "sliding_window": 512,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_double_wide_mlp": True, "vocab_size": 262144,
    "vocab_size_per_layer_input": 262144,
}
PRESETS["E4B"] = {
    **PRESETS["E2B"], "hidden_size": 2560, "intermediate_size": 10240,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 7, "num_hidden_layers": 42,
    "num_key_value_heads": 2, "num_kv_shared_layers": 18, "use_double_wide_mlp": False,
}

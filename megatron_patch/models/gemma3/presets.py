"""Published Gemma 3 sizes as their hub config.json dicts (MODEL_SIZE in the launcher), plus ``tiny``: the 1B
text-only model (Gemma3ForCausalLM), and the 4B, 12B and 27B multimodal ones, whose language model is trained
here and whose vision tower travels beside it. The multimodal configs name only what differs from
transformers' defaults (config.DEFAULTS), as the hub's do."""

from megatron_patch.models.gemma3.config import TINY_CONFIG

# SigLIP-400M at 896 px, as the 4B, 12B and 27B hub configs give it.
_VISION = {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
           "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}


def _multimodal(**text) -> dict:
    return {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
        "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144, "initializer_range": 0.02,
        "mm_tokens_per_image": 256,
        "text_config": {"model_type": "gemma3_text", "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024, **text},
        "torch_dtype": "bfloat16", "vision_config": _VISION,
    }


PRESETS = {
    "1B": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1,
        "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 262144,
    },
    "4B": _multimodal(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34),
    "12B": _multimodal(hidden_size=3840, intermediate_size=15360, num_attention_heads=16, num_hidden_layers=48,
                       num_key_value_heads=8),
    "27B": _multimodal(head_dim=128, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
                       num_hidden_layers=62, num_key_value_heads=16, query_pre_attn_scalar=168),
    "tiny": TINY_CONFIG,
}

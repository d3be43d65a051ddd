"""Qwen3.5 (``qwen3_5``: dense, the 27B; ``qwen3_5_moe``: 35B-A3B up to 397B-A17B) config.json -> Arch.

A Qwen3.5 hub folder holds the multimodal model (``Qwen3_5*ForConditionalGeneration``): its config.json
keeps the language model's numbers in ``text_config``, which is Qwen3-Next's hybrid architecture (Gated
DeltaNet and gated full attention, zero-centred norms, partial RoPE; the MoE model's experts renormalised
and a gated shared expert). The family builds and trains that language model; the vision tower's tensors
travel beside it (``convert/carried.py``) and the exported config.json is the whole multimodal one.

Its RoPE is multimodal (``mrope_section``: time, height and width positions interleaved over the
rotated dimensions); for text every position is the same in all three, which is 1D RoPE, what the MCore
model computes. Image and video positions (the vision tower's tokens) are not supported here.
"""

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.config_checks import Flag, Table, Text
from megatron_patch.models.description.hf_defaults import reads_hf_defaults
from megatron_patch.models.qwen3_next.config import CONFIG_KEYS as TEXT_KEYS
from megatron_patch.models.qwen3_next.config import parse_hybrid, with_moe


# transformers' Qwen3_5TextConfig and Qwen3_5MoeTextConfig defaults, for text_config's fields, where Qwen3-Next's
# fallbacks differ (hf_defaults.py).
HF_DEFAULTS = {
    "qwen3_5": {"head_dim": 256, "max_position_embeddings": 32768, "num_key_value_heads": 4},
    "qwen3_5_moe": {"head_dim": 256, "max_position_embeddings": 32768, "num_key_value_heads": 2,
                    "shared_expert_intermediate_size": 512},
}


def text_config(raw: dict) -> dict:
    """The language model's config.json values, with the fields the multimodal config keeps at its top."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"config.json of a {raw.get('model_type')} model has no text_config: point at Qwen3.5's "
                        "multimodal hub folder")
    # Tied as its own class (Qwen3_5*ForConditionalGeneration) ties: by the top level only, untied where absent.
    # Falling back on text_config's (which AutoModelForCausalLM reads) built a tied model, and the export left out the
    # lm_head.weight the folder's own class then loaded at random (the cfgvar2 audit).
    return text | {"tie_word_embeddings": bool(raw.get("tie_word_embeddings", False))}


@reads_hf_defaults(HF_DEFAULTS, within="text_config")
def parse_config(raw: dict) -> Arch:
    text = text_config(raw)
    moe = raw.get("model_type") == "qwen3_5_moe"
    if moe and text.get("intermediate_size") is None:
        # Every layer is MoE, so the model has no dense MLP, and transformers' Qwen3_5MoeTextConfig (so every hub
        # config.json) has no dense size; megatron-core's config still wants one, which it never builds.
        text = text | {"intermediate_size": text.get("moe_intermediate_size")}
    arch = parse_hybrid(text, "qwen3_5")
    # Qwen3.5 keeps the Gated DeltaNet's input projection as four HF tensors (mapping.py), Qwen3-Next as two
    arch = dataclasses.replace(arch, linear_attention=dataclasses.replace(arch.linear_attention,
                                                                          in_proj=("qkv", "z", "b", "a")))
    if moe:  # every layer MoE; transformers renormalises the top-k
        arch = with_moe(arch, text | {"norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 1})
    return dataclasses.replace(arch, hf_config=raw)


def num_mtp_layers(raw: dict) -> int:
    return int((raw.get("text_config") or {}).get("mtp_num_hidden_layers") or 0)


_TEXT = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "vocab_size": 200, "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
}
_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
           "patch_size": 4, "num_position_embeddings": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}

# A tiny Qwen3.5-MoE (the sizes users fine-tune most): a Gated DeltaNet layer then a gated full-attention one,
# 4 experts (top-2) with a gated shared expert, and a one-block vision tower that travels beside the model. Its
# text_config has the fields transformers' Qwen3_5MoeTextConfig writes, so no dense intermediate_size.
TINY_CONFIG = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "text_config": {**_TEXT, "model_type": "qwen3_5_moe_text", "num_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "router_aux_loss_coef": 0.001},
    "vision_config": {**_VISION, "model_type": "qwen3_5_moe_vision"}, "torch_dtype": "float32",
}
# Its dense sibling (Qwen3.5-27B's layout): every layer a dense SwiGLU MLP.
TINY_DENSE_CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {**_TEXT, "model_type": "qwen3_5_text", "intermediate_size": 128},
    "vision_config": {**_VISION, "model_type": "qwen3_5_vision"},
    "torch_dtype": "float32",
}


# The config.json fields this family reads: Qwen3-Next's, in text_config.
CONFIG_KEYS = {
    "text_config": Table({**TEXT_KEYS, "model_type": Text()}), "tie_word_embeddings": Flag(),
}

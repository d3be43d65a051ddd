"""gpt-oss (``gpt_oss``) config.json -> Arch and the megatron-core settings of its attention and experts.

- attention: GQA with biases on q/k/v and the output projection, a learnt sink logit per head that joins
  every softmax (megatron-core's ``softmax_type="learnable"``, its ``softmax_offset``), full attention and
  sliding windows alternating as ``layer_types`` says (``window_size`` on the layers
  ``window_attn_skip_freq`` marks), YaRN RoPE (defaults as transformers fills them in);
- MoE in every layer: a router with a bias, top-k then softmax over the chosen logits, experts with
  biases whose SwiGLU is clamped and offset: ``(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)`` with
  ``g = min(gate, l)`` (megatron-core's ``quick_gelu`` with ``glu_linear_offset=1`` and
  ``activation_func_clamp_value=l``).

Refused in one line: another SwiGLU gain than quick_gelu's 1.702, attention without biases (megatron-core
puts biases on every linear or none), layer types other than full and sliding attention.
"""

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.decoder import DECODER_KEYS, parse_decoder_config, sliding_window_kwargs
from megatron_patch.models.description.arch import FULL_ATTENTION, SLIDING_ATTENTION, Arch, require
from megatron_patch.models.description.config_checks import (
    Flag, MAX_EXPERTS, MAX_LAYERS, MAX_POSITIONS, Names, Real, Whole)
from megatron_patch.models.description.hf_defaults import reads_hf_defaults

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).
# So are blocks.builder and blocks.spec_edits, which import them at their top: when a model is built.

# transformers' GptOssConfig fills these in when config.json leaves them out.
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_THETA = 150000.0
QUICK_GELU_GAIN = 1.702
# And these, where the shared parser's fallbacks differ (hf_defaults.py).
HF_DEFAULTS = {"gpt_oss": {"head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
                           "num_key_value_heads": 8, "sliding_window": 128}}


def layer_types_of(raw: dict, layers: int) -> tuple[str, ...]:
    types = raw.get("layer_types") or [SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION for i in range(layers)]
    if len(types) != layers or set(types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise UserError(f"config.json layer_types must name {layers} layers, each full_attention or sliding_attention: "
                        f"found {types}")
    return tuple(types)


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    if float(raw.get("swiglu_alpha", QUICK_GELU_GAIN)) != QUICK_GELU_GAIN:
        raise UserError(f"swiglu_alpha={raw['swiglu_alpha']} is not supported: megatron-core's clamped SwiGLU "
                        f"(quick_gelu) has the gain {QUICK_GELU_GAIN}")
    if not raw.get("attention_bias", True):
        raise UserError("attention_bias=false is not supported for gpt-oss: megatron-core puts biases on every linear "
                        "layer or on none, and the experts have them")
    # transformers' GptOss never reads hidden_act: its experts are the clamped SwiGLU whatever the field says
    filled = raw | {"hidden_act": "silu"}
    if not (raw.get("rope_parameters") or raw.get("rope_scaling")):
        filled = filled | {"rope_scaling": dict(DEFAULT_ROPE)}
    if raw.get("rope_theta") is None and "rope_theta" not in (raw.get("rope_parameters") or {}):
        filled = filled | {"rope_theta": DEFAULT_THETA}
    arch = parse_decoder_config(filled, "gpt_oss", qkv_bias=True, linear_bias=True)
    types = layer_types_of(raw, arch.num_layers)
    window = raw.get("sliding_window")
    if SLIDING_ATTENTION in types and not (isinstance(window, int) and window > 0):
        raise UserError(f"config.json has sliding_attention layers but sliding_window={window!r}: it must be a "
                        "positive integer")
    return dataclasses.replace(
        arch, hf_config=raw,
        num_experts=require(raw, "num_local_experts", aliases=("num_experts",)),
        moe_topk=require(raw, "num_experts_per_tok", aliases=("experts_per_token",)),
        moe_ffn_hidden_size=arch.ffn_hidden_size,
        # softmax over the top-k logits: megatron-core's top-k then softmax
        norm_topk_prob=True, router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
        layer_types=types, sliding_window=window if SLIDING_ATTENTION in types else None, attention_sinks=True,
    )


def transformer_config_kwargs(arch: Arch) -> dict:
    # megatron-core is imported here, when a model is built, not when the converter reads the family
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return dict(
        softmax_type="learnable",
        **sliding_window_kwargs(arch),
        activation_func=quick_gelu, glu_linear_offset=1.0,
        activation_func_clamp_value=float(arch.hf_config.get("swiglu_limit", 7.0)),
        # megatron-core fuses only the plain SwiGLU / GeGLU with their biases
        bias_activation_fusion=False,
        moe_router_pre_softmax=False,
    )


# A tiny gpt-oss: a sliding-window layer (window 8, shorter than the tests' sequences) then a full one, sinks,
# biases everywhere, 4 experts (top-2) whose SwiGLU clamp (0.5) the tests' activations reach, YaRN.
TINY_CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
    "vocab_size": 200, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "attention_bias": True,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
    "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 0.5, "router_aux_loss_coef": 0.9,
    "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 64},
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "torch_dtype": "float32",
}


def layer_spec(arch: Arch, config, use_te: bool, vp_stage, core_attention: str | None):
    """The standard spec; on the local spec, experts that can train with their biases."""
    from megatron_patch.models.blocks.builder import layer_spec as standard_layer_spec
    from megatron_patch.models.blocks.spec_edits import with_biased_experts

    spec = standard_layer_spec(arch, config, use_te, vp_stage, core_attention, family_spec=False)
    return spec if use_te else with_biased_experts(spec)


# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {
    **DECODER_KEYS, "attention_bias": Flag(), "layer_types": Names(MAX_LAYERS),
    "sliding_window": Whole(1, MAX_POSITIONS), "num_local_experts": Whole(0, MAX_EXPERTS),
    "num_experts": Whole(0, MAX_EXPERTS), "experts_per_token": Whole(1, MAX_EXPERTS), "swiglu_alpha": Real(0),
    "swiglu_limit": Real(0), "num_experts_per_tok": Whole(1, MAX_EXPERTS),
    "router_aux_loss_coef": Real(0, closed=True),
}

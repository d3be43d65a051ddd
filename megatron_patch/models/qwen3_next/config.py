"""Qwen3-Next (``qwen3_next``) config.json -> Arch and the megatron-core settings of its hybrid layers.

- Gated DeltaNet (linear attention) layers interleaved with gated full attention, as ``layer_types`` says
  (transformers derives it from ``full_attention_interval``, 4 by default, when config.json has none);
- full attention: GQA with an output gate (megatron-core's ``attention_output_gate``), q/k norms and RoPE
  on part of each head (``partial_rotary_factor``, 0.25 when config.json leaves it out);
- zero-centred RMSNorms everywhere but the Gated DeltaNet's gated output norm (``layers.py``);
- MoE: softmax routing, top-k renormalised with ``norm_topk_prob`` (megatron-core's top-k then softmax), a
  shared expert behind a sigmoid gate; dense MLPs where ``mlp_only_layers`` / ``decoder_sparse_step`` say;
- multi-token-prediction layers (``mtp.*``) kept with ``--mtp``.

Refused in one line: attention biases (megatron-core would put them on the MLPs too), sliding windows,
layer types other than linear and full attention, value heads that are not a multiple of the key heads.
"""

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.decoder import (
    DECODER_KEYS, QWEN_DENSE_LAYER_KEYS, parse_decoder_config, qwen_dense_layers)
from megatron_patch.models.description.arch import (
    Arch, FULL_ATTENTION, LINEAR_ATTENTION, LinearAttentionShape, require)
from megatron_patch.models.description.config_checks import (
    Flag, MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_WIDTH, Names, Real, Whole)
from megatron_patch.models.description.hf_defaults import reads_hf_defaults

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).
# So is qwen3_next.layers, which imports them at its top: when a model is built.

# transformers' Qwen3NextConfig defaults where the family's fallbacks differ (hf_defaults.py): a config.json without
# num_experts has 512 of them (every layer but mlp_only_layers MoE) and a gated shared expert of 512.
HF_DEFAULTS = {"qwen3_next": {"head_dim": 256, "max_position_embeddings": 32768, "num_key_value_heads": 2,
                              "num_experts": 512, "shared_expert_intermediate_size": 512}}


def layer_types_of(raw: dict, layers: int) -> tuple[str, ...]:
    interval = raw.get("full_attention_interval") or 4
    types = raw.get("layer_types") or [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
    if len(types) != layers or set(types) - {FULL_ATTENTION, LINEAR_ATTENTION}:
        raise UserError(f"config.json layer_types must name {layers} layers, each linear_attention or full_attention: "
                        f"found {types}")
    return tuple(types)


def linear_attention_of(raw: dict) -> LinearAttentionShape:
    shape = LinearAttentionShape(
        num_key_heads=require(raw, "linear_num_key_heads"), num_value_heads=require(raw, "linear_num_value_heads"),
        key_head_dim=require(raw, "linear_key_head_dim"), value_head_dim=require(raw, "linear_value_head_dim"),
        conv_kernel=require(raw, "linear_conv_kernel_dim"))
    if shape.num_value_heads % shape.num_key_heads:
        raise UserError(f"linear_num_value_heads={shape.num_value_heads} is not a multiple of linear_num_key_heads="
                        f"{shape.num_key_heads}: each key head serves a whole number of value heads")
    return shape


def parse_hybrid(raw: dict, family: str) -> Arch:
    """What Qwen3-Next and Qwen3.5's language model share: the hybrid attention layers and the norms."""
    if raw.get("attention_bias"):
        raise UserError(f"attention_bias=true is not supported for {family}: megatron-core would put biases on the "
                        "MLPs too")
    # use_sliding_window is no field of transformers' Qwen3-Next or Qwen3.5, whose full-attention layers never slide
    arch = parse_decoder_config(raw, family, qkv_bias=False, partial_rope=0.25)
    return dataclasses.replace(arch, layer_types=layer_types_of(raw, arch.num_layers),
                               linear_attention=linear_attention_of(raw))


def with_moe(arch: Arch, raw: dict) -> Arch:
    """Qwen3-Next's MoE block: routed experts, a sigmoid-gated shared expert, dense layers where config says."""
    shared = raw.get("shared_expert_intermediate_size") or 0
    if raw.get("shared_expert_intermediate_size") == 0:
        # transformers still builds the block, zero rows wide, with its gate: the weight table's refusal of those
        # tensors named no config field (the cfg audit)
        raise UserError(f"shared_expert_intermediate_size=0 is not supported for {arch.family}: transformers builds a "
                        "shared expert zero rows wide and its gate, which this model has no block to hold")
    return dataclasses.replace(
        arch, num_experts=require(raw, "num_experts", aliases=("num_local_experts",)),
        moe_topk=require(raw, "num_experts_per_tok"), moe_ffn_hidden_size=require(raw, "moe_intermediate_size"),
        shared_expert_ffn_hidden_size=shared, shared_expert_gate=shared > 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)), dense_layers=qwen_dense_layers(raw))


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    arch = parse_hybrid(raw, "qwen3_next")
    return with_moe(arch, raw) if (raw.get("num_experts") or 0) > 0 else arch


def num_mtp_layers(raw: dict) -> int:
    return int(raw.get("mtp_num_hidden_layers") or 0)


def mtp_prefixes(arch: Arch, count: int) -> tuple[str, ...]:
    return ("mtp.",)


def transformer_config_kwargs(arch: Arch) -> dict:
    # megatron-core is imported here, when a model is built, not when the converter reads the family
    from megatron_patch.models.qwen3_next.layers import config_kwargs

    return dict(qk_layernorm=True, attention_output_gate=True, moe_router_pre_softmax=not arch.norm_topk_prob,
                **config_kwargs(arch))


def layer_spec(arch: Arch, config, use_te: bool, vp_stage, core_attention: str | None):
    from megatron_patch.models.qwen3_next.layers import layer_spec as hybrid_layer_spec

    return hybrid_layer_spec(arch, config, use_te, vp_stage, core_attention)


def mtp_block_spec(arch: Arch, config, spec, use_te: bool, vp_stage):
    from megatron_patch.models.qwen3_next.layers import mtp_block_spec as hybrid_mtp_block_spec

    return hybrid_mtp_block_spec(arch, config, spec, use_te, vp_stage)


# A tiny Qwen3-Next: a Gated DeltaNet layer (2 key heads serving 4 value heads) then a gated full-attention
# one (RoPE on a quarter of each head, head_dim apart from hidden/heads), 4 experts (top-2 renormalised) and
# a gated shared expert in both; 2 layers so that PP=2 splits them by kind.
TINY_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "vocab_size": 200, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "partial_rotary_factor": 0.25,
    "layer_types": ["linear_attention", "full_attention"], "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "mtp_num_hidden_layers": 0,
    "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000000.0,
    "tie_word_embeddings": False, "attention_bias": False, "router_aux_loss_coef": 0.001,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {
    **DECODER_KEYS, **QWEN_DENSE_LAYER_KEYS, "attention_bias": Flag(), "use_sliding_window": Flag(),
    "layer_types": Names(MAX_LAYERS), "full_attention_interval": Whole(1, MAX_LAYERS),
    "linear_num_key_heads": Whole(1, MAX_HEADS), "linear_num_value_heads": Whole(1, MAX_HEADS),
    "linear_key_head_dim": Whole(1, MAX_WIDTH), "linear_value_head_dim": Whole(1, MAX_WIDTH),
    "linear_conv_kernel_dim": Whole(1, MAX_WIDTH), "num_experts": Whole(0, MAX_EXPERTS),
    "num_local_experts": Whole(0, MAX_EXPERTS), "moe_intermediate_size": Whole(1, MAX_WIDTH),
    "shared_expert_intermediate_size": Whole(0, MAX_WIDTH), "norm_topk_prob": Flag(),
    "mtp_num_hidden_layers": Whole(0, MAX_LAYERS), "num_experts_per_tok": Whole(1, MAX_EXPERTS),
    "router_aux_loss_coef": Real(0, closed=True),
}

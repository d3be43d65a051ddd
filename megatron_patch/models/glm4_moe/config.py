"""GLM-4.5 / 4.6 / 4.7 (``glm4_moe``) config.json -> Arch and the megatron-core settings of its attention
and MoE.

GQA attention with q/k/v biases (``attention_bias``; the output projection has none), optional per-head
q/k RMSNorms (``use_qk_norm``: GLM-4.5 has them, GLM-4.5-Air not) and RoPE on the first half of each head
(``partial_rotary_factor``, 0.5 in every release: megatron-core's ``rotary_percent``); the first
``first_k_dense_replace`` layers dense, then DeepSeek-V3-style MoE layers: sigmoid scores with a score
correction bias that only chooses experts, optionally limited to groups, the top-k renormalised and
scaled by ``routed_scaling_factor``, plus ungated shared experts. Multi-token-prediction layers follow the
decoder's in the hub checkpoints (DeepSeek-V3's layout, ``models/blocks/mtp.py``).

What megatron-core would compute otherwise is refused in one line: top-k without renormalisation
(megatron-core renormalises sigmoid top-k), groups scored other than by their top two experts, an
activation other than SwiGLU.
"""

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.decoder import DECODER_KEYS, parse_decoder_config
from megatron_patch.models.blocks.routing import check_renormalised, expert_groups, sigmoid_routing_kwargs
from megatron_patch.models.description.arch import Arch, require
from megatron_patch.models.description.config_checks import MAX_EXPERTS, MAX_LAYERS, MAX_WIDTH, Flag, Real, Whole
from megatron_patch.models.description.hf_defaults import config_as_transformers_reads, reads_hf_defaults

# transformers' Glm4MoeConfig defaults where the family's fallbacks differ (hf_defaults.py): a config.json without
# them has a shared expert and its first layer dense.
HF_DEFAULTS = {"glm4_moe": {"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "num_key_value_heads": 8,
                            "n_shared_experts": 1, "first_k_dense_replace": 1}}


def routing_of(raw: dict) -> dict:
    """The routing fields, checked against what megatron-core computes exactly (``blocks/routing.py``)."""
    check_renormalised(raw, raw.get("norm_topk_prob", True))
    return {"groups": expert_groups(raw, top_per_group=2), "scale": float(raw.get("routed_scaling_factor", 1.0))}


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    routing_of(raw)
    if raw.get("mlp_bias"):
        raise UserError("mlp_bias=true is not supported for GLM-4.5 models: their MLPs have no biases")
    # transformers' Glm4MoeConfig rotates half of each head when config.json does not say
    arch = parse_decoder_config(raw, "glm4_moe", qkv_bias=bool(raw.get("attention_bias", False)), partial_rope=0.5)
    moe_ffn = require(raw, "moe_intermediate_size")
    return dataclasses.replace(
        arch,
        num_experts=require(raw, "n_routed_experts", aliases=("num_local_experts",)),
        moe_topk=require(raw, "num_experts_per_tok"), moe_ffn_hidden_size=moe_ffn,
        shared_expert_ffn_hidden_size=(raw.get("n_shared_experts") or 0) * moe_ffn,
        norm_topk_prob=True, router_aux_loss_coef=float(raw.get("router_aux_loss_coef") or 0.0),
        dense_layers=tuple(range(min(raw.get("first_k_dense_replace") or 0, arch.num_layers))),
    )


def transformer_config_kwargs(arch: Arch) -> dict:
    raw = config_as_transformers_reads(arch.hf_config, HF_DEFAULTS)
    routing = routing_of(raw)
    return dict(
        qk_layernorm=bool(raw.get("use_qk_norm", False)),
        **sigmoid_routing_kwargs(routing["groups"], routing["scale"]),
    )


# A tiny GLM-4.5: q/k/v biases, q/k norms, RoPE on half of each head (head_dim 32 apart from hidden/heads),
# layer 0 dense, then 4 routed experts (top-2, sigmoid with a correction bias, scaled by 2.5) and a shared
# expert; 2 layers so that PP=2 splits it.
TINY_CONFIG = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
    "vocab_size": 200, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": True,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
    "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
}


# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {
    **DECODER_KEYS, "attention_bias": Flag(), "first_k_dense_replace": Whole(0, MAX_LAYERS),
    "moe_intermediate_size": Whole(1, MAX_WIDTH), "n_routed_experts": Whole(0, MAX_EXPERTS),
    "n_shared_experts": Whole(0, MAX_EXPERTS), "n_group": Whole(1, MAX_EXPERTS), "topk_group": Whole(1, MAX_EXPERTS),
    "norm_topk_prob": Flag(), "routed_scaling_factor": Real(0), "num_nextn_predict_layers": Whole(0, MAX_LAYERS),
    "num_mtp_layers": Whole(0, MAX_LAYERS), "num_experts_per_tok": Whole(1, MAX_EXPERTS),
    "router_aux_loss_coef": Real(0, closed=True), "use_qk_norm": Flag(),
}

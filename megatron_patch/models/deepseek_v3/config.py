"""DeepSeek-V3 / V2 config.json -> Arch and the megatron-core settings of multi-latent attention and
DeepSeekMoE.

What megatron-core computes differently from transformers is refused in one line instead of being
converted into a model that routes or attends otherwise: sigmoid routing without renormalising the
top-k (megatron-core always renormalises it), group-limited routing whose group score is not the sum
of the top two experts (V3) or the best one (V2's group_limited_greedy), RoPE on halves rather than
interleaved pairs, attention biases.
"""

import dataclasses
import math

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.decoder import DECODER_KEYS, parse_decoder_config
from megatron_patch.models.blocks.routing import check_renormalised, expert_groups
from megatron_patch.models.description.arch import Arch, MLAShape, require, yarn_attention_factor, yarn_mscale
from megatron_patch.models.description.config_checks import MAX_EXPERTS, MAX_LAYERS, MAX_WIDTH, Flag, Real, Text, Whole
from megatron_patch.models.description.hf_defaults import config_as_transformers_reads, reads_hf_defaults


# Model types read as DeepSeek-V3: Kimi-K2's config.json says kimi_k2 (with remote code in auto_map, never
# run), its architecture is DeepseekV3ForCausalLM with its own values (384 experts, 64 heads).
V3_TYPES = ("deepseek_v3", "kimi_k2")

# transformers' DeepseekV3Config (Kimi-K2's too) and DeepseekV2Config defaults where the family's fallbacks differ
# (hf_defaults.py): a V3 config.json without q_lora_rank has a query LoRA of 1536, one shared expert, 8 groups of
# experts (top 4), the first 3 layers dense. deepseek_v32's tables name every field of these too, as its configs are
# read as V3's.
_V3_DEFAULTS = {"q_lora_rank": 1536, "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                "first_k_dense_replace": 3, "num_key_value_heads": 128}
HF_DEFAULTS = {
    "deepseek_v3": _V3_DEFAULTS, "kimi_k2": _V3_DEFAULTS,
    "deepseek_v2": {"q_lora_rank": 1536, "n_shared_experts": 2, "max_position_embeddings": 2048},
}


def routing_of(raw: dict) -> dict:
    """The routing fields, checked against what megatron-core can compute exactly."""
    v3 = raw.get("model_type") in V3_TYPES
    if v3:
        # transformers (5.24) builds V3 and Kimi-K2 with DeepseekV3TopkRouter, which reads neither field: always
        # sigmoid scores, the e_score_correction_bias, groups scored by their top two experts (as deepseek_v32's as_v3)
        raw = raw | {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    method = raw.get("topk_method", "greedy")
    score = raw.get("scoring_func", "softmax")
    norm = bool(raw.get("norm_topk_prob", v3))
    if score not in ("sigmoid", "softmax"):
        raise UserError(f"scoring_func '{score}' is not supported: choose sigmoid or softmax")
    if score == "sigmoid":
        check_renormalised(raw, norm)
    if score == "softmax" and norm:
        raise UserError("norm_topk_prob=true with softmax routing is not supported for DeepSeek-V2 models here")
    if method in ("noaux_tc", "group_limited_greedy"):
        # transformers scores a group by the sum of its top two experts (V3) or by the best one (V2's
        # group_limited_greedy)
        groups, group_topk = expert_groups(raw, top_per_group=2 if method == "noaux_tc" else 1)
    elif method == "greedy":
        groups, group_topk = None, None
    else:
        raise UserError(f"topk_method '{method}' is not supported: choose noaux_tc, greedy or group_limited_greedy")
    return {"score": score, "expert_bias": method == "noaux_tc", "groups": groups, "group_topk": group_topk,
            "scale": float(raw.get("routed_scaling_factor", 1.0)), "norm": norm}


def check_mla_rope(rope: dict | None) -> None:
    """megatron-core's multi-latent attention rotates with plain RoPE or its YaRN, which rounds the correction
    range and scales cos/sin by the ratio of the two mscales (``transformer_config_kwargs``): any other RoPE, an
    ``attention_factor`` other than 1 where every YaRN factor is 1, or ``truncate=false`` would convert into a
    model that computes otherwise, so each is refused."""
    kind = (rope or {}).get("rope_type", "default")
    if kind not in ("default", "yarn"):
        raise UserError(f"RoPE type '{kind}' is not supported for multi-latent attention: megatron-core's MLA takes "
                        "default RoPE or YaRN")
    if kind != "yarn":
        return
    if rope.get("truncate") is False:
        raise UserError("YaRN truncate=false is not supported for multi-latent attention: megatron-core rounds the "
                        "correction range, as transformers does with truncate=true (the default)")
    given = rope.get("attention_factor")
    if given is not None and rope["factor"] <= 1 and not math.isclose(given, 1.0, rel_tol=1e-6):
        raise UserError(f"YaRN attention_factor={given:g} with factor={rope['factor']:g} is not supported for "
                        "multi-latent attention: megatron-core scales cos/sin by 1 where factor is at most 1 (drop "
                        "attention_factor, or set it to 1)")


def mcore_yarn_mscale(rope: dict) -> float:
    """The ``mscale`` that makes megatron-core's cos/sin factor, the ratio of ``mscale``'s YaRN factor to
    ``mscale_all_dim``'s, the one transformers applies (``yarn_attention_factor``: config.json's attention_factor,
    else that ratio where both are given, else the plain YaRN factor). ``mscale_all_dim`` goes to megatron-core as
    given: both take it for the softmax correction, whether or not ``mscale`` is given."""
    factor, all_dim = rope["factor"], rope.get("mscale_all_dim") or 0.0
    if rope.get("attention_factor") is None and rope.get("mscale") and all_dim:
        return float(rope["mscale"])  # transformers' ratio itself
    if factor <= 1:
        return 1.0  # every YaRN factor is 1 there (check_mla_rope refuses an attention_factor that is not)
    # yarn_mscale(factor, m) / yarn_mscale(factor, all_dim) == wanted, solved for m
    return (yarn_attention_factor(rope) * yarn_mscale(factor, all_dim) - 1.0) / (0.1 * math.log(factor))


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    heads = require(raw, "num_attention_heads")
    if (raw.get("num_key_value_heads") or heads) != heads:
        raise UserError("multi-latent attention has one key/value head per query head: num_key_value_heads must "
                        f"equal num_attention_heads ({heads})")
    if raw.get("attention_bias"):
        raise UserError("attention_bias=true is not supported for DeepSeek models")
    if raw.get("rope_interleave", True) is False:
        raise UserError("rope_interleave=false (RoPE on halves) is not supported: megatron-core's multi-latent "
                        "attention rotates interleaved pairs, as DeepSeek's released checkpoints do")
    if (raw.get("moe_layer_freq") or 1) != 1:
        raise UserError(f"moe_layer_freq={raw['moe_layer_freq']} is not supported: every layer after "
                        "first_k_dense_replace must be an MoE layer")
    mla = MLAShape(q_lora_rank=raw.get("q_lora_rank"), kv_lora_rank=require(raw, "kv_lora_rank"),
                   qk_nope_head_dim=require(raw, "qk_nope_head_dim"), qk_rope_head_dim=require(raw, "qk_rope_head_dim"),
                   v_head_dim=require(raw, "v_head_dim"))
    routing = routing_of(raw)
    arch = parse_decoder_config(raw | {"head_dim": mla.v_head_dim}, "deepseek_v3", qkv_bias=False)
    check_mla_rope(arch.rope_scaling)
    experts = require(raw, "n_routed_experts", aliases=("num_local_experts", "num_experts"))
    moe_ffn = require(raw, "moe_intermediate_size")
    if raw.get("n_shared_experts") == 0:
        # transformers builds the shared expert all the same, of width 0, and saves its (0, hidden) tensors
        raise UserError("n_shared_experts=0 (an MoE layer without a shared expert) is not supported for this family: "
                        "every DeepSeek-V3-style model released has one")
    return dataclasses.replace(
        arch, mla=mla,
        num_experts=experts, moe_topk=require(raw, "num_experts_per_tok"), moe_ffn_hidden_size=moe_ffn,
        shared_expert_ffn_hidden_size=(raw.get("n_shared_experts") or 0) * moe_ffn, shared_expert_gate=False,
        norm_topk_prob=routing["norm"], router_aux_loss_coef=float(raw.get("aux_loss_alpha", 0.0)),
        dense_layers=tuple(range(min(raw.get("first_k_dense_replace") or 0, arch.num_layers))),
    )


def transformer_config_kwargs(arch: Arch) -> dict:
    raw, mla = config_as_transformers_reads(arch.hf_config, HF_DEFAULTS), arch.mla
    routing = routing_of(raw)
    rope = arch.rope_scaling or {}
    kwargs = dict(
        multi_latent_attention=True, q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim, qk_pos_emb_head_dim=mla.qk_rope_head_dim, v_head_dim=mla.v_head_dim,
        kv_channels=mla.v_head_dim,
        # The latent norms (q_a_layernorm, kv_a_layernorm): megatron-core builds them under qk_layernorm.
        qk_layernorm=True,
        rotary_base=arch.rope_theta, rope_type="yarn" if rope.get("rope_type") == "yarn" else "rope",
        moe_router_score_function=routing["score"], moe_router_enable_expert_bias=routing["expert_bias"],
        moe_router_num_groups=routing["groups"], moe_router_group_topk=routing["group_topk"],
        moe_router_topk_scaling_factor=routing["scale"] if routing["scale"] != 1.0 else None,
        moe_router_pre_softmax=routing["score"] == "softmax",
        moe_router_load_balancing_type="seq_aux_loss" if raw.get("seq_aux") else "aux_loss",
    )
    if rope.get("rope_type") == "yarn":
        # transformers scales cos/sin by mscale/mscale_all_dim only when both are given, else by the plain YaRN
        # factor (or config.json's attention_factor); megatron-core always takes the ratio: mcore_yarn_mscale
        # picks its mscale to match. The softmax correction (mscale_all_dim) is the same in both.
        kwargs.update(rotary_scaling_factor=rope["factor"],
                      original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                      beta_fast=rope.get("beta_fast") or 32.0, beta_slow=rope.get("beta_slow") or 1.0,
                      mscale=mcore_yarn_mscale(rope), mscale_all_dim=rope.get("mscale_all_dim") or 0.0)
    else:
        kwargs.update(rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    return kwargs


# A tiny DeepSeek-V3: q-LoRA, YaRN with a softmax-scale correction (mscale_all_dim) and a cos/sin factor
# (mscale != mscale_all_dim), sigmoid routing with a score-correction bias over 4 groups of 2 experts
# (top-2 groups, top-4 experts), a shared expert, the first layer dense; 3 layers so that PP=3 splits it.
TINY_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 200, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8},
    "rope_interleave": True, "tie_word_embeddings": False, "attention_bias": False, "num_nextn_predict_layers": 0,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
}


# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {
    **DECODER_KEYS, "attention_bias": Flag(), "q_lora_rank": Whole(1, MAX_WIDTH), "kv_lora_rank": Whole(1, MAX_WIDTH),
    "qk_nope_head_dim": Whole(1, MAX_WIDTH), "qk_rope_head_dim": Whole(1, MAX_WIDTH),
    "v_head_dim": Whole(1, MAX_WIDTH), "rope_interleave": Flag(), "n_routed_experts": Whole(0, MAX_EXPERTS),
    "num_local_experts": Whole(0, MAX_EXPERTS), "num_experts": Whole(0, MAX_EXPERTS),
    "n_shared_experts": Whole(0, MAX_EXPERTS), "moe_intermediate_size": Whole(1, MAX_WIDTH),
    "first_k_dense_replace": Whole(0, MAX_LAYERS), "moe_layer_freq": Whole(1, MAX_LAYERS),
    "n_group": Whole(1, MAX_EXPERTS), "topk_group": Whole(1, MAX_EXPERTS), "norm_topk_prob": Flag(),
    "routed_scaling_factor": Real(0), "scoring_func": Text(), "topk_method": Text(), "seq_aux": Flag(),
    "aux_loss_alpha": Real(0, closed=True), "num_nextn_predict_layers": Whole(0, MAX_LAYERS),
    "num_mtp_layers": Whole(0, MAX_LAYERS), "num_experts_per_tok": Whole(1, MAX_EXPERTS),
    "router_aux_loss_coef": Real(0, closed=True),
}

"""DeepSeek HF <-> MCore weight table: multi-latent attention, dense first layers, DeepSeekMoE
(router with its score-correction bias, routed experts, ungated shared experts), and, when converted
with them, the multi-token-prediction layers.

The down projections (q_a_proj, kv_a_proj_with_mqa) are whole on every TP rank with the TE spec, row
split with megatron-core's local spec; q_b_proj, q_proj and kv_b_proj are split by heads.
"""

import dataclasses

from megatron_patch.models.arch import Arch
from megatron_patch.models.deepseek_v3.config import routing_of
from megatron_patch.models.decoder import (
    HF_LAYER, MC_LAYER, dense_mlp_rules, embedding_and_head_rules, moe_rules, shared_expert_rules)
from megatron_patch.models.mapping import COLUMN, REPLICATED, ROW, LayerKind, LoraSite, Rule


def attention_rules(arch: Arch) -> list[Rule]:
    attn, mc = f"{HF_LAYER}.self_attn", f"{MC_LAYER}.self_attention"
    # LoRA: the down and up projections are the attention's input side ("qkv"), o_proj its output ("proj").
    qkv = LoraSite("qkv")
    rules = [Rule(f"{MC_LAYER}.input_layernorm.weight", f"{HF_LAYER}.input_layernorm.weight", REPLICATED)]
    if arch.mla.q_lora_rank is None:
        rules.append(Rule(f"{mc}.linear_q_proj.weight", f"{attn}.q_proj.weight", COLUMN, lora=qkv))
    else:
        rules += [
            Rule(f"{mc}.linear_q_down_proj.weight", f"{attn}.q_a_proj.weight", REPLICATED, local_split=COLUMN, lora=qkv),
            Rule(f"{mc}.linear_q_up_proj.layer_norm_weight", f"{attn}.q_a_layernorm.weight", REPLICATED),
            Rule(f"{mc}.linear_q_up_proj.weight", f"{attn}.q_b_proj.weight", COLUMN, lora=qkv),
        ]
    return rules + [
        Rule(f"{mc}.linear_kv_down_proj.weight", f"{attn}.kv_a_proj_with_mqa.weight", REPLICATED, local_split=COLUMN,
             lora=qkv),
        Rule(f"{mc}.linear_kv_up_proj.layer_norm_weight", f"{attn}.kv_a_layernorm.weight", REPLICATED),
        Rule(f"{mc}.linear_kv_up_proj.weight", f"{attn}.kv_b_proj.weight", COLUMN, lora=qkv),
        Rule(f"{mc}.linear_proj.weight", f"{attn}.o_proj.weight", ROW, lora=LoraSite("proj")),
    ]


def deepseek_moe_rules(arch: Arch) -> list[Rule]:
    moe = LayerKind.MOE
    rules = moe_rules(router="mlp.gate.weight", expert="mlp.experts.{expert}",
                      gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight")
    if routing_of(arch.hf_config)["expert_bias"]:
        rules.append(Rule(f"{MC_LAYER}.mlp.router.expert_bias", f"{HF_LAYER}.mlp.gate.e_score_correction_bias",
                          REPLICATED, layers=moe, dtype="float32"))
    if arch.shared_expert_ffn_hidden_size:
        rules += shared_expert_rules("mlp.shared_experts")
    return rules


MTP_LAYER = "mtp.layers.{layer}"


def mtp_rules(arch: Arch) -> list[Rule]:
    """Multi-token-prediction layers (HF: the layers after the decoder's) in megatron-core's MTP block:
    their own norms and eh_proj around a full decoder layer; the embedding and output head they use
    are the model's own (the HF copies are ``hf_copies``). They take no LoRA adapters: transformers does not
    build them, so peft cannot put any there."""
    layer = [dataclasses.replace(r, mcore=r.mcore.replace(MC_LAYER, f"{MTP_LAYER}.transformer_layer"), mtp=True,
                                 lora=None)
             for r in attention_rules(arch) + deepseek_moe_rules(arch)]
    return layer + [
        Rule(f"{MTP_LAYER}.enorm.weight", f"{HF_LAYER}.enorm.weight", REPLICATED, mtp=True),
        Rule(f"{MTP_LAYER}.hnorm.weight", f"{HF_LAYER}.hnorm.weight", REPLICATED, mtp=True),
        Rule(f"{MTP_LAYER}.eh_proj.weight", f"{HF_LAYER}.eh_proj.weight", COLUMN, mtp=True),
        Rule(f"{MTP_LAYER}.final_layernorm.weight", f"{HF_LAYER}.shared_head.norm.weight", REPLICATED, mtp=True),
    ]


def mtp_copies(arch: Arch) -> dict[str, str]:
    """HF tensors of each MTP layer that copy the model's embedding and output head."""
    out = {}
    for k in range(arch.mtp_layers):
        hf = HF_LAYER.replace("{layer}", str(arch.num_layers + k))
        out[f"{hf}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"{hf}.shared_head.head.weight"] = "lm_head.weight"
    return out


def weight_rules(arch: Arch) -> list[Rule]:
    return (embedding_and_head_rules() + attention_rules(arch) + deepseek_moe_rules(arch)
            + (dense_mlp_rules() if arch.dense_layers else []) + (mtp_rules(arch) if arch.mtp_layers else []))

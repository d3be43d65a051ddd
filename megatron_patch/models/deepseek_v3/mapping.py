"""DeepSeek HF <-> MCore weight table: multi-latent attention, dense first layers, DeepSeekMoE
(router with its score-correction bias, routed experts, ungated shared experts), and, when converted
with them, the multi-token-prediction layers.

The down projections (q_a_proj, kv_a_proj_with_mqa) are whole on every TP rank with the TE spec, row
split with megatron-core's local spec; q_b_proj, q_proj and kv_b_proj are split by heads.
"""

from megatron_patch.models.blocks.decoder import (
    HF_LAYER, MC_LAYER, dense_mlp_rules, embedding_and_head_rules, expert_bias_rule, moe_rules, shared_expert_rules)
from megatron_patch.models.blocks.mtp import mtp_rules
from megatron_patch.models.deepseek_v3.config import HF_DEFAULTS, routing_of
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.hf_defaults import config_as_transformers_reads
from megatron_patch.models.mapping import COLUMN, REPLICATED, ROW, LoraSite, Rule


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
    rules = moe_rules(router="mlp.gate.weight", expert="mlp.experts.{expert}",
                      gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight")
    if routing_of(config_as_transformers_reads(arch.hf_config, HF_DEFAULTS))["expert_bias"]:
        rules.append(expert_bias_rule())
    return rules + (shared_expert_rules() if arch.shared_expert_ffn_hidden_size else [])


def weight_rules(arch: Arch) -> list[Rule]:
    layer = attention_rules(arch) + deepseek_moe_rules(arch)
    return (embedding_and_head_rules() + layer + (dense_mlp_rules() if arch.dense_layers else [])
            + (mtp_rules(layer) if arch.mtp_layers else []))

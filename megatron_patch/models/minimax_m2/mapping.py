"""MiniMax-M2 HF <-> MCore weight table: GQA with whole-width q/k norms, and in
every layer the router, its score-correction bias and the experts (w1 = gate, w3 = up, w2 = down), under
the hub's ``block_sparse_moe`` names."""

from megatron_patch.models.blocks.decoder import (
    HF_LAYER, MC_LAYER, attention_rules, embedding_and_head_rules, expert_bias_rule, moe_rules)
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.mapping import REPLICATED, Rule


def whole_width_qk_norm_rules() -> list[Rule]:
    """q_norm [heads * head_dim] and k_norm [kv_heads * head_dim], whole on every TP rank (layers.py)."""
    attn = f"{HF_LAYER}.self_attn"
    return [
        Rule(f"{MC_LAYER}.self_attention.q_layernorm.weight", f"{attn}.q_norm.weight", REPLICATED),
        Rule(f"{MC_LAYER}.self_attention.k_layernorm.weight", f"{attn}.k_norm.weight", REPLICATED),
    ]


def weight_rules(arch: Arch) -> list[Rule]:
    moe = moe_rules(router="block_sparse_moe.gate.weight", expert="block_sparse_moe.experts.{expert}",
                    gate="w1.weight", up="w3.weight", down="w2.weight")
    return (embedding_and_head_rules() + attention_rules(qkv_bias=False) + whole_width_qk_norm_rules() + moe
            + [expert_bias_rule("block_sparse_moe.e_score_correction_bias")])

"""Qwen3-MoE HF <-> MCore weight table: Qwen3 attention, router and experts, dense MLPs where config says."""

from megatron_patch.models.blocks.decoder import (
    attention_rules, dense_mlp_rules, embedding_and_head_rules, moe_rules, qk_norm_rules)
from megatron_patch.models.description.arch import Arch


def weight_rules(arch: Arch):
    rules = embedding_and_head_rules() + attention_rules(qkv_bias=False) + qk_norm_rules() + moe_rules(
        router="mlp.gate.weight", expert="mlp.experts.{expert}",
        gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight")
    return rules + (dense_mlp_rules() if arch.has_dense_layers else [])

"""Qwen2-MoE HF <-> MCore weight table: attention with bias, router, experts, gated shared expert."""

from megatron_patch.models.blocks.decoder import (
    attention_rules, dense_mlp_rules, embedding_and_head_rules, moe_rules, shared_expert_rules)
from megatron_patch.models.description.arch import Arch


def weight_rules(arch: Arch):
    rules = embedding_and_head_rules() + attention_rules(arch.qkv_bias) + moe_rules(
        router="mlp.gate.weight", expert="mlp.experts.{expert}",
        gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight")
    if arch.has_dense_layers:
        rules += dense_mlp_rules()
    if arch.shared_expert_ffn_hidden_size:
        rules += shared_expert_rules("mlp.shared_expert", gate="mlp.shared_expert_gate.weight")
    return rules

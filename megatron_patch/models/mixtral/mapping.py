"""Mixtral HF <-> MCore weight table: w1 = gate, w3 = up, w2 = down for each expert."""

from megatron_patch.models.blocks.decoder import attention_rules, embedding_and_head_rules, moe_rules
from megatron_patch.models.description.arch import Arch


def weight_rules(arch: Arch):
    return embedding_and_head_rules() + attention_rules(qkv_bias=False) + moe_rules(
        router="block_sparse_moe.gate.weight", expert="block_sparse_moe.experts.{expert}",
        gate="w1.weight", up="w3.weight", down="w2.weight")

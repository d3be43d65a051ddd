"""Qwen2 HF <-> MCore weight table: Llama's plus q/k/v biases."""

from megatron_patch.models.blocks.decoder import attention_rules, dense_mlp_rules, embedding_and_head_rules
from megatron_patch.models.description.arch import Arch


def weight_rules(arch: Arch):
    return embedding_and_head_rules() + attention_rules(qkv_bias=True) + dense_mlp_rules()

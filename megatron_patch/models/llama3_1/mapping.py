"""Llama HF <-> MCore weight table (with the linear biases when config.json has them)."""

from megatron_patch.models.blocks.decoder import attention_rules, dense_mlp_rules, embedding_and_head_rules
from megatron_patch.models.description.arch import Arch


def weight_rules(arch: Arch):
    return (embedding_and_head_rules() + attention_rules(qkv_bias=arch.linear_bias, proj_bias=arch.linear_bias)
            + dense_mlp_rules(bias=arch.linear_bias))

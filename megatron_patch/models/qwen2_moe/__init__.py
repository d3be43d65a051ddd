"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): routed experts plus a sigmoid-gated shared expert."""

from megatron_patch.models.family import ModelFamily
from megatron_patch.models.qwen2_moe.config import TINY_CONFIG, parse_config, transformer_config_kwargs
from megatron_patch.models.qwen2_moe.mapping import weight_rules

FAMILY = ModelFamily(
    name="qwen2_moe", hf_model_types=("qwen2_moe",), hf_architecture="Qwen2MoeForCausalLM",
    parse_config=parse_config, weight_rules=weight_rules,
    transformer_config_kwargs=transformer_config_kwargs, tiny_config=TINY_CONFIG,
)

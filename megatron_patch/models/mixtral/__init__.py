"""Mixtral (8x7B, 8x22B): sparse MoE with top-2 routing, no shared expert."""

from megatron_patch.models.family import ModelFamily
from megatron_patch.models.mixtral.config import TINY_CONFIG, parse_config, transformer_config_kwargs
from megatron_patch.models.mixtral.mapping import weight_rules

FAMILY = ModelFamily(
    name="mixtral", hf_model_types=("mixtral",), hf_architecture="MixtralForCausalLM",
    parse_config=parse_config, weight_rules=weight_rules,
    transformer_config_kwargs=transformer_config_kwargs, tiny_config=TINY_CONFIG,
)

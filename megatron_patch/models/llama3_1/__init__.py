"""Llama 3 and 3.1 (dense, GQA, llama3 RoPE scaling)."""

from megatron_patch.models.family import ModelFamily
from megatron_patch.models.llama3_1.config import TINY_CONFIG, parse_config
from megatron_patch.models.llama3_1.mapping import weight_rules

FAMILY = ModelFamily(
    name="llama3_1", hf_model_types=("llama",), hf_architecture="LlamaForCausalLM",
    parse_config=parse_config, weight_rules=weight_rules, tiny_config=TINY_CONFIG,
)

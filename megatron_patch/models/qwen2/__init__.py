"""Qwen2 and Qwen2.5 (dense, q/k/v bias, tied embeddings on small models)."""

from megatron_patch.models.family import ModelFamily
from megatron_patch.models.qwen2.config import TINY_CONFIG, parse_config
from megatron_patch.models.qwen2.mapping import weight_rules

FAMILY = ModelFamily(
    name="qwen2", hf_model_types=("qwen2",), hf_architecture="Qwen2ForCausalLM",
    parse_config=parse_config, weight_rules=weight_rules, tiny_config=TINY_CONFIG,
)

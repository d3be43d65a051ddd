"""GLM-4.5 / 4.6 / 4.7 and GLM-4.5-Air: partial RoPE, q/k/v biases, DeepSeek-style MoE, MTP layers."""

from megatron_patch.models.blocks.mtp import mtp_copies, num_mtp_layers
from megatron_patch.models.description.family import HFModules, ModelFamily, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.glm4_moe.config import CONFIG_KEYS, TINY_CONFIG, parse_config, transformer_config_kwargs
from megatron_patch.models.glm4_moe.mapping import weight_rules
from megatron_patch.models.glm4_moe.presets import PRESETS
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="glm4_moe", summary="GLM-4.5 / 4.6 / 4.7, GLM-4.5-Air: partial RoPE, q/k/v bias, optional q/k norm, "
                             "sigmoid routing with a correction bias, shared experts, first layers dense, MTP layers",
    hf_model_types=("glm4_moe",), hf_architectures=("Glm4MoeForCausalLM",),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, launcher_parallel_args=("ETP", "EP"),
    hf_modules=HFModules(router="mlp.gate"), hf_mtp_layers=num_mtp_layers, hf_copies=mtp_copies,
    test_layouts=TestLayouts(
        parity=(L(), L(tp=2, ep=2), L(pp=2)),
        round_trips=(("legacy", L(tp=2, pp=2, ep=2), "fp32"), ("torch_dist", L(tp=2, ep=2, etp=1), "bf16"))),
))

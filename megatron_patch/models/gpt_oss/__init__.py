"""gpt-oss (20b, 120b): attention sinks, sliding windows, biases, clamped SwiGLU experts, MXFP4 hub weights."""

from megatron_patch.models.description.family import HFModules, ModelFamily, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.gpt_oss.config import (
    CONFIG_KEYS, TINY_CONFIG, layer_spec, parse_config, transformer_config_kwargs)
from megatron_patch.models.gpt_oss.mapping import hf_stacked, weight_rules
from megatron_patch.models.gpt_oss.presets import PRESETS
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="gpt_oss", summary="gpt-oss: attention sinks, sliding-window and full layers (layer_types), biases, router "
                            "and expert biases, clamped SwiGLU with a linear offset, YaRN; MXFP4 hub weights",
    hf_model_types=("gpt_oss",), hf_architectures=("GptOssForCausalLM",),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, launcher_parallel_args=("ETP", "EP"),
    hf_modules=HFModules(router="mlp.router"), hf_stacked=hf_stacked, layer_spec=layer_spec,
    skeleton_from_megatron_core="its sliding-window layers and attention sinks are beyond the derivation's rules",
    test_layouts=TestLayouts(
        # megatron-core's experts take biases only at ETP=1 (and legacy files need ETP = TP)
        parity=(L(), L(tp=2, ep=2, etp=1), L(pp=2)),
        round_trips=(("legacy", L(pp=2, ep=2), "fp32"), ("torch_dist", L(tp=2, pp=2, ep=4, etp=1), "bf16"))),
))

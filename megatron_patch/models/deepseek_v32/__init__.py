"""DeepSeek sparse attention models, two sibling families over one folder (one config reader, one weight
table, one layer spec; their presets and indexer RoPE apart): DeepSeek-V3.2 (``deepseek_v32``) and GLM-5
(``glm_moe_dsa``). DeepSeek-V3's multi-latent attention and DeepSeekMoE, plus a lightning indexer per layer."""

from megatron_patch.models.blocks.mtp import mtp_copies, num_mtp_layers
from megatron_patch.models.deepseek_v32.config import (
    CONFIG_KEYS, GLM_TINY_CONFIG, TINY_CONFIG, layer_spec, parse_config, transformer_config_kwargs)
from megatron_patch.models.deepseek_v32.mapping import weight_rules
from megatron_patch.models.deepseek_v32.presets import DEEPSEEK_V32_PRESETS, GLM_MOE_DSA_PRESETS
from megatron_patch.models.description.family import HFModules, ModelFamily, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.runtime.distributed import ParallelLayout as L

_COMMON = dict(
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, transformer_config_kwargs=transformer_config_kwargs,
    layer_spec=layer_spec, launcher_parallel_args=("ETP", "EP"), hf_modules=HFModules(router="mlp.gate", indexer="self_attn.indexer"),
    hf_mtp_layers=num_mtp_layers, hf_copies=mtp_copies,
    skeleton_from_megatron_core="its indexer and its own layer spec are beyond the derivation's rules",
)
_LAYOUTS = dict(
    parity=(L(), L(tp=2, ep=2), L(pp=3)),
    round_trips=(("legacy", L(tp=2, ep=2), "fp32"), ("legacy", L(pp=3, ep=2, etp=1), "bf16"),
                 ("torch_dist", L(tp=2, pp=3, ep=2), "bf16")))

FAMILY = register(ModelFamily(
    name="deepseek_v32", summary="DeepSeek-V3.2 / V3.2-Exp: DeepSeek-V3 with DeepSeek sparse attention (a lightning "
                                 "indexer per layer picks each query's top-k keys; RoPE on halves)",
    hf_model_types=("deepseek_v32",), hf_architectures=("DeepseekV32ForCausalLM",),
    tiny_config=TINY_CONFIG, presets=DEEPSEEK_V32_PRESETS, **_COMMON,
    # the indexer trained by its loss (frozen without it, outside DDP's buffers: GLM-5's case below)
    test_layouts=TestLayouts(**_LAYOUTS, memory_plan=((dict(PR="bf16", DO="true"), {"MP_DSA_INDEXER_LOSS_SCALE": "1"},
                                                       False),))))

GLM_FAMILY = register(ModelFamily(
    name="glm_moe_dsa", summary="GLM-5 / 5.1: DeepSeek-V3.2's layout with GLM's sizes (MLA, DeepSeekMoE, DeepSeek "
                                "sparse attention with interleaved indexer RoPE), MTP layers",
    hf_model_types=("glm_moe_dsa",), hf_architectures=("GlmMoeDsaForCausalLM",),
    tiny_config=GLM_TINY_CONFIG, presets=GLM_MOE_DSA_PRESETS, test_layouts=TestLayouts(**_LAYOUTS), **_COMMON))

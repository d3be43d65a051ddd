"""DeepSeek-V3 (and V2 / Moonlight, whose layout matches): multi-latent attention, DeepSeekMoE."""

from megatron_patch.models.blocks.mtp import mtp_copies, num_mtp_layers
from megatron_patch.models.deepseek_v3.config import CONFIG_KEYS, TINY_CONFIG, parse_config, transformer_config_kwargs
from megatron_patch.models.deepseek_v3.mapping import weight_rules
from megatron_patch.models.deepseek_v3.presets import PRESETS
from megatron_patch.models.description.family import HFModules, ModelFamily, PaiLauncher, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="deepseek_v3", summary="DeepSeek-V3 / V2 / Moonlight / Kimi-K2: multi-latent attention (q-LoRA or not, "
                                "YaRN), DeepSeekMoE (sigmoid or softmax routing, score bias, groups, shared experts)",
    hf_model_types=("deepseek_v3", "deepseek_v2", "kimi_k2"), hf_architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
    transformers_model_types={"kimi_k2": "deepseek_v3"},
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, launcher_parallel_args=("ETP", "EP"),
    size_aliases={"A37B": "671B"},
    pai_launchers=(PaiLauncher("examples/deepseek_v3/run_mcore_deepseek.sh", ("ETP", "EP"),
                               moe_balancing="seq_aux_loss"),),
    hf_modules=HFModules(router="mlp.gate"), hf_mtp_layers=num_mtp_layers, hf_copies=mtp_copies,
    test_layouts=TestLayouts(
        parity=(L(), L(tp=2, ep=2), L(pp=3)),
        round_trips=(("legacy", L(tp=2, ep=2), "fp32"), ("legacy", L(pp=3), "bf16"),
                     ("torch_dist", L(tp=2, ep=2), "bf16"))),
))

"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention, routed experts without a shared one."""

from megatron_patch.models.description.family import HFModules, ModelFamily, PaiLauncher, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.qwen3_moe.config import CONFIG_KEYS, TINY_CONFIG, parse_config, transformer_config_kwargs
from megatron_patch.models.qwen3_moe.mapping import weight_rules
from megatron_patch.models.qwen3_moe.presets import PRESETS
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="qwen3_moe", summary="Qwen3-MoE: Qwen3 attention (q/k norm), routed experts, norm_topk_prob, dense layers "
                              "from mlp_only_layers / decoder_sparse_step",
    hf_model_types=("qwen3_moe",), hf_architectures=("Qwen3MoeForCausalLM",),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, launcher_parallel_args=("ETP", "EP"),
    size_aliases={"A3B": "30B-A3B", "A22B": "235B-A22B"}, weight_decay=0.01,
    pai_launchers=tuple(PaiLauncher(script, ("ETP", "EP"), {"A3B": "30B-A3B", "A22B": "235B-A22B", "30B-A3B": "30B-A3B",
                                                           "235B-A22B": "235B-A22B"})
                        for script in ("examples/qwen3/run_mcore_qwen3.sh", "examples/qwen3/run_mcore_qwen3_moe.sh")),
    hf_modules=HFModules(router="mlp.gate"),
    test_layouts=TestLayouts(
        parity=(L(), L(pp=2), L(ep=2), L(tp=2, ep=2)),
        round_trips=(("legacy", L(tp=2, pp=2, ep=2), "fp32"), ("torch_dist", L(tp=2, ep=2, etp=1), "bf16"))),
))

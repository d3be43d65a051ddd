"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): routed experts plus a sigmoid-gated shared expert."""

from megatron_patch.models.description.family import HFModules, ModelFamily, PaiLauncher, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.qwen2_moe.config import CONFIG_KEYS, TINY_CONFIG, parse_config, transformer_config_kwargs
from megatron_patch.models.qwen2_moe.mapping import weight_rules
from megatron_patch.models.qwen2_moe.presets import PRESETS
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="qwen2_moe", summary="Qwen2-MoE: routed experts plus a sigmoid-gated shared expert, q/k/v bias",
    hf_model_types=("qwen2_moe",), hf_architectures=("Qwen2MoeForCausalLM",),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, launcher_parallel_args=("ETP", "EP"),
    size_aliases={"A14B": "57B-A14B"}, weight_decay=0.01,
    # Pai's dense Qwen2 launcher takes its MoE size too (EP only: ETP follows TP), with that script's weight decay
    # and no load-balancing loss (it passes no --moe-aux-loss-coeff); its MoE launcher balances per sequence
    pai_launchers=(PaiLauncher("examples/qwen2/run_mcore_qwen.sh", ("EP",),
                               {"A14B": "57B-A14B", "57B-A14B": "57B-A14B"}, weight_decay=0.1, moe_aux_loss=0.0),
                   PaiLauncher("examples/qwen2/run_mcore_qwen2_moe.sh", ("ETP", "EP"), moe_balancing="seq_aux_loss")),
    hf_modules=HFModules(router="mlp.gate"),
    test_layouts=TestLayouts(
        parity=(L(), L(pp=2), L(ep=2), L(tp=2, ep=2)),
        round_trips=(("legacy", L(tp=2, pp=2, ep=2), "fp32"), ("legacy", L(ep=4), "bf16"),
                     ("torch_dist", L(tp=2, pp=2, ep=4), "bf16"))),
))

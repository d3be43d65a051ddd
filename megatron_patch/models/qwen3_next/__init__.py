"""Qwen3-Next (80B-A3B): Gated DeltaNet interleaved with gated full attention, MoE with a gated shared expert."""

from megatron_patch.models.description.family import HFModules, ModelFamily, PaiLauncher, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.qwen3_next.config import (
    CONFIG_KEYS, TINY_CONFIG, layer_spec, mtp_block_spec, mtp_prefixes, num_mtp_layers, parse_config,
    transformer_config_kwargs)
from megatron_patch.models.qwen3_next.mapping import weight_rules
from megatron_patch.models.qwen3_next.presets import PRESETS
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="qwen3_next", summary="Qwen3-Next: Gated DeltaNet (linear attention) interleaved with gated full attention "
                               "(q/k norm, partial RoPE), zero-centred RMSNorm, MoE with a gated shared expert, MTP",
    hf_model_types=("qwen3_next",), hf_architectures=("Qwen3NextForCausalLM",),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, launcher_parallel_args=("ETP", "EP"),
    size_aliases={"A3B": "80B-A3B"}, weight_decay=0.01,
    pai_launchers=(PaiLauncher("examples/qwen3_next/run_mcore_qwen3.sh", ("ETP", "EP")),),
    hf_modules=HFModules(attention=("self_attn", "linear_attn"), router="mlp.gate"),
    hf_mtp_layers=num_mtp_layers, hf_mtp_prefixes=mtp_prefixes, layer_spec=layer_spec, mtp_block_spec=mtp_block_spec,
    skeleton_from_megatron_core="its Gated DeltaNet layers are modules of its own",
    test_layouts=TestLayouts(
        parity=(L(), L(tp=2, ep=2), L(pp=2)),
        round_trips=(("legacy", L(tp=2, pp=2, ep=2), "fp32"), ("torch_dist", L(tp=2, ep=2, etp=1), "bf16"))),
))

"""Qwen2 and Qwen2.5 (dense, q/k/v bias, tied embeddings on small models)."""

from megatron_patch.models.description.family import ModelFamily, PaiLauncher, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.qwen2.config import CONFIG_KEYS, TINY_CONFIG, parse_config
from megatron_patch.models.qwen2.mapping import weight_rules
from megatron_patch.models.qwen2.presets import PRESETS
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="qwen2", summary="Qwen2 / Qwen2.5: dense, q/k/v bias, tied embeddings up to 3B",
    hf_model_types=("qwen2",), hf_architectures=("Qwen2ForCausalLM",),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    launcher_parallel_args=("EP",),
    pai_launchers=(PaiLauncher("examples/qwen2/run_mcore_qwen.sh", ("EP",)),
                   PaiLauncher("examples/qwen2_5/run_mcore_qwen.sh", ())),
    test_layouts=TestLayouts(
        memory_plan=((dict(PR="bf16", DO="true"), {}, True),),  # tied embeddings, q/k/v bias
        parity=(L(), L(tp=2), L(pp=2)),
        # Tied embeddings with PP > 1: the last stage keeps a copy.
        round_trips=(("legacy", L(tp=2, pp=2), "fp32"), ("legacy", L(pp=4), "bf16"), ("torch_dist", L(pp=2), "fp32"))),
))

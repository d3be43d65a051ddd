"""Qwen3 (dense): q/k RMSNorm per head, head_dim apart from hidden/heads, tied embeddings up to 4B."""

from megatron_patch.models.description.family import ModelFamily, PaiLauncher, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.qwen3.config import CONFIG_KEYS, TINY_CONFIG, parse_config, transformer_config_kwargs
from megatron_patch.models.qwen3.mapping import weight_rules
from megatron_patch.models.qwen3.presets import PRESETS
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="qwen3", summary="Qwen3: dense, q/k RMSNorm (qk_layernorm), explicit head_dim, tied embeddings up to 4B",
    hf_model_types=("qwen3",), hf_architectures=("Qwen3ForCausalLM",),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, launcher_parallel_args=("EP",), weight_decay=0.01,
    # Pai's one Qwen3 launcher takes the dense and the MoE sizes (27 arguments); its README also starts it as
    # run_mcore_qwen3_moe.sh
    pai_launchers=(PaiLauncher("examples/qwen3/run_mcore_qwen3.sh", ("ETP", "EP")),
                   PaiLauncher("examples/qwen3/run_mcore_qwen3_moe.sh", ("ETP", "EP"))),
    test_layouts=TestLayouts(
        memory_plan=((dict(PR="bf16", DO="true"), {}, True),),  # q/k norms
        parity=(L(), L(tp=2), L(pp=2)),
        # Tied embeddings with PP > 1: the last stage keeps a copy.
        round_trips=(("legacy", L(tp=2, pp=2), "bf16"), ("torch_dist", L(tp=2, pp=2), "fp32"))),
))

"""Mixtral (8x7B, 8x22B): sparse MoE with top-2 routing, no shared expert."""

from megatron_patch.models.description.family import HFModules, ModelFamily, PaiLauncher, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.mixtral.config import CONFIG_KEYS, TINY_CONFIG, parse_config, transformer_config_kwargs
from megatron_patch.models.mixtral.mapping import weight_rules
from megatron_patch.models.mixtral.presets import PRESETS
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="mixtral", summary="Mixtral: sparse MoE, top-2 routing renormalised, no shared expert",
    hf_model_types=("mixtral",), hf_architectures=("MixtralForCausalLM",),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, launcher_parallel_args=("ETP", "EP"),
    # Pai's Mistral launcher takes Mixtral too (EP only: ETP follows TP), with its own --moe-aux-loss-coeff 1e-2
    pai_launchers=(PaiLauncher("examples/mistral/run_mcore_mistral.sh", ("EP",), {"8x7B": "8x7B"}, moe_aux_loss=0.01),),
    # transformers 4.x calls the MoE block block_sparse_moe
    hf_modules=HFModules(mlp=("mlp", "block_sparse_moe"), router=("mlp.gate", "block_sparse_moe.gate")),
    test_layouts=TestLayouts(
        memory_plan=((dict(PR="bf16"), {}, False),),  # megatron's Float16Optimizer
        parity=(L(), L(pp=2), L(ep=2), L(tp=2, ep=2, etp=1)),
        round_trips=(("legacy", L(tp=2, pp=4, ep=2), "fp32"), ("legacy", L(pp=2, ep=4), "bf16"),
                     ("torch_dist", L(ep=2), "fp32"))),
))

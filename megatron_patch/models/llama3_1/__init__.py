"""Llama 3.x and any Llama-architecture checkpoint (LlamaForCausalLM; MistralForCausalLM, its sliding window too)."""

from megatron_patch.models.description.family import ModelFamily, PaiLauncher, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.llama3_1.config import CONFIG_KEYS, TINY_CONFIG, parse_config, transformer_config_kwargs
from megatron_patch.models.llama3_1.mapping import weight_rules
from megatron_patch.models.llama3_1.presets import PRESETS
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="llama3_1", summary="Llama 3.x (3.2 with tied embeddings) and any Llama-architecture checkpoint, Mistral "
                             "with its sliding window: GQA, default/linear/llama3/yarn RoPE from config.json",
    hf_model_types=("llama", "mistral"), hf_architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs,
    pai_launchers=(PaiLauncher("examples/llama3_1/run_mcore_llama3_1.sh", ()),
                   PaiLauncher("examples/mistral/run_mcore_mistral.sh", ("EP",), {"7B": "Mistral-7B"})),
    test_layouts=TestLayouts(
        memory_plan=(),  # the plan's own variations (AC, offload, SDPA) run on Llama: tests/test_memory_plan.py
        parity=(L(), L(tp=2), L(pp=2)),
        round_trips=(("legacy", L(), "fp32"), ("legacy", L(tp=2, pp=2), "bf16"), ("torch_dist", L(tp=2), "fp32"))),
))

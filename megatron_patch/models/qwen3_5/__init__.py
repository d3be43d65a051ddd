"""Qwen3.5 (dense and MoE): the language model of the multimodal hub checkpoint, Qwen3-Next's hybrid layers."""

from megatron_patch.models.description.family import HFModules, ModelFamily, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.qwen3_5.config import CONFIG_KEYS, TINY_CONFIG, num_mtp_layers, parse_config
from megatron_patch.models.qwen3_5.mapping import weight_rules
from megatron_patch.models.qwen3_5.presets import PRESETS
from megatron_patch.models.qwen3_next.config import layer_spec, mtp_block_spec, mtp_prefixes, transformer_config_kwargs
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="qwen3_5", summary="Qwen3.5 / Qwen3.5-MoE language model from the multimodal checkpoint: Qwen3-Next's hybrid "
                            "layers (separate Gated DeltaNet projections), text RoPE; the vision tower carried through",
    hf_model_types=("qwen3_5", "qwen3_5_moe"),
    hf_architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, launcher_parallel_args=("ETP", "EP"),
    hf_modules=HFModules(attention=("self_attn", "linear_attn"), router="mlp.gate"),
    hf_carried=(r"model\.visual\..+",), hf_auto_class="AutoModelForImageTextToText",
    hf_mtp_layers=num_mtp_layers, hf_mtp_prefixes=mtp_prefixes, layer_spec=layer_spec, mtp_block_spec=mtp_block_spec,
    skeleton_from_megatron_core="its Gated DeltaNet layers are modules of its own",
    test_layouts=TestLayouts(
        parity=(L(), L(tp=2, ep=2)),
        round_trips=(("legacy", L(tp=2, pp=2, ep=2), "bf16"), ("torch_dist", L(tp=2, ep=2, etp=1), "fp32"))),
))

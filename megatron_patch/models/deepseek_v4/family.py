"""DeepSeek-V4's ``ModelFamily``: what the registry, the converter and the launcher read of it."""

from __future__ import annotations

from megatron_patch.models.deepseek_v4.config import CONFIG_KEYS, TINY_CONFIG, parse_config, recompute_refused
from megatron_patch.models.blocks.mtp import num_mtp_layers
from megatron_patch.models.deepseek_v4.hub_names import hf_names_view, mtp_prefixes
from megatron_patch.models.deepseek_v4.mapping import LOADED_NAMES, LORA_REFUSED, weight_rules
from megatron_patch.models.deepseek_v4.presets import PRESETS
from megatron_patch.models.description.family import HFModules, ModelFamily, TestLayouts
from megatron_patch.runtime.distributed import ParallelLayout as L


def transformer_config_kwargs(arch) -> dict:
    # megatron-core: imported when a model is built, not when the converter or the CLI reads the family
    from megatron_patch.models.deepseek_v4.layers import transformer_config_kwargs as kwargs

    return kwargs(arch)


def layer_spec(arch, config, use_te=None, vp_stage=None, core_attention=None):
    # megatron-core: imported when a model is built, not when the converter or the CLI reads the family
    from megatron_patch.models.deepseek_v4.layers import layer_spec as spec

    return spec(arch, config, use_te, vp_stage, core_attention)


def finish_model(model, arch) -> None:
    # megatron-core: imported when a model is built, not when the converter or the CLI reads the family
    from megatron_patch.models.deepseek_v4.layers import finish_model as finish

    finish(model, arch)


def tiny_hash_tables(raw: dict, name: str, buffer):
    """A tiny model's ``tid2eid`` drawn as the hub's tables are, k distinct experts per token: transformers
    initialises them to zeros (every token to expert 0, k times), which megatron-core's routing map cannot hold (one
    entry per expert and token)."""
    if not name.endswith("tid2eid"):
        return None
    import torch  # only when a tiny checkpoint is drawn: the family is read without torch

    rows, k = buffer.shape
    return torch.stack([torch.randperm(raw["n_routed_experts"])[:k] for _ in range(rows)]).to(buffer.dtype)


FAMILY = ModelFamily(
    name="deepseek_v4", summary="DeepSeek-V4: hyper-connection streams, sliding/CSA/HCA attention with a shared "
                                "key/value head and sinks, hash-routed and top-k MoE with clamped SwiGLU",
    hf_model_types=("deepseek_v4",), hf_architectures=("DeepseekV4ForCausalLM",),
    # every V4 model has experts: ETP and EP after CP, as DeepSeek-V3's launcher
    launcher_parallel_args=("ETP", "EP"),
    parse_config=parse_config, config_keys=CONFIG_KEYS, weight_rules=weight_rules, tiny_config=TINY_CONFIG,
    presets=PRESETS, transformer_config_kwargs=transformer_config_kwargs, layer_spec=layer_spec,
    finish_model=finish_model, tiny_buffer=tiny_hash_tables, recompute_refused=recompute_refused,
    skeleton_from_megatron_core="its layers (hyper-connections, V4 attention, hash routing) are modules of its own",
    test_layouts=TestLayouts(parity=(L(), L(tp=2), L(pp=2))),
    # the grouped output projection torchao would run as one plain linear; the compressor's and indexer's linears,
    # which the HF names do not tell apart from the other kinds
    fp8_align_refused="its attention's grouped output projection, compressor and indexer have no torchao "
                      "counterpart on the HF model that puts the same GEMMs in float8 as MCore",
    # the aligner's routers (hash and top-k layers alike) and the CSA layers' block selection
    # the streams also after the attention's hyper-connection: ffn_hc's input on both sides
    hf_modules=HFModules(router="mlp.gate", indexer="self_attn.compressor.indexer", attention_residual="ffn_hc"),
    hf_names_view=hf_names_view,  # the hub's own names (hub_names.py) read as transformers' save names
    hf_loaded_prefixes=LOADED_NAMES, lora_refused=LORA_REFUSED,  # peft's names are the loaded model's (mapping.py)
    # its MTP layers (mtp.{k}.*) convert-only: carried beside the model with --mtp, not built
    hf_mtp_layers=num_mtp_layers, hf_mtp_prefixes=mtp_prefixes, hf_mtp_carried=True,
)


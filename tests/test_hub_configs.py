"""Checkpoints as transformers writes them: its config classes' defaults with only the sizes made tiny, where a
family's own tiny config would hide what transformers reads otherwise (a field it honours or ignores, a default, a
top-level flag of a multimodal folder) or how the parity and align reference is loaded."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from megatron_patch.align.parity import FP32_KL, FP32_REL_L2, check_parity_all
from megatron_patch.models.description.hf_model import load_causal_lm
from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import families, get_family, parse_arch
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint, tiny_config

_DSV3 = dict(vocab_size=200, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2,
             num_experts_per_tok=4, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
             qk_rope_head_dim=16, v_head_dim=16, num_nextn_predict_layers=0)
HUB = {
    # transformers' Mixtral attends within sliding_window (8 keys, shorter than parity's 32 tokens)
    "mixtral_sliding_window": ("mixtral", dict(
        vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, sliding_window=8)),
    # transformers' DeepSeek-V3 router reads neither field: sigmoid, score bias, groups whatever they say
    "deepseek_v3_softmax": ("deepseek_v3", {**_DSV3, "scoring_func": "softmax", "topk_method": "noaux_tc"}),
    "deepseek_v3_greedy": ("deepseek_v3", {**_DSV3, "scoring_func": "softmax", "topk_method": "greedy"}),
    # Gemma 4's default layout (a 512-wide global head): transformers' sdpa is 5e-5 off its eager attention
    "gemma4_default_layout": ("gemma4", dict(
        vocab_size=200, vocab_size_per_layer_input=200, hidden_size=48, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size_per_layer_input=0, sliding_window=8)),
    # tied at the top level, untied in text_config (its default), no lm_head saved: the multimodal model ties
    "qwen3_5_tied": ("qwen3_5", dict(
        model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"], tie_word_embeddings=True,
        text_config=dict(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, num_position_embeddings=16))),
}


@pytest.fixture(scope="module")
def hub_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return {name: make_tiny_hf_checkpoint(family, root / name, seed=3, transformers_defaults=True, **fields)
            for name, (family, fields) in HUB.items()}


@pytest.mark.slow
def test_configs_as_transformers_writes_them_match_transformers(hub_dirs):
    names = list(hub_dirs)
    for name, m in zip(names, check_parity_all([hub_dirs[n] for n in names], seed=5)):
        assert m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, (name, m)


def test_reference_runs_eager_attention_and_ties_as_the_folder_says(hub_dirs):
    """parity's and align's transformers model: eager attention (sdpa differs on Gemma 4 beyond parity's bound);
    Qwen3.5's causal LM, built from a text_config that does not tie, shares the embedding as the folder says."""
    model = load_causal_lm(hub_dirs["qwen3_5_tied"], torch.float32)
    assert model.config._attn_implementation == "eager"
    assert torch.equal(model.get_output_embeddings().weight, model.get_input_embeddings().weight)
    assert parse_arch(hub_dirs["qwen3_5_tied"]).tie_word_embeddings


def test_mixtral_reads_sliding_window_and_transformers_defaults():
    arch = parse_arch(tiny_config("mixtral", sliding_window=8))
    assert set(arch.layer_types) == {"sliding_attention"} and arch.sliding_window == 8
    assert get_family("mixtral").transformer_config_kwargs(arch)["window_size"] == (7, 0)
    absent = ("rope_theta", "rms_norm_eps", "router_aux_loss_coef", "max_position_embeddings")
    arch = parse_arch({k: v for k, v in tiny_config("mixtral").items() if k not in absent})
    hf = transformers.MixtralConfig()
    assert (arch.rope_theta, arch.norm_eps, arch.router_aux_loss_coef, arch.max_position_embeddings) == \
        (hf.rope_parameters["rope_theta"], hf.rms_norm_eps, hf.router_aux_loss_coef, hf.max_position_embeddings)


# A config.json that leaves a field out is built by transformers with its config class's default: each family reads
# it so (its HF_DEFAULTS table, models/description/hf_defaults.py). These fields it refuses instead, sizes no
# config.json of a real model leaves out, which a default would turn into another model than the one on disk.
_SIZES = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"}
# Where every config.json of a family (as transformers writes it) names each layer's type, transformers refuses its
# own default num_hidden_layers too: both refuse, which agrees.
_TYPED = _SIZES - {"num_hidden_layers"}
_MLA = {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size",
        "n_routed_experts", "num_experts_per_tok"}
_LINEAR = {"linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim"}
_HYBRID_MOE = {"num_experts_per_tok", "moe_intermediate_size"}
REQUIRED = {
    "llama3_1": _SIZES, "qwen2": _TYPED, "qwen3": _TYPED,
    "mixtral": _SIZES | {"num_local_experts", "num_experts_per_tok"},
    "qwen2_moe": _TYPED | {"num_experts", "num_experts_per_tok", "moe_intermediate_size"},
    # transformers 5 writes num_experts as num_local_experts: without either, the count is not known
    "qwen3_moe": _SIZES | {"num_experts_per_tok", "moe_intermediate_size", "num_local_experts"},
    "glm4_moe": _SIZES | {"n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"},
    "gpt_oss": _TYPED | {"num_local_experts", "num_experts_per_tok"},
    "minimax_m2": _SIZES | {"num_local_experts", "num_experts_per_tok"},
    "deepseek_v3": _SIZES | _MLA, "deepseek_v32": _SIZES | _MLA | {"index_topk", "index_n_heads", "index_head_dim"},
    "glm_moe_dsa": _SIZES | _MLA | {"index_topk", "index_n_heads", "index_head_dim"},
    "qwen3_next": _SIZES | _HYBRID_MOE | _LINEAR,
    "qwen3_5": {f"text_config.{k}" for k in _TYPED | _HYBRID_MOE | _LINEAR | {"num_experts"}},
    "gemma3": {"text_config"},  # a multimodal config.json without its language model's
    "gemma4": set(), "deepseek_v4": set(),
}


def _as_transformers_writes(family, model_type: str, raw: dict) -> dict:
    """``raw`` as transformers' config class for its model_type holds it: every field, absent ones at its defaults."""
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    built = transformers.AutoConfig.for_model(family.transformers_model_types.get(model_type, model_type), **fields)
    return built.to_dict() | {"model_type": model_type, "architectures": raw.get("architectures")}


def _model(family, raw: dict):
    """What a config.json builds here: the Arch and the TransformerConfig settings (functions by name)."""
    arch = parse_arch(raw)
    settings = family.transformer_config_kwargs(arch)
    return {**{k: v for k, v in dataclasses.asdict(arch).items() if k != "hf_config"},
            **{f"TransformerConfig.{k}": getattr(v, "__name__", v) for k, v in settings.items()}}


def _model_or_refusal(family, raw: dict):
    try:
        return _model(family, raw)
    except UserError as exc:  # both refusing is agreeing: transformers' default does not build here either
        return f"refused: {exc}"


def _bases(family) -> list[tuple[str, dict]]:
    """Each model_type's tiny config and its first published size (whose values a tiny one may share with the
    defaults, hiding a difference), else the tiny config under that model_type."""
    out = []
    for model_type in family.hf_model_types:
        own = [c for c in (family.tiny_config, *family.presets.values()) if c.get("model_type") == model_type][:2]
        out += [(model_type, c) for c in own or [family.tiny_config | {"model_type": model_type}]]
    return out


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_a_field_config_json_leaves_out_is_read_as_transformers_reads_it(name):
    """Each field a family reads, left out of a config as transformers writes it: the family builds what it builds
    from transformers' class default for it (absent from the family's table, or a default changed in a new
    transformers release, fails here), unless the family refuses the config (REQUIRED, kept exact)."""
    family = get_family(name)
    assert set(REQUIRED) == set(families()), "every family needs its REQUIRED entry"
    within = family.hf_defaults_within
    refused, differ = set(), []
    for model_type, base in _bases(family):
        full = _as_transformers_writes(family, model_type, base)
        read = family.config_keys[within].fields if within else family.config_keys
        held = full[within] if within else full
        for field in sorted(set(read) & set(held) - {"model_type"}):
            dropped = {k: v for k, v in held.items() if k != field}
            raw = full | {within: dropped} if within else dropped
            path = f"{within}.{field}" if within else field
            try:
                theirs = _model_or_refusal(family, _as_transformers_writes(family, model_type, raw))
            except Exception as exc:  # noqa: BLE001 (nor can transformers' class: layer_types name other layers)
                theirs = f"transformers refuses: {exc}"
            ours = _model_or_refusal(family, raw)
            if isinstance(ours, str) and not isinstance(theirs, str):
                refused.add(path)
            elif isinstance(ours, str) != isinstance(theirs, str) or not isinstance(ours, str) and ours != theirs:
                shown = theirs if isinstance(theirs, str) or isinstance(ours, str) else {
                    k: (ours.get(k), theirs.get(k)) for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k)}
                differ.append(f"{model_type} without {path}: (here, transformers') {shown}")
    assert not differ, "\n".join(differ[:3])
    assert refused == REQUIRED[name], f"refused when absent: {sorted(refused)}; REQUIRED lists {sorted(REQUIRED[name])}"


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_a_family_defaults_table_is_transformers(name):
    """Every value of a family's HF_DEFAULTS table is its model_type's config-class default in this transformers."""
    family = get_family(name)
    for model_type, table in family.hf_defaults.items():
        built = transformers.AutoConfig.for_model(family.transformers_model_types.get(model_type, model_type))
        if family.hf_defaults_within:
            built = getattr(built, family.hf_defaults_within)
        theirs = built.to_dict()
        for field, ours in table.items():
            # transformers 5 keeps rope_theta in rope_parameters
            value = theirs["rope_parameters"]["rope_theta"] if field == "rope_theta" else theirs[field]
            assert ours == value, f"{name} HF_DEFAULTS[{model_type!r}][{field!r}] = {ours!r}, transformers' {value!r}"

"""DeepSeek-V4's config reader: transformers' own config and the hub's legacy names read to the same model; what
the model cannot be, and bad values, refused in one line; the parameters it describes are transformers' count."""

import pytest

from megatron_patch.errors import UserError
from megatron_patch.models.deepseek_v4.config import CONFIG_KEYS, TINY_CONFIG, parameter_count, parse_config
from megatron_patch.models.deepseek_v4.presets import PRESETS
from megatron_patch.models.deepseek_v4.settings import CSA, HASH_MOE, HCA, MOE, SLIDING, settings
from megatron_patch.models.description.config_checks import check_config_values

transformers = pytest.importorskip("transformers")

# TINY_CONFIG as the hub would write it: per-layer compress ratios (the trailing one an MTP layer's), the two rates
# as scalars, the hash layers as a count, the rotary dimensions as qk_rope_head_dim, YaRN as rope_scaling
LEGACY_TINY = {
    **{k: v for k, v in TINY_CONFIG.items()
       if k not in ("layer_types", "compress_rates", "mlp_layer_types", "partial_rotary_factor", "rope_parameters")},
    "compress_ratios": [0, 4, 128, 4, 0], "compress_rate_csa": 4, "compress_rate_hca": 8, "num_hash_layers": 2,
    "qk_rope_head_dim": 8,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                     "beta_slow": 1.0},
}


def read(raw: dict):
    check_config_values(raw, CONFIG_KEYS)
    return parse_config(raw)


def test_transformers_config_and_the_legacy_names_read_to_the_same_model():
    written = transformers.DeepseekV4Config(**TINY_CONFIG).to_dict()
    arch = read(written)
    assert read(TINY_CONFIG) == arch
    assert read(LEGACY_TINY) == arch
    assert read(transformers.DeepseekV4Config(**LEGACY_TINY).to_dict()) == arch
    s = settings(arch)
    assert arch.layer_types == (SLIDING, CSA, HCA, CSA)
    assert s.mlp_layer_types == (HASH_MOE, HASH_MOE, MOE, MOE)
    assert (s.compress_rate(CSA), s.compress_rate(HCA), s.compress_rate(SLIDING)) == (4, 8, 0)
    assert (s.hc_mult, s.hc_sinkhorn_iters, s.hc_eps, s.qk_rope_head_dim) == (4, 20, 1e-6, 8)
    # transformers' YaRN on the compressed layers scales no cos/sin
    assert s.compress_rope_scaling["attention_factor"] == 1.0 and arch.rope_scaling is None
    assert (arch.num_kv_heads, arch.num_experts, arch.moe_topk, arch.shared_expert_ffn_hidden_size) == (1, 8, 2, 32)


def test_transformers_defaults_fill_what_a_config_leaves_out():
    """A config that names only its sizes: transformers' default layer schedule (two HCA, then HCA and CSA in turn),
    three hash layers, RoPE on 64 of 512."""
    raw = {"model_type": "deepseek_v4", "num_hidden_layers": 6, "vocab_size": 300}
    ours, theirs = read(raw), transformers.DeepseekV4Config(**raw)
    assert list(ours.layer_types) == theirs.layer_types
    assert list(settings(ours).mlp_layer_types) == theirs.mlp_layer_types
    assert settings(ours).qk_rope_head_dim == theirs.qk_rope_head_dim == 64
    assert dict(settings(ours).compress_rates) == theirs.compress_rates


@pytest.mark.parametrize("name", ["Flash", "Pro"])
def test_the_published_sizes_read_as_transformers_reads_them(name):
    raw = PRESETS[name]
    theirs = transformers.DeepseekV4Config(**raw)
    arch = read(raw)
    assert read(theirs.to_dict()) == arch
    assert list(arch.layer_types) == theirs.layer_types and len(arch.layer_types) == raw["num_hidden_layers"]
    assert arch.layer_types[-1] == CSA  # the trailing compress ratio is the MTP layer's
    assert settings(arch).mlp_layer_types[:4] == (HASH_MOE, HASH_MOE, HASH_MOE, MOE)
    total = parameter_count(arch) / 1e9
    assert {"Flash": 280 < total < 290, "Pro": 1500 < total < 1650}[name], total  # 284B and 1.6T, MTP aside


def test_the_parameter_count_is_transformers_own():
    import torch

    torch.manual_seed(0)
    for raw in (TINY_CONFIG, {**TINY_CONFIG, "tie_word_embeddings": True, "hc_mult": 2}):
        model = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**raw))
        assert parameter_count(read(raw)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("change, says", [
    ({"hc_mult": 0}, "'hc_mult' must be between 1"),
    ({"hc_sinkhorn_iters": 0}, "'hc_sinkhorn_iters' must be between 1"),
    ({"hc_eps": -1e-6}, "'hc_eps' must be >= 0"),
    ({"hc_eps": "tiny"}, "'hc_eps' must be a number"),
    ({"compress_rates": {CSA: 0, HCA: 8}}, f"'compress_rates.{CSA}' must be between 1"),
    ({"compress_ratios": [0, 4, -1, 4]}, "'compress_ratios' must list whole numbers"),
    ({"rope_parameters": {"main": {"rope_theta": -1.0}, "compress": {}}}, "'rope_parameters.main.rope_theta' must be"),
    ({"layer_types": "sliding_attention"}, "'layer_types' must be a list of strings"),
])
def test_bad_values_are_refused_in_one_line(change, says):
    with pytest.raises(UserError, match=says) as info:
        read({**TINY_CONFIG, **change})
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change, says", [
    ({"layer_types": [SLIDING, CSA, "full_attention", CSA]}, "layer_types has full_attention"),
    ({"layer_types": [SLIDING, CSA, HCA]}, "layer_types names 3 layers, but num_hidden_layers is 4"),
    ({"mlp_layer_types": [HASH_MOE, MOE, MOE]}, "mlp_layer_types names 3 layers"),
    ({"mlp_layer_types": [HASH_MOE, "dense", MOE, MOE]}, "mlp_layer_types has dense"),
    ({"layer_types": None, "compress_ratios": [0, 4, 16, 4]}, "compress_ratios has 16"),
    ({"layer_types": None, "compress_ratios": [0, 4]}, "compress_ratios names 2 layers"),
    ({"compress_rates": {CSA: 4, "sliding_attention": 2}}, "compress_rates names sliding_attention"),
    ({"num_key_value_heads": 4}, "num_key_value_heads=4 is not supported"),
    ({"n_shared_experts": 2}, "n_shared_experts=2 is not supported"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"scoring_func": "relu"}, "scoring_func 'relu'"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 is more than the 8 experts"),
    ({"o_groups": 3}, "o_groups=3 does not divide the 4 attention heads"),
    ({"partial_rotary_factor": 0.01}, "must rotate an even number"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 2.0}}, "RoPE type 'llama3' on DeepSeek-V4's compressed"),
    ({"rope_parameters": {"main": {"rope_type": "yarn", "factor": 2.0}, "compress": {}}}, "sliding-window layers"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "YaRN RoPE lacks factor"),
])
def test_what_the_model_cannot_be_is_refused_in_one_line(change, says):
    with pytest.raises(UserError, match=says) as info:
        read({**TINY_CONFIG, **change})
    assert "\n" not in str(info.value)


def test_longer_lists_are_cut_to_the_layers_as_transformers_cuts_them():
    raw = {**TINY_CONFIG, "layer_types": [*TINY_CONFIG["layer_types"], HCA],
           "mlp_layer_types": [*TINY_CONFIG["mlp_layer_types"], MOE]}
    assert read(raw) == read(TINY_CONFIG)
    assert transformers.DeepseekV4Config(**raw).layer_types == list(read(raw).layer_types)


@pytest.mark.parametrize("name", ["Flash", "Pro"])
def test_the_least_weight_bound_fits_the_hubs_files(name):
    """The bound a conversion checks the files against (config_checks.check_weights_fit) stays under what the hub's
    files hold at the least (every weight one byte, FP8, the routed experts half a byte, FP4), where the common bound
    (the output projection as heads x head_dim x hidden, every expert weight a byte) would not."""
    from megatron_patch.models.description.config_checks import least_weight_elements

    arch = read(PRESETS[name])
    h, width, experts = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_experts
    routed = arch.num_layers * experts * 3 * h * width
    smallest_files = parameter_count(arch) - routed + routed // 2
    common = (arch.vocab_size * h + arch.num_layers * (arch.num_heads * arch.head_dim * h + experts * 2 * width * h))
    assert least_weight_elements(arch) < smallest_files < common

"""Model families: config parsing, layout checks, weight mapping round trips and HF/MCore logit parity."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from megatron_patch.align.parity import FP32_KL, FP32_REL_L2, check_parity, check_parity_all
from megatron_patch.checkpoint.engine import MappingError, hf_tensors_from_ranks, rank_state_dict_from_hf
from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import validate_layout
from megatron_patch.models.description.registry import families, get_family, parse_arch
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint, tiny_config
from megatron_patch.models.mapping import RankCoord, plan_transfers
from megatron_patch.models.mapping.naming import from_spec, to_spec
from megatron_patch.runtime import ParallelLayout

FAMILY_NAMES = list(families())


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny_hf_checkpoint(f, root / f, seed=1) for f in FAMILY_NAMES}


def hf_tensors(folder):
    reader = HFCheckpointReader(folder)
    return {k: reader.get(k) for k in reader.keys()}


def all_coords(layout: ParallelLayout):
    """One coordinate per distinct shard set: every (tp, pp) and, for experts, every (ep, etp)."""
    etp_sizes = range(layout.expert_tp)
    for tp, pp, ep, etp in itertools.product(range(layout.tp), range(layout.pp), range(layout.ep), etp_sizes):
        if layout.etp is None and etp != tp:
            continue
        yield RankCoord(tp=tp, pp=pp, ep=ep, etp=etp)


# --- config.json -> Arch ------------------------------------------------------------------------

def test_detects_each_family_from_model_type():
    for name, family in families().items():
        assert parse_arch(tiny_config(name)).family == name


def test_unknown_architecture_lists_supported_ones():
    with pytest.raises(UserError) as err:
        parse_arch({"model_type": "gpt2", "hidden_size": 8})
    msg = str(err.value)
    assert "gpt2" in msg and all(t in msg for t in ("llama", "qwen2", "qwen2_moe", "mixtral"))
    assert "\n" not in msg


def test_llama31_rope_scaling_is_read_from_config_not_hard_coded():
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_patch.models.blocks import rope

    raw = tiny_config("llama3_1")
    arch = parse_arch(raw)
    assert arch.rope_scaling == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                                 "original_max_position_embeddings": 64.0}
    hf_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.for_model(**raw), "cpu")
    ours = rope.inv_freq(arch)
    torch.testing.assert_close(ours, hf_freq.float(), rtol=0, atol=0)
    # megatron-core's own llama3 scaling assumes factors 1/4 and an 8192 context: it would be wrong here.
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    plain = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2).float() / arch.head_dim))
    megatron_default = RotaryEmbedding._apply_scaling(None, plain, factor=4.0)
    assert not torch.allclose(megatron_default, hf_freq.float())


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
             "beta_slow": 2.0},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                    "mscale_all_dim": 0.7},
    "yarn_untruncated": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 64, "truncate": False},
}


@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_every_rope_type_equals_transformers(name):
    """Inverse frequencies bit for bit, and the attention factor HF scales cos/sin by, for each type."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_patch.models.blocks import rope

    raw = {**tiny_config("llama3_1"), "rope_scaling": ROPE_CASES[name], "head_dim": 32}
    arch = parse_arch(raw)
    config = AutoConfig.for_model(**raw)
    kind = (ROPE_CASES[name] or {}).get("rope_type", "default")
    if kind == "default" and "default" not in ROPE_INIT_FUNCTIONS:  # transformers 5: on the rotary class
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        hf_freq, hf_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:  # transformers 4.x lists "default" with the others
        hf_freq, hf_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    ours, factor = rope.inv_freq_and_attention_factor(arch)
    torch.testing.assert_close(ours, hf_freq.float(), rtol=0, atol=0)
    assert factor == pytest.approx(hf_factor, rel=1e-12)
    if kind == "yarn":
        assert factor != 1.0 and rope.softmax_scale(arch) == pytest.approx(factor ** 2 / 32 ** 0.5)
    else:
        assert factor == 1.0 and rope.softmax_scale(arch) is None


# Families that rotate part of each head; YaRN is tried where config.json's RoPE is at its top (Qwen3.5 keeps it in
# its text_config, and its text RoPE is Qwen3-Next's).
PARTIAL_ROPE_CASES = [(f, scaling) for f in FAMILY_NAMES if parse_arch(tiny_config(f)).rotary_percent < 1
                      for scaling in ("default", "yarn") if scaling == "default" or "text_config" not in tiny_config(f)]


@pytest.mark.parametrize("family,scaling", PARTIAL_ROPE_CASES)
def test_partial_rope_equals_transformers(family, scaling):
    """RoPE on part of each head: the frequencies over the rotated dimensions (and YaRN's factor) bit for
    bit as the family's transformers model computes them, and megatron-core builds that many."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_patch.models.blocks import rope

    # a dict of its own: transformers writes rope_theta and partial_rotary_factor into the one it is given; an
    # attention factor of 1, as YaRN's other factors are refused on part of a head
    # (test_yarn_s_attention_factor_on_part_of_a_head_is_refused)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
            "attention_factor": 1.0}
    raw = tiny_config(family, **({"rope_scaling": yarn} if scaling == "yarn" else {}))
    arch = parse_arch(raw)
    hf_rotary = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw)).model.rotary_emb
    ours, factor = rope.inv_freq_and_attention_factor(arch)
    assert ours.numel() * 2 == rope.rotary_dim(arch) < arch.head_dim
    # a rotary embedding per RoPE type in transformers 5 (DeepSeek-V4's "main" and "compress") holds
    # ``<type>_inv_freq``: the first type's is the model's RoPE, the others the family's own layers rotate with
    kind = f"{hf_rotary.layer_types[0]}_" if not hasattr(hf_rotary, "inv_freq") else ""
    torch.testing.assert_close(ours, getattr(hf_rotary, f"{kind}inv_freq").float(), rtol=0, atol=0)
    assert factor == pytest.approx(getattr(hf_rotary, f"{kind}attention_scaling"), rel=1e-12)


# DeepSeek-V4's attention is its own and scales cos and sin itself (models/deepseek_v4/attention.py); Qwen3.5's text
# RoPE is Qwen3-Next's
@pytest.mark.parametrize("family", sorted({f for f, scaling in PARTIAL_ROPE_CASES if scaling == "yarn"}
                                           - {"deepseek_v4"}))
def test_yarn_s_attention_factor_on_part_of_a_head_is_refused(family):
    """transformers scales cos and sin by YaRN's factor, so the rotated part of each head alone; the fold into the
    softmax scale scales the whole score: GLM-4.5, MiniMax-M2 and Qwen3-Next with YaRN converted and aligned NOT."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(UserError, match=r"YaRN on part of each head \(partial rotary factor [0-9.]+\) is not "
                                        r"supported: transformers scales the rotated part alone by its attention "
                                        r"factor 1\.13863"):
        parse_arch(tiny_config(family, rope_scaling=yarn))


@pytest.mark.parametrize("family,over", [
    ("llama3_1", {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "attention_bias": True,
                  "mlp_bias": True}),
    ("gpt_oss", {"hidden_act": "gelu"}),
    ("gemma3", {"hidden_act": "gelu"}),
], ids=["mistral_biases", "gpt_oss_hidden_act", "gemma3_hidden_act"])
def test_fields_transformers_does_not_read_change_nothing(family, over):
    """Each was refused, though transformers builds the same model with or without it: Mistral has no biases and
    reads neither flag, gpt-oss's experts are the clamped SwiGLU whatever hidden_act says, Gemma 3 reads
    hidden_activation alone (here absent: its default). config.json is kept as given."""
    plain = tiny_config(family)
    raw = {k: v for k, v in {**plain, **over}.items() if k != "hidden_activation"}
    arch = parse_arch(raw)
    assert arch.hf_config == raw
    base = parse_arch({**plain, **{k: v for k, v in over.items() if k in ("model_type", "architectures")}})
    assert (arch.linear_bias, arch.qkv_bias, arch.ffn_hidden_size) == (base.linear_bias, base.qkv_bias,
                                                                       base.ffn_hidden_size)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
def test_qwen_s_use_sliding_window_is_refused_only_where_a_layer_slides(family):
    """transformers' Qwen2 and Qwen3 slide the layers from max_window_layers on, and none without a
    sliding_window: use_sliding_window=true with max_window_layers at the layer count (every layer full, logits
    identical) was refused."""
    layers = tiny_config(family)["num_hidden_layers"]
    on = {"use_sliding_window": True, "sliding_window": 8}
    # Qwen2 and Qwen3 slide from max_window_layers on, Qwen2-MoE every other layer below it, Qwen3-MoE every layer
    full = {"qwen2": layers, "qwen3": layers, "qwen2_moe": 0, "qwen3_moe": None}[family]
    for over in ({**on, "max_window_layers": full}, {**on, "sliding_window": None, "max_window_layers": 0}):
        if over["max_window_layers"] is not None:
            assert parse_arch(tiny_config(family, **over)).sliding_window is None
    with pytest.raises(UserError, match="use_sliding_window=true"):
        parse_arch(tiny_config(family, **on, max_window_layers=layers - 1))


def test_a_rope_theta_inside_rope_scaling_wins_as_in_transformers():
    """A 4.x-form config.json (rope_theta beside rope_scaling) whose rope_scaling carries a rope_theta of its own:
    transformers 5 takes the inner one (standardize_rope_params only sets the top one where the dict has none)."""
    raw = {**tiny_config("llama3_1"), "rope_theta": 500000.0,
           "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    assert parse_arch(raw).rope_theta == 10000.0
    assert parse_arch({**raw, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}).rope_theta == 500000.0


def test_rope_scaling_in_transformers5_form_is_read():
    raw = dict(tiny_config("llama3_1"))
    scaling = raw.pop("rope_scaling")
    raw["rope_parameters"] = {**scaling, "rope_theta": raw.pop("rope_theta")}
    arch = parse_arch(raw)
    assert arch.rope_theta == 500000.0 and arch.rope_scaling["low_freq_factor"] == 2.0


def test_family_specifics_are_parsed():
    qwen2 = parse_arch(tiny_config("qwen2"))
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings
    moe = parse_arch(tiny_config("qwen2_moe"))
    assert moe.is_moe and moe.shared_expert_gate and moe.shared_expert_ffn_hidden_size == 96 and not moe.norm_topk_prob
    mixtral = parse_arch(tiny_config("mixtral"))
    assert mixtral.num_experts == 4 and mixtral.moe_ffn_hidden_size == 64 and mixtral.norm_topk_prob
    assert not parse_arch(tiny_config("llama3_1")).qkv_bias


@pytest.mark.parametrize("raw, fragment", [
    ({**tiny_config("llama3_1"), "hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({**tiny_config("qwen2"), "use_sliding_window": True, "max_window_layers": 2}, "use_sliding_window"),
    ({**tiny_config("qwen2"), "use_sliding_window": True, "num_hidden_layers": 30}, "(2 from layer 28"),
    # transformers' Llama ignores a sliding_window; Mistral attends within it (LLAMA_VARIANTS)
    ({**tiny_config("llama3_1"), "sliding_window": 4096}, "sliding_window=4096 in a 'llama' config.json"),
    ({**tiny_config("llama3_1"), "model_type": "mistral", "sliding_window": 0}, "'sliding_window' must be between 1 and"),
    ({**tiny_config("llama3_1"), "attention_bias": True}, "attention_bias=true with mlp_bias=false"),
    ({**tiny_config("qwen2"), "mlp_bias": True}, "mlp_bias=true is not supported for qwen2"),
    ({**tiny_config("llama3_1"), "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "RoPE type 'longrope'"),
    ({**tiny_config("llama3_1"), "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({**tiny_config("llama3_1"), "rope_scaling": {"rope_type": "linear"}}, "linear RoPE scaling lacks factor"),
    ({k: v for k, v in tiny_config("mixtral").items() if k != "num_local_experts"}, "num_local_experts"),
    ({**tiny_config("llama3_1"), "num_hidden_layers": "four"}, "num_hidden_layers"),
    ({**tiny_config("glm4_moe"), "norm_topk_prob": False}, "norm_topk_prob=false"),
    ({**tiny_config("glm4_moe"), "n_group": 2, "topk_group": 2}, "group-limited routing"),
    ({**tiny_config("glm4_moe"), "partial_rotary_factor": 1.5}, "'partial_rotary_factor' must be > 0 and at most 1"),
    # more experts per token than there are: transformers' router fails (torch.topk), conversion let it through
    *[({**tiny_config(family), "num_experts_per_tok": 5}, "routes each token to 5 of its 4 experts")
      for family in ("qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe", "gpt_oss", "minimax_m2", "qwen3_next")],
    # an odd head RoPE rotates whole fails in transformers and megatron-core alike (Gemma 4's sliding layers were
    # not checked beside its global ones); Gemma 3 sized its RoPE by partial_rotary_factor and rotated whole heads
    *[({**tiny_config(family), "head_dim": 15}, "head_dim=15, which RoPE rotates whole")
      for family in ("llama3_1", "qwen3", "gpt_oss", "gemma3", "gemma4")],
    ({**tiny_config("deepseek_v3"), "qk_rope_head_dim": 7}, "qk_rope_head_dim=7"),
    ({**tiny_config("gemma3"), "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported for gemma3"),
    # expert groups transformers' router cannot form or choose among (a reshape, a top-k that fail)
    ({**tiny_config("deepseek_v3"), "n_group": 3}, "n_group=3 does not split the 8 routed experts"),
    ({**tiny_config("glm_moe_dsa"), "n_group": 3}, "n_group=3 does not split the 8 routed experts"),
    ({**tiny_config("deepseek_v3"), "topk_group": 5}, "topk_group=5 chooses more groups than n_group=4"),
    ({**tiny_config("glm4_moe"), "topk_group": 5}, "topk_group=5 chooses more groups than n_group=1"),
])
def test_unsupported_configs_fail_with_one_line(raw, fragment):
    with pytest.raises(UserError) as err:
        parse_arch(raw)
    assert fragment in str(err.value) and "\n" not in str(err.value)


# --- layouts that cannot work fail before any work ------------------------------------------------

@pytest.mark.parametrize("family, layout, fragment", [
    ("llama3_1", ParallelLayout(tp=3), "TP=3 does not divide the 4 attention heads"),
    ("llama3_1", ParallelLayout(tp=4), "TP=4 does not divide the 2 query groups"),
    ("llama3_1", ParallelLayout(pp=3), "PP=3 does not divide the 4 layers"),
    ("qwen2_moe", ParallelLayout(ep=3), "EP=3 does not divide the 4 experts"),
    ("mixtral", ParallelLayout(ep=8), "EP=8 does not divide the 4 experts"),
    ("qwen2", ParallelLayout(ep=2), "dense model"),
])
def test_impossible_layouts_are_refused(family, layout, fragment):
    with pytest.raises(UserError) as err:
        validate_layout(parse_arch(tiny_config(family)), layout)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_cli_refuses_impossible_layout_before_starting_processes(tiny_dirs):
    proc = subprocess.run([sys.executable, "-m", "megatron_patch", "parity", "--hf-dir", str(tiny_dirs["llama3_1"]),
                           "--tp", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.splitlines() if l.startswith("mpatch")]
    assert lines == ["mpatch parity: error: TP=3 does not divide the 4 attention heads: choose a TP that divides 4"]


# --- mapping engine: HF -> MCore (any layout) -> HF is bit-identical ----------------------------

DENSE_LAYOUTS = [ParallelLayout(), ParallelLayout(tp=2), ParallelLayout(pp=4), ParallelLayout(tp=2, pp=2)]
MOE_LAYOUTS = [ParallelLayout(ep=4), ParallelLayout(tp=2, pp=2, ep=2), ParallelLayout(tp=2, ep=2, etp=1),
               ParallelLayout(ep=2, pp=2), ParallelLayout(tp=2, ep=4)]


def round_trip_layouts(family: str) -> list[ParallelLayout]:
    """The in-memory round trip is cheap: every layout the family's tests name, and the generic ones of
    its kind (dense or MoE)."""
    fam = get_family(family)
    arch = parse_arch(fam.tiny_config)
    named = list(fam.test_layouts.parity) + [layout for _, layout, _ in fam.test_layouts.round_trips]
    return [layout for layout in dict.fromkeys(named + (MOE_LAYOUTS if arch.is_moe else DENSE_LAYOUTS))
            if _fits(arch, layout)]


def _fits(arch, layout) -> bool:
    try:
        validate_layout(arch, layout)
    except UserError:
        return False
    return True


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["te", "local"])
def test_round_trip_is_bit_identical(tiny_dirs, family, dtype, spec):
    arch = parse_arch(tiny_dirs[family])
    fam = get_family(arch.family)
    # the tensors the model holds (Qwen3.5's vision tower travels beside it: tests/test_convert.py)
    hf = {k: v.to(dtype) for k, v in hf_tensors(tiny_dirs[family]).items() if not fam.is_carried(k)}
    for layout in round_trip_layouts(family):
        ranks = {c: rank_state_dict_from_hf(fam, arch, layout, c, hf.__getitem__, spec) for c in all_coords(layout)}
        back = hf_tensors_from_ranks(fam, arch, layout, ranks, spec)
        assert set(back) == set(hf), layout
        for name, tensor in hf.items():
            assert back[name].dtype == dtype and torch.equal(back[name], tensor), f"{name} at {layout}"


def test_shards_have_megatron_shapes(tiny_dirs):
    arch = parse_arch(tiny_dirs["qwen2_moe"])
    hf = hf_tensors(tiny_dirs["qwen2_moe"])
    sd = rank_state_dict_from_hf(get_family("qwen2_moe"), arch, ParallelLayout(tp=2, pp=2, ep=2), RankCoord(tp=1, pp=1, ep=1, etp=1),
                     hf.__getitem__, "te")
    h, hd = arch.hidden_size, arch.head_dim
    assert sd["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * hd // 2, h)
    assert sd["decoder.layers.0.self_attention.linear_qkv.bias"].shape == ((4 + 2 * 2) * hd // 2,)
    assert sd["decoder.layers.1.mlp.experts.linear_fc1.weight1"].shape == (2 * arch.moe_ffn_hidden_size // 2, h)
    assert sd["output_layer.weight"].shape == (arch.padded_vocab_size() // 2, h)
    assert "embedding.word_embeddings.weight" not in sd  # last stage only holds the head
    assert not any(k.startswith("decoder.layers.2") for k in sd)  # stage-local numbering
    # EP rank 1 holds global experts 2 and 3 as its local 0 and 1.
    torch.testing.assert_close(sd["decoder.layers.1.mlp.experts.linear_fc2.weight1"],
                               hf["model.layers.3.mlp.experts.3.down_proj.weight"].chunk(2, 1)[1], rtol=0, atol=0)


def test_vocab_padding_rows_are_zero_and_dropped_on_the_way_back(tiny_dirs):
    arch = parse_arch(tiny_dirs["qwen2"])
    assert (arch.vocab_size, arch.padded_vocab_size()) == (250, 256)
    hf = hf_tensors(tiny_dirs["qwen2"])
    sd = rank_state_dict_from_hf(get_family("qwen2"), arch, ParallelLayout(tp=2), RankCoord(tp=1), hf.__getitem__)
    emb = sd["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 128 and torch.count_nonzero(emb[250 - 128:]) == 0
    assert "output_layer.weight" not in sd  # tied, single stage


def test_tied_embedding_with_pp_puts_a_copy_on_the_last_stage(tiny_dirs):
    arch = parse_arch(tiny_dirs["qwen2"])
    hf = hf_tensors(tiny_dirs["qwen2"])
    fam = get_family("qwen2")
    layout = ParallelLayout(pp=2)
    first = rank_state_dict_from_hf(fam, arch, layout, RankCoord(pp=0), hf.__getitem__)
    last = rank_state_dict_from_hf(fam, arch, layout, RankCoord(pp=1), hf.__getitem__)
    assert torch.equal(first["embedding.word_embeddings.weight"], last["output_layer.weight"])
    last["output_layer.weight"] = last["output_layer.weight"].clone()
    last["output_layer.weight"][0, 0] += 1
    with pytest.raises(MappingError, match="differs from the tied embedding"):
        hf_tensors_from_ranks(fam, arch, layout, {RankCoord(pp=0): first, RankCoord(pp=1): last})


def test_engine_is_strict_about_missing_and_extra_tensors(tiny_dirs):
    from megatron_patch.checkpoint.engine import check_hf_names, plan

    arch = parse_arch(tiny_dirs["llama3_1"])
    fam = get_family("llama3_1")
    transfers = plan(fam, arch, ParallelLayout())
    names = set(hf_tensors(tiny_dirs["llama3_1"]))
    check_hf_names(fam, arch, transfers, names)
    with pytest.raises(MappingError, match="lacks 1 tensor.*model.layers.2.self_attn.k_proj.weight"):
        check_hf_names(fam, arch, transfers, names - {"model.layers.2.self_attn.k_proj.weight"})
    with pytest.raises(MappingError, match="no llama3_1 mapping rule consumes: model.layers.0.extra"):
        check_hf_names(fam, arch, transfers, names | {"model.layers.0.extra"})
    ranks = {RankCoord(): rank_state_dict_from_hf(fam, arch, ParallelLayout(), RankCoord(), hf_tensors(tiny_dirs["llama3_1"]).__getitem__)}
    ranks[RankCoord()]["decoder.layers.0.unknown.weight"] = torch.zeros(1)
    with pytest.raises(MappingError, match="no mapping rule reads: decoder.layers.0.unknown.weight"):
        hf_tensors_from_ranks(fam, arch, ParallelLayout(), ranks)


def test_te_and_local_names_cross_both_ways(tiny_dirs):
    for family in ("llama3_1", "mixtral"):
        arch = parse_arch(tiny_dirs[family])
        hf = hf_tensors(tiny_dirs[family])
        te = rank_state_dict_from_hf(get_family(family), arch, ParallelLayout(), RankCoord(), hf.__getitem__, "te")
        local = to_spec(te, "local")
        assert from_spec(local, "local") == te
        if arch.is_moe:
            assert "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight" in local
            assert "decoder.layers.0.pre_mlp_layernorm.weight" in local
        else:
            assert "decoder.layers.0.pre_mlp_layernorm.weight" in local
        assert "decoder.layers.0.input_layernorm.weight" in local


# --- HF vs MCore logits, fp32: rel err <= 1e-5, KL <= 1e-10 --------------------------------------

# Each family's own parity layouts (models/<family>/__init__.py, test_layouts.parity), grouped by layout
# so that the families sharing a layout share one start of its processes.
PARITY_LAYOUTS: dict[ParallelLayout, list[str]] = {}
for _name, _family in families().items():
    for _layout in _family.test_layouts.parity:
        PARITY_LAYOUTS.setdefault(_layout, []).append(_name)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(PARITY_LAYOUTS), ids=lambda l: str(l).replace(" ", "-"))
def test_logits_match_transformers(tiny_dirs, layout):
    names = PARITY_LAYOUTS[layout]
    for name, m in zip(names, check_parity_all([tiny_dirs[n] for n in names], layout, seed=3)):
        assert m["rel_l2"] <= FP32_REL_L2, (name, m)
        assert m["kl"] <= FP32_KL, (name, m)
        assert m["top1"] == 1.0, (name, m)


# Llama-architecture checkpoints beyond Llama 3.1 (the family claims any LlamaForCausalLM and
# MistralForCausalLM): tied embeddings (Llama 3.2), an explicit head_dim, linear and yarn RoPE,
# linear biases, Mistral without a sliding window and with one (8 keys, shorter than the 32-token inputs).
LLAMA_VARIANTS = {
    "llama3.2_tied": {"tie_word_embeddings": True},
    "head_dim_32_yarn": {"head_dim": 32, "rope_scaling": ROPE_CASES["yarn"]},
    "linear_rope_biases": {"rope_scaling": ROPE_CASES["linear"], "attention_bias": True, "mlp_bias": True},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None,
                "rope_scaling": None},
    "mistral_sliding_window": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 8,
                               "rope_scaling": None},
}


@pytest.fixture(scope="module")
def llama_variants(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_variants")
    return {name: make_tiny_hf_checkpoint("llama3_1", root / name, seed=7, **over) for name, over in LLAMA_VARIANTS.items()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", [ParallelLayout(), ParallelLayout(tp=2, pp=2)], ids=str)
def test_llama_architecture_variants_match_transformers(llama_variants, layout):
    names = list(llama_variants)
    assert parse_arch(llama_variants["mistral"]).family == "llama3_1"
    for name, m in zip(names, check_parity_all([llama_variants[n] for n in names], layout, seed=4)):
        assert m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, (name, m)


def test_mistral_attends_within_its_window_whatever_use_sliding_window_says():
    """use_sliding_window is Qwen2's switch, no field of transformers' Mistral, which attends within the window
    anyway: a Mistral config.json carrying use_sliding_window=false converted without the window (aligned NOT).
    A Llama config.json with it false keeps full attention, as transformers' Llama does."""
    mistral = {**tiny_config("llama3_1"), "model_type": "mistral", "sliding_window": 8, "use_sliding_window": False}
    assert parse_arch(mistral).sliding_window == 8
    assert parse_arch({**mistral, "model_type": "llama"}).sliding_window is None


@pytest.fixture(scope="module")
def expertless_qwen_moe(tmp_path_factory):
    """Qwen-MoE config.json files with no experts, which transformers builds as dense models (MoE only where
    num_experts > 0): refused as 'num_experts must be a positive integer' before."""
    root = tmp_path_factory.mktemp("expertless")
    return {family: make_tiny_hf_checkpoint(family, root / family, seed=5, num_experts=0)
            for family in ("qwen2_moe", "qwen3_moe")}


def test_a_qwen_moe_without_experts_is_dense_and_round_trips(expertless_qwen_moe):
    layout = ParallelLayout(tp=2, pp=2)
    for family, folder in expertless_qwen_moe.items():
        arch, hf = parse_arch(folder), hf_tensors(folder)
        assert (arch.family, arch.is_moe, arch.shared_expert_ffn_hidden_size) == (family, False, 0)
        assert any(".mlp.gate_proj." in name for name in hf)
        fam = get_family(family)
        ranks = {c: rank_state_dict_from_hf(fam, arch, layout, c, hf.__getitem__) for c in all_coords(layout)}
        back = hf_tensors_from_ranks(fam, arch, layout, ranks)
        assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf), family


@pytest.mark.slow
def test_a_qwen_moe_without_experts_matches_transformers(expertless_qwen_moe):
    folders = list(expertless_qwen_moe.values())
    for family, m in zip(expertless_qwen_moe, check_parity_all(folders, ParallelLayout(tp=2), seed=4)):
        assert m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, (family, m)


def test_llama_architecture_variants_round_trip(llama_variants):
    layout = ParallelLayout(tp=2, pp=2)
    fam = get_family("llama3_1")
    for name, folder in llama_variants.items():
        arch, hf = parse_arch(folder), hf_tensors(folder)
        ranks = {c: rank_state_dict_from_hf(fam, arch, layout, c, hf.__getitem__) for c in all_coords(layout)}
        back = hf_tensors_from_ranks(fam, arch, layout, ranks)
        assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf), name


def test_parity_detects_a_wrong_mapping(tiny_dirs, tmp_path):
    """The parity bound is tight enough to catch two query heads swapped within a group."""
    import shutil

    from safetensors.torch import save_file

    src = tiny_dirs["llama3_1"]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = hf_tensors(src)
    q = tensors["model.layers.1.self_attn.q_proj.weight"].clone()
    hd = parse_arch(src).head_dim
    q[:hd], q[hd:2 * hd] = q[hd:2 * hd].clone(), q[:hd].clone()
    tensors["model.layers.1.self_attn.q_proj.weight"] = q
    # Reference logits come from the original folder; the MCore side loads the corrupted one.
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    from megatron_patch.align.metrics import compare_logits
    from megatron_patch.align.parity import hf_logits, mcore_logits, random_tokens

    tokens = random_tokens(parse_arch(src).vocab_size, seed=3)
    m = compare_logits(hf_logits(src, tokens), mcore_logits([bad], ParallelLayout(), [tokens])[0])
    assert m["rel_l2"] > 1e-3 and m["kl"] > FP32_KL


# --- TE and local specs meet at the checkpoint boundary ------------------------------------------

def checkpoint_keys_worker(family: str, overrides: dict) -> tuple[set, set]:
    """(torch_dist keys of the local-spec model, our TE names with the layer/expert index folded)."""
    import re

    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.runtime import init_model_parallel

    arch = parse_arch(tiny_config(family, **overrides))
    init_model_parallel(ParallelLayout())
    model = build_model(arch, ParallelLayout(), use_te=False)
    keys = set()
    for name, entry in model.sharded_state_dict().items():
        if not name.endswith("_extra_state"):  # a parameter stored as pieces (Gated DeltaNet) counts once
            keys.add(entry.key)
    # Every parameter the plan writes at TP=PP=EP=1, where layer and expert numbers are global.
    names = {p.mcore_name for t in plan_transfers(get_family(family).weight_rules(arch), arch, ParallelLayout())
             for p in t.placements}
    experts = r"mlp\.experts\.(linear_fc[12])\.(weight|bias)\d+"
    # megatron keys the layers of a mixed model (dense and MoE, linear and full attention, attention shapes of their
    # own, a family's moe_layer_freq list: DeepSeek-V4) by their number
    per_layer = isinstance(get_family(family).transformer_config_kwargs(arch).get("moe_layer_freq"), list)
    if arch.dense_layers or "linear_attention" in arch.layer_types or arch.own_attention_shapes or per_layer:
        folded = {re.sub(experts, r"mlp.experts.experts.\1.\2", n) for n in names}
    else:  # homogeneous layers are stacked on a leading axis
        folded = {re.sub(experts, r"mlp.experts.experts.\1.\2", re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", n))
                  for n in names}
    return keys, folded


KEY_CASES = [(f, {}) for f in families()] + [("qwen2_moe", {"decoder_sparse_step": 2, "mlp_only_layers": [1]})]


@pytest.mark.parametrize("family,overrides", KEY_CASES, ids=[f"{f}{'-mixed' if o else ''}" for f, o in KEY_CASES])
def test_local_spec_checkpoint_keys_are_the_te_names(family, overrides):
    """The local spec (CPU) writes torch_dist keys under the TE names the weight tables use."""
    from megatron_patch.runtime.launch import run_local

    keys, te_names = run_local(checkpoint_keys_worker, 1, family, overrides)[0]
    assert keys == te_names


# --- MoE models with dense layers (mlp_only_layers / decoder_sparse_step) ------------------------------

@pytest.fixture(scope="module")
def mixed_moe(tmp_path_factory):
    # MoE where (i + 1) % 2 == 0 and i is not listed: only layer 3; layers 0, 1, 2 have a dense MLP.
    return make_tiny_hf_checkpoint("qwen2_moe", tmp_path_factory.mktemp("mixed") / "hf", seed=2,
                                   decoder_sparse_step=2, mlp_only_layers=[1])


def test_dense_layers_of_an_moe_model_are_read_from_config(mixed_moe):
    arch = parse_arch(mixed_moe)
    assert arch.dense_layers == (0, 1, 2) and arch.moe_layer_pattern == [0, 0, 0, 1]
    hf = hf_tensors(mixed_moe)
    assert "model.layers.1.mlp.gate_proj.weight" in hf and "model.layers.3.mlp.gate.weight" in hf
    layout = ParallelLayout(tp=2, pp=2, ep=2)
    fam = get_family("qwen2_moe")
    for spec in ("te", "local"):
        ranks = {c: rank_state_dict_from_hf(fam, arch, layout, c, hf.__getitem__, spec) for c in all_coords(layout)}
        back = hf_tensors_from_ranks(fam, arch, layout, ranks, spec)
        assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    # Stage 1 holds global layers 2 (dense) and 3 (MoE) as its local layers 0 and 1.
    stage1 = rank_state_dict_from_hf(fam, arch, layout, RankCoord(pp=1), hf.__getitem__)
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in stage1
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in stage1 and "decoder.layers.1.mlp.router.weight" in stage1
    local = rank_state_dict_from_hf(fam, arch, layout, RankCoord(pp=1), hf.__getitem__, "local")
    assert {"decoder.layers.0.pre_mlp_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm.weight"} <= set(local)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [ParallelLayout(), ParallelLayout(pp=2, ep=2)], ids=str)
def test_moe_model_with_dense_layers_matches_transformers(mixed_moe, layout):
    m = check_parity(mixed_moe, layout, seed=5)
    assert m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, m


def test_a_bf16_model_is_bf16_where_the_family_does_not_declare_float32():
    """``build_model`` in bf16 is the model that trains, for align and eval too: megatron-core's local spec builds
    torch's norms in float32 whatever ``params_dtype`` says, which left align's and eval's bf16 norms more precise than
    the trained model's (and outside torch's fused kernel, which refuses two dtypes). Only what a family declares
    float32 stays so (DeepSeek-V4's hyper-connections, sinks and norms, as transformers keeps them)."""
    from megatron_patch.runtime.launch import run_local
    from tests.family_helpers import parameter_dtypes_worker

    (found,) = run_local(parameter_dtypes_worker, 1, FAMILY_NAMES, "bfloat16")
    assert {f: v["other"] for f, v in found.items() if v["other"]} == {}
    assert {f for f, v in found.items() if v["declared"]} == {"deepseek_v4"}
    assert any(n.endswith("attn_hc.fn") for n in found["deepseek_v4"]["declared"]), found["deepseek_v4"]

"""DeepSeek beyond what the registry-driven tests run for every family: its relatives' variants
(V2-Lite: no q-LoRA, softmax routing; Moonlight: plain RoPE, sigmoid routing without groups), the
RoPE layout megatron-core's MLA assumes, the configurations it refuses, and the launcher's checks.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from megatron_patch.align.metrics import compare_logits
from megatron_patch.align.parity import FP32_KL, FP32_REL_L2, check_parity_all, hf_logits, mcore_logits, random_tokens
from megatron_patch.checkpoint.engine import hf_tensors_from_ranks, rank_state_dict_from_hf
from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import get_family, parse_arch
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint, tiny_config
from megatron_patch.models.mapping import RankCoord
from megatron_patch.runtime import ParallelLayout
from tests.convert_helpers import quantize_fp8_blocks, write_fp8_checkpoint
from tests.training_helpers import launcher_args

TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])
V2_LITE = dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], q_lora_rank=None,
               topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1, norm_topk_prob=False,
               routed_scaling_factor=2.0,
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
# Moonlight's rms_norm_eps is 1e-5, while transformers' latent norms keep 1e-6: the parity checks both
MOONLIGHT = dict(q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=2.446, rope_scaling=None,
                 rope_theta=50000.0, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {name: make_tiny_hf_checkpoint("deepseek_v3", root / name, seed=seed, **over)
            for name, over, seed in (("v3", {}, 1), ("v2_lite", V2_LITE, 2), ("moonlight", MOONLIGHT, 3))}


def test_variants_parse_as_their_hub_configs_say(variants):
    v3, v2, moon = (parse_arch(variants[n]) for n in ("v3", "v2_lite", "moonlight"))
    assert v3.mla.q_lora_rank == 48 and v2.mla.q_lora_rank is None and moon.mla.q_lora_rank is None
    assert v3.dense_layers == (0,) and v3.shared_expert_ffn_hidden_size == 32 and not v3.shared_expert_gate
    kwargs = get_family("deepseek_v3").transformer_config_kwargs
    k3, k2, km = kwargs(v3), kwargs(v2), kwargs(moon)
    assert (k3["moe_router_score_function"], k3["moe_router_enable_expert_bias"], k3["moe_router_num_groups"],
            k3["moe_router_group_topk"], k3["moe_router_topk_scaling_factor"]) == ("sigmoid", True, 4, 2, 2.5)
    assert (k2["moe_router_score_function"], k2["moe_router_pre_softmax"], k2["moe_router_num_groups"]) == \
        ("softmax", True, None)
    assert k3["rope_type"] == k2["rope_type"] == "yarn" and km["rope_type"] == "rope"
    # V3's cos/sin factor is mscale/mscale_all_dim (1/0.8 here); with equal mscales it is 1.
    assert (k3["mscale"], k3["mscale_all_dim"]) == (1.0, 0.8) and (k2["mscale"], k2["mscale_all_dim"]) == (0.707, 0.707)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [ParallelLayout(), ParallelLayout(tp=2, ep=2)], ids=str)
def test_variants_match_transformers(variants, layout):
    # transformers 4.x's DeepseekV2 leaves YaRN's mscale out of the softmax scale (5.0 fixed it): its
    # V2-Lite is no reference there. Moonlight (V3 code, no YaRN) is compared on every version.
    names = ["v2_lite", "moonlight"] if TRANSFORMERS_MAJOR >= 5 else ["moonlight"]
    for name, m in zip(names, check_parity_all([variants[n] for n in names], layout, seed=6)):
        assert m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, (name, m)


@pytest.mark.slow
def test_variants_round_trip_at_tp_ep_and_pp(variants):
    fam = get_family("deepseek_v3")
    for name, folder in variants.items():
        arch = parse_arch(folder)
        from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

        reader = HFCheckpointReader(folder)
        hf = {k: reader.get(k) for k in reader.keys()}
        for layout in (ParallelLayout(tp=2, ep=2), ParallelLayout(pp=3), ParallelLayout(tp=2, ep=4, etp=1)):
            for spec in ("te", "local"):
                coords = [RankCoord(t, p, e, x) for t in range(layout.tp) for p in range(layout.pp)
                          for e in range(layout.ep) for x in range(layout.expert_tp)
                          if layout.etp is not None or x == t]
                ranks = {c: rank_state_dict_from_hf(fam, arch, layout, c, hf.__getitem__, spec) for c in coords}
                back = hf_tensors_from_ranks(fam, arch, layout, ranks, spec)
                assert sorted(back) == sorted(hf), (name, layout, spec)
                assert all(torch.equal(back[k], hf[k]) and back[k].dtype == hf[k].dtype for k in hf), (name, layout)


def _interleaved_to_halves(rows: torch.Tensor) -> torch.Tensor:
    """Rows of one RoPE block laid out as pairs (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...)."""
    d = rows.shape[0]
    return rows.view(d // 2, 2, -1).transpose(0, 1).reshape(d, -1)


@pytest.mark.slow
def test_rope_on_interleaved_pairs_is_what_megatron_core_computes(variants, tmp_path):
    """transformers' rope_interleave=true (the released checkpoints) is reproduced with the weights as
    they are (test_variants_match_transformers and the family's own parity); the same weights with their
    RoPE rows re-ordered to halves, which a converter ignoring the layout would produce, are far off."""
    from safetensors.torch import save_file

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    src, bad = variants["v3"], tmp_path / "halves"
    shutil.copytree(src, bad)
    reader = HFCheckpointReader(src)
    tensors = {k: reader.get(k).clone() for k in reader.keys()}
    arch = parse_arch(src)
    nope, rope, heads = arch.mla.qk_nope_head_dim, arch.mla.qk_rope_head_dim, arch.num_heads
    for layer in range(arch.num_layers):
        q = tensors[f"model.layers.{layer}.self_attn.q_b_proj.weight"].view(heads, nope + rope, -1)
        for h in range(heads):
            q[h, nope:] = _interleaved_to_halves(q[h, nope:].clone())
        kv = tensors[f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"]
        kv[arch.mla.kv_lora_rank:] = _interleaved_to_halves(kv[arch.mla.kv_lora_rank:].clone())
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    tokens = random_tokens(arch.vocab_size, seed=2)
    m = compare_logits(hf_logits(src, tokens), mcore_logits([bad], ParallelLayout(), [tokens])[0])
    assert m["rel_l2"] > 1e-3, m


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 0.8}


@pytest.mark.parametrize("over, fragment", [
    (dict(norm_topk_prob=False), "norm_topk_prob=false with sigmoid routing"),
    (dict(n_routed_experts=16, num_experts_per_tok=6, topk_group=2), "scores groups differently"),
    # 1 expert reachable in the one group chosen: transformers' forward failed on it, align with an internal error
    (dict(n_routed_experts=4, n_group=4, topk_group=1, num_experts_per_tok=2), "cannot be chosen from the 1 in"),
    (dict(rope_interleave=False), "rope_interleave=false"),
    # transformers keeps an empty shared expert: the refusal blamed (0, 64) tensors no mapping rule consumes
    (dict(n_shared_experts=0), "n_shared_experts=0 (an MoE layer without a shared expert) is not supported"),
    (dict(num_key_value_heads=2), "num_key_value_heads must equal num_attention_heads"),
    (dict(model_type="deepseek_v2", scoring_func="sqrtsoftplus"), "scoring_func 'sqrtsoftplus'"),
    (dict(attention_bias=True), "attention_bias=true"),
    # RoPE that megatron-core's MLA does not compute: they converted and aligned NOT (audit reproducers)
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "RoPE type 'linear' is not supported for multi-latent"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                        "original_max_position_embeddings": 64}), "RoPE type 'llama3' is not supported for multi"),
    (dict(rope_scaling={**YARN, "factor": 1.0, "attention_factor": 0.5}),
     "YaRN attention_factor=0.5 with factor=1 is not supported for multi"),
    (dict(rope_scaling={**YARN, "truncate": False}), "YaRN truncate=false is not supported for multi-latent"),
])
def test_what_megatron_core_computes_otherwise_is_refused(over, fragment):
    with pytest.raises(UserError) as err:
        parse_arch({**tiny_config("deepseek_v3"), **over})
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_yarn_s_attention_factor_as_transformers_derives_it_is_accepted():
    """The factor megatron-core derives (mscale over mscale_all_dim), written out as some configs do."""
    import math

    derived = (0.1 * math.log(4.0) + 1) / (0.1 * 0.8 * math.log(4.0) + 1)
    arch = parse_arch({**tiny_config("deepseek_v3"), "rope_scaling": {**YARN, "attention_factor": derived}})
    assert arch.rope_scaling["attention_factor"] == derived


# YaRN's two mscales as configs give them: transformers scales cos/sin by their ratio only where both are given, else
# by the plain YaRN factor or config.json's attention_factor, and corrects the softmax by mscale_all_dim's whenever
# it is given. Only mscale_all_dim converted into another model, aligned NOT at layer 0 (the cfgvar audit).
YARN_MSCALES = {
    "both": {"mscale": 1.0, "mscale_all_dim": 0.8},
    "mscale_all_dim alone": {"mscale_all_dim": 0.8},
    "mscale 0 beside mscale_all_dim": {"mscale": 0, "mscale_all_dim": 0.8},
    "mscale alone": {"mscale": 0.7},
    "neither": {},
    "attention_factor": {"mscale": 1.0, "mscale_all_dim": 0.8, "attention_factor": 0.9},
}


def _yarn_with(mscales: dict) -> dict:
    return {**{k: v for k, v in YARN.items() if k not in ("mscale", "mscale_all_dim")}, **mscales}


@pytest.mark.parametrize("mscales", YARN_MSCALES.values(), ids=YARN_MSCALES.keys())
def test_megatron_cores_yarn_scales_cos_sin_and_softmax_as_transformers(mscales):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor, _yarn_get_mscale)
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = _yarn_with(mscales)
    config = DeepseekV3Config(**{**tiny_config("deepseek_v3"), "rope_scaling": rope})
    _, theirs = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    kwargs = get_family("deepseek_v3").transformer_config_kwargs(parse_arch({**tiny_config("deepseek_v3"),
                                                                            "rope_scaling": rope}))
    ours = _yarn_get_concentration_factor(kwargs["rotary_scaling_factor"], kwargs["mscale"], kwargs["mscale_all_dim"])
    assert ours == pytest.approx(theirs, rel=1e-12)
    softmax = _yarn_get_mscale(kwargs["rotary_scaling_factor"], kwargs["mscale_all_dim"]) ** 2
    wanted = _yarn_get_mscale(4.0, mscales["mscale_all_dim"]) ** 2 if mscales.get("mscale_all_dim") else 1.0
    assert softmax == pytest.approx(wanted, rel=1e-12)


@pytest.mark.slow
def test_each_way_of_giving_yarns_mscales_matches_transformers(tmp_path):
    names = list(YARN_MSCALES)
    folders = [make_tiny_hf_checkpoint("deepseek_v3", tmp_path / str(i), seed=4, rope_scaling=_yarn_with(m))
               for i, m in enumerate(YARN_MSCALES.values())]
    for name, m in zip(names, check_parity_all(folders, ParallelLayout(), seed=6)):
        assert m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, (name, m)


@pytest.mark.parametrize("over", [dict(scoring_func="softmax"), dict(topk_method="greedy", scoring_func="softmax"),
                                  dict(model_type="kimi_k2", topk_method="group_limited_greedy")], ids=str)
def test_v3_routes_as_transformers_whatever_scoring_func_and_topk_method_say(over):
    """transformers' DeepseekV3TopkRouter reads neither field (sigmoid, score bias, groups), nor does the
    conversion: the routing settings and the weight table's score bias are the plain V3's."""
    fam, plain = get_family("deepseek_v3"), parse_arch(tiny_config("deepseek_v3"))
    arch = parse_arch(tiny_config("deepseek_v3", **over))
    routing = [k for k in fam.transformer_config_kwargs(plain) if k.startswith("moe_router")]
    assert {k: fam.transformer_config_kwargs(arch)[k] for k in routing} == \
        {k: fam.transformer_config_kwargs(plain)[k] for k in routing}
    assert [r.hf for r in fam.weight_rules(arch)] == [r.hf for r in fam.weight_rules(plain)]


@pytest.mark.parametrize("over, fragment", [
    (dict(TP="3"), "TP=3 does not divide the 4 attention heads"),
    (dict(EP="3"), "EP=3 does not divide the 8 experts"),
    (dict(PP="2"), "PP=2 does not divide the 3 layers (1 dense, then MoE)"),
])
def test_launcher_refuses_layouts_that_cannot_split_the_model(tmp_path, over, fragment):
    from megatron_patch.training.validation import resolve

    prefix = tmp_path / "d_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    args = launcher_args("deepseek_v3", DATASET_PATH=str(prefix), OUTPUT_BASEPATH=str(tmp_path / "out"), **over)
    with pytest.raises(UserError) as err:
        resolve("deepseek_v3", args)
    assert fragment in str(err.value)


# --- FP8 hub checkpoints ------------------------------------------------------------------------------

FP8_BLOCK = (16, 16)
_FP8_LINEAR = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def fp8_checkpoint(variants, tmp_path_factory):
    """The tiny V3 written as the hub writes DeepSeek-V3: linear weights in FP8 with block scales,
    everything else bf16 (the router bias fp32), quantization_config in config.json."""
    return write_fp8_checkpoint(variants["v3"], tmp_path_factory.mktemp("fp8") / "hf", _FP8_LINEAR, FP8_BLOCK)


@pytest.mark.skipif(TRANSFORMERS_MAJOR < 5, reason="transformers 4.x dequantizes FP8 checkpoints only on a GPU, "
                    "so it gives no reference on this machine (test_fp8_dequantization_* check ours)")
def test_fp8_checkpoint_converts_to_what_transformers_dequantizes(fp8_checkpoint, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.sidecar import read_sidecar
    from megatron_patch.cli import main

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "hf2mcore", "--hf-dir", str(fp8_checkpoint), "--save-dir", str(mcore), "--dtype", "bf16",
                 "--tp", "2", "--ep", "2", "--format", "legacy", "--quiet"]) == 0
    assert any("dequantized from FP8 (16x16" in n for n in read_sidecar(mcore).notes)
    assert main(["convert", "mcore2hf", "--load-dir", str(mcore), "--save-dir", str(back), "--quiet"]) == 0
    ours = HFCheckpointReader(back)
    assert not any(n.endswith("_scale_inv") for n in ours.keys())
    assert "quantization_config" not in (back / "config.json").read_text()

    # transformers' own dequantization (on CPU it dequantizes pre-quantized FP8 while loading). Its
    # dtypes are its own choice: 5.x keeps the router's weight and bias in fp32
    # (_keep_in_fp32_modules_strict), 4.x casts them. What a user relies on is ours: FP8 weights become
    # --dtype, everything else keeps the dtype it was stored in, and every value is theirs bit for bit.
    model = AutoModelForCausalLM.from_pretrained(str(fp8_checkpoint), dtype=torch.bfloat16)
    theirs = model.state_dict()
    source = HFCheckpointReader(fp8_checkpoint)
    inter = parse_arch(fp8_checkpoint).moe_ffn_hidden_size
    checked = 0
    for name in ours.keys():
        got = ours.get(name)
        stored = source.get(name).dtype
        assert got.dtype == (torch.bfloat16 if stored == torch.float8_e4m3fn else stored), name
        if name not in theirs:  # transformers 5.x keeps the experts fused: [E, 2I, H] and [E, H, I]
            prefix, expert, proj = name.rsplit(".", 3)[0], int(name.split(".")[-3]), name.split(".")[-2]
            if proj == "down_proj":
                want = theirs[f"{prefix}.down_proj"][expert]
            else:
                want = theirs[f"{prefix}.gate_up_proj"][expert][(0 if proj == "gate_proj" else inter):][:inter]
        else:
            want = theirs[name]
        assert torch.equal(got.to(want.dtype), want) and torch.equal(want.to(got.dtype), got), name
        checked += 1
    assert checked == len(ours.keys()) and checked > 40


def test_fp8_dequantization_with_partial_blocks():
    """A dimension that is not a multiple of the block (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows in
    128-row blocks) scales its last, partial block by the last scale."""
    from megatron_patch.convert.fp8 import dequantize

    torch.manual_seed(0)
    w = torch.randn(40, 24)
    q, scale = quantize_fp8_blocks(w, (16, 16))  # 3 x 2 blocks, the last ones partial
    got = dequantize(q, scale, (16, 16))
    want = q.float() * scale.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :24]
    assert torch.equal(got, want) and (got - w).abs().max() < 0.1 * w.abs().max()
    with pytest.raises(UserError, match="needs scales of shape"):
        dequantize(q, scale[:2], (16, 16))
    # Every code of both FP8 formats (NaNs and infinities too) becomes what torch makes of it, bit for bit.
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = torch.arange(256, dtype=torch.uint8).view(fp8).reshape(16, 16)
        got = dequantize(codes, torch.full((1, 1), 0.5), (16, 16))
        want = codes.to(torch.float32) * 0.5
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), fp8


def test_fp8_hub_folder_converts_to_the_dtype_its_config_names(fp8_checkpoint, tmp_path, capsys):
    """DeepSeek-V3 as the hub ships it (FP8 weights with block scales beside bf16 ones) converts without --dtype:
    into the float dtype its config.json names, which the run says in one line."""
    import json

    from megatron_patch.checkpoint.sidecar import read_sidecar
    from megatron_patch.cli import main

    config = json.loads((fp8_checkpoint / "config.json").read_text())
    named = config.get("dtype") or config["torch_dtype"]
    mcore = tmp_path / "mcore"
    assert main(["convert", "hf2mcore", "--hf-dir", str(fp8_checkpoint), "--save-dir", str(mcore), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert f"writing {named}, the dtype config.json names (--dtype chooses another)" in err
    assert read_sidecar(mcore).dtype_name == named


# --- multi-token-prediction layers --------------------------------------------------------------------

@pytest.fixture(scope="module")
def mtp_checkpoint(variants, tmp_path_factory):
    """The tiny V3 with one MTP layer after its decoder, laid out as DeepSeek-V3's hub checkpoint: a full
    (MoE) decoder layer, enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and head."""
    import json

    from safetensors.torch import save_file

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    src = variants["v3"]
    out = tmp_path_factory.mktemp("mtp") / "hf"
    shutil.copytree(src, out)
    reader = HFCheckpointReader(src)
    tensors = {n: reader.get(n) for n in reader.keys()}
    arch = parse_arch(src)
    n, h = arch.num_layers, arch.hidden_size
    g = torch.Generator().manual_seed(9)
    for name in list(tensors):
        if name.startswith(f"model.layers.{n - 1}."):
            tensors[name.replace(f"layers.{n - 1}.", f"layers.{n}.")] = tensors[name] + 0.01 * torch.randn(
                tensors[name].shape, generator=g)
    tensors.update({
        f"model.layers.{n}.enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"model.layers.{n}.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"model.layers.{n}.eh_proj.weight": 0.08 * torch.randn(h, 2 * h, generator=g),
        f"model.layers.{n}.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
        f"model.layers.{n}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
        f"model.layers.{n}.shared_head.head.weight": tensors["lm_head.weight"].clone(),
    })
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.slow
def test_mtp_layers_are_dropped_loudly_without_mtp(mtp_checkpoint, tmp_path, capsys):
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.sidecar import read_sidecar
    from megatron_patch.cli import main

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "hf2mcore", "--hf-dir", str(mtp_checkpoint), "--save-dir", str(mcore), "--quiet"]) == 0
    mtp_names = [n for n in HFCheckpointReader(mtp_checkpoint).keys() if n.startswith("model.layers.3.")]
    message = f"{len(mtp_names)} tensors of 1 multi-token-prediction layer(s) were not converted"
    assert message in capsys.readouterr().err
    sidecar = read_sidecar(mcore)
    assert sidecar.mtp_layers == 0 and any(message in n for n in sidecar.notes)
    assert main(["convert", "mcore2hf", "--load-dir", str(mcore), "--save-dir", str(back), "--quiet"]) == 0
    assert not any(n.startswith("model.layers.3.") for n in HFCheckpointReader(back).keys())


@pytest.mark.slow
@pytest.mark.parametrize("fmt,layout", [("legacy", ["--tp", "2", "--ep", "2"]), ("torch_dist", ["--pp", "3"])])
def test_mtp_layers_convert_both_ways_bit_exact(mtp_checkpoint, tmp_path, fmt, layout):
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.sidecar import read_sidecar
    from megatron_patch.cli import main

    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "hf2mcore", "--hf-dir", str(mtp_checkpoint), "--save-dir", str(mcore), "--mtp",
                 "--format", fmt, *layout, "--quiet"]) == 0
    assert read_sidecar(mcore).mtp_layers == 1
    assert main(["convert", "mcore2hf", "--load-dir", str(mcore), "--save-dir", str(back), "--quiet"]) == 0
    src, out = HFCheckpointReader(mtp_checkpoint), HFCheckpointReader(back)
    assert sorted(out.keys()) == sorted(src.keys())
    for name in src.keys():
        assert torch.equal(out.get(name), src.get(name)), name
    if fmt == "legacy":  # what transformers loads from the export computes the source's logits exactly
        tokens = random_tokens(200, seed=5)
        assert torch.equal(hf_logits(back, tokens), hf_logits(mtp_checkpoint, tokens))
    if fmt == "torch_dist":  # a model run without its MTP block still loads the checkpoint: HF's logits
        from tests.convert_helpers import checkpoint_logits_worker
        from megatron_patch.runtime.launch import run_local

        tokens = random_tokens(200, seed=4)
        got = run_local(checkpoint_logits_worker, 1, str(mcore), ParallelLayout(), tokens)[0]
        m = compare_logits(hf_logits(mtp_checkpoint, tokens), got)
        assert m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, m


@pytest.mark.slow
def test_mtp_layers_train_from_a_checkpoint_converted_with_them(mtp_checkpoint, corpus, tmp_path):
    """As Pai trains DeepSeek-V3 (--mtp-num-layers 1): a checkpoint converted with --mtp trains its MTP layer, here
    at PP=2 (the layer on the last stage, with its own copy of the embedding), the MTP loss in the log beside the
    main one, which is transformers' on the first batch; the export holds the trained MTP layer, its copies of the
    embedding and head equal to the trained ones. Untrained, the checkpoint goes back bit-exact."""
    import json
    import os
    import subprocess
    import sys

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.cli import main
    from tests.training_helpers import REPO, hf_loss_on_first_batch, read_metrics

    mcore, untouched = tmp_path / "mcore", tmp_path / "untouched"
    assert main(["convert", "hf2mcore", "--hf-dir", str(mtp_checkpoint), "--save-dir", str(mcore), "--mtp",
                 "--quiet"]) == 0
    assert main(["convert", "mcore2hf", "--load-dir", str(mcore), "--save-dir", str(untouched), "--quiet"]) == 0
    src, back = HFCheckpointReader(mtp_checkpoint), HFCheckpointReader(untouched)
    assert sorted(back.keys()) == sorted(src.keys()) and all(torch.equal(back.get(n), src.get(n)) for n in src.keys())

    out, gbs, seq = tmp_path / "out", 4, 32
    run = dict(MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(mcore), DATASET_PATH=corpus["prefix"],
               OUTPUT_BASEPATH=str(out), GLOBAL_BATCH_SIZE=str(gbs), SEQ_LEN=str(seq),
               TRAIN_TOKENS_OR_ITERS=str(3 * gbs * seq), WARMUP_TOKENS_OR_ITERS=str(gbs * seq), LR="3e-3", MIN_LR="3e-4")
    args = launcher_args("deepseek_v3", PP="2", **run)
    proc = subprocess.run(["bash", os.path.join(REPO, get_family("deepseek_v3").launcher), *args], capture_output=True,
                          text=True, timeout=480, env={**os.environ, "PYTHON": sys.executable, "MP_PP0_LAYERS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert len(metrics) == 3 and all(0 < m["mtp_1_loss"] < 10 for m in metrics), metrics
    assert "| mtp_1 loss " in proc.stdout
    first_batch = hf_loss_on_first_batch(mtp_checkpoint, "deepseek_v3", launcher_args("deepseek_v3", **run))
    assert abs(metrics[0]["loss"] - first_batch) < 1e-4, (metrics[0]["loss"], first_batch)
    assert json.loads((out / "final" / "mpatch_checkpoint.json").read_text())["mtp_layers"] == 1

    trained = tmp_path / "trained"
    assert main(["convert", "mcore2hf", "--load-dir", str(out / "final"), "--save-dir", str(trained), "--quiet"]) == 0
    after = HFCheckpointReader(trained)
    assert sorted(after.keys()) == sorted(src.keys())
    own = [n for n in src.keys() if n.startswith("model.layers.3.") and "embed_tokens" not in n and "shared_head.head" not in n]
    assert own and all(not torch.equal(after.get(n), src.get(n)) for n in own)
    assert torch.equal(after.get("model.layers.3.embed_tokens.weight"), after.get("model.embed_tokens.weight"))
    assert torch.equal(after.get("model.layers.3.shared_head.head.weight"), after.get("lm_head.weight"))


def test_mtp_of_a_model_without_it_is_refused(variants, tmp_path, capsys):
    from megatron_patch.cli import main

    assert main(["convert", "hf2mcore", "--hf-dir", str(variants["moonlight"]), "--save-dir", str(tmp_path / "x"),
                 "--mtp", "--quiet"]) == 2
    assert "declares no multi-token-prediction layers" in capsys.readouterr().err


# --- Kimi-K2: a DeepSeek-V3 checkpoint under its own model_type, with remote code that never runs --------------

@pytest.fixture(scope="module")
def kimi_checkpoint(variants, tmp_path_factory):
    """The tiny V3 laid out as Kimi-K2's hub folder: model_type kimi_k2, auto_map pointing at code of its
    own, which, were it ever imported, would leave a file behind."""
    import json

    out = tmp_path_factory.mktemp("kimi") / "hf"
    shutil.copytree(variants["v3"], out)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                                   "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    (out / "config.json").write_text(json.dumps(config))
    marker = out.parent / "remote_code_ran"
    for name in ("configuration_deepseek.py", "modeling_deepseek.py"):
        (out / name).write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit('remote code ran')\n")
    return out


@pytest.mark.slow
def test_kimi_k2_converts_and_runs_as_deepseek_v3_without_its_code(kimi_checkpoint, variants, tmp_path):
    import json

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.cli import main

    assert parse_arch(kimi_checkpoint).family == "deepseek_v3"
    assert parse_arch(kimi_checkpoint).to_dict() | {"hf_config": None} == \
        parse_arch(variants["v3"]).to_dict() | {"hf_config": None}
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "hf2mcore", "--hf-dir", str(kimi_checkpoint), "--save-dir", str(mcore), "--tp", "2",
                 "--ep", "2", "--format", "legacy", "--quiet"]) == 0
    assert main(["convert", "mcore2hf", "--load-dir", str(mcore), "--save-dir", str(back), "--quiet"]) == 0
    src, out = HFCheckpointReader(kimi_checkpoint), HFCheckpointReader(back)
    assert sorted(out.keys()) == sorted(src.keys()) and all(torch.equal(out.get(n), src.get(n)) for n in src.keys())
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and "auto_map" in config
    # transformers' own DeepSeek-V3 runs it (as the aligner and parity check load it), and MCore agrees
    tokens = random_tokens(200, seed=8)
    reference = hf_logits(kimi_checkpoint, tokens)
    assert torch.equal(reference, hf_logits(variants["v3"], tokens))
    m = compare_logits(reference, mcore_logits([kimi_checkpoint], ParallelLayout(), [tokens])[0])
    assert m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, m
    assert not (kimi_checkpoint.parent / "remote_code_ran").exists()


def test_int4_hub_weights_are_refused_in_one_line(kimi_checkpoint, tmp_path, capsys):
    """Kimi-K2-Thinking ships INT4 (compressed-tensors) weights: refused before anything is read or written."""
    import json

    from megatron_patch.cli import main

    int4 = tmp_path / "int4"
    shutil.copytree(kimi_checkpoint, int4)
    config = json.loads((int4 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (int4 / "config.json").write_text(json.dumps(config))
    assert main(["convert", "hf2mcore", "--hf-dir", str(int4), "--save-dir", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "quant_method 'compressed-tensors' (INT4 weights, as Kimi-K2-Thinking ships them) is not supported" in err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


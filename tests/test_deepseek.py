"""DeepSeek beyond what the registry-driven tests run for every family: its relatives' variants
(V2-Lite: no q-LoRA, softmax routing; Moonlight: plain RoPE, sigmoid routing without groups), the
RoPE layout megatron-core's MLA assumes, the configurations it refuses, and the launcher's checks.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from megatron_patch.align.parity import FP32_KL, FP32_REL_L2, check_parity_all, hf_logits, mcore_logits, random_tokens
from megatron_patch.align.metrics import compare_logits
from megatron_patch.convert.engine import hf_tensors_from_ranks, rank_state_dict_from_hf
from megatron_patch.errors import UserError
from megatron_patch.models.mapping import RankCoord
from megatron_patch.models.registry import get_family, parse_arch
from megatron_patch.models.tiny import make_tiny_hf_checkpoint, tiny_config
from megatron_patch.runtime import ParallelLayout
from tests.training_helpers import launcher_args

V2_LITE = dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], q_lora_rank=None,
               topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1, norm_topk_prob=False,
               routed_scaling_factor=2.0,
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707})
MOONLIGHT = dict(q_lora_rank=None, n_group=1, topk_group=1, routed_scaling_factor=2.446, rope_scaling=None,
                 rope_theta=50000.0)


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


@pytest.mark.parametrize("layout", [ParallelLayout(), ParallelLayout(tp=2, ep=2)], ids=str)
def test_variants_match_transformers(variants, layout):
    names = ["v2_lite", "moonlight"]
    for name, m in zip(names, check_parity_all([variants[n] for n in names], layout, seed=6)):
        assert m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, (name, m)


def test_variants_round_trip_at_tp_ep_and_pp(variants):
    fam = get_family("deepseek_v3")
    for name, folder in variants.items():
        arch = parse_arch(folder)
        from megatron_patch.convert.hf_reader import HFCheckpointReader

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


def test_rope_on_interleaved_pairs_is_what_megatron_core_computes(variants, tmp_path):
    """transformers' rope_interleave=true (the released checkpoints) is reproduced with the weights as
    they are (test_variants_match_transformers and the family's own parity); the same weights with their
    RoPE rows re-ordered to halves, which a converter ignoring the layout would produce, are far off."""
    from safetensors.torch import save_file

    from megatron_patch.convert.hf_reader import HFCheckpointReader

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


@pytest.mark.parametrize("over, fragment", [
    (dict(norm_topk_prob=False), "norm_topk_prob=false with sigmoid routing"),
    (dict(num_experts_per_tok=6, topk_group=2), "scores groups differently"),
    (dict(rope_interleave=False), "rope_interleave=false"),
    (dict(num_key_value_heads=2), "num_key_value_heads must equal num_attention_heads"),
    (dict(scoring_func="sqrtsoftplus"), "scoring_func 'sqrtsoftplus'"),
    (dict(attention_bias=True), "attention_bias=true"),
])
def test_what_megatron_core_computes_otherwise_is_refused(over, fragment):
    with pytest.raises(UserError) as err:
        parse_arch({**tiny_config("deepseek_v3"), **over})
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("over, fragment", [
    (dict(TP="3"), "TP=3 does not divide the 4 attention heads"),
    (dict(EP="3"), "EP=3 does not divide the 8 experts"),
    (dict(PP="2"), "PP=2 does not divide the 3 layers (1 dense, then MoE)"),
])
def test_launcher_refuses_layouts_that_cannot_split_the_model(tmp_path, over, fragment):
    from megatron_patch.training.arguments import resolve

    prefix = tmp_path / "d_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    args = launcher_args("deepseek_v3", DATASET_PATH=str(prefix), OUTPUT_BASEPATH=str(tmp_path / "out"), **over)
    with pytest.raises(UserError) as err:
        resolve("deepseek_v3", args)
    assert fragment in str(err.value)

"""Gemma 4's MoE block (``enable_moe_block``, the 26B-A4B): the dense MLP and the experts side by side on the same
residual, Gemma 4's router (a weightless norm times its scale, renormalised top-k times a per-expert scale), the
experts' own pre-norm, on megatron-core's MoELayer. The tiny MoE model (TINY_MOE_CONFIG: the tiny model with 4
experts of 32, top-2) against transformers at TP=1, EP=2 and TP=2, each piece shown to matter, bit-exact round trips
of the fused on-disk expert tensors at EP>1 layouts, the 26B-A4B preset's published size, the memory plan's experts,
and an incomplete config refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.models.gemma4.config import TINY_MOE_CONFIG

GEMMA4 = families()["gemma4"]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """The tiny MoE model's HF folder, made once for this module's tests."""
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint("gemma4", tmp_path_factory.mktemp("gemma4-moe") / "hf", seed=7, **TINY_MOE_CONFIG)


def test_the_moe_fields_are_read_and_an_incomplete_config_is_refused_in_one_line():
    arch = parse_arch(TINY_MOE_CONFIG)
    assert (arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size, arch.shared_expert_ffn_hidden_size) == \
        (4, 2, 32, 96)
    assert all(arch.is_moe_layer(i) for i in range(arch.num_layers)) and not parse_arch(GEMMA4.tiny_config).is_moe
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        with pytest.raises(UserError, match=f"enable_moe_block=true but no {key}"):
            parse_arch({k: v for k, v in TINY_MOE_CONFIG.items() if k != key})
    with pytest.raises(UserError, match="top_k_experts=5 is more than the 4 experts"):
        parse_arch({**TINY_MOE_CONFIG, "top_k_experts": 5})
    with pytest.raises(UserError, match="'num_experts' must be"):
        parse_arch({**TINY_MOE_CONFIG, "num_experts": 0})


def test_the_tiny_moe_model_counts_as_transformers_builds_it():
    """megatron-core's MoE model has transformers' parameters (the vocabulary's padding aside), and a token passes
    through top-2 of the 4 experts."""
    from transformers import AutoConfig, Gemma4ForCausalLM

    from megatron_patch.models.shape.model_shape import model_shape

    arch = parse_arch(TINY_MOE_CONFIG)
    shape = model_shape(arch)
    hf = Gemma4ForCausalLM(AutoConfig.for_model(**TINY_MOE_CONFIG))
    padding = (arch.padded_vocab_size() - arch.vocab_size) * arch.hidden_size
    assert shape.params() == sum(p.numel() for p in hf.parameters()) + padding
    experts = 2 * 4 * 3 * 32 * 48  # 2 layers of 4 experts: [gate; up] and down, of 32 x 48
    assert shape.params() - shape.params(active=True) == experts // 2


@pytest.mark.slow
def test_the_26b_a4b_preset_has_the_published_size():
    """The 26B-A4B preset's language model as megatron-core builds it (128 experts of 704, top 8, beside a dense
    MLP of 2112) has transformers' parameter count, 25.2B, 3.8B of them active, as Google gives them."""
    import transformers

    from megatron_patch.models.shape.model_shape import model_shape

    config = GEMMA4.presets["26B-A4B"]
    arch = parse_arch(config)
    shape = model_shape(arch)
    assert shape.layers["full_attention+moe"]["self_attention.linear_qkv.weight"] == ((16 + 2) * 512, 2816)
    assert shape.layers["sliding_attention+moe"]["mlp.experts.linear_fc1.weight0"] == (2 * 704, 2816)
    with torch.device("meta"):
        hf = transformers.Gemma4ForCausalLM(transformers.AutoConfig.for_model(**config))
    assert shape.params() == sum(p.numel() for p in hf.parameters()) == 25_233_141_760
    assert round(shape.params() / 1e9, 1) == 25.2 and round(shape.params(active=True) / 1e9, 1) == 3.8


@pytest.mark.slow
def test_logits_are_transformers_at_tp1_ep2_and_tp2(tiny_moe):
    from megatron_patch.align.parity import check_parity
    from megatron_patch.runtime.distributed import ParallelLayout as L

    for layout in (L(), L(ep=2), L(tp=2), L(tp=2, ep=2, etp=1)):
        metrics = check_parity(tiny_moe, layout)
        assert metrics["passed"], (layout, metrics)


def pieces_worker(hf_dir: str, tokens: torch.Tensor) -> dict:
    """The tiny MoE model's logits as built, and with each piece of the MoE block left out."""
    from megatron_patch.models.gemma4 import moe
    from tests.family_helpers import logits_with_pieces_left_out

    def unscaled_routing(self, logits, *args, **kwargs):
        return moe.TopKRouter.routing(self, logits, *args, **kwargs)

    def unscaled_gating(self, input):
        return moe.TopKRouter.gating(self, moe._rms(input, self.config.layernorm_epsilon) * self.config.hidden_size
                                     ** -0.5)

    def raw_dispatch(self, hidden_states, probs):
        return moe.MoELayer.dispatch(self, hidden_states, probs)

    router, layer = moe.Gemma4Router, moe.Gemma4MoELayer
    left_out = {
        "built": {},
        "no_per_expert_scale": {"Gemma4Router": type("R", (router,), {"routing": unscaled_routing})},
        "no_router_scale": {"Gemma4Router": type("R", (router,), {"gating": unscaled_gating})},
        "no_experts_pre_norm": {"Gemma4MoELayer": type("M", (layer,), {"dispatch": raw_dispatch})},
    }
    return logits_with_pieces_left_out(moe, hf_dir, tokens, left_out)


@pytest.mark.slow
def test_each_piece_of_the_moe_block_matters(tiny_moe):
    """With the router's scale, its per-expert scale and the experts' own pre-norm, the logits are transformers';
    leaving any one out is far off."""
    from megatron_patch.align.parity import FP32_REL_L2, compare_logits, hf_logits, random_tokens
    from megatron_patch.runtime.launch import run_local

    tokens = random_tokens(200, 2, 32, 1)
    logits = run_local(pieces_worker, 1, str(tiny_moe), tokens)[0]
    want = hf_logits(tiny_moe, tokens)
    assert compare_logits(want, logits["built"])["rel_l2"] <= FP32_REL_L2
    for name in ("no_per_expert_scale", "no_router_scale", "no_experts_pre_norm"):
        assert compare_logits(want, logits[name])["rel_l2"] > 100 * FP32_REL_L2, name


@pytest.mark.slow
def test_the_fused_expert_tensors_convert_at_ep_layouts_and_back_bit_exact(tiny_moe, tmp_path):
    """transformers' stacked experts (gate_up_proj [4, 2 x 32, 48] of [gate; up] halves, down_proj [4, 48, 32]) go
    to megatron-core's per-expert [gate; up] and down weights, split over EP (and ETP), and come back bit for bit
    with every other tensor."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf
    from megatron_patch.runtime.distributed import ParallelLayout as L

    src = HFCheckpointReader(tiny_moe)
    assert tuple(src.get("model.layers.1.experts.gate_up_proj").shape) == (4, 64, 48)
    for fmt, layout in (("legacy", L(ep=2)), ("legacy", L(tp=2, ep=2)), ("torch_dist", L(pp=2, ep=4)),
                        ("torch_dist", L(tp=2, ep=2, etp=1))):
        name = f"{fmt}-{layout.tp}-{layout.pp}-{layout.ep}"
        ckpt, back = tmp_path / name, tmp_path / f"back-{name}"
        hf_to_mcore(tiny_moe, ckpt, layout, fmt=fmt, dtype="fp32", progress=False)
        if fmt == "legacy" and layout.tp == 1:  # rank 1 of EP holds experts 2 and 3
            state = torch.load(next(ckpt.glob("release/mp_rank_00_001/model_optim_rng.pt")), weights_only=True)
            fc1 = state["model"]["decoder.layers.1.mlp.experts.linear_fc1.weight1"]  # its 2nd
            assert torch.equal(fc1, src.get("model.layers.1.experts.gate_up_proj")[3])
        mcore_to_hf(ckpt, back, progress=False)
        got = HFCheckpointReader(back)
        assert sorted(got.keys()) == sorted(src.keys()), name
        assert all(torch.equal(got.get(n), src.get(n)) for n in src.keys()), name


def test_the_memory_plan_counts_the_experts(tmp_path):
    """The plan's weights are the MoE model's parameters as megatron-core builds them: beside the dense model's,
    per layer the 4 experts, the router (proj, scale, per-expert scale) and three norms more."""
    from megatron_patch.training import memory_plan
    from megatron_patch.training.validation import resolve
    from tests.training_helpers import launcher_args

    prefix = tmp_path / "c_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    cfg = resolve("gemma4", launcher_args("gemma4", PR="bf16", DATASET_PATH=str(prefix),
                                          OUTPUT_BASEPATH=str(tmp_path / "out")), env={})
    moe = parse_arch({**cfg.arch.hf_config, **TINY_MOE_CONFIG})
    dense, experts = (memory_plan.stage_memory(a, cfg, 0, "local") for a in (cfg.arch, moe))
    per_layer = 4 * 3 * 32 * 48 + (4 * 48 + 48 + 4) + 3 * 48
    assert experts.trainable - dense.trainable == 2 * per_layer


@pytest.mark.slow
def test_the_launcher_trains_the_moe_block_at_ep2_from_a_converted_checkpoint(tiny_moe, corpus, tmp_path):
    """The Gemma 4 launcher takes ETP and EP after CP where the model has experts (its dense command lines keep
    their 25 arguments): the tiny MoE model, converted, trains at EP=2 (each rank 2 of the 4 experts) and the loss
    falls; the checkpoint it saves converts back to an HF folder."""
    from megatron_patch.cli import main
    from megatron_patch.training.launcher_args import get_launcher
    from tests.training_helpers import train_converted

    assert [len(get_launcher("gemma4").arg_names(layout)) for layout in get_launcher("gemma4").layouts] == [25, 27]
    proc, losses = train_converted("gemma4", tiny_moe, corpus, tmp_path, ("ETP", "EP"), {"MP_NPROC": "2"}, EP="2")
    assert proc.returncode == 0 and len(proc.args) == 2 + 27, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
    out = tmp_path / "out"
    assert main(["convert", "mcore2hf", "--load-dir", str(out / "checkpoint"), "--save-dir", str(tmp_path / "back"),
                 "--quiet"]) == 0


@pytest.mark.slow
def test_align_says_aligned_in_fp32_and_bf16(tiny_moe):
    """`mpatch align --dtype bf16` on the MoE model (the HF folder mapped in memory): fp32 certifies the mapping,
    and bf16 stays within transformers' own bf16 rounding at every layer (the router's projection runs in fp32 in
    megatron-core, in the model's dtype in transformers: within that rounding here)."""
    from megatron_patch.cli import main

    assert main(["align", "--hf-dir", str(tiny_moe), "--dtype", "bf16", "--quiet"]) == 0


@pytest.mark.slow
def test_align_compares_the_router_and_every_expert_and_a_fault_no_token_reaches_fails(tiny_moe, tmp_path):
    """Gemma 4's MoE layers have align's router logits (its projection's: the router returns probabilities first)
    and every-expert points as every MoE family's: a clean conversion is aligned with them, an expert no input token
    chose scaled by 2 fails at that layer's every-expert point (it was ALIGNED: the MoE block had neither point), and
    a router row 0.3% off fails at the router's logits."""
    from megatron_patch.align.points import every_expert_point, router_point
    from megatron_patch.align.parity import random_tokens
    from megatron_patch.align.runner import McoreRun, capture_hf_dir, capture_mcore_runs
    from megatron_patch.align.verdict import judge
    from megatron_patch.checkpoint_files.manifest import write_manifest
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.runtime import ParallelLayout
    from tests.convert_helpers import edit_weights

    arch = parse_arch(tiny_moe)
    # two tokens (4 expert slots of 4 experts): the first seed whose routing leaves an expert of layer 1 unchosen
    for seed in range(20):
        tokens = random_tokens(arch.vocab_size, batch=1, seq=2, seed=seed)
        ref = capture_hf_dir(tiny_moe, tokens, "fp32")
        unused = sorted(set(range(arch.num_experts)) - set(ref["routing.1"].flatten().tolist()))
        if unused:
            break
    assert unused, "no seed left an expert unchosen"

    def planted(name, edit):
        ckpt = tmp_path / name
        hf_to_mcore(tiny_moe, ckpt, ParallelLayout(), fmt="legacy", progress=False)
        if edit is not None:
            edit_weights(ckpt, edit)
            write_manifest(ckpt, "tests: planted fault", sync=False)
        return McoreRun("fp32", mcore_dir=str(ckpt))

    def scale_unused_expert(sd):
        sd[f"decoder.layers.1.mlp.experts.linear_fc2.weight{unused[0]}"] *= 2

    def nudge_router_row(sd):
        sd["decoder.layers.1.mlp.router.weight"][0] *= 1.003

    runs = [planted("clean", None), planted("expert", scale_unused_expert), planted("router", nudge_router_row)]
    clean, expert, router = (judge(ref, c, "fp32", arch.num_layers)
                             for c in capture_mcore_runs(ParallelLayout(), tokens, runs))
    names = [p.name for p in clean.points]
    for i in range(arch.num_layers):
        assert names.index(router_point(i)) < names.index(f"layers.{i}.mlp") < names.index(every_expert_point(i))
    assert clean.aligned and [r.layer for r in clean.routing] == list(range(arch.num_layers)), clean.summary
    assert not expert.aligned and expert.first_failure == every_expert_point(1), expert.summary
    assert not router.aligned and router.first_failure == router_point(1), router.summary

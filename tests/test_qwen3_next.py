"""Qwen3-Next beyond what the registry-driven tests run for every family: its layers' arithmetic against
transformers' own (the gated delta rule over several chunks, the zero-centred and gated norms, bit for
bit), and what megatron-core cannot run refused in one line.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import validate_layout
from megatron_patch.models.description.registry import parse_arch
from megatron_patch.models.description.tiny import tiny_config
from megatron_patch.runtime import ParallelLayout


@pytest.mark.parametrize("length", [32, 150])  # one chunk; three, the last one partial
def test_gated_delta_rule_is_transformers_bit_for_bit(length):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from megatron_patch.models.qwen3_next.layers import chunked_gated_delta_rule

    g = torch.Generator().manual_seed(length)
    q, k = (torch.randn(2, length, 2, 16, generator=g) for _ in range(2))  # 2 key heads serve 4 value heads
    v = torch.randn(2, length, 4, 8, generator=g)
    decay, beta = -torch.rand(2, length, 4, generator=g), torch.rand(2, length, 4, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        args = [t.to(dtype) for t in (q, k, v)] + [decay, beta.to(dtype)]
        # transformers' layer gives the function each key head repeated for its value heads (before 5.24 the
        # function required it; 5.24 also takes them grouped)
        q_rep, k_rep = (t.repeat_interleave(2, dim=2) for t in args[:2])
        theirs = torch_chunk_gated_delta_rule(q_rep, k_rep, args[2], g=args[3], beta=args[4],
                                              use_qk_l2norm_in_kernel=True)[0]
        assert torch.equal(chunked_gated_delta_rule(*args)[0], theirs), dtype


def _rule_inputs(length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, length, 2, 16, generator=g) for _ in range(2))  # 2 key heads serve 4 value heads
    v = torch.randn(2, length, 4, 8, generator=g)
    return q, k, v, -torch.rand(2, length, 4, generator=g), torch.rand(2, length, 4, generator=g)


def test_the_recurrent_and_continued_rules_are_transformers_bit_for_bit():
    """The two forms a generation runs: one token at a time from a state, and the chunks of a continuation
    from a state; each as transformers computes it, the final state included."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                    torch_recurrent_gated_delta_rule)

    from megatron_patch.models.qwen3_next.layers import chunked_gated_delta_rule, recurrent_gated_delta_rule

    q, k, v, decay, beta = _rule_inputs(70)
    state = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(1))
    q_rep, k_rep = (t.repeat_interleave(2, dim=2) for t in (q, k))
    for ours, theirs in ((recurrent_gated_delta_rule, torch_recurrent_gated_delta_rule),
                         (lambda *a: chunked_gated_delta_rule(*a[:5], initial_state=a[5], output_final_state=True),
                          torch_chunk_gated_delta_rule)):
        out, last = ours(q, k, v, decay, beta, state)
        their_out, their_last = theirs(q_rep, k_rep, v, g=decay, beta=beta, initial_state=state,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert torch.equal(out, their_out) and torch.equal(last, their_last)


@pytest.mark.parametrize("prompt", [1, 64, 70])  # a token; exactly a chunk; a chunk and part of one
def test_a_sequence_continued_from_its_state_is_the_whole_sequence(prompt):
    """A prompt's chunked rule with its final state, then the rest one token at a time and as one continuation,
    gives the whole sequence's output and final state within float32 noise."""
    from megatron_patch.models.qwen3_next.layers import chunked_gated_delta_rule, recurrent_gated_delta_rule

    inputs = _rule_inputs(prompt + 9, seed=prompt)
    head, tail = ([t[:, :prompt] for t in inputs], [t[:, prompt:] for t in inputs])
    whole, whole_state = chunked_gated_delta_rule(*inputs, output_final_state=True)
    first, state = chunked_gated_delta_rule(*head, output_final_state=True)
    steps, step_state = [], state
    for i in range(tail[0].shape[1]):
        out, step_state = recurrent_gated_delta_rule(*[t[:, i:i + 1] for t in tail], step_state)
        steps.append(out)
    continued, continued_state = chunked_gated_delta_rule(*tail, initial_state=state, output_final_state=True)
    for rest, last in ((torch.cat(steps, 1), step_state), (continued, continued_state)):
        torch.testing.assert_close(torch.cat([first, rest], 1), whole, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(last, whole_state, rtol=1e-5, atol=1e-5)


def test_norms_are_transformers_bit_for_bit():
    """The zero-centred RMSNorm keeps the weight as stored and adds the 1 in float32, as transformers does;
    the Gated DeltaNet's output norm has a plain weight and a SiLU gate."""
    from types import SimpleNamespace

    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated

    from megatron_patch.models.blocks.norms import ZeroCenteredRMSNorm
    from megatron_patch.models.qwen3_next.layers import GatedRMSNorm

    g = torch.Generator().manual_seed(0)
    x, gate, weight = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g), 0.1 * torch.randn(32, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        config = SimpleNamespace(params_dtype=dtype, sequence_parallel=False)
        ours, theirs = ZeroCenteredRMSNorm(config, 32, eps=1e-6), Qwen3NextRMSNorm(32, eps=1e-6).to(dtype)
        ours_gated, theirs_gated = GatedRMSNorm(config, 32, eps=1e-6), Qwen3NextRMSNormGated(32, eps=1e-6).to(dtype)
        with torch.no_grad():
            for module in (ours, theirs, ours_gated, theirs_gated):
                module.weight.copy_(weight if module in (ours, theirs) else 1 + weight)
            assert torch.equal(ours(x.to(dtype)), theirs(x.to(dtype))), dtype
            assert torch.equal(ours_gated(x.to(dtype), gate.to(dtype)), theirs_gated(x.to(dtype), gate.to(dtype))), dtype


@pytest.mark.parametrize("over, fragment", [
    ({"attention_bias": True}, "attention_bias=true is not supported for qwen3_next"),
    ({"layer_types": ["linear_attention", "sliding_attention"]}, "each linear_attention or full_attention"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads=3 is not a multiple"),
    # the weight table refused its zero-wide tensors, naming no config field (the cfg audit)
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0 is not supported for qwen3_next"),
])
def test_what_megatron_core_computes_otherwise_is_refused(over, fragment):
    with pytest.raises(UserError) as err:
        parse_arch(tiny_config("qwen3_next", **over))
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_use_sliding_window_is_no_field_of_qwen3_next():
    """transformers' Qwen3NextConfig has no use_sliding_window (and drops sliding_window): its full-attention layers
    never slide, so a config.json carrying them builds the same model (it was refused)."""
    plain = parse_arch(tiny_config("qwen3_next"))
    carrying = parse_arch(tiny_config("qwen3_next", use_sliding_window=True, sliding_window=4))
    assert (carrying.layer_types, carrying.sliding_window) == (plain.layer_types, plain.sliding_window)


@pytest.mark.parametrize("over, layout, fragment", [
    ({}, ParallelLayout(cp=2), "does not split linear attention (Gated DeltaNet)"),
    ({"linear_num_key_heads": 1}, ParallelLayout(tp=2), "TP=2 does not divide the linear attention's 1 key"),
])
def test_layouts_megatron_core_cannot_run_are_refused(over, layout, fragment):
    with pytest.raises(UserError) as err:
        validate_layout(parse_arch(tiny_config("qwen3_next", **over)), layout)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_more_than_one_mtp_layer_is_refused():
    import dataclasses

    from megatron_patch.models.description.registry import get_family

    arch = dataclasses.replace(parse_arch(tiny_config("qwen3_next")), mtp_layers=2)
    with pytest.raises(UserError, match="share one mtp.fc"):
        get_family("qwen3_next").weight_rules(arch)


# --- Qwen3.5 (the qwen3_5 family): the dense sibling of the MoE model the registry-driven tests run ---------------

@pytest.mark.slow
def test_qwen3_5_dense_language_model_round_trips_and_matches_transformers(tmp_path):
    """Qwen3.5-27B's layout (a dense MLP in every layer) at a tiny size: converted both ways bit-exact with its
    vision tower, and its MCore twin's logits are transformers'."""
    from megatron_patch.align.parity import FP32_KL, FP32_REL_L2, check_parity
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.models.qwen3_5.config import TINY_DENSE_CONFIG

    hf = make_tiny_hf_checkpoint("qwen3_5", tmp_path / "hf", seed=5, **TINY_DENSE_CONFIG)
    arch = parse_arch(hf)
    assert not arch.is_moe and arch.layer_types == ("linear_attention", "full_attention")
    hf_to_mcore(hf, tmp_path / "mcore", ParallelLayout(tp=2, pp=2), fmt="legacy", progress=False)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    src, out = HFCheckpointReader(hf), HFCheckpointReader(tmp_path / "back")
    assert sorted(out.keys()) == sorted(src.keys()) and any("visual" in n for n in src.keys())
    assert all(torch.equal(out.get(n), src.get(n)) for n in src.keys())
    m = check_parity(hf, ParallelLayout(tp=2), seed=3)
    assert m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, m


def test_qwen3_5_ties_its_embeddings_as_its_own_class_does(tmp_path):
    """Qwen3_5*ForConditionalGeneration reads tie_word_embeddings at the top of config.json (absent: untied); the
    family fell back on text_config's, built a tied model, and the export left out lm_head.weight, which the folder's
    own class then loaded at random: exit 0 both ways, the logits off (the cfgvar2 audit)."""
    import json

    from safetensors.torch import load_file, save_file

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    text = {**tiny_config("qwen3_5")["text_config"], "tie_word_embeddings": True}
    hf = make_tiny_hf_checkpoint("qwen3_5", tmp_path / "hf", seed=4, text_config=text)
    config = json.loads((hf / "config.json").read_text())
    config.pop("tie_word_embeddings", None)
    (hf / "config.json").write_text(json.dumps(config))
    shard = next(hf.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"] * 2  # not the embedding: untied
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert not parse_arch(hf).tie_word_embeddings
    hf_to_mcore(hf, tmp_path / "mcore", ParallelLayout(), progress=False)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    src, out = HFCheckpointReader(hf), HFCheckpointReader(tmp_path / "back")
    assert sorted(out.keys()) == sorted(src.keys()) and all(torch.equal(out.get(n), src.get(n)) for n in src.keys())
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "back", dtype=torch.float32)
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


def test_qwen3_5_without_its_text_config_is_refused():
    with pytest.raises(UserError, match="has no text_config: point at Qwen3.5's multimodal hub folder"):
        parse_arch({"model_type": "qwen3_5", "hidden_size": 64})


def test_qwen3_5_moe_config_as_transformers_writes_it_converts(tmp_path):
    """transformers' Qwen3_5MoeTextConfig has no dense intermediate_size (every layer is MoE), so neither has a
    hub config.json: the tiny model is saved through it, and the field absent or null is no refusal."""
    import json

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.cli import main
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    assert "intermediate_size" not in transformers.Qwen3_5MoeTextConfig().to_dict()
    hf = make_tiny_hf_checkpoint("qwen3_5", tmp_path / "hf", seed=4)
    config = json.loads((hf / "config.json").read_text())
    assert "intermediate_size" not in config["text_config"]
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "mcore"), "--quiet"]) == 0
    assert main(["convert", "mcore2hf", "--load-dir", str(tmp_path / "mcore"), "--save-dir", str(tmp_path / "back"),
                 "--quiet"]) == 0
    src, out = HFCheckpointReader(hf), HFCheckpointReader(tmp_path / "back")
    assert sorted(out.keys()) == sorted(src.keys()) and all(torch.equal(out.get(n), src.get(n)) for n in src.keys())
    config["text_config"]["intermediate_size"] = None
    arch = parse_arch(config)
    assert arch.is_moe and not arch.has_dense_layers


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])  # TP=2: a multi-process parity check
def test_generation_continues_the_gated_deltanet_state_one_token_per_step(tp):
    """A generation with the runner's inference context gives the logits one whole forward gives, within float32
    noise: each Gated DeltaNet layer continues its convolution and recurrent state, each row of the batch its own,
    each TP rank its heads. And a generated token costs one token's forward: every layer, linear and full
    attention, sees the prompt once and then one token per step."""
    from tests.eval_helpers import check_generation_continues

    arch = parse_arch(tiny_config("qwen3_next"))
    assert arch.num_layers == 2
    tokens = [[5, 17, 33, 8, 90, 61, 12, 4, 9, 100, 11, 3, 44, 150],
              [44, 3, 150, 27, 9, 71, 18, 100, 7, 7, 120, 3, 66, 1]]
    check_generation_continues(arch, tp, tokens, prompt=6)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_a_legacy_checkpoint_loads_into_the_local_spec(family, tmp_path):
    """A legacy checkpoint (TE's layout) is re-cut for the local spec where the two cut alike: the Gated DeltaNet's
    in_proj split, built anew by each plan, was taken for another and `mpatch align` (and CPU training) refused
    the project's own legacy conversion (the second fp8 audit)."""
    from megatron_patch.cli import main
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    hf = make_tiny_hf_checkpoint(family, tmp_path / "hf", seed=3)
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "legacy"), "--format",
                 "legacy", "--quiet"]) == 0
    assert main(["align", "--hf-dir", str(hf), "--mcore-dir", str(tmp_path / "legacy"), "--dtype", "fp32",
                 "--seq-len", "16", "--report-dir", str(tmp_path / "report"), "--quiet"]) == 0


@pytest.mark.slow
def test_align_runs_a_model_of_gated_deltanet_layers_alone(tmp_path, capsys):
    """A Qwen3-Next whose every layer is Gated DeltaNet converts and runs in transformers; align's HF forward made
    transformers' KV cache, which cannot size a mask without an attention layer: an internal error. One forward
    needs no cache."""
    from megatron_patch.cli import main
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    hf = make_tiny_hf_checkpoint("qwen3_next", tmp_path / "hf", seed=5, num_hidden_layers=1,
                                 layer_types=["linear_attention"])
    assert parse_arch(hf).layer_types == ("linear_attention",)
    assert main(["align", "--hf-dir", str(hf), "--dtype", "fp32", "--seq-len", "16", "--batch", "1", "--quiet"]) == 0, \
        capsys.readouterr().err

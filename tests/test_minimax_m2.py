"""MiniMax-M2 beyond what the registry-driven tests run for every family (round trips at its layouts, logits
against transformers at TP=1, TP=2 and PP=2, alignment, LoRA against peft, the launcher): config.json as the
hub writes it (the legacy rotary_dim), the whole-width q/k norm against transformers' and across TP ranks in
training, FP8 hub weights, and the configurations it refuses.
"""

from __future__ import annotations

import types

import pytest
import torch
import transformers

from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import get_family, parse_arch
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint, tiny_config
from megatron_patch.runtime import ParallelLayout
from megatron_patch.runtime.launch import run_local
from tests.convert_helpers import write_fp8_checkpoint
from tests.minimax_helpers import grads_worker

FP8_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf_checkpoint("minimax_m2", tmp_path_factory.mktemp("minimax_m2") / "hf", seed=4)


HUB = get_family("minimax_m2").presets["230B-A10B"]


@pytest.mark.parametrize("raw", [
    HUB,  # the hub's config.json: rotary_dim and a top-level rope_theta only
    tiny_config("minimax_m2", rotary_dim=8),
    tiny_config("minimax_m2", partial_rotary_factor=0.25),  # wins over rotary_dim, as in transformers
    tiny_config("minimax_m2", rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}),
], ids=["hub", "rotary_dim", "top-level-factor", "rope_parameters"])
def test_rotary_dim_is_read_as_transformers_reads_it(raw):
    config = transformers.AutoConfig.for_model(**raw)
    assert parse_arch(raw).rotary_percent == config.rope_parameters["partial_rotary_factor"]


@pytest.mark.parametrize("over, fragment", [
    ({"qk_norm_type": "per_head"}, "qk_norm_type 'per_head' is not supported"),
    ({"use_qk_norm": False}, "use_qk_norm=false"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' is not supported"),
    ({"use_routing_bias": False}, "use_routing_bias=false"),
    ({"shared_intermediate_size": 64}, "no shared expert"),
    ({"attn_type_list": [0, 1]}, "lightning attention"),
    ({"rotary_dim": 33}, "rotary_dim=33 must be an even number of at most head_dim=32"),
    ({"rotary_dim": "16"}, "'rotary_dim' must be a whole number"),
    ({"attn_type_list": [1, 2]}, "'attn_type_list' must list whole numbers between 0 and 1"),
    ({"qk_norm_type": 1}, "'qk_norm_type' must be a string"),
])
def test_unsupported_configs_fail_in_one_line(over, fragment):
    with pytest.raises(UserError) as err:
        parse_arch(tiny_config("minimax_m2", **over))
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_whole_width_norm_equals_transformers(dtype):
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    from megatron_patch.models.minimax_m2.layers import KeyNorm, QueryNorm

    config = types.SimpleNamespace(tensor_model_parallel_size=1, num_attention_heads=4, num_query_groups=2,
                                   params_dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    for cls, heads in ((QueryNorm, 4), (KeyNorm, 2)):
        ours, theirs = cls(config, hidden_size=8, eps=1e-6), MiniMaxM2RMSNorm(heads * 8, eps=1e-6).to(dtype)
        with torch.no_grad():
            ours.weight.copy_(torch.rand(heads * 8, generator=gen) + 0.5)
            theirs.weight.copy_(ours.weight)
        x = (torch.randn(5, 3, heads, 8, generator=gen) * 3).to(dtype)  # [s, b, heads, head_dim]
        got, want = ours(x), theirs(x.reshape(5, 3, heads * 8)).reshape(5, 3, heads, 8)
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, rtol=1e-6 if dtype == torch.float32 else 0, atol=0)
        # per head it would be another function: the test can fail
        assert not torch.allclose(got.float(), (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
                                                * ours.weight.view(heads, 8).float()), atol=1e-3)


@pytest.mark.slow
def test_tp2_with_sequence_parallel_trains_as_tp1(hf_dir):
    """One global batch through megatron-core's schedule and finalize_model_grads: every gradient at TP=2 with
    sequence parallelism equals TP=1's. The q/k norms' statistics cross the ranks in forward and backward
    (without the backward all-reduce every gradient below the norms is off by several percent), and their
    weights' gradients are summed over TP by megatron-core (a weight split over TP would add its
    neighbours' slices)."""
    one = run_local(grads_worker, 1, str(hf_dir), ParallelLayout(), False)[0]
    two = next(r for r in run_local(grads_worker, 2, str(hf_dir), ParallelLayout(tp=2), True) if r is not None)
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-5)
    assert set(one["grads"]) == set(two["grads"]) and any("q_layernorm" in k for k in one["grads"])
    for name, want in one["grads"].items():
        got = two["grads"][name]
        assert float(want.norm()) > 0, name
        assert float((got - want).norm() / want.norm()) < 1e-5, name


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="transformers 4.x has no MiniMaxM2 and dequantizes FP8 only on a GPU")
def test_fp8_checkpoint_converts_to_what_transformers_dequantizes(hf_dir, tmp_path):
    """MiniMax-M2's hub weights are FP8 with 128x128 block scales (16x16 here): converted with --dtype bf16 at
    TP=2, EP=2 and back, every dequantized weight is transformers' bit for bit, every other tensor as stored."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.cli import main

    fp8 = write_fp8_checkpoint(hf_dir, tmp_path / "fp8", FP8_LINEAR, (16, 16))
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "hf2mcore", "--hf-dir", str(fp8), "--save-dir", str(mcore), "--dtype", "bf16",
                 "--tp", "2", "--ep", "2", "--format", "torch_dist", "--quiet"]) == 0
    assert main(["convert", "mcore2hf", "--load-dir", str(mcore), "--save-dir", str(back), "--quiet"]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(fp8), dtype=torch.bfloat16).state_dict()
    source, ours = HFCheckpointReader(fp8), HFCheckpointReader(back)
    inter = parse_arch(fp8).moe_ffn_hidden_size
    quantized = 0
    for name in ours.keys():
        got = ours.get(name)
        if source.dtype(name) != "float8_e4m3fn":
            assert torch.equal(got, source.get(name)), name  # norms, router, its fp32 bias, embeddings: as stored
            continue
        quantized += 1
        if ".experts." in name:  # transformers 5 stacks each layer's experts: [E, 2I, H] (w1; w3) and [E, H, I]
            prefix, expert, proj = name.split(".block_sparse_moe.")[0], int(name.split(".")[-3]), name.split(".")[-2]
            stacked = theirs[f"{prefix}.mlp.experts.{'down_proj' if proj == 'w2' else 'gate_up_proj'}"][expert]
            want = stacked if proj == "w2" else stacked[(0 if proj == "w1" else inter):][:inter]
        else:
            want = theirs[name]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    assert quantized == 2 * (4 + 3 * 4)  # per layer: q, k, v, o and three per expert


@pytest.mark.slow
def test_peft_adapter_on_attention_and_experts_gives_peft_logits_at_tp2_ep2(hf_dir, tmp_path):
    """A random peft adapter on q/k/v/o and the stacked experts, imported at TP=2, EP=2 (the q/k norms' heads
    split, the adapted linear_qkv feeding them): peft's logits. (test_lora's all-family parity covers the other
    layouts.)"""
    from megatron_patch.align.parity import random_tokens
    from tests.lora_helpers import hf_logits, make_peft_adapter, mcore_lora_logits, peft_logits, rel

    adapter = make_peft_adapter(hf_dir, tmp_path / "peft")
    tokens = random_tokens(200, batch=2, seq=24, seed=5)
    ours = mcore_lora_logits([(hf_dir, adapter, hf_dir)], ParallelLayout(tp=2, ep=2), tokens)[0]
    want = peft_logits(hf_dir, adapter, tokens)
    assert rel(ours, want) <= 1e-5, rel(ours, want)
    assert rel(want, hf_logits(hf_dir, tokens)) > 1e-2  # the adapter changes the function: the check can fail

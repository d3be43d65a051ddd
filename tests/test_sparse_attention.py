"""DeepSeek sparse attention (deepseek_v32, glm_moe_dsa) beyond what the registry-driven tests run for every
family (round trips, parity, alignment, the launcher): config.json's refusals, the key-selection verdict,
the indexer's Hadamard path, a planted indexer fault found at its layer, the training extras (refusals, the
indexer loss, the indexer-only dense warm-up with everything else bit-identical), generation with the indexer's
keys cached.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_patch.align.capture import selection_mask
from megatron_patch.align.points import point_names
from megatron_patch.cli import main
from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import parse_arch
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint, tiny_config
from tests.training_helpers import launcher_args, make_corpus, read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- config.json ---------------------------------------------------------------------------------------------

def test_both_families_read_one_table_with_their_own_indexer_rope():
    v32, glm = parse_arch(tiny_config("deepseek_v32")), parse_arch(tiny_config("glm_moe_dsa"))
    assert (v32.family, glm.family) == ("deepseek_v32", "glm_moe_dsa")
    assert not v32.sparse_attention.rope_interleaved and glm.sparse_attention.rope_interleaved
    assert v32.sparse_attention.topk == 8 < 32  # the tiny models' sequences really select
    from megatron_patch.models.description.registry import get_family

    names = [r.hf for r in get_family("deepseek_v32").weight_rules(v32)]
    assert names == [r.hf for r in get_family("glm_moe_dsa").weight_rules(glm)]
    assert ("model.layers.{layer}.self_attn.indexer.k_norm.bias",) in names


@pytest.mark.parametrize("name", ["indexed_attention", "deepseek_sparse_attention"])
def test_layer_types_as_each_transformers_release_writes_them(name):
    """transformers 5.24 writes indexed_attention, 5.17 (the lent GPU machine's) deepseek_sparse_attention: the
    GPU suite's parity refused every V3.2 and GLM-5 checkpoint that 5.17 had written."""
    arch = parse_arch({**tiny_config("deepseek_v32"), "layer_types": [name] * 3})
    assert arch.sparse_attention.topk == 8


@pytest.mark.parametrize("over, fragment", [
    ({"indexer_types": ["full", "shared", "full"]}, "shared top-k"),
    ({"index_topk_freq": 2}, "index_topk_freq"),
    ({"q_lora_rank": None}, "q_lora_rank is missing"),
    ({"layer_types": ["full_attention"] * 3}, "indexed_attention"),
    ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, "mlp_layer_types"),
    ({"index_head_dim": 8}, "cannot hold"),
    ({"index_topk": 0}, "index_topk"),
])
def test_what_cannot_run_is_refused_in_one_line(over, fragment):
    raw = {**tiny_config("glm_moe_dsa"), **over}
    with pytest.raises(UserError, match=fragment):
        parse_arch(raw)


@pytest.mark.parametrize("over", [{"index_topk_pattern": "FFF", "indexer_types": ["full"] * 3},
                                  {"index_topk_pattern": "FSF"}, {"index_topk_freq": 2, "index_skip_topk_offset": 5},
                                  {"index_topk_freq": 2}, {}], ids=str)
def test_glm5_s_shared_top_k_layers_are_those_transformers_derives(over):
    """GLM-5's indexer_types win over index_topk_pattern, which wins over index_topk_freq / index_skip_topk_offset
    (a pattern beside saved all-full indexer_types was refused); DeepSeek-V3.2 reads none of them."""
    from transformers import GlmMoeDsaConfig

    from megatron_patch.models.deepseek_v32.config import shared_topk_layers

    raw = {**tiny_config("glm_moe_dsa"), **over}
    hf = GlmMoeDsaConfig(**raw).indexer_types
    assert shared_topk_layers(raw, 3) == [i for i, kind in enumerate(hf) if kind != "full"]
    assert shared_topk_layers({**tiny_config("deepseek_v32"), **over}, 3) == []


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_fields_neither_model_reads_are_not_refused(family):
    """mlp_bias (neither model reads it) and moe_layer_freq (DeepSeek-V2/V3's remote code's field, no field of
    theirs) were refused, as DeepSeek-V3's reading of them does, naming deepseek_v3."""
    plain = parse_arch(tiny_config(family))
    carrying = parse_arch({**tiny_config(family), "mlp_bias": True, "moe_layer_freq": 2})
    assert (carrying.linear_bias, carrying.num_experts) == (plain.linear_bias, plain.num_experts)


# --- the Hadamard rotation --------------------------------------------------------------------------------------

def test_hadamard_rotation_runs_only_where_the_extension_can(monkeypatch):
    """On CPU (or without the extension) q and k go unrotated, which is exact: the rotation is orthogonal and
    nothing is quantized before the dot product. With the extension, the rotation needs bf16 on a GPU."""
    from megatron.core.transformer.experimental_attention_variant import dsa as mcore_dsa

    from megatron_patch.models.blocks import sparse_attention as sa

    x = torch.randn(4, 2, 3, 16)
    monkeypatch.setattr(mcore_dsa, "hadamard_transform", None)
    assert sa.maybe_rotate(x) is x and sa.maybe_rotate(x.bfloat16()).dtype == torch.bfloat16
    assert "no rotation" in sa.rope_path(x)
    monkeypatch.setattr(mcore_dsa, "hadamard_transform", lambda t, scale: t * 0)  # would zero it if it ran
    assert sa.hadamard_extension_available() and torch.equal(sa.maybe_rotate(x.bfloat16()), x.bfloat16())


# --- the key-selection verdict --------------------------------------------------------------------------------

def _captures(layers, selections, b=2, s=16, h=8):
    out = {n: torch.randn(b, s, h) for n in point_names(layers)}
    out["logits"] = torch.randn(b, s, 32)
    out.update({f"selection.{i}": sel.clone() for i, sel in enumerate(selections)})
    return out


def test_selection_flips_are_judged_on_their_own_floor():
    """Near-tie flips within HF's own pass, and the tokens they reach are left out from that attention output
    on; a systematic difference fails at the layer's selection, before its attention output."""
    from megatron_patch.align.verdict import judge

    torch.manual_seed(0)
    layers, b, s = 2, 2, 16
    topk = torch.stack([torch.stack([torch.randperm(s)[:4] for _ in range(s)]) for _ in range(b)])
    ref_sel = [selection_mask(topk)] * layers
    ref = _captures(layers, ref_sel)

    def flipped(sel, tokens):
        sel = sel.clone()
        for bi, si in tokens:
            sel[bi, si, 0] = ~sel[bi, si, 0]
        return sel

    floor_sel = [flipped(ref_sel[0], [(0, 3), (1, 5)]), ref_sel[1]]
    test_sel = [flipped(ref_sel[0], [(0, 4), (1, 6)]), ref_sel[1]]
    floor = {**ref, **{f"selection.{i}": t for i, t in enumerate(floor_sel)}}
    test = {**ref, **{f"selection.{i}": t for i, t in enumerate(test_sel)}}
    # the flipped tokens' attention outputs differ on both sides: left out, so the points still pass
    for side in (floor, test):
        side["layers.0.attention"] = ref["layers.0.attention"].clone()
        side["layers.0.attention"][0, 3:5] += 1.0
        side["layers.0.attention"][1, 5:7] += 1.0
    # near 1x its floor elsewhere: a little noise on both
    for name in point_names(layers) + ["logits"]:
        if name != "layers.0.attention":
            floor[name] = ref[name] + 1e-3 * torch.randn_like(ref[name])
            test[name] = ref[name] + 1e-3 * torch.randn_like(ref[name])
    v = judge(ref, test, "bf16", layers, floor)
    assert v.aligned, v.summary
    assert [r.layer for r in v.selection] == [0, 1] and v.selection[0].flipped == 2
    assert v.selection[0].agreement == 1 - 2 / (b * s) and v.to_dict()["selection"][1]["agreement"] == 1.0
    assert next(p for p in v.points if p.name == "layers.0.attention").tokens == b * s - 4
    # a systematic difference: every token of layer 1 keeps other keys
    bad = {**test, "selection.1": ~ref_sel[1]}
    v = judge(ref, bad, "bf16", layers, floor)
    assert not v.aligned and v.first_failure == "layers.1.selection", v.summary
    assert "attend to other keys" in v.summary
    # in fp32 any flip beyond 1% of the tokens fails
    v = judge(ref, {**ref, "selection.0": test_sel[0]}, "fp32", layers)
    assert not v.aligned and v.first_failure == "layers.0.selection", v.summary


@pytest.mark.slow
def test_planted_indexer_fault_fails_at_its_layers_selection(tmp_path):
    """An indexer whose key projection has two rows swapped (a mapping fault the logits alone would blur) is
    named at layer 1's key selection, everything upstream exact; the clean conversion keeps every key."""
    from megatron_patch.align.parity import random_tokens
    from megatron_patch.align.runner import McoreRun, capture_hf_dir, capture_mcore_runs
    from megatron_patch.align.verdict import judge
    from megatron_patch.checkpoint_files.manifest import write_manifest
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.runtime import ParallelLayout

    hf = make_tiny_hf_checkpoint("glm_moe_dsa", tmp_path / "hf", seed=2)
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    for ckpt in (clean, faulty):
        hf_to_mcore(hf, ckpt, ParallelLayout(), fmt="legacy", progress=False)

    path = faulty / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    wk = state["model"]["decoder.layers.1.self_attention.core_attention.indexer.linear_wk.weight"]
    wk[[0, 1]] = wk[[1, 0]].clone()
    torch.save(state, path)
    write_manifest(faulty, "tests: planted fault", sync=False)
    tokens = random_tokens(200, batch=2, seq=64, seed=0)
    ref = capture_hf_dir(hf, tokens, "fp32")
    good, bad = capture_mcore_runs(ParallelLayout(), tokens, [McoreRun("fp32", mcore_dir=str(clean)),
                                                             McoreRun("fp32", mcore_dir=str(faulty))])
    v = judge(ref, good, "fp32", 3)
    assert v.aligned and all(r.flipped == 0 for r in v.selection), v.summary
    v = judge(ref, bad, "fp32", 3)
    assert not v.aligned and v.first_failure == "layers.1.selection", v.summary
    upstream = [p for p in v.points if p.name in ("embedding",) or p.name.startswith("layers.0.")]
    assert all(p.passed and p.metrics["rel_l2"] <= 1e-5 for p in upstream)


# --- training: the extras, the indexer loss, the dense warm-up -------------------------------------------------

def test_training_extras_are_refused_where_they_cannot_run(tmp_path, monkeypatch, capsys):
    prefix = tmp_path / "c_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    monkeypatch.setenv("MP_DRY_RUN", "1")
    cases = [
        ("llama3_1", {}, {"MP_DSA_INDEXER_LOSS_SCALE": "1"}, "applies to DeepSeek sparse attention models"),
        ("deepseek_v32", {"CP": "2"}, {}, "CP=2 with DeepSeek sparse attention is not supported"),
        ("deepseek_v32", {}, {"MP_DSA_INDEXER_ONLY": "true", "MP_DSA_INDEXER_LOSS_SCALE": "0"}, "must be > 0"),
        ("deepseek_v32", {}, {"MP_DSA_INDEXER_LOSS_SCALE": "-1"}, "a finite number >= 0"),
        ("deepseek_v32", {}, {"MP_LORA_RANK": "4", "MP_LORA_TARGETS": "qkv,indexer"}, "learns from its loss alone"),
        ("deepseek_v32", {"TP": "2", "SP": "true"},
         {"MP_LORA_RANK": "4", "MP_LORA_TARGETS": "indexer", "MP_DSA_INDEXER_LOSS_SCALE": "1"}, "with TP=2"),
        ("deepseek_v32", {}, {"MP_LORA_RANK": "4", "MP_DSA_INDEXER_ONLY": "true"}, "choose one"),
    ]
    for family, over, env, message in cases:
        for k in ("MP_DSA_INDEXER_LOSS_SCALE", "MP_DSA_INDEXER_ONLY", "MP_LORA_RANK", "MP_LORA_TARGETS"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        args = launcher_args(family, DATASET_PATH=str(prefix), OUTPUT_BASEPATH=str(tmp_path / "out"), **over)
        assert main(["train", family, *args]) == 2, (family, env)
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err


@pytest.mark.slow
def test_indexer_only_warm_up_trains_the_indexers_alone(tmp_path):
    """DeepSeek's dense warm-up through the launcher from a converted checkpoint: the indexer loss falls, the
    exported model's indexers moved and every other tensor is bit for bit the converted one."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    data = make_corpus(tmp_path / "data", 300, seed=1)
    hf = make_tiny_hf_checkpoint("deepseek_v32", tmp_path / "hf", seed=11)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf / name).write_bytes((data["tok"] / name).read_bytes())
    mcore, out, back = tmp_path / "mcore", tmp_path / "out", tmp_path / "back"
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(mcore), "--quiet"]) == 0
    gbs, seq, iters = 4, 32, 8
    args = launcher_args("deepseek_v32", MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(mcore),
                         DATASET_PATH=data["prefix"], OUTPUT_BASEPATH=str(out), LR="2e-2", MIN_LR="2e-2",
                         GLOBAL_BATCH_SIZE=str(gbs), BATCH_SIZE="2", SEQ_LEN=str(seq),
                         TRAIN_TOKENS_OR_ITERS=str(iters * gbs * seq), WARMUP_TOKENS_OR_ITERS="0",
                         SAVE_INTERVAL=str(iters), AC="full")
    # under AC=full (the dsa audit: megatron-core's recompute of a frozen embedding's output ran without a gradient,
    # computed no indexer loss and trained nothing, at exit 0)
    env = {**os.environ, "PYTHON": sys.executable, "MP_DSA_INDEXER_ONLY": "true",
           "MP_DSA_INDEXER_LOSS_SCALE": "1"}
    proc = subprocess.run(["bash", os.path.join(REPO, "examples/deepseek_v32/run_mcore_deepseek_v32.sh"), *args],
                          env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "indexer-only (dense warm-up)" in proc.stdout and "indexer loss" in proc.stdout
    losses = [m["indexer_loss"] for m in read_metrics(out)]
    assert len(losses) == iters and losses[-1] < 0.8 * losses[0], losses
    assert main(["convert", "mcore2hf", "--load-dir", str(out / "final"), "--save-dir", str(back), "--quiet"]) == 0
    source, trained = HFCheckpointReader(hf), HFCheckpointReader(back)
    assert sorted(source.keys()) == sorted(trained.keys())
    moved = [n for n in source.keys() if not torch.equal(source.get(n), trained.get(n))]
    indexer = [n for n in source.keys() if ".self_attn.indexer." in n]
    assert moved and set(moved) <= set(indexer), moved
    assert all(".indexer." in n for n in moved)


# --- LoRA on the indexer -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_indexer_adapters_match_peft(tmp_path):
    """peft reaches the indexer's wq_b, wk and weights_proj (plain linears): an adapter on them alone, imported,
    gives peft's logits at TP=1 and TP=2; it changes which keys are kept, so the logits move off the base's."""
    from megatron_patch.align.parity import random_tokens
    from megatron_patch.runtime import ParallelLayout
    from tests.lora_helpers import hf_logits, make_peft_adapter, mcore_lora_logits, peft_logits, rel

    hf = make_tiny_hf_checkpoint("glm_moe_dsa", tmp_path / "hf", seed=1)
    adapter = make_peft_adapter(hf, tmp_path / "peft", modules=("wq_b", "wk", "weights_proj"), r=4, lora_alpha=16)
    tokens = random_tokens(200, batch=2, seq=32, seed=5)
    reference = peft_logits(hf, adapter, tokens)
    assert rel(reference, hf_logits(hf, tokens)) > 1e-3
    for layout in (ParallelLayout(), ParallelLayout(tp=2)):
        (ours,) = mcore_lora_logits([(hf, adapter, hf)], layout, tokens)
        assert rel(ours, reference) <= 1e-5, (layout, rel(ours, reference))


# --- the memory plan ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_memory_plan_counts_what_the_indexer_keeps(tmp_path):
    """One step with autograd's saved tensors metered, the indexer loss on and off (same data, same routing): the
    model state equals the plan to the byte (the frozen indexer outside DDP's buffers), and the activations the
    loss adds (the indexer's per-head scores, its q and k, the loss's [b, s, s] tensors) are the plan's term."""
    from megatron_patch.runtime.launch import run_local
    from megatron_patch.training.memory_plan import stage_memory
    from megatron_patch.training.validation import resolve
    from tests.memory_helpers import measure_ranks

    corpus = make_corpus(tmp_path / "c", 100, seed=0)
    runs = [(pr, env) for pr in ("bf16", "fp32") for env in ({"MP_DSA_INDEXER_LOSS_SCALE": "1"}, {})]
    cfgs = [resolve("deepseek_v32", launcher_args("deepseek_v32", DATASET_PATH=corpus["prefix"], PR=pr, DO="true",
                                                  OUTPUT_BASEPATH=str(tmp_path / str(i)), SAVE_INTERVAL="100"), env=env)
            for i, (pr, env) in enumerate(runs)]
    measured = run_local(measure_ranks, 1, cfgs, timeout=900)[0]
    planned = [stage_memory(c.arch, c, 0, "local", 0) for c in cfgs]
    for st, r in zip(planned, measured):
        assert {k: getattr(st, k) for k in ("params", "grads", "optimizer_device")} == \
            {k: r[k] for k in ("params", "grads", "optimizer_device")}
        assert r["attention"] == "unfused" and r["leftover"] == 0
    assert planned[1].frozen > 0 and planned[0].frozen == 0  # the indexers, frozen without their loss
    for on, off in ((0, 1), (2, 3)):
        term = (planned[on].activations - planned[off].activations) / (measured[on]["activations"] -
                                                                       measured[off]["activations"])
        assert abs(term - 1) < 0.10, (runs[on], term)  # 0.16: within 1.4%; 0.19's loss keeps its masks too


def test_chunked_attention_equals_the_whole_one():
    """The no-gradient path (a few queries at a time) computes what the training path computes (dense scores masked
    to the same keys), top-k lists that reach past a query included."""
    from megatron_patch.models.blocks.sparse_attention import causal_mask, chunked_sparse_attention, sparse_attention

    torch.manual_seed(0)
    s, b, h, d, dv, k = 23, 2, 3, 8, 5, 6
    q, key = torch.randn(s, b, h, d), torch.randn(s, b, h, d)
    v = torch.randn(s, b, h, dv)

    def row(i):  # k distinct keys, the query itself among them (no row without a key), later ones too
        others = torch.randperm(s)
        return torch.cat([torch.tensor([i]), others[others != i][:k - 1]])

    topk = torch.stack([torch.stack([row(i) for i in range(s)]) for _ in range(b)])
    dense = sparse_attention(q, key, v, topk, 0.3, causal_mask(s, s, q.device))
    for chunk in (1, 5, s):
        chunked = chunked_sparse_attention(q, key, v, topk, 0.3, chunk=chunk)
        assert torch.allclose(chunked, dense, atol=1e-6, rtol=1e-5), chunk


def _selections_worker(prompt: int) -> dict:
    """A tiny GLM-5's layer-1 indexer on 40 random tokens: its top-k scored whole, 7 queries at a time, and as a
    generation keeping its keys in an inference context (the first ``prompt`` tokens, then one at a time), in a
    process of its own: megatron-core's process groups stay out of the test process."""
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.blocks.sparse_attention import causal_mask, indexer_key_cache
    from megatron_patch.models.shape.skeleton import _ensure_single_rank_state
    from megatron_patch.runtime import ParallelLayout

    _ensure_single_rank_state()
    torch.manual_seed(0)
    model = build_model(parse_arch(tiny_config("glm_moe_dsa")), ParallelLayout(), torch.float32)
    indexer = model.decoder.layers[1].self_attention.core_attention.indexer
    x, qr = torch.randn(40, 2, 64), torch.randn(40, 2, 48)
    scores, whole = indexer.forward_with_scores(x, qr, mask=causal_mask(40, 40, x.device))
    context, cached = StaticInferenceContext(2, 40), []
    for start, end in zip([0, *range(prompt, 40)], range(prompt, 41)):
        cache = indexer_key_cache(context, 2, 2, indexer.index_head_dim, x.device)
        cached.append(indexer.select(x[start:end], qr[start:end], cache=cache))
        context.sequence_len_offset = end
    return {"scores": scores, "whole": whole, "chunked": indexer.select(x, qr, chunk=7), "cached": cached}


@pytest.fixture(scope="module")
def selections() -> dict:
    from megatron_patch.runtime.launch import run_local

    return run_local(_selections_worker, 1, 30, timeout=300)[0]


def _selected_scores(scores: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
    """The index scores [b, s, k] of the keys each query selects, highest first, from the whole sequence's
    ``scores`` (causal mask added): equal for two selections of the same keys up to ties, as a ReLU scores many keys
    0 and top-k breaks a tie by the length of its row."""
    return scores.gather(-1, topk).sort(dim=-1, descending=True).values


@pytest.mark.slow
def test_indexer_chunked_selection_equals_the_whole_one(selections):
    """Without a gradient the indexer scores a chunk of queries at a time under their slice of the causal mask: the
    same keys as scoring the whole sequence."""
    scores, whole, chunked = selections["scores"], selections["whole"], selections["chunked"]
    assert whole.shape == chunked.shape == (2, 40, 8)
    assert torch.equal(_selected_scores(scores, chunked), _selected_scores(scores, whole))


@pytest.mark.slow
def test_indexer_selection_from_cached_keys_equals_the_whole_one(selections):
    """A generation's indexer scores each new query against the keys it cached for the earlier tokens and its own,
    under the causal mask shifted to the query's position: the keys scoring the whole sequence selects, where the
    top 8 keep fewer than the visible keys (a prompt of 30, then 10 tokens one at a time)."""
    scores, whole, (prompt, *steps) = selections["scores"], selections["whole"], selections["cached"]
    assert prompt.shape == (2, 30, 8) and [t.shape for t in steps] == [(2, 1, 8)] * 10
    expected = _selected_scores(scores, whole)
    assert torch.equal(_selected_scores(scores[:, :30], prompt), expected[:, :30])
    for position, step in enumerate(steps, start=30):
        assert torch.equal(_selected_scores(scores[:, position:position + 1], step), expected[:, position:position + 1]), \
            position


@pytest.mark.parametrize("family, tp", [("deepseek_v32", 1),  # TP=2: multi-process parity checks, in the whole suite
                                        pytest.param("deepseek_v32", 2, marks=pytest.mark.slow),
                                        pytest.param("glm_moe_dsa", 2, marks=pytest.mark.slow)])
def test_generation_continues_the_indexer_keys_one_token_per_step(family, tp):
    """A generation with the runner's inference context gives the logits one whole forward gives, within float32
    noise: each layer's indexer scores the new token against the keys it cached for the earlier ones, under the
    causal mask shifted to the token's position, and the attention reads MLA's cached keys and values. A prompt of
    10 and 16 tokens in all, past the tiny indexer's top 8, so a wrong key set changes the selection. And a
    generated token costs one token's forward: every layer sees the prompt once and then one token per step."""
    from tests.eval_helpers import check_generation_continues

    arch = parse_arch(tiny_config(family))
    assert arch.sparse_attention.topk < 10 and arch.num_layers == 3
    tokens = [[5, 17, 33, 8, 90, 61, 12, 4, 9, 100, 11, 3, 44, 150, 21, 77],
              [44, 3, 150, 27, 9, 71, 18, 100, 7, 7, 120, 3, 66, 1, 56, 2]]
    check_generation_continues(arch, tp, tokens, prompt=10)


# --- FP8 hub weights ---------------------------------------------------------------------------------------------

def test_fp8_hub_weights_dequantize_to_what_transformers_loads(tmp_path):
    """A tiny DeepSeek-V3.2 written as the hub writes it (the attention's and the indexer's linears in block-scaled
    FP8, the rest bf16): converted at TP=2 x EP=2 and back, the indexer's tensors are transformers' own
    dequantization bit for bit."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from tests.convert_helpers import quantize_fp8_blocks

    src = make_tiny_hf_checkpoint("deepseek_v32", tmp_path / "src", seed=4)
    fp8 = tmp_path / "fp8"
    fp8.mkdir()
    reader = HFCheckpointReader(src)
    quantized = ("q_a_proj", "q_b_proj", "kv_b_proj", "o_proj", "wq_b", "wk", "weights_proj")
    tensors = {}
    for name in reader.keys():
        t = reader.get(name)
        if name.endswith(".weight") and name.split(".")[-2] in quantized:
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blocks(t, (16, 16))
        else:
            tensors[name] = t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
    save_file(tensors, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}
    (fp8 / "config.json").write_text(json.dumps(config))
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "hf2mcore", "--hf-dir", str(fp8), "--save-dir", str(mcore), "--dtype", "bf16", "--tp", "2",
                 "--ep", "2", "--format", "legacy", "--quiet"]) == 0
    assert main(["convert", "mcore2hf", "--load-dir", str(mcore), "--save-dir", str(back), "--quiet"]) == 0
    ours = HFCheckpointReader(back)
    theirs = AutoModelForCausalLM.from_pretrained(str(fp8), dtype=torch.bfloat16).state_dict()
    names = [n for n in ours.keys() if ".indexer." in n or ".self_attn.q_b_proj." in n]
    assert len(names) == 3 * 6
    for name in names:
        got = ours.get(name)
        assert got.dtype == torch.bfloat16 and torch.equal(got, theirs[name].to(torch.bfloat16)), name

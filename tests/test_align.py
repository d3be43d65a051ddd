"""`mpatch align`: faults planted in converted checkpoints fail at the right layer; clean ones pass.

All MCore runs of a layout share one set of spawned processes (``capture_mcore_runs``), so the whole
module costs two spawns plus one CLI run with ablations.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_patch.align.alignment import config_differences
from megatron_patch.align.capture import _hooks
from megatron_patch.align.points import (EVERY_ID, every_expert_point, point_layer, point_names, router_point,
                                        selection_layers)
from megatron_patch.align.parity import random_tokens
from megatron_patch.align.runner import McoreRun, capture_hf_dir, capture_mcore_runs
from megatron_patch.align.verdict import DEFAULT_TOLERANCE, MIN_FLOOR_FLIPS, exact_routing_layers, judge
from megatron_patch.checkpoint_files.manifest import write_manifest
from megatron_patch.cli import main
from megatron_patch.convert.checkpoint import hf_to_mcore
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.runtime import ParallelLayout
from tests.convert_helpers import edit_weights

FAMILY_NAMES = list(families())
DTYPES = ("fp32", "bf16")
TP2PP2 = ParallelLayout(tp=2, pp=2)


def multi_rank_layout(family: str) -> ParallelLayout:
    """Where a family's clean conversion is aligned besides TP=1: TP=2 x PP=2, or, for a model that
    cannot split so (DeepSeek's 3 tiny layers), the last layout its own parity tests run."""
    from megatron_patch.errors import UserError
    from megatron_patch.models.description.arch import validate_layout

    family_ = families()[family]
    try:
        validate_layout(parse_arch(family_.tiny_config), TP2PP2)
        return TP2PP2
    except UserError:
        return family_.test_layouts.parity[-1]
def moe_tp2_layout(family: str) -> ParallelLayout:
    """TP=2, with the experts unsplit where megatron-core cannot split them (gpt-oss's biased experts)."""
    from megatron_patch.errors import UserError
    from megatron_patch.models.description.arch import validate_layout

    try:
        validate_layout(parse_arch(families()[family].tiny_config), ParallelLayout(tp=2))
        return ParallelLayout(tp=2)
    except UserError:
        return ParallelLayout(tp=2, etp=1)


FAULT_LAYER = 2


def align_tokens() -> torch.Tensor:
    """The tokens every alignment here runs: ids below 200, the smallest tiny vocabulary."""
    return random_tokens(200, batch=2, seq=128, seed=0)


# --- planting faults in a converted (legacy, TP=1) checkpoint ----------------------------------

def edit_config(ckpt, edit) -> None:
    path = ckpt / "mpatch_checkpoint.json"
    data = json.loads(path.read_text())
    edit(data["hf_config"])
    path.write_text(json.dumps(data))


def qkv_rows(arch, group: int, kind: str, index: int = 0) -> slice:
    """Rows of one head in MCore's fused linear_qkv: per query group [q heads; k; v]."""
    per, hd = arch.num_heads // arch.num_kv_heads, arch.head_dim
    offset = {"q": index * hd, "k": per * hd, "v": (per + 1) * hd}[kind]
    start = group * (per + 2) * hd + offset
    return slice(start, start + hd)


def swap_rows(t: torch.Tensor, a: slice, b: slice) -> None:
    ta, tb = t[a].clone(), t[b].clone()
    t[a], t[b] = tb, ta


def qkv_name(layer: int, what: str = "weight") -> str:
    return f"decoder.layers.{layer}.self_attention.linear_qkv.{what}"


def plant_query_heads_swapped(arch):
    def edit(sd):
        swap_rows(sd[qkv_name(FAULT_LAYER)], qkv_rows(arch, 1, "q", 0), qkv_rows(arch, 1, "q", 1))
    return edit


def plant_k_v_swapped(arch):
    def edit(sd):
        for g in range(arch.num_kv_heads):
            swap_rows(sd[qkv_name(FAULT_LAYER)], qkv_rows(arch, g, "k"), qkv_rows(arch, g, "v"))
    return edit


def plant_interleaved_rope_layout(arch):
    """q/k rows in the interleaved (GPT-J) order instead of HF/MCore's half rotation, every layer."""
    hd = arch.head_dim

    def edit(sd):
        for layer in range(arch.num_layers):
            w = sd[qkv_name(layer)]
            per = arch.num_heads // arch.num_kv_heads
            for g in range(arch.num_kv_heads):
                for rows in [qkv_rows(arch, g, "q", i) for i in range(per)] + [qkv_rows(arch, g, "k")]:
                    w[rows] = w[rows].view(2, hd // 2, -1).transpose(0, 1).reshape(hd, -1)
    return edit


def plant_qkv_bias_dropped(arch):
    def edit(sd):
        for layer in range(arch.num_layers):
            sd[qkv_name(layer, "bias")].zero_()
    return edit


def plant_expert_swap(arch):
    def edit(sd):
        for fc in ("linear_fc1", "linear_fc2"):
            a, b = (f"decoder.layers.1.mlp.experts.{fc}.weight{j}" for j in (0, 1))
            sd[a], sd[b] = sd[b].clone(), sd[a].clone()
    return edit


def plant_router_rows_swapped(arch):
    """Experts 0 and 1 swapped in the router only: tokens go to the other expert's weights."""
    def edit(sd):
        swap_rows(sd["decoder.layers.1.mlp.router.weight"], slice(0, 1), slice(1, 2))
    return edit


def plant_router_row_nudged(arch):
    """Expert 0's router row 0.3% larger: the scores move a little, a token or two (within the 1% of near-ties fp32
    allows) changes experts, and the routing check alone let it through ('fp32 certifies the conversion')."""
    def edit(sd):
        sd["decoder.layers.1.mlp.router.weight"][0] *= 1.003
    return edit


def plant_correction_bias_nudged(arch):
    """Layer 1's score-correction bias of expert 0 off by 0.01: the bias only moves choices, a few tokens' here
    (fp32's 1% of near-ties), and no output was compared to it."""
    def edit(sd):
        sd["decoder.layers.1.mlp.router.expert_bias"][0] += 0.01
    return edit


# DeepSeek-V4 (hyper-connection streams, CSA block selection, hash routing)
V4_STREAM = 3


def plant_v4_sinks_dropped(arch):
    """Layer 2's attention sinks left at the model's zeros, as a converter that dropped them would leave them."""
    def edit(sd):
        sd[f"decoder.layers.{FAULT_LAYER}.self_attention.sinks"].zero_()
    return edit


def plant_v4_sinkhorn_eps(hf_config):
    """A wrong Sinkhorn epsilon (1e-4 for 1e-6): every comb mix off by ~1e-4. At layer 0 the streams are equal
    copies, so the attention's input only scales (its norm undoes that): the first point off is the streams after
    the attention's comb mix (layers.0.residual)."""
    hf_config["hc_eps"] = 1e-4


def plant_v4_one_stream_post_mix(arch):
    """Layer 2's MLP output spread into stream 3 with another weight (its post-mix bias moved): only that stream
    of the layer's output changes."""
    def edit(sd):
        sd[f"decoder.layers.{FAULT_LAYER}.ffn_hc.base"][arch.family_config.hc_mult + V4_STREAM] += 1.0
    return edit


def plant_v4_attention_step_post_mix(arch):
    """Layer 2's attention output spread into stream 3 with another weight (attn_hc's post-mix bias moved): the
    streams after the attention's hyper-connection are off, before the MLP sees them."""
    def edit(sd):
        sd[f"decoder.layers.{FAULT_LAYER}.attn_hc.base"][arch.family_config.hc_mult + V4_STREAM] += 1.0
    return edit


def plant_v4_tid2eid_row_replaced(arch):
    """Layer 1's hash table row of the first input token replaced by the row of a token the input never has: the
    few tokens of that id go to other experts, fewer than routing's noise rule would notice."""
    def edit(sd):
        table = sd["decoder.layers.1.mlp.router.tid2eid"]
        token = int(align_tokens()[0, 0])
        other = next(t for t in range(200, arch.vocab_size) if set(table[t].tolist()) != set(table[token].tolist()))
        table[token] = table[other].clone()
    return edit


def plant_v4_indexer_rows_swapped(arch):
    """Two rows of layer 1's CSA indexer query projection swapped: only the blocks its queries pick change."""
    def edit(sd):
        w = sd["decoder.layers.1.self_attention.indexer.linear_q_up_proj.weight"]
        swap_rows(w, slice(0, 1), slice(1, 2))
    return edit


def plant_unused_embedding_rows_swapped(arch):
    """The embedding rows of two ids the inputs never use swapped (untied: the output layer keeps its rows), as a
    converter that misplaced a vocabulary shard's rows would leave them: ALIGNED while only the inputs' rows were
    compared."""
    def edit(sd):
        used = set(align_tokens().flatten().tolist())
        a, b = [i for i in range(arch.vocab_size) if i not in used][:2]
        swap_rows(sd["embedding.word_embeddings.weight"], slice(a, a + 1), slice(b, b + 1))
    return edit


def plant_megatron_default_rope_scaling(hf_config):
    """The fault users hit: llama3 scaling factors hard-coded to megatron's defaults (1, 4, 8192)."""
    rope = hf_config.get("rope_parameters") or hf_config["rope_scaling"]
    rope.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


# name -> (family, weight edit or None, config edit or None, first point that must fail)
FAULTS = {
    "query_heads_swapped_in_group": ("llama3_1", plant_query_heads_swapped, None, f"layers.{FAULT_LAYER}.attention"),
    "k_and_v_swapped": ("llama3_1", plant_k_v_swapped, None, f"layers.{FAULT_LAYER}.attention"),
    "interleaved_rope_layout": ("llama3_1", plant_interleaved_rope_layout, None, "layers.0.attention"),
    "qwen2_qkv_bias_dropped": ("qwen2", plant_qkv_bias_dropped, None, "layers.0.attention"),
    "unused_embedding_rows_swapped": ("llama3_1", plant_unused_embedding_rows_swapped, None, EVERY_ID),
    "wrong_rope_scaling_in_config": ("llama3_1", None, plant_megatron_default_rope_scaling, "layers.0.attention"),
    "expert_0_and_1_swapped": ("qwen2_moe", plant_expert_swap, None, "layers.1.mlp"),
    "router_rows_0_and_1_swapped": ("mixtral", plant_router_rows_swapped, None, "layers.1.router"),
    "router_row_nudged": ("mixtral", plant_router_row_nudged, None, "layers.1.router"),
    "correction_bias_nudged": ("deepseek_v3", plant_correction_bias_nudged, None, "layers.1.router"),
    "v4_sinks_dropped": ("deepseek_v4", plant_v4_sinks_dropped, None, f"layers.{FAULT_LAYER}.attention"),
    "v4_wrong_sinkhorn_eps": ("deepseek_v4", None, plant_v4_sinkhorn_eps, "layers.0.residual"),
    "v4_one_stream_post_mix": ("deepseek_v4", plant_v4_one_stream_post_mix, None, f"layers.{FAULT_LAYER}.output"),
    "v4_attention_step_post_mix": ("deepseek_v4", plant_v4_attention_step_post_mix, None,
                                   f"layers.{FAULT_LAYER}.residual"),
    "v4_tid2eid_row_replaced": ("deepseek_v4", plant_v4_tid2eid_row_replaced, None, "layers.1.routing"),
    "v4_indexer_rows_swapped": ("deepseek_v4", plant_v4_indexer_rows_swapped, None, "layers.1.selection"),
}
MOE_FAMILIES = [f for f in FAMILY_NAMES if parse_arch(families()[f].tiny_config).is_moe]
# Faults also judged in bf16 against the noise floor.
BF16_FAULTS = ("k_and_v_swapped", "unused_embedding_rows_swapped", "expert_0_and_1_swapped",
               "router_rows_0_and_1_swapped", "v4_tid2eid_row_replaced",
               "v4_indexer_rows_swapped", "v4_one_stream_post_mix")


@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    """Every capture the tests judge: HF fp32/bf16 per family, MCore runs at TP=1 and TP=2/PP=2."""
    root = tmp_path_factory.mktemp("align")
    hf = {f: make_tiny_hf_checkpoint(f, root / "hf" / f, seed=1) for f in FAMILY_NAMES}
    tokens = align_tokens()
    ref = {f: capture_hf_dir(hf[f], tokens, "fp32") for f in FAMILY_NAMES}
    floor = {f: capture_hf_dir(hf[f], tokens, "bf16") for f in FAMILY_NAMES}
    # HF's own fp32 rounding: the floor an fp32 run over the fixed bound is judged against again (verdict.py)
    floor64 = {f: capture_hf_dir(hf[f], tokens, "fp64") for f in {FAULTS[n][0] for n in FAULTS}}

    (root / "clean").mkdir()
    (root / "faulty").mkdir()
    clean = {}
    for f in FAMILY_NAMES:  # torch_dist written at TP=1 loads at any layout
        clean[f] = root / "clean" / f
        hf_to_mcore(hf[f], clean[f], ParallelLayout(), fmt="torch_dist", progress=False)
    faulty = {}
    for name, (family, edit_w, edit_c, _) in FAULTS.items():
        ckpt = root / "faulty" / name
        hf_to_mcore(hf[family], ckpt, ParallelLayout(), fmt="legacy", progress=False)
        arch = parse_arch(hf[family])
        if edit_w:
            edit_weights(ckpt, edit_w(arch))
        if edit_c:
            edit_config(ckpt, edit_c)
        # A fault planted by hand would otherwise be refused as a damaged file before alignment sees it.
        write_manifest(ckpt, "tests: planted fault", sync=False)
        faulty[name] = ckpt

    clean_runs = [McoreRun(dt, mcore_dir=str(clean[f])) for f in FAMILY_NAMES for dt in DTYPES]
    fault_runs = [McoreRun("fp32", mcore_dir=str(faulty[n])) for n in FAULTS]
    bf16_faults = [McoreRun("bf16", mcore_dir=str(faulty[n])) for n in BF16_FAULTS]
    tp1 = capture_mcore_runs(ParallelLayout(), tokens, clean_runs + fault_runs + bf16_faults)
    multi = {}
    for layout in dict.fromkeys(multi_rank_layout(f) for f in FAMILY_NAMES):
        runs = [r for r in clean_runs if multi_rank_layout(Path(r.mcore_dir).name) == layout]
        multi.update({(Path(r.mcore_dir).name, r.dtype): c for r, c in zip(runs, capture_mcore_runs(layout, tokens, runs))})
    # MoE routing under bf16 at the layouts users convert MoE models to: TP=2 (Mixtral's reported case)
    # and expert parallelism.
    moe_runs = [McoreRun("bf16", mcore_dir=str(clean[f])) for f in MOE_FAMILIES]
    tp2 = {}
    for layout in dict.fromkeys(moe_tp2_layout(f) for f in MOE_FAMILIES):
        runs = [r for r in moe_runs if moe_tp2_layout(Path(r.mcore_dir).name) == layout]
        tp2.update(zip([Path(r.mcore_dir).name for r in runs], capture_mcore_runs(layout, tokens, runs)))
    tp2 = [tp2[f] for f in MOE_FAMILIES]
    ep2 = capture_mcore_runs(ParallelLayout(ep=2), tokens, moe_runs)

    n = len(clean_runs)
    keys = [(f, dt) for f in FAMILY_NAMES for dt in DTYPES]
    moe_keys = [(f, "bf16") for f in MOE_FAMILIES]
    return {
        "hf": hf, "ref": ref, "floor": floor, "floor64": floor64, "faulty": faulty,
        "clean": {"tp1": dict(zip(keys, tp1[:n])), "multi": multi,
                  "tp2": dict(zip(moe_keys, tp2)), "ep2": dict(zip(moe_keys, ep2))},
        "faults": dict(zip(FAULTS, tp1[n:n + len(FAULTS)])),
        "bf16_faults": dict(zip(BF16_FAULTS, tp1[n + len(FAULTS):])),
    }


def _judge(aligned, family, dtype, test, fp32_floor=False):
    arch = parse_arch(aligned["hf"][family])
    floor = aligned["floor64"][family] if fp32_floor else aligned["floor"][family] if dtype != "fp32" else None
    return judge(aligned["ref"][family], test, dtype, arch.num_layers, floor, exact_routing=exact_routing_layers(arch))


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(FAULTS))
def test_planted_fault_fails_at_its_first_layer(aligned, fault):
    family, _, _, expected = FAULTS[fault]
    # judged again against transformers' own fp32 rounding (HF fp64), as align does an fp32 run over the fixed
    # bound: the floor hides no planted fault
    on_floor = _judge(aligned, family, "fp32", aligned["faults"][fault], fp32_floor=True)
    assert on_floor.fp32_floor and not on_floor.aligned and on_floor.first_failure == expected, on_floor.summary
    v = _judge(aligned, family, "fp32", aligned["faults"][fault])
    assert not v.aligned, v.summary
    assert v.first_failure == expected, v.summary
    if expected == EVERY_ID:  # the first point: the summary names the id
        used = set(align_tokens().flatten().tolist())
        assert v.points[0].metrics["worst_id"] not in used, v.summary
        assert f"the embedding of token id {v.points[0].metrics['worst_id']}" in v.summary
        assert all(p.metrics["rel_l2"] <= 1e-5 for p in v.points[1:])  # the inputs' own rows are right
        return
    assert f"layer {int(expected.split('.')[1])}" in v.summary
    # Everything upstream of the fault agrees to fp32 precision: the localisation is not luck (a
    # routing fault sits just before its layer's MLP output, a key-selection fault before its attention output).
    at = expected.replace(".routing", ".mlp").replace(".selection", ".attention")
    upstream = [p for p in v.points[: [p.name for p in v.points].index(at)]]
    assert upstream and all(p.metrics["rel_l2"] <= 1e-5 for p in upstream)


@pytest.mark.slow
@pytest.mark.parametrize("fault", BF16_FAULTS)
def test_fault_in_bf16_fails_against_the_noise_floor(aligned, fault):
    family, _, _, expected = FAULTS[fault]
    v = _judge(aligned, family, "bf16", aligned["bf16_faults"][fault])
    assert not v.aligned and v.first_failure == expected, v.summary
    if expected.endswith(".routing") and FAULTS[fault][0] == "deepseek_v4":
        # a hash table row: a handful of tokens, which the noise rule for routing would have let pass
        r = next(r for r in v.routing if not r.passed)
        assert r.exact and r.floor_flipped == 0 and 0 < r.flipped <= DEFAULT_TOLERANCE * MIN_FLOOR_FLIPS, v.summary
        assert "token id alone decides them" in v.summary
    elif expected.endswith(".routing"):
        r = next(r for r in v.routing if not r.passed)
        assert r.flipped > 10 * max(r.floor_flipped, 1) and "choose other experts" in v.summary
    elif expected.endswith(".selection"):
        r = next(r for r in v.selection if not r.passed)
        assert r.flipped > DEFAULT_TOLERANCE * max(r.floor_flipped, MIN_FLOOR_FLIPS) and "attend to other keys" in v.summary
    else:
        # An expert swap keeps the routing: the tokens it judges on are the ones with HF's expert choice.
        failing = next(p for p in v.points if not p.passed)
        # a fault in one residual stream stands out most in that stream (V4: 11x there, 6x over all four)
        ratio = max([failing.ratio] + [r.ratio for r in failing.failed_streams])
        assert ratio > 10 and "HF's own bf16 rounding" in v.summary


def _check_clean(v, family, dtype, aligned):
    assert v.aligned, v.summary
    arch = parse_arch(aligned["hf"][family])
    # with the streams after the attention's step where the family names that point (DeepSeek-V4)
    residual = families()[family].hf_modules.attention_residual is not None
    # every id's embedding first; each MoE layer's router logits before its MLP output, its every-expert output after
    expected = [EVERY_ID]
    for name in point_names(arch.num_layers, residual):
        moe = name.endswith(".mlp") and arch.is_moe_layer(point_layer(name))
        expected += [router_point(point_layer(name))] * moe + [name] + [every_expert_point(point_layer(name))] * moe
    assert v.first_failure is None and [p.name for p in v.points] == expected
    assert v.points[0].metrics["ids"] == arch.vocab_size
    assert [r.layer for r in v.routing] == [i for i in range(arch.num_layers) if arch.is_moe_layer(i)]
    assert [r.layer for r in v.routing if r.exact] == exact_routing_layers(arch)
    # sparse attention (DeepSeek-V3.2, GLM-5: every layer; DeepSeek-V4: its CSA layers): each layer whose HF
    # indexer the family names has its key selection judged, exact in fp32
    selected = selection_layers(aligned["ref"][family])
    assert bool(selected) == (families()[family].hf_modules.indexer is not None)
    if arch.sparse_attention:
        assert selected == list(range(arch.num_layers))
    assert [r.layer for r in v.selection] == selected
    if dtype == "fp32":
        assert all(r.flipped == 0 for r in v.selection)
    logits = v.points[-1]
    if dtype == "fp32":
        assert logits.metrics["rel_l2"] <= 1e-5 and logits.metrics["kl"] <= 1e-10
        assert all(r.flipped == 0 for r in v.routing)
    else:
        # A correct bf16 model is about as far from fp32 as HF's own bf16 run: near 1x, not 0x.
        assert 0.25 < logits.ratio < 2.0, v.summary
        assert logits.metrics["rel_l2"] > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp1", "multi"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_clean_conversion_is_aligned(aligned, family, dtype, layout):
    _check_clean(_judge(aligned, family, dtype, aligned["clean"][layout][(family, dtype)]), family, dtype, aligned)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "ep2"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_clean_moe_conversion_is_aligned_in_bf16_at_tp_and_ep(aligned, family, layout):
    _check_clean(_judge(aligned, family, "bf16", aligned["clean"][layout][(family, "bf16")]), family, "bf16", aligned)


# --- DeepSeek-V4: residual streams, CSA block selection, hash routing --------------------------------

@pytest.mark.slow
def test_deepseek_v4_aligned_sequence_makes_every_sparsity_bite(aligned):
    """The clean V4 runs above are aligned at a length where the sliding window, both compression rates and the
    index top-k all cut something (a sequence that leaves them whole would not test them), and every CSA layer's
    block selection is judged."""
    from megatron_patch.models.deepseek_v4.attention import V4AttentionSettings
    from megatron_patch.models.deepseek_v4.settings import CSA, HCA, SLIDING

    arch = parse_arch(aligned["hf"]["deepseek_v4"])
    own = V4AttentionSettings.from_hf(arch.hf_config)
    seq = align_tokens().shape[1]
    assert set(own.layer_types) == {SLIDING, CSA, HCA} and own.sliding_window < seq
    assert all(seq // own.compress_rate(t) > own.sliding_window // own.compress_rate(t) for t in (CSA, HCA))
    ref = aligned["ref"]["deepseek_v4"]
    csa = [i for i, t in enumerate(own.layer_types) if t == CSA]
    assert selection_layers(ref) == csa
    for i in csa:  # late queries see more blocks than they keep: the top-k chose
        kept = ref[f"selection.{i}"].sum(-1)
        assert int(kept.max()) == own.index_topk < seq // own.compress_rate(CSA)
    assert exact_routing_layers(arch) == [i for i, t in enumerate(arch.family_config.mlp_layer_types) if t == "hash_moe"]


@pytest.mark.slow
def test_deepseek_v4_layer_outputs_are_judged_per_stream(aligned):
    """Each layer's output is compared per residual stream, as transformers holds them ([b, s, hc, h]); the
    embedding, one hidden state there, against each stream it is copied into. A fault in one stream's mix fails
    at its layer's output naming that stream, the others exact."""
    arch = parse_arch(aligned["hf"]["deepseek_v4"])
    streams = arch.family_config.hc_mult
    for dtype in DTYPES:
        v = _judge(aligned, "deepseek_v4", dtype, aligned["clean"]["tp1"][("deepseek_v4", dtype)])
        # each layer's output, and its streams after the attention's hyper-connection (the residual point)
        for kind in (".output", ".residual"):
            held = [p for p in v.points if p.name.endswith(kind)]
            assert [len(p.streams) for p in held] == [streams] * arch.num_layers, kind
            assert all(r.passed for p in held for r in p.streams), kind
        assert not next(p for p in v.points if p.name == "embedding").streams
    v = _judge(aligned, "deepseek_v4", "fp32", aligned["faults"]["v4_one_stream_post_mix"])
    point = next(p for p in v.points if p.name == f"layers.{FAULT_LAYER}.output")
    assert [r.stream for r in point.failed_streams] == [V4_STREAM], v.summary
    assert all(r.metrics["rel_l2"] <= 1e-5 for r in point.streams if r.stream != V4_STREAM)
    assert f"layer {FAULT_LAYER} (layers.{FAULT_LAYER}.output, stream {V4_STREAM})" in v.summary


@pytest.mark.slow
def test_cli_deepseek_v4_aligned_and_a_hash_table_fault_not(aligned, tmp_path):
    """`mpatch align` on V4: the clean conversion ALIGNED by both runs, its report showing the streams, the hash
    layers held exact and the CSA selection; one wrong hash-table row NOT aligned (exit 1) at its routing."""
    hf = str(aligned["hf"]["deepseek_v4"])
    clean = aligned["faulty"]["v4_sinks_dropped"].parent.parent / "clean" / "deepseek_v4"
    report = tmp_path / "clean"
    assert main(["align", "--hf-dir", hf, "--mcore-dir", str(clean), "--dtype", "bf16", "--quiet",
                 "--report-dir", str(report)]) == 0
    verdict = json.loads((report / "report.json").read_text())["verdict"]
    assert verdict["aligned"] and "decided by both runs" in verdict["summary"]
    md = (report / "report.md").read_text()
    assert "| layers.3.output (all streams) |" in md and "| layers.3.output stream 3 |" in md
    assert "none (routed by token id)" in md and "## Key selection" in md
    report = tmp_path / "fault"
    assert main(["align", "--hf-dir", hf, "--mcore-dir", str(aligned["faulty"]["v4_tid2eid_row_replaced"]),
                 "--dtype", "fp32", "--quiet", "--report-dir", str(report)]) == 1
    assert json.loads((report / "report.json").read_text())["verdict"]["first_failure"] == "layers.1.routing"


def test_routing_flips_are_judged_on_their_own_floor():
    """The verdict's routing rule on made-up captures: near-tie flips within the floor pass and the
    tokens they reach are left out; flips far beyond HF's own fail, naming the layer."""
    from megatron_patch.align.verdict import MIN_FLOOR_FLIPS

    torch.manual_seed(0)
    layers, b, s, h, k = 2, 2, 16, 8, 2

    def captures(routing):
        out = {n: torch.randn(b, s, h) for n in point_names(layers)}
        out["logits"] = torch.randn(b, s, 32)
        out.update({f"routing.{i}": r.clone() for i, r in enumerate(routing)})
        return out

    route = [torch.sort(torch.randint(0, 8, (b, s, k)), -1).values for _ in range(layers)]
    ref = captures(route)
    floor = {n: t + 0.01 * torch.randn_like(t) if t.is_floating_point() else t.clone() for n, t in ref.items()}
    test = {n: t + 0.01 * torch.randn_like(t) if t.is_floating_point() else t.clone() for n, t in ref.items()}
    # One near-tie flip at layer 1, position 10 of sequence 0: that token's MLP output jumps.
    test["routing.1"][0, 10] = test["routing.1"][0, 10] + 8
    test["layers.1.mlp"][0, 10] += 5.0
    v = judge(ref, test, "bf16", layers, floor)
    assert v.aligned, v.summary
    mlp = next(p for p in v.points if p.name == "layers.1.mlp")
    assert mlp.tokens == b * s - 1 and v.points[-1].tokens == b * s - (s - 10)  # reached through attention
    # Beyond the floor: every token of layer 0 goes elsewhere.
    test["routing.0"] = test["routing.0"] + 8
    v = judge(ref, test, "bf16", layers, floor)
    assert not v.aligned and v.first_failure == "layers.0.routing", v.summary
    assert v.routing[0].flipped == b * s and v.routing[0].ratio == b * s / MIN_FLOOR_FLIPS


def test_an_fp32_floor_raises_the_fixed_bound_to_twice_transformers_own_rounding_and_no_further():
    """fp32 rounding adds up with depth (a correct 12-layer Qwen3-Next went over 1e-5 at layer 4: the cfg audit), so
    an fp32 run over the fixed bound is judged again against HF's own fp32 error from HF fp64: each point within the
    larger of 1e-5 and 2x that floor, on made-up captures."""
    torch.manual_seed(0)
    layers, b, s, h = 2, 2, 16, 8

    def off(captures, by, names=None):  # each point moved by ``by`` of its norm (relative L2), or only ``names``
        out = {}
        for n, t in captures.items():
            noise = torch.randn_like(t)
            moved = by if names is None or n in names else 0.0
            out[n] = t + moved * t.norm() / noise.norm() * noise
        return out

    ref = {n: torch.randn(b, s, h) for n in point_names(layers)}
    ref["logits"] = torch.randn(b, s, 32)
    floor = off(ref, 4e-5)    # HF fp64, as far from HF fp32 as a deep model's fp32 rounding goes
    drifted = off(ref, 6e-5)  # the tested side: over 1e-5, within 2x the floor
    fixed = judge(ref, drifted, "fp32", layers)
    assert not fixed.aligned and not fixed.fp32_floor and fixed.first_failure == "embedding", fixed.summary
    v = judge(ref, drifted, "fp32", layers, floor)
    assert v.aligned and v.fp32_floor, v.summary
    assert "judged against HF's own fp32 error from HF fp64, 4.0e-05 at the logits, as a floor" in v.summary
    assert v.points[0].limit == "rel_l2 <= 8.0e-05 (max of 1e-05, 2x floor)" and 1.4 < v.points[0].ratio < 1.6
    # past twice the floor at layer 1's MLP alone: named there, with both numbers
    faulty = {**drifted, **off(ref, 1e-4, {"layers.1.mlp"})}
    v = judge(ref, faulty, "fp32", layers, floor)
    assert not v.aligned and v.first_failure == "layers.1.mlp", v.summary
    assert ("rel_l2 1.0e-04 > 8.0e-05, the larger of 1e-05 and 2x HF's own fp32 error (4.0e-05 against HF fp64)"
            in v.summary), v.summary
    # where HF's own rounding is below half the fixed bound, the fixed bound holds
    v = judge(ref, off(ref, 2e-5), "fp32", layers, off(ref, 1e-6))
    assert not v.aligned and v.first_failure == "embedding" and "> 1.0e-05, the larger of" in v.summary, v.summary


def test_the_verdict_says_which_experts_the_forced_routing_leaves_unexercised():
    """Fewer token slots (batch x seq x top-k) than experts: the forced routing cannot reach them all, and an
    ALIGNED verdict must not read as if it had."""
    from megatron_patch.align.alignment import input_coverage

    arch = parse_arch(families()["deepseek_v3"].tiny_config)  # 8 experts, top-4
    two_tokens = {"routing.1": torch.zeros(1, 1, 4, dtype=torch.long), "routing.2": torch.zeros(1, 1, 4)}
    said = input_coverage(two_tokens, arch)
    assert said.startswith(f"the forced routing reaches 4 of the {arch.num_experts} experts of each MoE layer"), said
    assert input_coverage({"routing.1": torch.zeros(1, 2, 4, dtype=torch.long)}, arch) is None
    assert input_coverage({}, parse_arch(families()["llama3_1"].tiny_config)) is None


@pytest.mark.slow
def test_a_fault_in_an_expert_no_input_token_reaches_fails_at_every_expert(tmp_path):
    """Two tokens reach at most 4 of an MoE layer's expert slots: a fault in an expert none of them chose was
    ALIGNED ('fp32 certifies the conversion'). The forced-routing forward sends tokens to every expert."""
    hf = make_tiny_hf_checkpoint("qwen3_moe", tmp_path / "hf", seed=1)
    arch = parse_arch(hf)
    tokens = random_tokens(arch.vocab_size, batch=1, seq=2, seed=0)
    ref = capture_hf_dir(hf, tokens, "fp32")
    unused = sorted(set(range(arch.num_experts)) - set(ref["routing.1"].flatten().tolist()))
    assert unused, ref["routing.1"]
    ckpt = tmp_path / "mcore"
    hf_to_mcore(hf, ckpt, ParallelLayout(), fmt="legacy", progress=False)

    def scale_unused_expert(sd):
        sd[f"decoder.layers.1.mlp.experts.linear_fc2.weight{unused[0]}"] *= 2

    edit_weights(ckpt, scale_unused_expert)
    write_manifest(ckpt, "tests: planted fault", sync=False)
    test, = capture_mcore_runs(ParallelLayout(), tokens, [McoreRun("fp32", mcore_dir=str(ckpt))])
    v = judge(ref, test, "fp32", arch.num_layers)
    assert not v.aligned and v.first_failure == every_expert_point(1), v.summary
    assert "every expert" in v.summary
    # what the inputs' own routing computes is right: only the forced outputs from layer 1 on differ
    assert {p.name for p in v.points if not p.passed} == {every_expert_point(i) for i in range(1, arch.num_layers)}


def test_forced_routes_send_tokens_to_every_expert_in_either_token_order():
    from megatron_patch.align.capture import forced_routes

    batch_first, weights = forced_routes(2, 3, num_experts=8, top_k=2, seq_first=False)
    assert batch_first.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3]]
    assert weights[0].tolist() == pytest.approx([1 / 3, 2 / 3])
    seq_first, _ = forced_routes(2, 3, num_experts=8, top_k=2, seq_first=True)
    # MCore's router sees (s, b): token (b, s) gets the same experts as in HF's (b, s) order
    assert torch.equal(seq_first.view(3, 2, 2).transpose(0, 1), batch_first.view(2, 3, 2))


def test_every_id_is_judged_row_by_row_and_names_the_worst():
    """One row in a vocabulary of 50,000 off by 1%: a whole-tensor error of 4e-5, within bf16's floor, but that
    id's own row is 1e-2 off: the point fails and names it."""
    from megatron_patch.align.verdict import _judge_every_id

    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(50_000, 1, 16, generator=gen)
    test = ref.clone()
    test[31_337] *= 1.01
    floor = ref.to(torch.bfloat16).float()
    point = _judge_every_id({EVERY_ID: ref}, {EVERY_ID: test}, None, "fp32", DEFAULT_TOLERANCE)
    assert not point.passed and point.metrics["worst_id"] == 31_337 and point.metrics["ids"] == 50_000
    point = _judge_every_id({EVERY_ID: ref}, {EVERY_ID: test}, {EVERY_ID: floor}, "bf16", DEFAULT_TOLERANCE)
    assert not point.passed and point.metrics["worst_id"] == 31_337 and point.ratio > 2, point
    # the same rounding as HF's own in bf16 passes
    point = _judge_every_id({EVERY_ID: ref}, {EVERY_ID: floor.clone()}, {EVERY_ID: floor}, "bf16", DEFAULT_TOLERANCE)
    assert point.passed and point.ratio == 1.0
    test[7] = float("nan")
    point = _judge_every_id({EVERY_ID: ref}, {EVERY_ID: test}, None, "fp32", DEFAULT_TOLERANCE)
    assert not point.passed and point.metrics["worst_id"] == 7


def test_fp32_certifies_the_conversion_saying_how_many_routing_flips_it_allowed():
    """A router bias off by 0.03 moved 2 of 256 tokens in fp32, within the 1% allowed for near-ties: the verdict
    said 'fp32 certifies the conversion' while the whole logits differed 2600x over the fp32 bound. The router
    logits are now a point of their own (the planted fault ``router_row_nudged`` fails there); the flips allowed
    are still said."""
    from types import SimpleNamespace

    from megatron_patch.align.alignment import _certifies
    from megatron_patch.align.verdict import RoutingResult

    def run(flipped):
        return SimpleNamespace(routing=[RoutingResult(2, 256, flipped, None, None, "<= 1% of tokens", True)])

    assert _certifies(run(0)) == "fp32 certifies the conversion"
    assert _certifies(run(2)).startswith("fp32 certifies the conversion (2 routing flip(s) at fp32 near-ties, with "
                                         "router logits that agree"), _certifies(run(2))


def test_a_nan_is_the_worst_point_of_the_verdict():
    """With a NaN from layer 1 on, the verdict named 'worst point embedding at 0.0e+00': max() over a NaN keeps
    what it met first."""
    layers, b, s, h = 2, 2, 8, 8
    ref = {n: torch.randn(b, s, h) for n in point_names(layers)}
    ref["logits"] = torch.randn(b, s, 32)
    test = {n: t.clone() for n, t in ref.items()}
    for name in [n for n in test if n.startswith("layers.1.") or n in ("final_norm", "logits")]:
        test[name] = torch.full_like(test[name], float("nan"))
    v = judge(ref, test, "fp32", layers)
    assert not v.aligned and v.worst_point != "embedding" and "worst point embedding" not in v.summary, v.summary


@pytest.mark.slow
def test_bf16_verdict_needs_the_floor_and_uses_it(aligned):
    ref, floor = aligned["ref"]["llama3_1"], aligned["floor"]["llama3_1"]
    with pytest.raises(ValueError):
        judge(ref, floor, "bf16", 4, None)
    # HF's own bf16 run judged against itself as floor is exactly 1x everywhere.
    v = judge(ref, floor, "bf16", 4, floor)
    assert v.aligned and all(abs(p.ratio - 1) < 1e-12 for p in v.points if p.floor["rel_l2"] > 1e-3)
    # The fp32 rule would call that same bf16 run misaligned at its first point, the embedding of every id.
    assert judge(ref, floor, "fp32", 4).first_failure == EVERY_ID


def test_keys_that_say_nothing_about_the_computation_are_ignored_at_any_depth():
    """A multimodal config.json holds a dtype in each sub-config: the same weights saved again in another dtype were
    called "another model" (text_config.dtype: bfloat16 -> float32; the align audit); a nested key that does say
    something is still named."""
    saved = {"dtype": "bfloat16", "text_config": {"dtype": "bfloat16", "rope_theta": 1e6, "use_cache": True},
             "vision_config": {"dtype": "bfloat16", "torch_dtype": "bfloat16", "depth": 2}}
    again = {"dtype": "float32", "text_config": {"dtype": "float32", "rope_theta": 1e6, "use_cache": False},
             "vision_config": {"dtype": "float32", "torch_dtype": "float32", "depth": 2}}
    assert config_differences(saved, again) == []
    again["text_config"]["rope_theta"] = 1e4
    assert config_differences(saved, again) == [{"key": "text_config.rope_theta", "reference": 1e6, "tested": 1e4}]


@pytest.mark.slow
def test_config_differences_name_the_changed_keys(aligned):
    from megatron_patch.checkpoint.sidecar import read_sidecar

    ckpt = aligned["faulty"]["wrong_rope_scaling_in_config"]
    diff = config_differences(parse_arch(aligned["hf"]["llama3_1"]).hf_config, read_sidecar(ckpt).hf_config)
    keys = {d["key"].split(".")[-1] for d in diff}
    assert keys == {"low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}


@pytest.mark.slow
def test_a_checkpoint_whose_config_says_another_model_is_not_aligned(tmp_path, capsys):
    """A gpt-oss checkpoint whose sidecar says sliding_window 4096 for the HF model's 128 agrees on align's 128
    tokens: it was certified ALIGNED, exit 0, the difference only a table at the end of report.md (the adoc audit;
    at 256 tokens it fails at layers.0.attention). The verdict is NOT ALIGNED, naming the key."""
    from megatron_patch.checkpoint.sidecar import SIDECAR_NAME

    hf = make_tiny_hf_checkpoint("gpt_oss", tmp_path / "hf", seed=1, sliding_window=128)
    hf_to_mcore(hf, tmp_path / "ckpt", ParallelLayout(), progress=False)
    sidecar = tmp_path / "ckpt" / SIDECAR_NAME
    saved = json.loads(sidecar.read_text())
    saved["hf_config"]["sliding_window"] = 4096
    sidecar.write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(["align", "--hf-dir", str(hf), "--mcore-dir", str(tmp_path / "ckpt"), "--no-verify", "--dtype",
                 "fp32", "--seq-len", "32", "--batch", "1", "--quiet", "--report-dir", str(tmp_path / "out")]) == 1
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert not report["verdict"]["aligned"] and "(sliding_window: 128 -> 4096)" in report["verdict"]["summary"]
    assert report["verdict"]["runs"]["fp32"]["aligned"]  # what the numbers alone said


def _with_weight(hf, out, name, value):
    """A copy of the HF folder ``hf`` whose tensor ``name`` holds ``value`` at one element."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(hf, out)
    tensors = load_file(out / "model.safetensors")
    tensors[name][3, 5] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_hf_weight_is_bad_input_not_a_divergence(tmp_path, capsys, value):
    """The conversion carries a NaN exactly, so align said "NOT aligned: first divergence at layer 1" and parity
    "FAIL" (exit 1, the verdict on the conversion) where the input was at fault."""
    from megatron_patch.errors import UserError
    from megatron_patch.models.description.hf_model import load_causal_lm

    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "clean")
    bad = _with_weight(hf, tmp_path / "bad", "model.layers.1.mlp.down_proj.weight", value)
    message = "the weight model.layers.1.mlp.down_proj.weight is not finite"
    with pytest.raises(UserError, match=message):
        load_causal_lm(bad, torch.float32)
    assert main(["align", "--hf-dir", str(bad), "--report-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "NOT aligned" not in err, err


def test_a_non_finite_peft_weight_is_bad_input_not_a_divergence(tmp_path, capsys):
    """--peft-dir puts the adapter on both sides, so its NaN made the same false divergence as the base's."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file, save_file

    from tests.lora_helpers import make_peft_adapter

    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf")
    adapter = make_peft_adapter(hf, tmp_path / "adapter")
    path = adapter / "adapter_model.safetensors"
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if "lora_B" in n)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, path, metadata={"format": "pt"})
    assert main(["align", "--hf-dir", str(hf), "--peft-dir", str(adapter), "--report-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{adapter}: the weight " in err and "lora_B" in err and "is not finite" in err, err


@pytest.mark.slow
def test_a_nan_only_the_mcore_side_holds_is_still_a_divergence(tmp_path, capsys):
    """The finiteness check is on the reference alone: a NaN the conversion puts there is the conversion's fault."""
    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf")
    ckpt = tmp_path / "ck"
    hf_to_mcore(hf, ckpt, ParallelLayout(), fmt="legacy", progress=False)
    edit_weights(ckpt, lambda sd: sd["decoder.layers.1.mlp.linear_fc2.weight"].__setitem__((3, 5), float("nan")))
    write_manifest(ckpt, "tests: planted fault", sync=False)
    assert main(["align", "--hf-dir", str(hf), "--mcore-dir", str(ckpt), "--report-dir", str(tmp_path / "out")]) == 1
    out = capsys.readouterr().out
    assert "NOT aligned: first divergence at layer 1" in out, out


# --- the command line ---------------------------------------------------------------------------

@pytest.mark.slow
def test_cli_bad_input_exits_2(aligned, tmp_path, capsys):
    llama = str(aligned["hf"]["llama3_1"])
    legacy = str(aligned["faulty"]["k_and_v_swapped"])
    assert main(["align", "--hf-dir", str(tmp_path / "nope")]) == 2
    assert main(["align", "--hf-dir", llama, "--mcore-dir", legacy, "--hf-dir-2", llama]) == 2
    assert main(["align", "--hf-dir", llama, "--mcore-dir", legacy, "--tp", "2"]) == 2
    assert main(["align", "--hf-dir", llama, "--mcore-dir", str(aligned["faulty"]["expert_0_and_1_swapped"])]) == 2
    err = capsys.readouterr().err
    assert "legacy checkpoint for TP=1" in err and "different models" in err
    # --base-dir is for a LoRA run's moved base; a plain checkpoint has none to replace
    assert main(["align", "--hf-dir", llama, "--mcore-dir", legacy, "--base-dir", str(tmp_path)]) == 2
    assert f"--base-dir names the base of a LoRA run's checkpoint given as --mcore-dir, and {legacy} is none" in \
        capsys.readouterr().err


def test_options_for_a_side_that_is_not_there_are_refused(tmp_path, capsys):
    """--tp/--pp/--ep with --hf-dir-2 ran two HF models whole, ALIGNED and exit 0, the layout silently dropped (and
    written in the report's command); --no-verify without --mcore-dir did nothing (the align audit): exit 2."""
    hf = str(make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf"))
    assert main(["align", "--hf-dir", hf, "--hf-dir-2", hf, "--tp", "2", "--pp", "2"]) == 2
    assert ("--tp/--pp/--ep/--etp split the MCore side, and --hf-dir-2 runs two HF models whole: drop them (got TP=2 "
            "PP=2") in capsys.readouterr().err
    assert main(["align", "--hf-dir", hf, "--hf-dir-2", hf, "--etp", "1"]) == 2
    assert main(["align", "--hf-dir", hf, "--no-verify"]) == 2
    assert "--no-verify skips checking --mcore-dir's files against its manifest, and there is no --mcore-dir" in \
        capsys.readouterr().err


def test_a_reference_transformers_cannot_build_is_bad_input(tmp_path):
    """A pad_token_id beyond the vocabulary converts (the weights are whole) but transformers cannot build the
    model align compares against: that was an internal error (exit 3)."""
    from megatron_patch.errors import UserError
    from megatron_patch.models.description.hf_model import load_causal_lm

    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "pad_token_id": config["vocab_size"] + 10}))
    with pytest.raises(UserError, match="cannot load the model in .*Padding_idx must be within num_embeddings"):
        load_causal_lm(hf, torch.float32)


@pytest.mark.slow
def test_cli_hf_vs_hf_round_trip_verdicts_and_report(aligned, tmp_path):
    from safetensors.torch import load_file, save_file

    src = aligned["hf"]["qwen2"]
    good = tmp_path / "good"
    shutil.copytree(src, good)
    assert main(["align", "--hf-dir", str(src), "--hf-dir-2", str(good), "--dtype", "fp32", "--quiet",
                 "--report-dir", str(tmp_path / "r_good")]) == 0

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["model.layers.3.self_attn.v_proj.bias"] = torch.zeros_like(tensors["model.layers.3.self_attn.v_proj.bias"])
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    report = tmp_path / "r_bad"
    assert main(["align", "--hf-dir", str(src), "--hf-dir-2", str(bad), "--dtype", "bf16", "--quiet",
                 "--report-dir", str(report)]) == 1
    data = json.loads((report / "report.json").read_text())
    assert data["verdict"]["first_failure"] == "layers.3.attention"
    md = (report / "report.md").read_text()
    assert "NOT ALIGNED" in md and "layer 3" in md and "--hf-dir-2" in md
    assert (report / "error_by_layer.png").read_bytes()[:4] == b"\x89PNG"


GPU_ABLATIONS = ("rope_fused", "rmsnorm_te", "softmax_fused", "attention_te")
CPU_ABLATIONS = ("rope_fp32", "rmsnorm_hf", "rmsnorm_lowp", "softmax_lowp", "residual_fp32", "bias_swiglu_fused",
                 "attention_sdpa")


@pytest.fixture(scope="module")
def ablation_report(aligned, tmp_path_factory):
    report = tmp_path_factory.mktemp("ablate") / "rep"
    ckpt = str(aligned["faulty"]["query_heads_swapped_in_group"].parent.parent / "clean" / "llama3_1")
    code = main(["align", "--hf-dir", str(aligned["hf"]["llama3_1"]), "--mcore-dir", ckpt, "--dtype", "bf16",
                 "--seq-len", "64", "--ablate", "--quiet", "--report-dir", str(report)])
    assert code == 0
    return report


@pytest.mark.slow
def test_cli_ablate_reports_each_source(ablation_report):
    from megatron_patch.align.ablations import ABLATIONS

    rows = {r["name"]: r for r in json.loads((ablation_report / "report.json").read_text())["ablations"]}
    assert set(rows) == {"baseline"} | {a.name for a in ABLATIONS}
    for name in CPU_ABLATIONS:
        assert rows[name]["status"] == "ran", name
    base = rows["baseline"]["diff_to_hf_same_dtype"]
    assert base > 1e-3
    # HF's RMSNorm arithmetic removes most of the HF/MCore bf16 difference; a bf16-only norm adds error.
    assert rows["rmsnorm_hf"]["diff_to_hf_same_dtype"] < 0.5 * base
    assert rows["rmsnorm_lowp"]["logits_rel_l2"] > rows["baseline"]["logits_rel_l2"]


@pytest.mark.slow
def test_cli_ablate_of_a_family_with_its_own_norms_and_activation(tmp_path):
    """Gemma 3 (its own zero-centred norms, a tanh GeLU): --ablate stopped as an internal error, its fp32 residual
    feeding the norms' fp32 output into bf16 linears and its fused-SwiGLU variant failing the model build (the cmp
    audit). The residual variant runs; those that would change nothing in this model are skipped saying why."""
    hf = make_tiny_hf_checkpoint("gemma3", tmp_path / "hf", seed=1)
    report = tmp_path / "rep"
    assert main(["align", "--hf-dir", str(hf), "--dtype", "bf16", "--seq-len", "32", "--ablate", "--quiet",
                 "--report-dir", str(report)]) == 0
    rows = {r["name"]: r for r in json.loads((report / "report.json").read_text())["ablations"]}
    assert rows["residual_fp32"]["status"] == rows["rope_fp32"]["status"] == "ran"
    assert rows["residual_fp32"]["change_vs_baseline"] != 0.0
    assert rows["bias_swiglu_fused"]["status"] == "skipped"
    assert "not one megatron-core fuses" in rows["bias_swiglu_fused"]["reason"]
    for name in ("rmsnorm_hf", "rmsnorm_lowp"):
        assert rows[name]["status"] == "skipped" and "not torch's RMSNorm" in rows[name]["reason"], rows[name]


@pytest.mark.slow
@pytest.mark.parametrize("family, skipped, ran", [
    ("gpt_oss", {"attention_sdpa": "unfused arithmetic inside SDPA's module",
                 "bias_swiglu_fused": "not one megatron-core fuses"}, ("rope_fp32", "residual_fp32")),
    ("deepseek_v4", {"attention_sdpa": "attention is its own", "softmax_lowp": "attention is its own",
                     "rope_fp32": "RoPE of its own", "rmsnorm_hf": "not torch's RMSNorm"}, ("residual_fp32",)),
])
def test_cli_ablate_skips_what_would_not_change_the_model(tmp_path, family, skipped, ran):
    """gpt-oss's sinks run megatron's unfused arithmetic inside SDPA's module, DeepSeek-V4 has its own attention and
    RoPE: those variants were listed as runs equal to the baseline (the s63 audit)."""
    hf = make_tiny_hf_checkpoint(family, tmp_path / "hf", seed=1)
    report = tmp_path / "rep"
    assert main(["align", "--hf-dir", str(hf), "--dtype", "bf16", "--seq-len", "32", "--ablate", "--quiet",
                 "--report-dir", str(report)]) == 0
    rows = {r["name"]: r for r in json.loads((report / "report.json").read_text())["ablations"]}
    for name, why in skipped.items():
        assert rows[name]["status"] == "skipped" and why in rows[name]["reason"], rows[name]
    for name in ran:
        assert rows[name]["status"] == "ran" and rows[name]["change_vs_baseline"] != 0.0, rows[name]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the TE/fused variants run (next test)")
def test_cli_ablate_skips_gpu_variants_on_cpu(ablation_report):
    rows = {r["name"]: r for r in json.loads((ablation_report / "report.json").read_text())["ablations"]}
    for name in GPU_ABLATIONS:
        assert rows[name]["status"] == "skipped" and "GPU" in rows[name]["reason"], name
    # on CPU the baseline is megatron's unfused attention, and the report says so; SDPA is a variant
    assert rows["attention_unfused"]["status"] == "skipped" and "baseline already runs it" in rows["attention_unfused"]["reason"]
    assert rows["attention_sdpa"]["logits_rel_l2"] < 1.5 * rows["baseline"]["logits_rel_l2"]
    report = (ablation_report / "report.md").read_text()
    assert "skipped" in report and "- attention: local: megatron-core DotProductAttention" in report


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the TE/fused ablations need a CUDA GPU")
def test_cli_ablate_runs_gpu_variants_on_gpu(tmp_path):
    """One GPU is enough: a fresh tiny model aligned at TP=1 (the module's fixtures also run multi-rank layouts).
    Each variant runs exactly where this GPU has what it needs (TE, Apex's softmax), else is skipped saying why."""
    from megatron_patch.align.ablations import ABLATIONS, describe_baseline_attention, skip_reason
    from megatron_patch.models.blocks.builder import fused_softmax_available, te_available

    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf", seed=1)
    assert main(["align", "--hf-dir", str(hf), "--dtype", "bf16", "--seq-len", "64", "--ablate", "--quiet",
                 "--report-dir", str(tmp_path / "rep")]) == 0
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    rows = {r["name"]: r for r in data["ablations"]}
    assert data["attention"] == describe_baseline_attention()
    assert rows["softmax_fused"]["status"] == ("ran" if fused_softmax_available() and te_available() else "skipped")
    for name in ("rope_fused", "rmsnorm_te", "attention_te"):
        assert rows[name]["status"] == ("ran" if te_available() else "skipped"), name
    for ab in ABLATIONS:
        assert rows[ab.name]["status"] == ("skipped" if skip_reason(ab) else "ran"), ab.name


@pytest.mark.slow
def test_cli_text_file_feeds_real_text_through_the_tokenizer(aligned, tmp_path, capsys):
    from megatron_patch.demo_data import make_texts, make_tokenizer

    texts = make_texts(400, seed=2)
    hf = tmp_path / "llama_with_tokenizer"
    shutil.copytree(aligned["hf"]["llama3_1"], hf)
    tok_dir = make_tokenizer(tmp_path / "tok", texts, vocab_size=200)
    for f in tok_dir.iterdir():
        shutil.copy(f, hf / f.name)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(texts[:60]))
    report = tmp_path / "rep"
    assert main(["align", "--hf-dir", str(hf), "--text-file", str(text), "--dtype", "fp32", "--seq-len", "48",
                 "--batch", "2", "--quiet", "--report-dir", str(report)]) == 0
    data = json.loads((report / "report.json").read_text())
    assert "text from text.txt (96 tokens)" in json.dumps(data)
    # Too little text for the requested batch is bad input, said in one line.
    short = tmp_path / "short.txt"
    short.write_text(texts[0])
    capsys.readouterr()
    assert main(["align", "--hf-dir", str(hf), "--text-file", str(short), "--dtype", "fp32", "--quiet"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mpatch")]
    assert len(err) == 1 and "tokens; --batch 2 x --seq-len 128 needs 256" in err[0]


@pytest.mark.slow
def test_cli_fp16_is_judged_against_hf_fp16_rounding(aligned, tmp_path):
    report = tmp_path / "rep"
    assert main(["align", "--hf-dir", str(aligned["hf"]["llama3_1"]), "--dtype", "fp16", "--quiet",
                 "--report-dir", str(report)]) == 0
    verdict = json.loads((report / "report.json").read_text())["verdict"]
    assert "HF's own fp16 rounding" in verdict["summary"]


@pytest.mark.slow
def test_cli_moe_checkpoint_aligned_at_expert_parallel_2(aligned, tmp_path):
    ckpt = aligned["faulty"]["query_heads_swapped_in_group"].parent.parent / "clean" / "qwen2_moe"
    report = tmp_path / "rep"
    assert main(["align", "--hf-dir", str(aligned["hf"]["qwen2_moe"]), "--mcore-dir", str(ckpt), "--ep", "2",
                 "--dtype", "fp32", "--quiet", "--report-dir", str(report)]) == 0
    data = json.loads((report / "report.json").read_text())
    assert "EP=2" in json.dumps(data) and data["verdict"]["aligned"]


def test_routing_by_token_id_is_held_exact_and_streams_are_judged_each():
    """The verdict on made-up captures: a flip that routing's noise rule lets pass fails at a layer routed by token
    id; a layer output held as streams fails when one stream is off, naming it, though the whole is within the
    bound; the embedding (one hidden state in the reference) is compared against each stream it is copied into."""
    torch.manual_seed(0)
    layers, b, s, n, h = 2, 2, 16, 4, 8

    def captures():
        out = {name: torch.randn(b, s, n, h) if name.endswith(".output") else torch.randn(b, s, h)
               for name in point_names(layers)}
        out["logits"] = torch.randn(b, s, 32)
        out.update({f"routing.{i}": torch.sort(torch.randint(0, 8, (b, s, 2)), -1).values for i in range(layers)})
        return out

    ref = captures()
    floor = {k: t + 0.01 * torch.randn_like(t) if t.is_floating_point() else t.clone() for k, t in ref.items()}
    test = {k: t + 0.01 * torch.randn_like(t) if t.is_floating_point() else t.clone() for k, t in ref.items()}
    test["embedding"] = ref["embedding"].unsqueeze(-2).expand(b, s, n, h) + 0.01 * torch.randn(b, s, n, h)
    test["routing.1"][0, 3] += 8  # one token to other experts
    assert judge(ref, test, "bf16", layers, floor).aligned
    v = judge(ref, test, "bf16", layers, floor, exact_routing=[1])
    assert not v.aligned and v.first_failure == "layers.1.routing" and v.routing[1].exact, v.summary
    assert "token id alone decides them" in v.summary

    test["routing.1"] = ref["routing.1"].clone()
    test["layers.0.output"][..., 2, :] += 0.03 * torch.randn(b, s, h)  # stream 2 about 3x the floor's error, the whole 1.7x
    v = judge(ref, test, "bf16", layers, floor, exact_routing=[1])
    point = next(p for p in v.points if p.name == "layers.0.output")
    assert point.ratio < DEFAULT_TOLERANCE and [r.stream for r in point.failed_streams] == [2], v.summary
    assert not v.aligned and "layer 0 (layers.0.output, stream 2)" in v.summary
    assert not v.points[0].streams and v.points[0].passed  # the embedding, copied into the streams
    # --ablate's error series reads the two layouts alike
    from megatron_patch.align.alignment import _point_series

    assert _point_series(ref, test, layers)[0] == pytest.approx(v.points[0].metrics["rel_l2"])


def test_streams_folded_into_the_batch_unfold_as_the_reference_holds_them():
    """megatron-core's [s, b * n, h] (a view of [s, b, n, h]) is captured as transformers' [b, s, n, h]; V4's CSA
    indexer marks 'no block' with -1, which keeps nothing."""
    from megatron_patch.align.capture import selection_mask

    streams = torch.randn(5, 2, 4, 3)  # [s, b, n, h]
    store = {}
    module = torch.nn.Identity()
    with torch.no_grad(), _hooks({"layers.0.output": module}, store, seq_first=True, batch=2, streams=4):
        module(streams.view(5, 8, 3))
    assert torch.equal(store["layers.0.output"], streams.permute(1, 0, 2, 3))
    topk = torch.tensor([[[-1, -1], [0, -1], [1, 0]]])  # [b=1, s=3, k=2]
    assert selection_mask(topk).tolist() == [[[False] * 3, [True, False, False], [True, True, False]]]


def test_a_capture_is_a_copy_even_when_the_output_is_changed_in_place_later():
    """MCore adds the residual into a sub-block's output in place; with batch 1 the [seq, 1, h] output
    transposes to an already contiguous tensor, so a capture that aliased it was silently changed."""
    module = torch.nn.Linear(4, 4)
    x = torch.randn(5, 1, 4)  # [seq, batch=1, hidden], MCore's order
    store = {}
    with torch.no_grad(), _hooks({"layers.0.mlp": module}, store, seq_first=True):
        out = module(x)
        expected = out.transpose(0, 1).clone()
        out.add_(1.0)
    assert torch.equal(store["layers.0.mlp"], expected)


def test_peft_dir_without_peft_is_refused_before_the_models_load(tmp_path, capsys, monkeypatch):
    """align --peft-dir without peft installed stopped 13-33 s in, after the HF model loaded (the newuser audit)."""
    import importlib.util

    import megatron_patch.align.alignment as alignment

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else find_spec(name, *a))
    monkeypatch.setattr(alignment, "run_alignment", lambda *a, **k: pytest.fail("the alignment ran"))
    rc = main(["align", "--hf-dir", str(tmp_path / "hf"), "--peft-dir", str(tmp_path / "peft"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "--peft-dir compares against peft's own model of the adapter: pip install peft" in err, err


def test_force_without_a_report_dir_is_refused_before_the_models_load(tmp_path, capsys, monkeypatch):
    """--force without --report-dir was accepted and did nothing (the tools audit)."""
    import megatron_patch.align.alignment as alignment

    monkeypatch.setattr(alignment, "run_alignment", lambda *a, **k: pytest.fail("the alignment ran"))
    rc = main(["align", "--hf-dir", str(tmp_path / "hf"), "--force", "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "--force replaces an earlier report in --report-dir, and none is given" in err, err

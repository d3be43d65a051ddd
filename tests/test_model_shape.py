"""A model's parameters and FLOPs from megatron-core's own shapes (models/shape/model_shape.py).

- `mpatch families --json` gives every preset's params_total and params_active; the published sizes
  of four models are checked;
- the per-layer-kind arithmetic equals a full build of the whole model (on the meta device) for a
  mid-size preset of each MoE layout (a dense layer then MoE layers with MLA; Qwen's MoE; Mixtral);
- the FLOPs per token equal Megatron-LM's ``num_floating_point_operations`` formula, written out here,
  within 1% (GQA, MoE with shared experts, MLA), and 6N plus the attention term for dense models;
- per rank, the memory plan's tests compare the same shapes with what a run allocates, for every family.
"""

from __future__ import annotations

import json
import math
from unittest import mock

import pytest

from megatron_patch.cli import main
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.models.shape.model_shape import model_shape, model_shapes
from megatron_patch.runtime.launch import run_local

B = 1e9


@pytest.fixture(scope="module")
def rows():
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["families", "--json"]) == 0
    return {r["family"]: r for r in json.loads(out.getvalue())}


# Published sizes as their authors give them: Meta's and Mistral's rounded, DeepSeek's "37B activated"
# and Qwen's "3.3B activated" cut down from 37.55 B and 3.35 B. Active counts include the embedding and
# the output layer, as all four publishers count them (without them: 36.6, 3.0 and 12.8).
@pytest.mark.parametrize("family,size,total,active,digits,cut", [
    ("llama3_1", "8B", 8.03, 8.03, 2, False),
    ("deepseek_v3", "671B", 671, 37, 0, True),      # without the multi-token-prediction layer
    ("deepseek_v3", "Kimi-K2-1T-A32B", 1026, 32, 0, True),  # Moonshot: "1T total (1.026T), 32B activated"
    ("deepseek_v4", "Flash", 284, 13, 0, True),  # DeepSeek: "284B parameters, 13B activated", MTP aside
    ("qwen3_moe", "30B-A3B", 30.5, 3.3, 1, True),
    ("mixtral", "8x7B", 46.7, 12.9, 1, False),
])
def test_families_json_gives_the_published_sizes(rows, family, size, total, active, digits, cut):
    counts = rows[family]["presets"][size]
    assert round(counts["params_total"] / B, digits) == total, counts
    scale = 10 ** digits
    shown = math.floor(counts["params_active"] / B * scale) / scale if cut else round(counts["params_active"] / B, digits)
    assert shown == active, counts


def test_deepseek_v4_pro_has_its_published_size(rows):
    """DeepSeek: "1.6T parameters, 49B activated" (the MTP layer aside), as its card rounds them."""
    counts = rows["deepseek_v4"]["presets"]["Pro"]
    assert round(counts["params_total"] / 1e12, 1) == 1.6 and math.floor(counts["params_active"] / B) == 49, counts


# Published sizes within 1%, and active ones as the publisher counts them: Zhipu and Qwen (for Qwen3-Next) leave
# out the embedding and the output layer, Qwen for Qwen3.5 neither (GLM-4.5 "355B total, 32B active", its total rounded up from 352.8 B without the MTP
# layer: within 1%), OpenAI only the embedding (gpt-oss's card: 20.91 B / 3.61 B and 116.83 B / 5.13 B).
@pytest.mark.parametrize("family,size,total,active,left_out,rel", [
    ("glm4_moe", "355B-A32B", 355, 32, 2, 0.01),
    ("glm4_moe", "Air-106B-A12B", 106, 12, 2, 0.01),
    ("glm_moe_dsa", "744B-A40B", 744, 40, 2, 0.01),  # Zhipu: "744B parameters (40B active)" (743.9 B, 39.9 B)
    ("gpt_oss", "20B-A3.6B", 20.91, 3.61, 1, 0.0005),
    ("gpt_oss", "120B-A5.1B", 116.83, 5.13, 1, 0.0005),
    ("qwen3_next", "80B-A3B", 80, 3, 2, 0.01),  # Qwen: "80B total, 3B activated" (79.7 B, 3.25 B)
    ("qwen3_5", "397B-A17B", 397, 17, 0, 0.01),  # the language model, 396.3 B: the card counts the vision tower too
    ("minimax_m2", "230B-A10B", 230, 10, 2, 0.01),  # MiniMax: "230B total, 10B activated" (228.7 B, 9.8 B)
])
def test_published_sizes_without_vocabulary_matrices(rows, family, size, total, active, left_out, rel):
    counts = rows[family]["presets"][size]
    arch = parse_arch(families()[family].presets[size])
    digits = len(str(active).partition(".")[2])
    assert abs(counts["params_total"] / B - total) <= rel * total, counts
    shown = (counts["params_active"] - left_out * arch.padded_vocab_size() * arch.hidden_size) / B
    assert round(shown, digits) == active, counts


def test_deepseek_v32_is_v3_with_an_indexer_per_layer(rows):
    """DeepSeek-V3.2's card gives V3's 671B (685B with the MTP layer's 14B): 671.9 B here, the difference
    exactly 61 indexers (wq_b from the query latent, wk, the key LayerNorm, weights_proj), all active."""
    v3, v32 = rows["deepseek_v3"]["presets"]["671B"], rows["deepseek_v32"]["presets"]["671B"]
    assert abs(v32["params_total"] / B - 671) <= 0.01 * 671, v32
    indexer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    for key in ("params_total", "params_active"):
        assert v32[key] - v3[key] == 61 * indexer, (v3, v32)


def test_every_preset_has_its_counts(rows):
    for name, family in families().items():
        for size in family.presets:
            counts = rows[name]["presets"][size]
            assert 0 < counts["params_active"] <= counts["params_total"], (name, size, counts)
            assert (counts["params_active"] < counts["params_total"]) == parse_arch(family.presets[size]).is_moe
    assert rows["llama3_1"]["presets"]["8B"]["params_total"] == 8_030_261_248  # Meta's own count


def _full_meta_build_worker(configs: list[dict]) -> list[int]:
    """Every parameter of each whole model, built by megatron-core on the meta device (no storage)."""
    import torch

    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.shape.skeleton import _ensure_single_rank_state
    from megatron_patch.runtime import ParallelLayout

    _ensure_single_rank_state()
    out = []
    for config in configs:
        # RoPE's frequencies are buffers, not parameters, and a meta tensor cannot take their values
        with torch.device("meta"), mock.patch("megatron_patch.models.blocks.rope.install"):
            model = build_model(parse_arch(config), ParallelLayout(), torch.float32, use_te=False, pre_process=True,
                                post_process=True, perform_initialization=False, use_cpu_initialization=True)
        out.append(sum(p.numel() for p in model.parameters()))
        del model
    return out


@pytest.mark.slow
def test_layer_kind_arithmetic_equals_a_full_build():
    configs = [families()["deepseek_v3"].presets["Moonlight-16B-A3B"], families()["qwen2_moe"].presets["57B-A14B"],
               families()["mixtral"].presets["8x7B"], families()["qwen3_moe"].tiny_config]
    built = run_local(_full_meta_build_worker, 1, configs, timeout=900)[0]
    counted = [s.params() for s in model_shapes([parse_arch(c) for c in configs])]
    assert counted == built


def _megatron_lm_flops_per_token(arch, seq: int) -> float:
    """Megatron-LM's num_floating_point_operations (training.py) for one token, causal attention."""
    h, layers = arch.hidden_size, arch.num_layers
    moe_layers = sum(arch.is_moe_layer(i) for i in range(layers))
    dense_layers = layers - moe_layers
    mlp = 12 * h * 1.5 * (arch.ffn_hidden_size * dense_layers
                          + (arch.moe_ffn_hidden_size * arch.moe_topk + arch.shared_expert_ffn_hidden_size) * moe_layers)
    if arch.mla:
        m = arch.mla
        q = h * arch.num_heads * m.qk_head_dim if m.q_lora_rank is None else \
            m.q_lora_rank * (h + arch.num_heads * m.qk_head_dim + 1)
        attention = 6 * layers * (q + m.kv_lora_rank * (h + arch.num_heads * (m.qk_nope_head_dim + m.v_head_dim) + 1)
                                  + h * m.qk_rope_head_dim + arch.num_heads * m.v_head_dim * h
                                  + seq * arch.num_heads * m.qk_head_dim * 0.5 + seq * arch.num_heads * m.v_head_dim * 0.5)
    else:
        q = arch.num_heads * arch.head_dim
        attention = 12 * layers * h * h * (1 + arch.num_kv_heads / arch.num_heads + seq / h * 0.5) * (q / h)
    return mlp + attention + 6 * h * arch.padded_vocab_size()


@pytest.mark.parametrize("family,size", [("llama3_1", "8B"), ("llama3_1", "70B"), ("qwen3", "8B"),
                                         ("qwen3_moe", "30B-A3B"), ("qwen2_moe", "57B-A14B"), ("mixtral", "8x7B"),
                                         ("deepseek_v3", "671B"), ("deepseek_v3", "V2-Lite-16B"),
                                         ("glm4_moe", "355B-A32B")])
@pytest.mark.parametrize("seq", [4096, 32768])
def test_flops_follow_megatron_lm(family, size, seq):
    arch = parse_arch(families()[family].presets[size])
    ours, theirs = model_shape(arch).flops_per_token(seq), _megatron_lm_flops_per_token(arch, seq)
    assert abs(ours / theirs - 1) < 0.01, (ours, theirs)


@pytest.mark.parametrize("seq", [64, 32768])
def test_sliding_window_layers_count_the_keys_their_window_leaves(seq):
    """gpt-oss-120b: half its layers see 128 keys at most; against the same model with full attention
    everywhere, exactly those layers' score and value products go (W - W^2/2s keys a query for s > W)."""
    import dataclasses

    arch = parse_arch(families()["gpt_oss"].presets["120B-A5.1B"])
    full = dataclasses.replace(arch, layer_types=("full_attention",) * arch.num_layers)
    sliding, w = arch.layer_types.count("sliding_attention"), arch.sliding_window
    keys = seq / 2 if seq <= w else w - w * w / (2 * seq)
    saved = 6 * sliding * (seq / 2 - keys) * arch.num_heads * 2 * arch.head_dim
    assert model_shape(full).flops_per_token(seq) - model_shape(arch).flops_per_token(seq) == pytest.approx(saved)
    assert (saved == 0) == (seq <= w)


@pytest.mark.parametrize("size", ["8B", "70B"])
def test_dense_flops_are_6n_plus_attention(size):
    """N: every parameter a token's matrices multiply (the embedding lookup is not a product)."""
    arch = parse_arch(families()["llama3_1"].presets[size])
    shape = model_shape(arch)
    n = shape.params() - arch.padded_vocab_size() * arch.hidden_size
    seq = 8192
    attention = 6 * arch.num_layers * seq / 2 * arch.num_heads * 2 * arch.head_dim
    assert abs(shape.flops_per_token(seq) / (6 * n + attention) - 1) < 0.01

"""DeepSeek-V4's attention (models/deepseek_v4/attention.py) against transformers' DeepseekV4Attention: each layer
type's output and input gradient within fp32 noise, TP=2 as TP=1, and each piece shown to matter.

The ranks (``run_local``, one process for TP=1) build a tiny transformers attention per layer type from a seed,
with every parameter random (sinks and position biases too, which transformers initialises to zero), copy its
weights into the module through the module's own weight table, and return relative errors; the assertions are
here. The workers are module-level so that the spawned ranks import them.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from megatron_patch.models.deepseek_v4.attention import (CSA, HCA, LAYER_TYPES, SLIDING, InterleavedRope,
                                                        V4AttentionSettings)

TOLERANCE = 1e-5  # relative L2: fp32 noise
FAR = 1e-3  # a piece left out moves the output at least this far (100x the tolerance)
BATCH, SEQ = 2, 37  # 37 tokens: 9 CSA windows of 4 (top-3 of them kept), 4 HCA windows of 8, a remainder left out
RAW = dict(
    hidden_size=64, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=24, o_groups=2,
    o_lora_rank=16, sliding_window=8, compress_rates={CSA: 4, HCA: 8}, index_n_heads=4, index_head_dim=16,
    index_topk=3, num_hidden_layers=3, layer_types=list(LAYER_TYPES), rope_theta=10000.0,
    compress_rope_theta=160000.0, max_position_embeddings=64, vocab_size=100, moe_intermediate_size=32,
    n_routed_experts=4,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
                  "beta_slow": 1},
)


def _hf_config(raw: dict):
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(**raw)
    config._attn_implementation = "eager"
    return config


def _reference(layer_index: int):
    """transformers' attention of layer ``layer_index`` with random weights, its output and input gradient on a
    fixed input and output gradient."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = _hf_config(RAW)
    torch.manual_seed(layer_index)
    attention = hf.DeepseekV4Attention(config, layer_index).float()
    with torch.no_grad():
        for name, p in attention.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if "norm" in name else 0.0))
    x = torch.randn(BATCH, SEQ, RAW["hidden_size"], requires_grad=True)
    grad = torch.randn(BATCH, SEQ, RAW["hidden_size"])
    positions = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    rotary = hf.DeepseekV4RotaryEmbedding(config)
    embeddings = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None,
                                             position_ids=positions)
    out, _ = attention(x, embeddings, positions, mask)
    out.backward(grad)
    return dict(attention.state_dict()), x.detach(), grad, out.detach(), x.grad


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def _megatron_config(tp: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=RAW["hidden_size"], num_attention_heads=RAW["num_attention_heads"],
                             use_cpu_initialization=True, params_dtype=torch.float32, gradient_accumulation_fusion=False,
                             tensor_model_parallel_size=tp)


def _run(module, x: torch.Tensor, grad: torch.Tensor):
    """The module's output and input gradient, batch-first like transformers'."""
    x = x.transpose(0, 1).clone().requires_grad_(True)
    out, bias = module(x)
    assert bias is None
    out.backward(grad.transpose(0, 1))
    return out.detach().transpose(0, 1), x.grad.transpose(0, 1)


def compare_worker(tp: int, ablations: bool) -> dict:
    """Per layer type: the output and input gradient of this rank's module, their relative errors against
    transformers, and (``ablations``) the output's relative error with one piece left out."""
    from megatron.core import parallel_state

    from megatron_patch.models.deepseek_v4.attention import DeepseekV4Attention, shard_from_transformers
    from megatron_patch.runtime.distributed import ParallelLayout, init_model_parallel

    warnings.filterwarnings("ignore")
    init_model_parallel(ParallelLayout(tp=tp))
    rank = parallel_state.get_tensor_model_parallel_rank()
    config, settings = _megatron_config(tp), V4AttentionSettings.from_hf(RAW)
    results = {}
    for index, layer_type in enumerate(LAYER_TYPES):
        state, x, grad, want, want_grad = _reference(index)

        def build(settings=settings):
            module = DeepseekV4Attention(config, settings, layer_type)
            module.load_state_dict(shard_from_transformers(state, layer_type, rank, tp), strict=True)
            return module

        module = build()
        out, x_grad = _run(module, x, grad)
        result = {"out": out, "grad": x_grad, "out_error": _rel(out, want), "grad_error": _rel(x_grad, want_grad)}
        # what torch_dist checkpoints record: each weight's whole shape and this rank's offset in it
        result["sharded"] = {k: (tuple(v.global_shape), tuple(v.global_offset))
                             for k, v in module.sharded_state_dict().items() if hasattr(v, "global_shape")}
        if ablations:
            moved = {}
            module = build()
            with torch.no_grad():
                module.sinks.zero_()
            moved["without sinks"] = module
            if layer_type == SLIDING:
                moved["without the sliding window"] = build(dataclasses.replace(settings, sliding_window=SEQ))
            else:
                module = build()
                with torch.no_grad():
                    module.compressor.position_bias.zero_()
                moved["without the compressor's position bias"] = module
                module = build()
                module.rope = InterleavedRope(settings.rope(SLIDING), settings.rope_head_dim)
                moved["with the main RoPE instead of the compress RoPE"] = module
                module = build()
                module.rope = InterleavedRope({**settings.rope(layer_type), "rope_type": "default"},
                                              settings.rope_head_dim)
                moved["without YaRN on the compress RoPE"] = module
                module = build()
                module.compressor = None
                module.indexer = None
                moved["without the compressed entries"] = module
            if layer_type == CSA:
                moved["attending to every compressed entry (no top-k)"] = build(
                    dataclasses.replace(settings, index_topk=SEQ))
                module = build()
                with torch.no_grad():
                    module.indexer.compressor.position_bias.zero_()
                moved["without the indexer compressor's position bias"] = module
            result["moved"] = {why: _rel(_run(m, x, grad)[0], want) for why, m in moved.items()}
        results[layer_type] = result
    return results


def _masks_as_the_reference_builds_them() -> bool:
    """The reference is transformers 5.24's DeepSeek-V4 attention, its masks built as 5.24 builds them (with a
    ``cache`` argument); the older 5.x that Python 3.10 resolves (5.20) builds them otherwise."""
    import inspect

    from transformers.masking_utils import create_sliding_window_causal_mask

    return "cache" in inspect.signature(create_sliding_window_causal_mask).parameters


@pytest.fixture(scope="module")
def tp1():
    import transformers

    from megatron_patch.runtime.launch import run_local

    if not _masks_as_the_reference_builds_them():
        pytest.skip(f"the reference is transformers >= 5.24's DeepSeek-V4 attention; found {transformers.__version__}")
    return run_local(compare_worker, 1, 1, True)[0]


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_each_layer_type_is_transformers_attention_forward_and_backward(tp1, layer_type):
    result = tp1[layer_type]
    assert result["out_error"] <= TOLERANCE, (layer_type, result["out_error"])
    assert result["grad_error"] <= TOLERANCE, (layer_type, result["grad_error"])


@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_each_piece_matters(tp1, layer_type):
    moved = tp1[layer_type]["moved"]
    assert len(moved) >= 2
    too_close = {why: err for why, err in moved.items() if err < FAR}
    assert not too_close, f"{layer_type}: leaving these out barely moves the output: {too_close}"


@pytest.mark.slow
def test_tp2_is_tp1(tp1):
    from megatron_patch.runtime.launch import run_local

    ranks = run_local(compare_worker, 2, 2, False)
    for layer_type in LAYER_TYPES:
        for rank, result in enumerate(ranks):
            assert _rel(result[layer_type]["out"], tp1[layer_type]["out"]) <= TOLERANCE, (layer_type, rank)
            assert _rel(result[layer_type]["grad"], tp1[layer_type]["grad"]) <= TOLERANCE, (layer_type, rank)
            assert result[layer_type]["out_error"] <= TOLERANCE, (layer_type, rank)
        heads, groups = RAW["num_attention_heads"], RAW["o_groups"] * RAW["o_lora_rank"]
        for rank, result in enumerate(ranks):
            sharded = result[layer_type]["sharded"]
            assert sharded["sinks"] == ((heads,), (rank * heads // 2,))
            assert sharded["linear_o_group_proj.weight"][1] == (rank * groups // 2, 0)
            assert sharded["linear_proj.weight"][1] == (0, rank * groups // 2)
            assert sharded["linear_kv_proj.weight"] == tp1[layer_type]["sharded"]["linear_kv_proj.weight"]
        assert ranks[0][layer_type]["sharded"].keys() == tp1[layer_type]["sharded"].keys()


HUB_STYLE = {  # DeepSeek's own config.json names, which transformers folds into its fields
    **{k: v for k, v in RAW.items() if k not in ("compress_rates", "layer_types")},
    "compress_ratios": [0, 4, 128, 0], "compress_rate_hca": 8,
}


@pytest.mark.parametrize("raw", [RAW, HUB_STYLE], ids=["transformers", "hub"])
def test_settings_read_what_transformers_reads(raw):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config, settings = _hf_config(dict(raw)), V4AttentionSettings.from_hf(raw)
    assert list(settings.layer_types) == config.layer_types
    assert dict(settings.compress_rates) == config.compress_rates
    assert settings.rope_head_dim == config.qk_rope_head_dim
    rotary = hf.DeepseekV4RotaryEmbedding(config)
    for kind, layer_type in (("main", SLIDING), ("compress", CSA)):
        mine = InterleavedRope(settings.rope(layer_type), settings.rope_head_dim)
        assert torch.allclose(mine.inv_freq, getattr(rotary, f"{kind}_inv_freq"), rtol=1e-6, atol=0), kind
        assert mine.attention_factor == getattr(rotary, f"{kind}_attention_scaling"), kind
    assert not torch.allclose(InterleavedRope(settings.rope(SLIDING), 8).inv_freq,
                              InterleavedRope(settings.rope(CSA), 8).inv_freq)


def test_heads_or_groups_that_do_not_split_over_tp_are_refused():
    from megatron_patch.models.deepseek_v4.attention import DeepseekV4Attention

    with pytest.raises(ValueError, match="do not split over TP=4"):
        DeepseekV4Attention(_megatron_config(4), V4AttentionSettings.from_hf(RAW), CSA)

"""Gemma 4's text model beyond what the registry-driven tests run for every family (round trips at its layouts,
logit parity, `mpatch align` in fp32 and bf16 with its window of 8 inside the aligned sequence, LoRA against peft,
the launcher end to end, the memory plan): the model-level pieces it owns (the embedding's scale, proportional
RoPE on the full-attention layers, the value norm, the layer scalar, the logits' soft cap) shown to matter, both
config.json forms, the full-attention layers' keys doubling as values (attention_k_eq_v, on in the tiny model), the
31B preset's published size, and what it does not build yet refused in one line (the E pieces: test_gemma4_e.py).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import AttentionShape
from megatron_patch.models.description.registry import families, parse_arch

GEMMA4 = families()["gemma4"]


def test_hub_and_transformers5_config_forms_read_the_same():
    """A config as the hub writes Gemma 4 (global_head_dim) and as transformers 5.24 writes it back
    (per_layer_config per full-attention layer, every default spelt out) are one model, its full-attention layers
    with heads of their own."""
    from transformers import Gemma4TextConfig

    hub = {k: v for k, v in GEMMA4.tiny_config.items() if k != "per_layer_config"}
    # num_global_key_value_heads counts only with attention_k_eq_v, as transformers reads it
    apart = {**hub, "attention_k_eq_v": False}
    for config, full in ((GEMMA4.tiny_config, AttentionShape(num_kv_heads=4, head_dim=32)),
                         (hub, AttentionShape(num_kv_heads=4, head_dim=32)),
                         (apart, AttentionShape(num_kv_heads=2, head_dim=32))):
        written = Gemma4TextConfig(**config).to_dict()
        assert "per_layer_config" in written and "global_head_dim" not in written
        read = [dataclasses.replace(parse_arch(c), hf_config={}) for c in (written, config)]
        assert read[0] == read[1]
        assert read[0].own_attention_shapes == (("full_attention", full),)
        assert read[0].attention_shape(0) == AttentionShape(num_kv_heads=2, head_dim=16)
        assert read[0].attention_shape(1) == full
    arch = parse_arch(GEMMA4.tiny_config)
    assert arch.layer_types == ("sliding_attention", "full_attention") and arch.sliding_window == 8
    assert (arch.rope_theta, arch.family_config.full_rope_theta, arch.family_config.full_partial_rotary_factor) == \
        (1e4, 1e6, 0.5)
    assert arch.family_config.final_logit_softcapping == 3.0 and arch.tie_word_embeddings
    assert arch.family_config.full_keys_are_values and not parse_arch(apart).family_config.full_keys_are_values
    # transformers makes the last layer full attention whatever layer_types says; so does the reader
    assert parse_arch({**GEMMA4.tiny_config, "layer_types": ["sliding_attention"] * 2}).layer_types[-1] == \
        "full_attention"


@pytest.mark.parametrize("rope", [
    {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6, "factor": 8.0}}},
    {"partial_rotary_factor": 0.25, "rope_parameters": {"full_attention": {"rope_type": "proportional",
                                                                          "rope_theta": 1e6}}},
    {"rope_parameters": {"full_attention": {"type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0,
                                            "rope_theta": 1e6}}},
], ids=["default-with-factor", "top-level-share", "legacy-type-key"])
def test_full_attention_rope_is_read_as_transformers_standardizes_it(rope):
    """The cfg audit: a default table's factor divided the frequencies (transformers' Gemma 4 reads none), a top-level
    partial_rotary_factor and a legacy "type" key were not read: each converted into a model align found NOT
    aligned. The full-attention frequencies equal transformers' own rotary embedding's."""
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    from megatron_patch.models.gemma4.layers import proportional_inv_freq

    tables = {**GEMMA4.tiny_config["rope_parameters"], **rope.pop("rope_parameters")}
    config = {k: v for k, v in GEMMA4.tiny_config.items() if k != "per_layer_config"}
    config.update(rope, rope_parameters=tables)
    # a copy: transformers fills the tables it is given in place
    theirs = Gemma4TextRotaryEmbedding(Gemma4TextConfig(**copy.deepcopy(config))).full_attention_inv_freq
    arch = parse_arch(config)
    own = arch.family_config
    ours = proportional_inv_freq(own.full_rope_theta, arch.attention_shape(1).head_dim,
                                 own.full_partial_rotary_factor, own.full_rope_factor)
    assert torch.equal(ours, theirs.to(ours.dtype)), (ours, theirs)


@pytest.mark.parametrize("over, fragment", [
    ({"per_layer_config": {"x": 3}}, "'per_layer_config' must map layer numbers"),
    ({"per_layer_config": {"1": {"head_dim": 0}}}, "'per_layer_config.1.head_dim' must be"),
    ({"per_layer_config": {"2": {"head_dim": 32}}}, "per_layer_config names layer 2, but the model has 2"),
    ({"per_layer_config": {"1": {"head_dim": 32, "sliding_window": 4}}}, "layer 1's own settings ['sliding_window']"),
    ({"per_layer_config": {"1": {"num_key_value_heads": 3}}}, "4 attention heads, not a multiple of its 3 key/value"),
    ({"num_hidden_layers": 3, "layer_types": ["full_attention", "sliding_attention", "full_attention"],
      "per_layer_config": {"0": {"head_dim": 32}, "2": {"head_dim": 64}}},
     "gemma4's full_attention layers differ in attention shape"),
    # transformers' defaults for the per-layer inputs: a per-layer vocabulary of 262144 beside the tiny one's 200
    ({"hidden_size_per_layer_input": None}, "vocab_size_per_layer_input=262144 differs from vocab_size=200"),
    ({"num_kv_shared_layers": 1}, "num_kv_shared_layers=1: every attention type of the shared layers needs"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
      "hidden_size_per_layer_input": 8}, "MoE block (enable_moe_block) with per-layer inputs or KV sharing"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention=all is not supported yet"),
    ({"attention_bias": True}, "attention_bias=True is not supported yet"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
    ({"layer_types": ["sliding_attention", "linear_attention"]}, "each sliding_attention or full_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "RoPE type 'yarn' on gemma4's full_attention layers"),
    ({"rope_parameters": {"sliding_attention": {"rope_theta": -1.0}}}, "'rope_parameters.sliding_attention"),
    ({"final_logit_softcapping": "30"}, "'final_logit_softcapping' must be a number"),
    # a sliding layer of its own shape (transformers runs it): hf2mcore failed inside the build, an internal error
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"], "num_hidden_layers": 3,
      "per_layer_config": {"1": {"head_dim": 32}}}, "sliding_attention layers with a shape of their own"),
    ({"model_type": "gemma4", "architectures": ["Gemma4ForCausalLM"]}, "config.json has model_type 'gemma4'"),
])
def test_what_it_does_not_build_is_refused_in_one_line(over, fragment):
    with pytest.raises(UserError) as err:
        parse_arch({**GEMMA4.tiny_config, **over})
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_vision_bidirectional_attention_leaves_the_text_model_causal():
    """The 31B's use_bidirectional_attention="vision" opens the attention only between the multimodal model's image
    tokens: transformers' text model stays causal, and so is it read."""
    from transformers import AutoConfig, Gemma4ForCausalLM

    config = {**GEMMA4.tiny_config, "use_bidirectional_attention": "vision"}
    hf = Gemma4ForCausalLM(AutoConfig.for_model(**config))
    assert all(layer.self_attn.is_causal for layer in hf.model.layers)
    assert dataclasses.replace(parse_arch(config), hf_config={}) == \
        dataclasses.replace(parse_arch(GEMMA4.tiny_config), hf_config={})


def test_a_config_naming_only_transformers_defaults_reads_its_global_head_dim():
    """transformers' own Gemma4TextConfig defaults (those of the published sizes: full-attention heads of 512 beside
    sliding ones of 256, per-layer inputs of 256) read so; without the per-layer inputs too, the full-attention
    layers have their heads of 512, in either form."""
    from transformers import Gemma4TextConfig

    defaults = parse_arch({**Gemma4TextConfig().to_dict(), "architectures": ["Gemma4ForCausalLM"]})
    assert defaults.family_config.per_layer_input_size == 256
    hub = {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "hidden_size_per_layer_input": 0}
    for config in (hub, {**Gemma4TextConfig(**hub).to_dict(), "architectures": ["Gemma4ForCausalLM"]}):
        arch = parse_arch(config)
        assert (arch.head_dim, arch.num_kv_heads) == (256, 4)
        assert arch.own_attention_shapes == (("full_attention", AttentionShape(num_kv_heads=4, head_dim=512)),)
        assert [arch.attention_shape(i).head_dim for i in range(6)] == [256] * 5 + [512]


def pieces_worker(hf_dir: str, tokens: torch.Tensor) -> dict:
    """The tiny model's logits as built, and with each model-level piece the family owns left out."""
    from megatron_patch.models.gemma4 import layers
    from tests.family_helpers import logits_with_pieces_left_out

    proportional = layers.proportional_inv_freq
    keys_as_values = layers.Gemma4KeysAsValuesAttention

    def normed_keys_as_values(self, *args, **kwargs):  # the values taken after the key norm
        query, key, _ = keys_as_values._keys_as_values(self, *args, **kwargs)
        return query, key, key

    left_out = {
        "built": {},
        "no_scale": {"scale_embedding": lambda m, i, o: o},
        "one_rope": {"install_per_layer_type": lambda *a: None},
        "whole_rotary": {"proportional_inv_freq": lambda theta, dim, share, factor:
                         proportional(theta, dim, 1.0, factor)},
        "no_cap": {"_soft_cap": lambda cap: (lambda m, i, o: o)},
        "no_value_norm": {"_value_norm": lambda value, eps: value},
        "no_layer_scalar": {"LayerScalar": type("Ones", (layers.LayerScalar,), {"forward": lambda self, x: x})},
        "values_after_k_norm": {"Gemma4KeysAsValuesAttention": type(
            "NormedValues", (keys_as_values,), {"_keys_as_values": normed_keys_as_values})},
    }
    return logits_with_pieces_left_out(layers, hf_dir, tokens, left_out)


@pytest.mark.slow
def test_the_model_level_pieces_it_owns_are_what_transformers_computes(tmp_path):
    """Gemma 4's embedding scale, its full-attention layers' proportional RoPE (on part of each head), the value norm, the layer scalar
    and the logits' soft cap live in models/gemma4/: with all of them, the MCore twin's logits are transformers';
    leaving any one out is far off. So is taking the full-attention layer's values (attention_k_eq_v: its keys) after
    the key norm rather than before it, as transformers does."""
    from megatron_patch.align.parity import FP32_REL_L2, compare_logits, hf_logits, random_tokens
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.launch import run_local

    hf = make_tiny_hf_checkpoint("gemma4", tmp_path / "hf", seed=7)
    tokens = random_tokens(200, 2, 32, 1)  # 32 tokens: the window of 8 bites
    logits = run_local(pieces_worker, 1, str(hf), tokens)[0]
    want = hf_logits(hf, tokens)
    assert compare_logits(want, logits["built"])["rel_l2"] <= FP32_REL_L2
    for name in ("no_scale", "one_rope", "whole_rotary", "no_cap", "no_value_norm", "no_layer_scalar",
                 "values_after_k_norm"):
        assert compare_logits(want, logits[name])["rel_l2"] > 100 * FP32_REL_L2, name


def test_full_attention_layers_have_their_own_shape_in_megatron_core_and_the_counts():
    """The tiny model's full-attention layer, 4 heads of 32 and 4 key/value heads beside the sliding layer's 4 of
    16 and 2, its keys doubling as values (no value rows), is built so by megatron-core (the shapes model_shape reads
    from it), and its parameters and FLOPs count so: the total is transformers' own (with the vocabulary's padding),
    and the same model with a v_proj there has that projection's parameters and FLOPs more."""
    from transformers import AutoConfig, Gemma4ForCausalLM

    from megatron_patch.models.shape.model_shape import model_shape

    arch = parse_arch(GEMMA4.tiny_config)
    shape = model_shape(arch)
    for kind, heads, groups, dim, kv in (("sliding_attention+dense", 4, 2, 16, 2),
                                         ("full_attention+dense", 4, 4, 32, 1)):  # kv: k and v rows, or k alone
        layer = shape.layers[kind]
        assert layer["self_attention.linear_qkv.weight"] == ((heads + kv * groups) * dim, 48), kind
        assert layer["self_attention.linear_proj.weight"] == (48, heads * dim), kind
        assert layer["self_attention.q_layernorm.weight"] == layer["self_attention.k_layernorm.weight"] == (dim,)
    hf = Gemma4ForCausalLM(AutoConfig.for_model(**GEMMA4.tiny_config))
    padding = (arch.padded_vocab_size() - arch.vocab_size) * arch.hidden_size  # the embedding's padded rows
    assert shape.params() == sum(p.numel() for p in hf.parameters()) + padding
    # within the window (8) every key counts: s/2 keys per query, times the heads, times q.k and a.v per layer
    assert shape.flops_per_token(8) - shape.flops_per_token(2) == 6 * 3 * 4 * (2 * 16 + 2 * 32)
    with_values = model_shape(parse_arch({**GEMMA4.tiny_config, "attention_k_eq_v": False}))
    v_proj = 4 * 32 * 48  # the full-attention layer's: 4 key/value heads of 32
    assert with_values.params() - shape.params() == v_proj
    assert with_values.flops_per_token(8) - shape.flops_per_token(8) == 6 * v_proj


def test_the_memory_plan_counts_the_full_attention_layers_own_shape(tmp_path):
    """The plan's activations take each layer's own attention shape: the tiny model's full-attention layer (heads of
    32) saves more than it would with the sliding layer's heads of 16."""
    from megatron_patch.training import memory_plan
    from megatron_patch.training.validation import resolve
    from tests.training_helpers import launcher_args

    prefix = tmp_path / "c_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    cfg = resolve("gemma4", launcher_args("gemma4", PR="bf16", DATASET_PATH=str(prefix),
                                          OUTPUT_BASEPATH=str(tmp_path / "out")), env={})
    shapes = memory_plan._layer_shapes(cfg.arch, cfg, 0)
    assert [(s.a, s.kvw, s.hn) for s in shapes] == [(64, 32, 16), (128, 128, 32)]
    own = memory_plan.stage_memory(cfg.arch, cfg, 0, "local").activations
    alike = dataclasses.replace(cfg.arch, own_attention_shapes=())
    ac, attention = cfg.activation_checkpointing, memory_plan._attention(cfg, "local")
    assert own - memory_plan.stage_memory(alike, cfg, 0, "local").activations == \
        memory_plan.layer_activations(shapes[1], ac, "local", attention) - \
        memory_plan.layer_activations(shapes[0], ac, "local", attention)


@pytest.mark.slow
@pytest.mark.parametrize("own_shape", [True, False], ids=["full-layers-own-shape", "one-shape"])
def test_keys_as_values_convert_from_q_and_k_alone_and_back_bit_exact(tmp_path, own_shape):
    """With attention_k_eq_v the full-attention layer has no v_proj: its linear_qkv is [q heads; k] per query group
    from q_proj and k_proj alone (the sliding layer's keeps its v), and every layout and format gives the HF tensors
    back bit for bit, no v_proj invented. Also where the full layers have the model's head size and key/value
    heads (per_layer_config {}): torch_dist stacked both kinds of linear_qkv under one key, an internal error."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.distributed import ParallelLayout

    hf = make_tiny_hf_checkpoint("gemma4", tmp_path / "hf", seed=5, **({} if own_shape else {"per_layer_config": {}}))
    src = HFCheckpointReader(hf)
    attn = "model.layers.{}.self_attn.{}_proj.weight"
    assert attn.format(0, "v") in src.keys() and attn.format(1, "v") not in src.keys()
    layouts = (("legacy", ParallelLayout()), ("legacy", ParallelLayout(tp=2)),
               ("torch_dist", ParallelLayout(pp=2)), ("torch_dist", ParallelLayout(tp=2)))
    for fmt, layout in layouts if own_shape else layouts[2:]:
        ckpt, back = tmp_path / f"{fmt}-{layout.tp}-{layout.pp}", tmp_path / f"back-{fmt}-{layout.tp}-{layout.pp}"
        hf_to_mcore(hf, ckpt, layout, fmt=fmt, dtype="fp32", progress=False)
        if fmt == "legacy" and layout.tp == 1 and own_shape:
            (state,) = [torch.load(f, weights_only=True)["model"] for f in ckpt.glob("release/*/model_optim_rng.pt")]
            q, k = (src.get(attn.format(1, p)).reshape(4, -1, 48) for p in "qk")  # 4 groups of 1 head of 32
            assert torch.equal(state["decoder.layers.1.self_attention.linear_qkv.weight"],
                               torch.cat([q, k], 1).reshape(-1, 48))
        mcore_to_hf(ckpt, back, progress=False)
        got = HFCheckpointReader(back)
        assert sorted(got.keys()) == sorted(src.keys()), (fmt, layout)
        assert all(torch.equal(got.get(n), src.get(n)) for n in src.keys()), (fmt, layout)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2)])
def test_a_legacy_checkpoint_without_a_sidecar_exports_with_its_own_config(tmp_path, tp, pp):
    """A legacy Gemma 4 checkpoint from another tool (no sidecar, no manifest) with its own --hf-config: a legacy
    rank file's layers were read as one stack, so the last layer's (full-attention) heads stood for every layer and
    the checkpoint was refused as "not the model the config describes". Layers that differ are read one by one, as
    torch_dist stores them, and the export is the HF model bit for bit."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME
    from megatron_patch.checkpoint.sidecar import SIDECAR_NAME
    from megatron_patch.cli import main
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.distributed import ParallelLayout

    hf = make_tiny_hf_checkpoint("gemma4", tmp_path / "hf", seed=5)
    ckpt = tmp_path / "legacy"
    hf_to_mcore(hf, ckpt, ParallelLayout(tp=tp, pp=pp), fmt="legacy", dtype="fp32", progress=False)
    (ckpt / SIDECAR_NAME).unlink()
    (ckpt / MANIFEST_NAME).unlink()
    assert main(["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "back"),
                 "--hf-config", str(hf / "config.json"), "--quiet"]) == 0
    src, got = HFCheckpointReader(hf), HFCheckpointReader(tmp_path / "back")
    assert sorted(got.keys()) == sorted(src.keys())
    assert all(torch.equal(got.get(n), src.get(n)) for n in src.keys())


@pytest.mark.slow
def test_the_31b_preset_has_the_published_size():
    """The 31B preset's language model, as megatron-core builds it (its full-attention layers: 32 heads and 4
    key/value heads of 512, no value rows), has transformers' parameter count, which Google gives as 30.7B (beside
    its vision encoder of about 550M)."""
    import transformers

    from megatron_patch.models.shape.model_shape import model_shape

    config = GEMMA4.presets["31B"]
    arch = parse_arch(config)
    shape = model_shape(arch)
    assert shape.layers["full_attention+dense"]["self_attention.linear_qkv.weight"] == ((32 + 4) * 512, 5376)
    assert shape.layers["sliding_attention+dense"]["self_attention.linear_qkv.weight"] == ((32 + 2 * 16) * 256, 5376)
    with torch.device("meta"):
        hf = transformers.Gemma4ForCausalLM(transformers.AutoConfig.for_model(**config))
    assert arch.padded_vocab_size() == arch.vocab_size
    assert shape.params() == sum(p.numel() for p in hf.parameters()) == 30_697_345_280
    assert round(shape.params() / 1e9, 1) == 30.7 and shape.params(active=True) == shape.params()


def test_the_memory_plan_holds_no_value_weights_where_keys_are_values(tmp_path):
    """The plan's weights, gradients and optimizer state are the model's parameters as megatron-core builds them:
    with attention_k_eq_v, the full-attention layer's v_proj (4 key/value heads of 32) is not among them."""
    from megatron_patch.training import memory_plan
    from megatron_patch.training.validation import resolve
    from tests.training_helpers import launcher_args

    prefix = tmp_path / "c_text_document"
    for suffix in (".bin", ".idx"):
        prefix.with_name(prefix.name + suffix).write_bytes(b"")
    cfg = resolve("gemma4", launcher_args("gemma4", PR="bf16", DATASET_PATH=str(prefix),
                                          OUTPUT_BASEPATH=str(tmp_path / "out")), env={})
    apart = parse_arch({**cfg.arch.hf_config, "attention_k_eq_v": False})  # per_layer_config: 4 key/value heads
    shared, own = (memory_plan.stage_memory(a, cfg, 0, "local") for a in (cfg.arch, apart))
    assert own.trainable - shared.trainable == 4 * 32 * 48
    assert own.params - shared.params == 4 * 32 * 48 * 2  # bf16


@pytest.mark.slow
def test_a_checkpoint_converted_at_tp2_loads_at_pp2_with_transformers_logits(tmp_path):
    """The full-attention layer's fused q/k/v, cut by its own heads at TP=2 into torch_dist (one key per layer: the
    layers differ in shape), loads at PP=2 into a model whose logits are transformers'."""
    from megatron_patch.align.parity import FP32_KL, FP32_REL_L2, compare_logits, hf_logits, random_tokens
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.distributed import ParallelLayout
    from megatron_patch.runtime.launch import run_local
    from tests.convert_helpers import checkpoint_logits_worker

    src = make_tiny_hf_checkpoint("gemma4", tmp_path / "hf", seed=3)
    ckpt = tmp_path / "ckpt"
    hf_to_mcore(src, ckpt, ParallelLayout(tp=2), fmt="torch_dist", progress=False)
    layout = ParallelLayout(pp=2)
    tokens = random_tokens(200, batch=2, seq=16)
    results = run_local(checkpoint_logits_worker, layout.world_size, str(ckpt), layout, tokens)
    metrics = compare_logits(hf_logits(src, tokens), next(r for r in results if r is not None))
    assert metrics["rel_l2"] <= FP32_REL_L2 and metrics["kl"] <= FP32_KL, metrics

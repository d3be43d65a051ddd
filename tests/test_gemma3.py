"""Gemma 3 beyond what the registry-driven tests run for every family (round trips at its layouts, logit parity,
`mpatch align` in fp32 and bf16 with its window of 8 inside the aligned sequence, LoRA against peft, the launcher
end to end, the memory plan): the model-level pieces it owns (the embedding's scale, two RoPE bases) shown to
matter, the multimodal checkpoint's language model with its vision tower carried, both config.json forms, the
published sizes, and what it does not build refused in one line.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.runtime import ParallelLayout

GEMMA3 = families()["gemma3"]
VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
          "image_size": 16, "patch_size": 4, "vision_use_head": False, "model_type": "siglip_vision_model"}


def multimodal_config(**text) -> dict:
    """A tiny Gemma3ForConditionalGeneration: the tiny language model in text_config, a one-layer vision tower."""
    tiny = {k: v for k, v in GEMMA3.tiny_config.items() if k not in ("architectures", "torch_dtype")}
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 4,
            "text_config": {**tiny, **text}, "vision_config": VISION, "tie_word_embeddings": True,
            "torch_dtype": "float32"}


def test_hub_and_transformers5_config_forms_read_the_same():
    """A hub config.json (transformers 4.50's rope_theta, rope_local_base_freq and rope_scaling; a multimodal one
    naming only what differs from the defaults) and the same model as transformers 5.24 writes it (rope_parameters
    per layer type, every default spelt out) are one model."""
    from transformers import Gemma3Config, Gemma3TextConfig

    for size in ("1B", "27B"):
        hub = GEMMA3.presets[size]
        written = (Gemma3TextConfig if size == "1B" else Gemma3Config)(**hub).to_dict()
        assert "rope_parameters" in json.dumps(written) and "rope_local_base_freq" not in json.dumps(written)
        read = [dataclasses.replace(parse_arch(c), hf_config={}) for c in (written, hub)]
        assert read[0] == read[1], size
    arch = parse_arch(GEMMA3.presets["27B"])
    assert (arch.rope_theta, arch.rope_scaling, arch.family_config.local_rope_theta) == \
        (1e6, {"rope_type": "linear", "factor": 8.0}, 1e4)
    assert arch.layer_types.count("full_attention") == 10 and arch.sliding_window == 1024
    assert arch.family_config.query_pre_attn_scalar == 168 and arch.family_config.multimodal
    assert arch.tie_word_embeddings


GEMMA3_ROPE_FORMS = {
    # a flat rope_parameters: transformers builds each layer type's RoPE from its defaults
    "flat_rope_parameters": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}},
    # 4.x's rope_scaling beside 5.x's tables: merged into the full-attention one
    "rope_scaling_beside_tables": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                       "sliding_attention": {"rope_type": "default",
                                                                             "rope_theta": 1e4}},
                                   "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    # 4.x's old key: the default table's rope_type wins over it, in transformers as here
    "old_type_key": {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_local_base_freq": 2e4},
    "llama3_on_full": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
}


@pytest.mark.parametrize("form", list(GEMMA3_ROPE_FORMS))
def test_each_layer_type_s_rope_is_read_as_transformers_reads_it(form):
    """Each config.json form's RoPE per layer type, against transformers' own Gemma3TextConfig. The flat table was
    applied to the full-attention layers, and a rope_scaling beside the tables was dropped (aligned NOT)."""
    from transformers import Gemma3TextConfig

    from megatron_patch.models.gemma3.config import rope_of

    base = {k: v for k, v in families()["gemma3"].tiny_config.items()
            if k not in ("rope_parameters", "rope_scaling", "rope_theta", "rope_local_base_freq")}
    text = {**base, **GEMMA3_ROPE_FORMS[form]}
    hf = Gemma3TextConfig(**json.loads(json.dumps(text))).rope_parameters
    for layer_type in ("full_attention", "sliding_attention"):
        theta, scaling = rope_of(text, layer_type)
        want = hf[layer_type]
        assert theta == want["rope_theta"], (layer_type, want)
        assert (scaling or {"rope_type": "default"})["rope_type"] == want["rope_type"], (layer_type, scaling, want)
        assert all(v == want[k] for k, v in (scaling or {}).items() if k != "rope_type"), (layer_type, scaling, want)


def test_a_private_sliding_window_pattern_is_not_read():
    """transformers reads sliding_window_pattern alone; a saved _sliding_window_pattern made layers alternate here
    while transformers kept every sixth layer full."""
    from transformers import Gemma3TextConfig

    raw = {k: v for k, v in families()["gemma3"].tiny_config.items() if k not in ("layer_types",
                                                                                   "sliding_window_pattern")}
    raw = {**raw, "num_hidden_layers": 7, "_sliding_window_pattern": 2}
    assert list(parse_arch(raw).layer_types) == Gemma3TextConfig(**raw).layer_types


@pytest.mark.parametrize("over, fragment", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported for gemma3"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported for gemma3"),
    ({"layer_types": ["sliding_attention", "linear_attention"]}, "each sliding_attention or full_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                             "original_max_position_embeddings": 64}}}, "YaRN RoPE on gemma3's"),
    ({"query_pre_attn_scalar": "256"}, "'query_pre_attn_scalar' must be a number"),
    ({"rope_parameters": {"sliding_attention": {"rope_theta": -1.0}}},
     "'rope_parameters.sliding_attention.rope_theta'"),
])
def test_what_it_does_not_build_is_refused_in_one_line(over, fragment):
    with pytest.raises(UserError) as err:
        parse_arch({**GEMMA3.tiny_config, **over})
    assert fragment in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UserError, match="has no text_config"):
        parse_arch({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]})


def pieces_worker(hf_dir: str, tokens: torch.Tensor) -> dict:
    """The tiny model's logits as built, and with each model-level piece the family owns left out."""
    from megatron_patch.models.gemma3 import layers
    from tests.family_helpers import logits_with_pieces_left_out

    left_out = {"built": {}, "no_scale": {"scale_embedding": lambda m, i, o: o},
                "one_base": {"install_per_layer_type": lambda *a: None}}
    return logits_with_pieces_left_out(layers, hf_dir, tokens, left_out)


@pytest.mark.slow
def test_the_model_level_pieces_it_owns_are_what_transformers_computes(tmp_path):
    """Gemma 3's embedding scale and its sliding-window layers' own RoPE base live in models/gemma3/ (its
    finish_model hook): with both, the MCore twin's logits are transformers'; leaving either out is far off."""
    from megatron_patch.align.parity import FP32_REL_L2, compare_logits, hf_logits, random_tokens
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.launch import run_local

    hf = make_tiny_hf_checkpoint("gemma3", tmp_path / "hf", seed=7)
    tokens = random_tokens(200, 2, 32, 1)  # 32 tokens: the window of 8 bites
    logits = run_local(pieces_worker, 1, str(hf), tokens)[0]
    want = hf_logits(hf, tokens)
    assert compare_logits(want, logits["built"])["rel_l2"] <= FP32_REL_L2
    for name in ("no_scale", "one_base"):
        assert compare_logits(want, logits[name])["rel_l2"] > 100 * FP32_REL_L2, name


@pytest.mark.slow
def _tiny_multimodal(folder):
    """A tiny Gemma3ForConditionalGeneration saved by transformers (norms near 1, other weights random)."""
    import transformers

    config = transformers.AutoConfig.for_model(**multimodal_config())
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if name.endswith("norm.weight") else p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    return folder


def test_multimodal_language_model_round_trips_with_its_vision_tower_and_matches_transformers(tmp_path):
    """The language model of a tiny Gemma3ForConditionalGeneration (tensors under language_model.model., as the hub
    and transformers 5.24 write them): converted both ways bit-exact at sharded layouts with its vision tower and
    projector carried byte for byte, and its MCore twin's logits are the multimodal model's on text."""
    from megatron_patch.align.parity import FP32_KL, FP32_REL_L2, check_parity
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    hf = _tiny_multimodal(tmp_path / "hf")
    arch = parse_arch(hf)
    assert arch.family_config.multimodal and arch.tie_word_embeddings
    src = HFCheckpointReader(hf)
    carried = [n for n in src.keys() if GEMMA3.is_carried(n)]
    assert any(n.startswith("vision_tower.") for n in carried) and any("multi_modal_projector" in n for n in carried)
    for fmt, layout, dtype in (("legacy", ParallelLayout(tp=2, pp=2), "bf16"),
                               ("torch_dist", ParallelLayout(tp=2), "fp32")):
        hf_to_mcore(hf, tmp_path / fmt, layout, fmt=fmt, dtype=dtype, progress=False)
        mcore_to_hf(tmp_path / fmt, tmp_path / f"back-{fmt}", progress=False)
        back = HFCheckpointReader(tmp_path / f"back-{fmt}")
        assert sorted(back.keys()) == sorted(src.keys()), fmt
        for n in src.keys():
            assert torch.equal(back.get(n), src.get(n).to(back.get(n).dtype)) or n not in carried, (fmt, n)
        assert all(torch.equal(back.get(n), src.get(n)) for n in carried), fmt
    m = check_parity(hf, ParallelLayout(tp=2), seed=3)
    assert m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, m


# The published sizes: Google's model cards count the 1B exactly (999,885,952) and the multimodal ones with their
# vision tower and projector (4.3 B, 12.2 B, 27.4 B as the hub shows them).
PUBLISHED = {"1B": (0.999885952, 9), "4B": (4.3, 1), "12B": (12.2, 1), "27B": (27.4, 1)}


@pytest.mark.slow
def test_parameter_counts_are_the_published_sizes():
    import transformers

    from megatron_patch.models.shape.model_shape import model_shapes

    sizes = list(PUBLISHED)
    shapes = model_shapes([parse_arch(GEMMA3.presets[s]) for s in sizes])
    for size, shape in zip(sizes, shapes):
        arch = parse_arch(GEMMA3.presets[size])
        total = shape.params() - (arch.padded_vocab_size() - arch.vocab_size) * arch.hidden_size  # the padding rows
        if arch.family_config.multimodal:
            config = transformers.AutoConfig.for_model(**GEMMA3.presets[size])
            with torch.device("meta"):
                full = transformers.Gemma3ForConditionalGeneration(config)
            text = full.model.language_model
            assert total == sum(p.numel() for p in text.parameters()), size  # the language model as transformers has it
            total = sum(p.numel() for p in full.parameters())  # its vision tower and projector too (lm_head tied)
        value, digits = PUBLISHED[size]
        assert round(total / 1e9, digits) == value, (size, total)
        assert shape.params(active=True) == shape.params()


LANGUAGE_MODEL_LINEARS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def _random_peft_adapter(hf, out, target_modules, **config):
    from peft import LoraConfig, get_peft_model

    from tests.lora_helpers import load_hf

    model = get_peft_model(load_hf(hf), LoraConfig(r=3, lora_alpha=5, target_modules=target_modules, **config))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out)
    return out


def test_a_peft_adapter_of_the_multimodal_checkpoint_converts_both_ways_and_merges_as_peft(tmp_path, capsys):
    """LoRA on Gemma3ForConditionalGeneration as peft trains it (its modules under model.language_model.), with the
    final norm trained whole (modules_to_save, named as peft names it: language_model.norm, stored as
    language_model.model.norm): the adapter imports with hf2mcore --peft-dir, exports back bit for bit under peft's
    names (--lora-adapter), and --merge-lora gives peft's merge_and_unload logits on text. An adapter on the vision
    tower too is refused in one line: the vision tower is carried, not built."""
    from safetensors.torch import load_file

    from megatron_patch.cli import main
    from megatron_patch.align.parity import random_tokens
    from tests.lora_helpers import hf_logits, load_hf, peft_logits, rel

    hf = _tiny_multimodal(tmp_path / "hf")
    adapter = _random_peft_adapter(hf, tmp_path / "peft", LANGUAGE_MODEL_LINEARS,
                                   modules_to_save=["language_model.norm"])
    names = list(load_file(adapter / "adapter_model.safetensors"))
    assert names and all(".language_model." in n for n in names), names[:3]
    assert "base_model.model.model.language_model.norm.weight" in names
    ckpt, out, merged = tmp_path / "ckpt", tmp_path / "out", tmp_path / "merged"
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(ckpt), "--peft-dir", str(adapter),
                 "--tp", "2", "--quiet"]) == 0
    assert main(["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(out), "--lora-adapter"]) == 0
    a, b = load_file(adapter / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    # peft loads the export onto the same modules alone: its target_modules match no vision-tower module
    from peft import PeftModel

    exported = PeftModel.from_pretrained(load_hf(hf), str(out))
    adapted = {n.rsplit(".lora_", 1)[0] for n, _ in exported.named_parameters() if ".lora_" in n}
    assert adapted and not any("vision_tower" in n for n in adapted), sorted(adapted)[:3]
    assert main(["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(merged), "--merge-lora",
                 "--quiet"]) == 0
    tokens = random_tokens(200, batch=2, seq=16, seed=3)
    ours, theirs = hf_logits(merged, tokens), peft_logits(hf, adapter, tokens, merged=True)
    assert rel(ours, theirs) <= 1e-6 and rel(theirs, hf_logits(hf, tokens)) > 1e-2

    everywhere = _random_peft_adapter(hf, tmp_path / "peft-all", ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert any("vision_tower" in n for n in load_file(everywhere / "adapter_model.safetensors"))
    capsys.readouterr()
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "refused"),
                 "--peft-dir", str(everywhere), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "vision_tower" in err, err

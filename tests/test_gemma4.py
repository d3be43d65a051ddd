"""Gemma 4's text model beyond what the registry-driven tests run for every family (round trips at its layouts,
logit parity, `mpatch align` in fp32 and bf16 with its window of 8 inside the aligned sequence, LoRA against peft,
the launcher end to end, the memory plan): the model-level pieces it owns (the embedding's scale, proportional
RoPE on the full-attention layers, the value norm, the layer scalar, the logits' soft cap) shown to matter, both
config.json forms, and what it does not build yet refused in one line.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import families, parse_arch

GEMMA4 = families()["gemma4"]


def test_hub_and_transformers5_config_forms_read_the_same():
    """The tiny config as the hub writes Gemma 4 (global_head_dim) and as transformers 5.24 writes it back
    (per_layer_config per full-attention layer, every default spelt out) are one model."""
    from transformers import Gemma4TextConfig

    written = Gemma4TextConfig(**GEMMA4.tiny_config).to_dict()
    assert "per_layer_config" in written and "global_head_dim" not in written
    read = [dataclasses.replace(parse_arch(c), hf_config={}) for c in (written, GEMMA4.tiny_config)]
    assert read[0] == read[1]
    arch = read[0]
    assert arch.layer_types == ("sliding_attention", "full_attention") and arch.sliding_window == 8
    assert (arch.rope_theta, arch.family_config.full_rope_theta, arch.family_config.full_partial_rotary_factor) == \
        (1e4, 1e6, 0.5)
    assert arch.family_config.final_logit_softcapping == 3.0 and arch.tie_word_embeddings
    # transformers makes the last layer full attention whatever layer_types says; so does the reader
    assert parse_arch({**GEMMA4.tiny_config, "layer_types": ["sliding_attention"] * 2}).layer_types[-1] == \
        "full_attention"


@pytest.mark.parametrize("over, fragment", [
    ({"global_head_dim": 32}, "gemma4 layer 1's own attention shape {'head_dim': 32}"),
    ({"per_layer_config": {"1": {"head_dim": 16, "num_key_value_heads": 1}}}, "every layer must have head_dim 16"),
    ({"per_layer_config": {"x": 3}}, "per_layer_config must map layer numbers"),
    ({"hidden_size_per_layer_input": None}, "hidden_size_per_layer_input=256 (per-layer input embeddings)"),
    ({"hidden_size_per_layer_input": 8}, "hidden_size_per_layer_input=8"),
    ({"num_kv_shared_layers": 1}, "num_kv_shared_layers=1 is not supported yet for gemma4"),
    ({"attention_k_eq_v": True}, "attention_k_eq_v=True is not supported yet"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
     "enable_moe_block=True is not supported yet"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention=all is not supported yet"),
    ({"attention_bias": True}, "attention_bias=True is not supported yet"),
    ({"hidden_activation": "silu"}, "hidden_activation 'silu' is not supported"),
    ({"layer_types": ["sliding_attention", "linear_attention"]}, "each sliding_attention or full_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "RoPE type 'yarn' on gemma4's full_attention layers"),
    ({"rope_parameters": {"sliding_attention": {"rope_theta": -1.0}}}, "'rope_parameters.sliding_attention"),
    ({"final_logit_softcapping": "30"}, "'final_logit_softcapping' must be a number"),
    ({"model_type": "gemma4", "architectures": ["Gemma4ForCausalLM"]}, "config.json has model_type 'gemma4'"),
])
def test_what_it_does_not_build_is_refused_in_one_line(over, fragment):
    with pytest.raises(UserError) as err:
        parse_arch({**GEMMA4.tiny_config, **over})
    assert fragment in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_config_naming_only_transformers_defaults_is_refused_for_its_global_head_dim():
    """transformers' own Gemma4TextConfig defaults (those of the published sizes: full-attention heads of 512 beside
    sliding ones of 256, per-layer inputs of 256) are refused in one line, not built wrong."""
    from transformers import Gemma4TextConfig

    with pytest.raises(UserError, match="own attention shape {'head_dim': 512}"):
        parse_arch({**Gemma4TextConfig().to_dict(), "architectures": ["Gemma4ForCausalLM"]})
    with pytest.raises(UserError, match="hidden_size_per_layer_input=256"):
        parse_arch({**Gemma4TextConfig(global_head_dim=256).to_dict(), "architectures": ["Gemma4ForCausalLM"]})


def pieces_worker(hf_dir: str, tokens: torch.Tensor) -> dict:
    """The tiny model's logits as built, and with each model-level piece the family owns left out."""
    from megatron_patch.models.gemma4 import layers
    from tests.family_helpers import logits_with_pieces_left_out

    proportional = layers.proportional_inv_freq
    left_out = {
        "built": {},
        "no_scale": {"scale_embedding": lambda m, i, o: o},
        "one_rope": {"install_per_layer_type": lambda *a: None},
        "whole_rotary": {"proportional_inv_freq": lambda theta, dim, share, factor:
                         proportional(theta, dim, 1.0, factor)},
        "no_cap": {"_soft_cap": lambda cap: (lambda m, i, o: o)},
        "no_value_norm": {"_value_norm": lambda value, eps: value},
        "no_layer_scalar": {"LayerScalar": type("Ones", (layers.LayerScalar,), {"forward": lambda self, x: x})},
    }
    return logits_with_pieces_left_out(layers, hf_dir, tokens, left_out)


@pytest.mark.slow
def test_the_model_level_pieces_it_owns_are_what_transformers_computes(tmp_path):
    """Gemma 4's embedding scale, its full-attention layers' proportional RoPE (on part of each head), the value norm, the layer scalar
    and the logits' soft cap live in models/gemma4/: with all of them, the MCore twin's logits are transformers';
    leaving any one out is far off."""
    from megatron_patch.align.parity import FP32_REL_L2, compare_logits, hf_logits, random_tokens
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.launch import run_local

    hf = make_tiny_hf_checkpoint("gemma4", tmp_path / "hf", seed=7)
    tokens = random_tokens(200, 2, 32, 1)  # 32 tokens: the window of 8 bites
    logits = run_local(pieces_worker, 1, str(hf), tokens)[0]
    want = hf_logits(hf, tokens)
    assert compare_logits(want, logits["built"])["rel_l2"] <= FP32_REL_L2
    for name in ("no_scale", "one_rope", "whole_rotary", "no_cap", "no_value_norm", "no_layer_scalar"):
        assert compare_logits(want, logits[name])["rel_l2"] > 100 * FP32_REL_L2, name

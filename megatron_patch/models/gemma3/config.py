"""Gemma 3 (``gemma3_text``: Gemma3ForCausalLM, the 1B; ``gemma3``: the language model of
Gemma3ForConditionalGeneration, 4B to 27B) config.json -> Arch, as transformers 5.24 builds the model:

- the embedding times sqrt(hidden_size), that factor rounded to the embedding's dtype first (transformers'
  ``Gemma3TextScaledWordEmbedding``);
- zero-centred RMSNorms (``(1 + weight)``, in float32), before and after the attention and before and after the
  MLP, and q/k norms over each head;
- GeGLU: ``gelu_pytorch_tanh(gate) * up``;
- the softmax scale ``query_pre_attn_scalar ** -0.5``;
- sliding-window and full-attention layers as ``layer_types`` says (else every ``sliding_window_pattern``-th layer
  full, 6 by default), each type with its own RoPE: full attention with ``rope_theta`` and the config's scaling,
  sliding windows with ``rope_local_base_freq`` (5.x keeps both in ``rope_parameters`` per layer type);
- tied embeddings unless config.json says otherwise.

A multimodal folder keeps the language model's values in ``text_config`` (a hub config names only what differs
from transformers' defaults, which are filled in here as transformers fills them) and its tensors under
``language_model.model.``; the vision tower and projector travel beside the checkpoint (``convert/carried.py``).

Refused in one line: logit soft-capping (attention or final: Gemma 3 sets none), bidirectional attention,
another activation, attention biases, RoPE with an attention factor (YaRN), partial rotary embeddings.
"""

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import FULL_ATTENTION, SLIDING_ATTENTION, Arch, rope_settings
from megatron_patch.models.description.config_checks import (
    MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, ROPE_FIELDS, Flag, Given, Names, Real, Table, Text,
    Whole)
from megatron_patch.models.gemma3.settings import Gemma3Settings, settings

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

MULTIMODAL = "gemma3"
# transformers' Gemma3TextConfig defaults, which the hub's multimodal configs rely on.
DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
            "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
            "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
ACTIVATION = "gelu_pytorch_tanh"


def text_values(raw: dict) -> dict:
    """The language model's config.json values: the top level of a text-only config, ``text_config`` of a
    multimodal one."""
    if raw.get("model_type") != MULTIMODAL:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise UserError("config.json of a gemma3 model has no text_config: point at Gemma 3's multimodal hub folder")
    return text


def value(text: dict, key: str):
    found = text.get(key)
    return DEFAULTS.get(key) if found is None else found


def _rope_params(params) -> dict:
    """A RoPE table's fields (those config_checks.ROPE_FIELDS names), read one by one."""
    return {k: params.get(k) for k in ROPE_FIELDS if params.get(k) is not None}


def rope_of(text: dict, layer_type: str) -> tuple[float, dict | None]:
    """(theta, scaling or None) of ``layer_type``'s layers, as transformers 5's Gemma3TextConfig reads
    config.json: ``rope_parameters``' table for that layer type (a flat table, or none, gives each type the
    default), 4.x's ``rope_scaling`` merged into the full-attention one, and the theta where the table has none:
    ``rope_theta`` (full attention) or ``rope_local_base_freq`` (sliding windows)."""
    tables = text.get("rope_parameters")
    table = tables.get(layer_type) if isinstance(tables, dict) else None
    params = _rope_params(table) if isinstance(table, dict) else {"rope_type": "default"}
    if layer_type == FULL_ATTENTION and isinstance(text.get("rope_scaling"), dict):
        params.update(_rope_params(text["rope_scaling"]))
    if "rope_theta" not in params:
        params["rope_theta"] = value(text, "rope_theta" if layer_type == FULL_ATTENTION else "rope_local_base_freq")
    view = {"model_type": text.get("model_type", "gemma3_text"), "rope_parameters": params,
            "max_position_embeddings": value(text, "max_position_embeddings")}
    theta, scaling = rope_settings(view)
    if scaling is not None and scaling["rope_type"] == "yarn":
        raise UserError(f"YaRN RoPE on gemma3's {layer_type} layers is not supported: its attention factor would "
                        "change the softmax scale, which query_pre_attn_scalar sets")
    return theta, scaling


def layer_types_of(text: dict, layers: int) -> tuple[str, ...]:
    # transformers reads sliding_window_pattern alone (a saved _sliding_window_pattern is its own attribute,
    # overwritten as the config is built)
    pattern = text.get("sliding_window_pattern") or DEFAULTS["sliding_window_pattern"]
    types = text.get("layer_types") or [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                                        for i in range(layers)]
    if len(types) != layers or set(types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise UserError(f"config.json layer_types must name {layers} layers, each sliding_attention or full_attention: "
                        f"found {types}")
    return tuple(types)


def check_supported(text: dict) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if text.get(key) is not None:
            raise UserError(f"{key}={text[key]} is not supported for gemma3: Gemma 3 caps no logits, and this model "
                            "computes them uncapped")
    if text.get("use_bidirectional_attention"):
        raise UserError("use_bidirectional_attention=true is not supported for gemma3: its text layers here attend "
                        "causally")
    # transformers' Gemma3 reads hidden_activation alone (a hidden_act beside it, or instead of it, is ignored)
    act = text.get("hidden_activation") or ACTIVATION
    if act != ACTIVATION:
        raise UserError(f"hidden_activation '{act}' is not supported: gemma3's MLP here is GeGLU with {ACTIVATION}")
    if text.get("attention_bias"):
        raise UserError("attention_bias=true is not supported for gemma3: Gemma 3's attention has no biases")
    # transformers' Gemma 3 sizes its RoPE tables by it but rotates whole heads (its forward fails); never set
    tables = text.get("rope_parameters") if isinstance(text.get("rope_parameters"), dict) else {}
    for table in (text, text.get("rope_scaling"), tables, *(tables.get(kind) for kind in (FULL_ATTENTION,
                                                                                           SLIDING_ATTENTION))):
        if not isinstance(table, dict):
            continue
        if table.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise UserError(f"partial_rotary_factor={table['partial_rotary_factor']} is not supported for gemma3: "
                            "Gemma 3 rotates whole heads")


def parse_config(raw: dict) -> Arch:
    text = text_values(raw)
    check_supported(text)
    hidden, heads, kv_heads = (value(text, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    layers = value(text, "num_hidden_layers")
    types = layer_types_of(text, layers)
    theta, scaling = rope_of(text, FULL_ATTENTION)
    local_theta, local_scaling = rope_of(text, SLIDING_ATTENTION)
    multimodal = raw.get("model_type") == MULTIMODAL
    tied = raw.get("tie_word_embeddings") if multimodal else text.get("tie_word_embeddings")
    window = value(text, "sliding_window")
    return Arch(
        family="gemma3", vocab_size=value(text, "vocab_size"), hidden_size=hidden,
        ffn_hidden_size=value(text, "intermediate_size"), num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=value(text, "head_dim"), norm_eps=float(value(text, "rms_norm_eps")), rope_theta=theta,
        rope_scaling=scaling, max_position_embeddings=value(text, "max_position_embeddings"),
        tie_word_embeddings=True if tied is None else bool(tied), layer_types=types,
        sliding_window=window if SLIDING_ATTENTION in types else None,
        family_config=Gemma3Settings(query_pre_attn_scalar=float(value(text, "query_pre_attn_scalar")),
                                     local_rope_theta=local_theta, local_rope_scaling=local_scaling,
                                     multimodal=multimodal),
        hf_config=raw,
    )


def transformer_config_kwargs(arch: Arch) -> dict:
    # megatron-core is imported here, when a model is built, not when the converter reads the family
    from megatron_patch.models.blocks.decoder import sliding_window_kwargs
    from megatron_patch.models.blocks.sandwich_norms import gelu_tanh

    return dict(
        qk_layernorm=True, activation_func=gelu_tanh, softmax_scale=settings(arch).query_pre_attn_scalar ** -0.5,
        **sliding_window_kwargs(arch),
        # the family's own modules, with or without transformer-engine: no TE-only or SwiGLU-only fusions
        bias_activation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


def layer_spec(arch: Arch, config, use_te: bool, vp_stage, core_attention: str | None):
    # megatron-core: imported only when a model is built, not when the converter reads the family
    from megatron_patch.models.gemma3.layers import layer_spec as gemma3_layer_spec

    return gemma3_layer_spec(arch, config, vp_stage, core_attention)


def finish_model(model, arch: Arch) -> None:
    # megatron-core: imported only when a model is built
    from megatron_patch.models.gemma3.layers import finish_model as finish_gemma3_model

    finish_gemma3_model(model, arch)


_TEXT_KEYS = {
    "vocab_size": Whole(1, MAX_VOCAB), "hidden_size": Whole(1, MAX_WIDTH), "intermediate_size": Whole(1, MAX_WIDTH),
    "num_hidden_layers": Whole(1, MAX_LAYERS), "num_attention_heads": Whole(1, MAX_HEADS),
    "num_key_value_heads": Whole(1, MAX_HEADS), "head_dim": Whole(1, MAX_WIDTH),
    "max_position_embeddings": Whole(1, MAX_POSITIONS), "rms_norm_eps": Real(0, 1.0), "model_type": Text(),
    "query_pre_attn_scalar": Real(0), "sliding_window": Whole(1, MAX_POSITIONS), "layer_types": Names(MAX_LAYERS),
    "sliding_window_pattern": Whole(1, MAX_LAYERS), "_sliding_window_pattern": Whole(1, MAX_LAYERS),
    "rope_theta": Real(0), "rope_local_base_freq": Real(0), "rope_scaling": Table(ROPE_FIELDS),
    "partial_rotary_factor": Real(0, 1.0), "rope_parameters": Table({**ROPE_FIELDS, FULL_ATTENTION: Table(ROPE_FIELDS),
                              SLIDING_ATTENTION: Table(ROPE_FIELDS)}),
    "tie_word_embeddings": Flag(), "attention_bias": Flag(), "hidden_activation": Text(), "hidden_act": Text(),
    "attn_logit_softcapping": Given(), "final_logit_softcapping": Given(), "use_bidirectional_attention": Flag(),
}
# The config.json fields this family reads: the language model's, at the top of a text-only config or in a
# multimodal one's text_config.
CONFIG_KEYS = {**_TEXT_KEYS, "text_config": Table(_TEXT_KEYS)}

# A tiny Gemma 3 (Gemma3ForCausalLM): a sliding-window layer (window 8, shorter than the tests' sequences) then a
# full-attention one, the two RoPE bases apart, 4 heads of 16 (64 wide, not hidden/heads), 2 key/value heads, a
# softmax scale apart from 1/sqrt(head_dim), tied embeddings, a vocabulary that needs padding.
TINY_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "vocab_size": 200, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24,
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    "tie_word_embeddings": True, "attention_bias": False, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "float32",
}

"""Gemma 4's text model (``gemma4_text``: Gemma4ForCausalLM) config.json -> Arch, as transformers 5.24 builds it:

- the embedding times sqrt(hidden_size), that factor rounded to the embedding's dtype first;
- RMSNorms computed in float32 with a plain weight (``x * weight``, not Gemma 3's ``1 + weight``), before and
  after the attention and the MLP, as q/k norms over each head, and a weightless one over each value head;
- attention without a softmax scale (``scaling = 1``: the q/k norms set the logits' size);
- sliding-window and full-attention layers from ``layer_types`` (every 6th full by default, the last always
  full), each type with its own RoPE from ``rope_parameters``: default RoPE on sliding windows; proportional RoPE
  on full attention, which rotates the first ``partial_rotary_factor`` of each head's frequency pairs and passes
  the rest through;
- the full-attention layers with a head size and key/value heads of their own (``global_head_dim``, or
  ``per_layer_config`` as transformers 5.24 writes it back; ``Arch.own_attention_shapes``);
- ``attention_k_eq_v``: the full-attention layers' key projection doubles as their values (no ``v_proj``: the
  values are its output before k_norm and RoPE, then v_norm), and only then do those layers take
  ``num_global_key_value_heads`` key/value heads (the 31B's 4 beside its sliding layers' 16);
- GeGLU (``gelu_pytorch_tanh``) and a stored scalar on each layer's output (``layer_scalar``);
- with ``enable_moe_block`` (the 26B-A4B), in every layer a MoE block beside the dense MLP on the same residual:
  ``num_experts`` GeGLU experts of ``moe_intermediate_size``, ``top_k_experts`` of them chosen per token by
  Gemma 4's router (moe.py); each of the three fields is needed then;
- the final logits soft-capped (``tanh(x / c) * c``) where ``final_logit_softcapping`` is set; tied embeddings;
- E2B and E4B's per-layer input embeddings (``hidden_size_per_layer_input``; ``vocab_size_per_layer_input`` must be
  ``vocab_size``: per_layer_inputs.py), KV sharing (``num_kv_shared_layers``: transformers' ``kv_sharing_modes``,
  kv_sharing.py) and the KV-shared layers' double-wide MLP (``use_double_wide_mlp``), in ``Gemma4Settings``.

Refused in one line, each what this model does not build yet: layers of one type with different attention shapes
(transformers itself computes one RoPE per type), the MoE block together with per-layer inputs or KV sharing,
bidirectional attention over text (``use_bidirectional_attention="all"``; "vision" touches only the multimodal
model's image tokens), attention biases, another activation. The multimodal ``gemma4`` folder is not claimed (the
registry refuses its model_type).
"""

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import FULL_ATTENTION, SLIDING_ATTENTION, Arch, AttentionShape
from megatron_patch.models.description.config_checks import (
    MAX_EXPERTS, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, ROPE_FIELDS, Flag, Given, Names, PerLayer,
    Real, Table, Text, Whole)
from megatron_patch.models.gemma4.settings import Gemma4Settings

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

# transformers' Gemma4TextConfig defaults, which the hub's configs rely on.
DEFAULTS = {"vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "global_head_dim": 512,
            "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "sliding_window": 512,
            "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144, "num_kv_shared_layers": 0}
DEFAULT_ROPE = {SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL_ATTENTION: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
ACTIVATION = "gelu_pytorch_tanh"
SLIDING_WINDOW_PATTERN = 6


def value(raw: dict, key: str):
    found = raw.get(key)
    return DEFAULTS.get(key) if found is None else found


def layer_types_of(raw: dict, layers: int) -> tuple[str, ...]:
    types = list(raw.get("layer_types") or [SLIDING_ATTENTION if (i + 1) % SLIDING_WINDOW_PATTERN else FULL_ATTENTION
                                            for i in range(layers)])
    if len(types) != layers or set(types) - {FULL_ATTENTION, SLIDING_ATTENTION}:
        raise UserError(f"config.json layer_types must name {layers} layers, each sliding_attention or full_attention: "
                        f"found {types}")
    types[-1] = FULL_ATTENTION  # as transformers forces it
    return tuple(types)


def full_layer_overrides(raw: dict, types: tuple[str, ...]) -> dict[int, dict]:
    """Each full-attention layer's own head dim and key/value heads, from either form: the hub's
    ``global_head_dim`` / ``num_global_key_value_heads``, or ``per_layer_config`` as transformers 5.24 writes it."""
    written = raw.get("per_layer_config")
    if written is not None:
        if not isinstance(written, dict) or not all(isinstance(v, dict) and str(k).isdigit() for k, v in
                                                    written.items()):
            raise UserError("config.json per_layer_config must map layer numbers to tables of their own settings")
        found = {int(k): v for k, v in written.items()}
        if found and max(found) >= len(types):
            raise UserError(f"config.json per_layer_config names layer {max(found)}, but the model has {len(types)}")
        return found
    overrides = {"head_dim": value(raw, "global_head_dim")}
    if raw.get("attention_k_eq_v") and raw.get("num_global_key_value_heads") is not None:
        overrides["num_key_value_heads"] = raw["num_global_key_value_heads"]
    return {i: overrides for i, t in enumerate(types) if t == FULL_ATTENTION}


def own_attention_shapes(raw: dict, types: tuple[str, ...]) -> tuple[tuple[str, AttentionShape], ...]:
    """The layer types whose layers have an attention shape of their own (the full-attention ones, in the published
    sizes), each one shape for all its layers."""
    model = AttentionShape(value(raw, "num_key_value_heads"), value(raw, "head_dim"))
    overrides = full_layer_overrides(raw, types)
    of_type: dict[str, dict[int, AttentionShape]] = {}
    for layer, layer_type in enumerate(types):
        over = overrides.get(layer, {})
        if set(over) - {"head_dim", "num_key_value_heads"}:
            other = sorted(set(over) - {"head_dim", "num_key_value_heads"})
            raise UserError(f"gemma4 layer {layer}'s own settings {other} (per_layer_config) are not supported: only "
                            "head_dim and num_key_value_heads")
        of_type.setdefault(layer_type, {})[layer] = AttentionShape(
            over.get("num_key_value_heads", model.num_kv_heads), over.get("head_dim", model.head_dim))
    out = []
    for layer_type, shapes in sorted(of_type.items()):
        if len(set(shapes.values())) > 1:
            raise UserError(f"gemma4's {layer_type} layers differ in attention shape (per_layer_config: "
                            f"{ {i: (s.head_dim, s.num_kv_heads) for i, s in shapes.items()} } as (head_dim, "
                            "key/value heads)): each layer type must have one, as transformers' RoPE per type needs")
        shape = next(iter(shapes.values()))
        if shape != model and layer_type == SLIDING_ATTENTION:
            # the sliding layers' RoPE is built for the model's head size (the published sizes give the full ones
            # theirs): a conversion failed inside the model build
            raise UserError(f"gemma4's sliding_attention layers with a shape of their own (per_layer_config: head_dim "
                            f"{shape.head_dim}, {shape.num_kv_heads} key/value heads) are not supported: only the "
                            "full-attention layers take their own")
        if shape != model:
            out.append((layer_type, shape))
    return tuple(out)


def kv_sharing_modes(raw: dict, types: tuple[str, ...]) -> tuple[str | None, ...]:
    """transformers' ``kv_sharing_modes``: the last ``num_kv_shared_layers`` layers "reuse" the keys and values of
    the last earlier layer of their attention type, which "store"s them; () without KV sharing."""
    shared = value(raw, "num_kv_shared_layers")
    if not shared:
        return ()
    first = len(types) - shared
    producers = {t: i for i, t in enumerate(types[:first])}  # the last layer of each type before the shared ones
    if first <= 0 or set(producers) != set(types):
        raise UserError(f"num_kv_shared_layers={shared}: every attention type of the shared layers needs an earlier "
                        f"layer of its type to take its keys and values from (layer_types: {list(types)})")
    return tuple("reuse" if i >= first else "store" if producers[t] == i else None for i, t in enumerate(types))


def per_layer_input_size(raw: dict) -> int:
    """hidden_size_per_layer_input, its embedding's vocabulary checked (the main one's: one vocab-parallel split)."""
    size = value(raw, "hidden_size_per_layer_input")
    if size and value(raw, "vocab_size_per_layer_input") != value(raw, "vocab_size"):
        raise UserError(f"gemma4's vocab_size_per_layer_input={value(raw, 'vocab_size_per_layer_input')} differs from "
                        f"vocab_size={value(raw, 'vocab_size')}: only per-layer embeddings of the main vocabulary "
                        "are supported")
    return size


def check_supported(raw: dict) -> None:
    # "vision" (the 31B's) makes only the multimodal model's image tokens see each other: the text model is causal
    if raw.get("enable_moe_block") and (value(raw, "hidden_size_per_layer_input") or value(raw, "num_kv_shared_layers")):
        raise UserError("gemma4's MoE block (enable_moe_block) with per-layer inputs or KV sharing is not supported "
                        "yet: no published size has both")
    for key, unset in (("use_bidirectional_attention", "vision"), ("attention_bias", False)):
        if raw.get(key) not in (unset, None):
            raise UserError(f"{key}={raw[key]} is not supported yet for gemma4: this model builds none")
    act = raw.get("hidden_activation") or ACTIVATION
    if act != ACTIVATION:
        raise UserError(f"hidden_activation '{act}' is not supported: gemma4's MLP here is GeGLU with {ACTIVATION}")


def moe_fields(raw: dict) -> dict:
    """The Arch's MoE fields with ``enable_moe_block`` (every layer: the dense MLP as megatron-core's shared expert,
    models/gemma4/moe.py), else none."""
    if not raw.get("enable_moe_block"):
        return {}
    missing = [k for k in MOE_KEYS if raw.get(k) is None]
    if missing:
        raise UserError(f"config.json has enable_moe_block=true but no {', '.join(missing)}: gemma4's MoE block needs them")
    if raw["top_k_experts"] > raw["num_experts"]:
        raise UserError(f"top_k_experts={raw['top_k_experts']} is more than the {raw['num_experts']} experts")
    return dict(num_experts=raw["num_experts"], moe_topk=raw["top_k_experts"],
                moe_ffn_hidden_size=raw["moe_intermediate_size"],
                shared_expert_ffn_hidden_size=value(raw, "intermediate_size"), norm_topk_prob=True)


def rope_of(raw: dict) -> dict[str, dict]:
    """Each layer type's RoPE table: default RoPE on sliding windows, proportional RoPE on full attention; filled
    in as transformers' ``standardize_rope_params`` fills it: the kind from a legacy ``type`` key, and the
    top-level ``partial_rotary_factor`` where the table has none (each was read otherwise, and converted into a
    model align found NOT aligned: the cfg audit)."""
    given = raw.get("rope_parameters") or {}
    tables = {}
    for layer_type in (SLIDING_ATTENTION, FULL_ATTENTION):
        table = given.get(layer_type) or DEFAULT_ROPE[layer_type]
        filled = {"rope_type": table.get("rope_type", table.get("type", "default"))}
        if raw.get("partial_rotary_factor") is not None and "partial_rotary_factor" not in table:
            filled["partial_rotary_factor"] = raw["partial_rotary_factor"]
        tables[layer_type] = table | filled  # a copy with ``|``: the fields read stay known (test_family_seams)
    wanted = {SLIDING_ATTENTION: ("default",), FULL_ATTENTION: ("proportional", "default")}
    for layer_type, kinds in wanted.items():
        kind = tables[layer_type].get("rope_type", "default")
        if kind not in kinds:
            raise UserError(f"RoPE type '{kind}' on gemma4's {layer_type} layers is not supported: "
                            f"supported are {', '.join(kinds)}")
    return tables


def parse_config(raw: dict) -> Arch:
    layers = value(raw, "num_hidden_layers")
    types = layer_types_of(raw, layers)
    check_supported(raw)
    ropes = rope_of(raw)
    full = ropes[FULL_ATTENTION]
    # Gemma 4's default RoPE reads neither a share nor a factor (transformers' compute_default_rope_parameters)
    proportional = full["rope_type"] == "proportional"
    partial = float(full.get("partial_rotary_factor", 1.0)) if proportional else 1.0
    tied = raw.get("tie_word_embeddings")
    return Arch(
        family="gemma4", vocab_size=value(raw, "vocab_size"), hidden_size=value(raw, "hidden_size"),
        ffn_hidden_size=value(raw, "intermediate_size"), num_layers=layers,
        num_heads=value(raw, "num_attention_heads"), num_kv_heads=value(raw, "num_key_value_heads"),
        head_dim=value(raw, "head_dim"), norm_eps=float(value(raw, "rms_norm_eps")),
        rope_theta=float(ropes[SLIDING_ATTENTION].get("rope_theta", 10_000.0)), rope_scaling=None,
        max_position_embeddings=value(raw, "max_position_embeddings"),
        tie_word_embeddings=True if tied is None else bool(tied), layer_types=types,
        sliding_window=value(raw, "sliding_window") if SLIDING_ATTENTION in types else None,
        own_attention_shapes=own_attention_shapes(raw, types),
        family_config=Gemma4Settings(
            full_rope_theta=float(full.get("rope_theta", 1_000_000.0)), full_partial_rotary_factor=partial,
            full_rope_factor=float(full.get("factor", 1.0)) if proportional else 1.0,
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            full_keys_are_values=bool(raw.get("attention_k_eq_v")),
            per_layer_input_size=per_layer_input_size(raw), per_layer_input_layers=layers,
            kv_sharing=kv_sharing_modes(raw, types), double_wide_mlp=bool(raw.get("use_double_wide_mlp"))),
        hf_config=raw, **moe_fields(raw),
    )


def transformer_config_kwargs(arch: Arch) -> dict:
    # megatron-core is imported here, when a model is built, not when the converter reads the family
    from megatron_patch.models.blocks.decoder import sliding_window_kwargs
    from megatron_patch.models.blocks.sandwich_norms import gelu_tanh

    return dict(
        qk_layernorm=True, activation_func=gelu_tanh, softmax_scale=1.0, **sliding_window_kwargs(arch),
        # layers of another attention shape cannot share a torch_dist key stacked over the layers: one key each
        # (keys doubling as values leave the full layers' linear_qkv without value rows: another shape too)
        hetereogenous_dist_checkpoint=bool(arch.own_attention_shapes) or _keys_as_values_beside_sliding(arch),
        # the family's own modules, with or without transformer-engine: no TE-only or SwiGLU-only fusions
        bias_activation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # the MoE block: softmax over the top-k logits is the renormalised top-k of transformers' softmax; no
        # auxiliary loss (transformers trains none); the local experts its own layers are built of
        **(dict(moe_router_pre_softmax=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                moe_grouped_gemm=False) if arch.is_moe else {}),
    )


def _keys_as_values_beside_sliding(arch: Arch) -> bool:
    """Whether full-attention layers whose keys double as values sit beside sliding ones in one model."""
    return bool(arch.family_config.full_keys_are_values) and len(set(arch.layer_types)) > 1


def layer_spec(arch: Arch, config, use_te: bool, vp_stage, core_attention: str | None):
    # megatron-core: imported only when a model is built, not when the converter reads the family
    if arch.is_moe:
        from megatron_patch.models.gemma4.moe import layer_spec as gemma4_layer_spec  # megatron-core: as above
    else:
        from megatron_patch.models.gemma4.layers import layer_spec as gemma4_layer_spec  # megatron-core: as above

    return gemma4_layer_spec(arch, config, vp_stage, core_attention)


def finish_model(model, arch: Arch) -> None:
    # megatron-core: imported only when a model is built
    from megatron_patch.models.gemma4.layers import finish_model as finish_gemma4_model

    finish_gemma4_model(model, arch)


_ROPE_TABLE = Table(ROPE_FIELDS)
# What the MoE block reads (enable_moe_block): each needed then.
MOE_KEYS = {"num_experts": Whole(1, MAX_EXPERTS), "top_k_experts": Whole(1, MAX_EXPERTS),
            "moe_intermediate_size": Whole(1, MAX_WIDTH)}
# The config.json fields this family reads.
CONFIG_KEYS = {
    "vocab_size": Whole(1, MAX_VOCAB), "hidden_size": Whole(1, MAX_WIDTH), "intermediate_size": Whole(1, MAX_WIDTH),
    "num_hidden_layers": Whole(1, MAX_LAYERS), "num_attention_heads": Whole(1, MAX_HEADS),
    "num_key_value_heads": Whole(1, MAX_HEADS), "head_dim": Whole(1, MAX_WIDTH),
    "global_head_dim": Whole(1, MAX_WIDTH), "num_global_key_value_heads": Whole(1, MAX_HEADS),
    "per_layer_config": PerLayer({"head_dim": Whole(1, MAX_WIDTH), "num_key_value_heads": Whole(1, MAX_HEADS)}),
    "max_position_embeddings": Whole(1, MAX_POSITIONS), "rms_norm_eps": Real(0, 1.0),
    "model_type": Text(), "sliding_window": Whole(1, MAX_POSITIONS), "layer_types": Names(MAX_LAYERS),
    "rope_parameters": Table({FULL_ATTENTION: _ROPE_TABLE, SLIDING_ATTENTION: _ROPE_TABLE}),
    "tie_word_embeddings": Flag(), "attention_bias": Flag(), "hidden_activation": Text(),
    "final_logit_softcapping": Real(0), "use_bidirectional_attention": Given(),
    "hidden_size_per_layer_input": Whole(0, MAX_WIDTH), "vocab_size_per_layer_input": Whole(0, MAX_VOCAB),
    "num_kv_shared_layers": Whole(0, MAX_LAYERS), "attention_k_eq_v": Flag(), "enable_moe_block": Flag(),
    "use_double_wide_mlp": Flag(), "partial_rotary_factor": Real(0, 1.0), **MOE_KEYS,
}

# A tiny Gemma 4 (Gemma4ForCausalLM): a sliding-window layer (window 8, shorter than the tests' sequences), 4 heads
# of 16 (64 wide, not hidden/heads) and 2 key/value heads, then a full-attention one with heads of its own, 4 of 32
# and 4 key/value heads (per_layer_config as transformers writes it; global_head_dim and num_global_key_value_heads
# say the same), proportional RoPE on half its pairs, and its keys doubling as values (attention_k_eq_v, as the 31B:
# no v_proj there, while the sliding layer keeps its own); logits soft-capped at 3 (near their size, so that the cap
# bites), tied embeddings, a vocabulary that needs padding.
TINY_CONFIG = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
    "vocab_size": 200, "hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32,
    "num_global_key_value_heads": 4, "per_layer_config": {"1": {"head_dim": 32, "num_key_value_heads": 4}},
    "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                           "rope_theta": 1000000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    "final_logit_softcapping": 3.0, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
    "attention_k_eq_v": True, "enable_moe_block": False, "use_double_wide_mlp": False,
    "tie_word_embeddings": True, "attention_bias": False, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
    "torch_dtype": "float32",
}

# The tiny model with the MoE block (enable_moe_block, as the 26B-A4B): 4 experts of 32, top-2, beside the dense MLP
# of 96 in every layer.
TINY_MOE_CONFIG = {**TINY_CONFIG, "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                   "moe_intermediate_size": 32}

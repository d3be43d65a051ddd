"""What Llama-style decoders share: config.json fields and weight-table pieces.

Families built on the Llama layout (RMSNorm, GQA attention with RoPE, SwiGLU MLP or experts) parse
their config.json with ``parse_decoder_config`` and assemble their tables from these rules.
"""

from __future__ import annotations

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import (
    Arch, SLIDING_ATTENTION, check_partial_yarn, partial_rotary_factor, require, rope_settings)
from megatron_patch.models.description.config_checks import (
    Flag, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, MAX_WIDTH, ROPE_FIELDS, Names, Real, Table, Text, Whole,
    WholeList)
from megatron_patch.models.mapping import GATE_UP, QKV, REPLICATED, ROW, VOCAB, LayerKind, LoraSite, Rule, Scope


# The config.json fields ``parse_decoder_config`` reads (a family's ``config_keys`` start from them).
DECODER_KEYS = {
    "vocab_size": Whole(1, MAX_VOCAB), "hidden_size": Whole(1, MAX_WIDTH), "intermediate_size": Whole(1, MAX_WIDTH),
    "num_hidden_layers": Whole(1, MAX_LAYERS), "num_attention_heads": Whole(1, MAX_HEADS),
    "num_key_value_heads": Whole(1, MAX_HEADS), "head_dim": Whole(1, MAX_WIDTH),
    "max_position_embeddings": Whole(1, MAX_POSITIONS), "rms_norm_eps": Real(0, 1.0), "rope_theta": Real(0),
    "partial_rotary_factor": Real(0, 1.0), "original_max_position_embeddings": Whole(1, MAX_POSITIONS),
    "rope_scaling": Table(ROPE_FIELDS), "rope_parameters": Table(ROPE_FIELDS), "tie_word_embeddings": Flag(),
    "mlp_bias": Flag(), "hidden_act": Text(),
}
# Those ``qwen_windowed_layers`` reads.
QWEN_WINDOW_KEYS = {"use_sliding_window": Flag(), "sliding_window": Whole(0, MAX_POSITIONS),
                    "max_window_layers": Whole(0, MAX_LAYERS), "layer_types": Names(MAX_LAYERS)}
# Those ``qwen_dense_layers`` reads.
QWEN_DENSE_LAYER_KEYS = {"decoder_sparse_step": Whole(1, MAX_LAYERS), "mlp_only_layers": WholeList(0, MAX_LAYERS)}


def qwen_windowed_layers(raw: dict, slides=lambda i, max_window_layers: i >= max_window_layers,
                         read_layer_types: bool = True) -> list[int]:
    """The layers transformers' Qwen models attend within a window: none without use_sliding_window and a
    sliding_window; else those ``layer_types`` calls sliding_attention (where the model reads it), by default the
    layers ``slides(i, max_window_layers)`` picks: Qwen2 and Qwen3 from max_window_layers on (a config.json with it
    at the layer count slides in none), Qwen2-MoE every other one below it, Qwen3-MoE every layer."""
    # transformers' defaults where config.json gives no such key: a window of 4096, max_window_layers 28
    if not raw.get("use_sliding_window") or raw.get("sliding_window", 4096) in (None, 0):
        return []
    layers = require(raw, "num_hidden_layers")
    given = raw.get("layer_types") if read_layer_types else None
    types = given or ["sliding_attention" if slides(i, raw.get("max_window_layers", 28)) else "full_attention"
                      for i in range(layers)]
    return [i for i, kind in enumerate(types) if kind == "sliding_attention"]


def parse_decoder_config(raw: dict, family: str, *, qkv_bias: bool, linear_bias: bool = False,
                         ffn_key: str = "intermediate_size", partial_rope: float | None = None) -> Arch:
    """The fields every Llama-style decoder shares (attention, norms, RoPE, embeddings).

    ``linear_bias``: every linear layer has a bias (megatron-core's ``add_bias_linear``); a family
    that can have them reads its config's flags and says so, any other refuses ``mlp_bias``.
    ``partial_rope``: the family's models may rotate only part of each head (``partial_rotary_factor``), and
    this is the share transformers assumes when config.json gives none (GLM-4.5: 0.5, Qwen3-Next: 0.25).
    """
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"hidden_act '{act}' is not supported: {family} models here use SwiGLU (silu)")
    if raw.get("mlp_bias") and not linear_bias:
        raise UserError(f"mlp_bias=true is not supported for {family}: its SwiGLU MLP here has no biases")
    hidden = require(raw, "hidden_size")
    heads = require(raw, "num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UserError(f"config.json has {heads} attention heads, not a multiple of its {kv_heads} key/value heads")
    head_dim = raw.get("head_dim") or hidden // heads
    theta, scaling = rope_settings(raw, partial=partial_rope is not None)
    rotary_percent = partial_rotary_factor(raw, default=1.0 if partial_rope is None else partial_rope)
    check_partial_yarn(scaling, rotary_percent)
    return Arch(
        family=family,
        vocab_size=require(raw, "vocab_size"),
        hidden_size=hidden,
        ffn_hidden_size=require(raw, ffn_key),
        num_layers=require(raw, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_percent=rotary_percent,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias or linear_bias,
        linear_bias=linear_bias,
        hf_config=raw,
    )


def sliding_every_layer(arch: Arch, window) -> Arch:
    """Every layer a sliding-window layer of ``window`` keys, as transformers' Mistral and Mixtral attend
    whenever config.json gives a ``sliding_window`` (None: full attention, ``arch`` unchanged)."""
    if window is None:
        return arch
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise UserError(f"config.json sliding_window must be a positive integer or null, got {window!r}")
    return dataclasses.replace(arch, layer_types=(SLIDING_ATTENTION,) * arch.num_layers, sliding_window=window)


def sliding_window_kwargs(arch: Arch) -> dict:
    """megatron-core's sliding-window settings for the layers ``layer_types`` marks "sliding_attention" (none: {}).

    transformers' window of W keys (the query's own among them) is W - 1 keys back, none ahead."""
    sliding = [int(t == SLIDING_ATTENTION) for t in arch.layer_types]
    if not any(sliding):
        return {}
    return {"window_size": (arch.sliding_window - 1, 0), "window_attn_skip_freq": None if all(sliding) else sliding}


HF_LAYER = "model.layers.{layer}"
MC_LAYER = "decoder.layers.{layer}"


def embedding_and_head_rules() -> list[Rule]:
    return [
        Rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", VOCAB, Scope.FIRST_STAGE),
        Rule("decoder.final_layernorm.weight", "model.norm.weight", REPLICATED, Scope.LAST_STAGE),
        Rule("output_layer.weight", "lm_head.weight", VOCAB, Scope.LAST_STAGE, tied_to="model.embed_tokens.weight"),
    ]


def attention_rules(qkv_bias: bool, proj_bias: bool = False) -> list[Rule]:
    attn = f"{HF_LAYER}.self_attn"
    rules = [
        Rule(f"{MC_LAYER}.self_attention.linear_qkv.layer_norm_weight", f"{HF_LAYER}.input_layernorm.weight", REPLICATED),
        Rule(f"{MC_LAYER}.self_attention.linear_qkv.weight",
             (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"), QKV, lora=LoraSite("qkv")),
        Rule(f"{MC_LAYER}.self_attention.linear_proj.weight", f"{attn}.o_proj.weight", ROW, lora=LoraSite("proj")),
    ]
    if qkv_bias:
        rules.append(Rule(f"{MC_LAYER}.self_attention.linear_qkv.bias",
                          (f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"), QKV))
    if proj_bias:  # a row-parallel layer adds its whole bias once, after the reduction
        rules.append(Rule(f"{MC_LAYER}.self_attention.linear_proj.bias", f"{attn}.o_proj.bias", REPLICATED))
    return rules


def qk_norm_rules() -> list[Rule]:
    """Per-head RMSNorms of queries and keys before RoPE (Qwen3): megatron-core's qk_layernorm."""
    attn = f"{HF_LAYER}.self_attn"
    return [
        Rule(f"{MC_LAYER}.self_attention.q_layernorm.weight", f"{attn}.q_norm.weight", REPLICATED),
        Rule(f"{MC_LAYER}.self_attention.k_layernorm.weight", f"{attn}.k_norm.weight", REPLICATED),
    ]


def dense_mlp_rules(bias: bool = False) -> list[Rule]:
    """The SwiGLU MLP of dense layers (every layer of a dense model, the dense ones of an MoE model)."""
    mlp, dense = f"{HF_LAYER}.mlp", LayerKind.DENSE
    rules = [
        Rule(f"{MC_LAYER}.mlp.linear_fc1.layer_norm_weight", f"{HF_LAYER}.post_attention_layernorm.weight", REPLICATED,
             layers=dense),
        Rule(f"{MC_LAYER}.mlp.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), GATE_UP,
             layers=dense, lora=LoraSite("fc1")),
        Rule(f"{MC_LAYER}.mlp.linear_fc2.weight", f"{mlp}.down_proj.weight", ROW, layers=dense, lora=LoraSite("fc2")),
    ]
    if bias:
        rules += [
            Rule(f"{MC_LAYER}.mlp.linear_fc1.bias", (f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias"), GATE_UP,
                 layers=dense),
            Rule(f"{MC_LAYER}.mlp.linear_fc2.bias", f"{mlp}.down_proj.bias", REPLICATED, layers=dense),
        ]
    return rules


def moe_rules(router: str, expert: str, gate: str, up: str, down: str, stacked: str = "mlp.experts") -> list[Rule]:
    """Router and routed experts of MoE layers; HF names are relative to the layer, ``{expert}`` marks
    the index. ``stacked``: the module that holds every expert's weights as 3-D parameters in transformers 5
    (``gate_up_proj``, ``down_proj``), where peft puts the experts' LoRA adapters."""
    moe = LayerKind.MOE
    return [
        Rule(f"{MC_LAYER}.pre_mlp_layernorm.weight", f"{HF_LAYER}.post_attention_layernorm.weight", REPLICATED,
             layers=moe),
        Rule(f"{MC_LAYER}.mlp.router.weight", f"{HF_LAYER}.{router}", REPLICATED, layers=moe),
        Rule(f"{MC_LAYER}.mlp.experts.linear_fc1.weight{{expert}}",
             (f"{HF_LAYER}.{expert}.{gate}", f"{HF_LAYER}.{expert}.{up}"), GATE_UP, Scope.EXPERT, layers=moe,
             lora=LoraSite("experts", hf_param=f"{HF_LAYER}.{stacked}.gate_up_proj")),
        Rule(f"{MC_LAYER}.mlp.experts.linear_fc2.weight{{expert}}", f"{HF_LAYER}.{expert}.{down}", ROW, Scope.EXPERT,
             layers=moe, lora=LoraSite("experts", hf_param=f"{HF_LAYER}.{stacked}.down_proj")),
    ]


def shared_expert_rules(hf: str = "mlp.shared_experts", gate: str | None = None) -> list[Rule]:
    """The shared expert of MoE layers (one SwiGLU MLP, of all the model's shared experts together), HF
    names relative to the layer; ``gate``: its sigmoid gate's weight (Qwen2-MoE's, Qwen3-Next's)."""
    shared, moe = f"{HF_LAYER}.{hf}", LayerKind.MOE
    rules = [
        Rule(f"{MC_LAYER}.mlp.shared_experts.linear_fc1.weight",
             (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"), GATE_UP, layers=moe,
             lora=LoraSite("shared_experts")),
        Rule(f"{MC_LAYER}.mlp.shared_experts.linear_fc2.weight", f"{shared}.down_proj.weight", ROW, layers=moe,
             lora=LoraSite("shared_experts")),
    ]
    if gate is not None:
        rules.append(Rule(f"{MC_LAYER}.mlp.shared_experts.gate_weight", f"{HF_LAYER}.{gate}", REPLICATED, layers=moe))
    return rules


def expert_bias_rule(hf: str = "mlp.gate.e_score_correction_bias") -> Rule:
    """The router's score-correction bias (DeepSeek-V3's noaux_tc routing): it only chooses experts, kept in
    float32 as the hub's checkpoints and megatron-core keep it (choices depend on its exact values)."""
    return Rule(f"{MC_LAYER}.mlp.router.expert_bias", f"{HF_LAYER}.{hf}", REPLICATED, layers=LayerKind.MOE,
                dtype="float32")


def qwen_expert_count(raw: dict) -> int:
    """A Qwen-MoE config.json's expert count (transformers 5 writes the hub's num_experts as num_local_experts);
    0 is valid there: transformers then gives every layer a dense MLP of intermediate_size."""
    count = next((raw[k] for k in ("num_experts", "num_local_experts") if raw.get(k) is not None), None)
    return 0 if count == 0 else require(raw, "num_experts", aliases=("num_local_experts",))


def qwen_dense_layers(raw: dict) -> tuple[int, ...]:
    """Layers a Qwen-MoE config.json gives a dense MLP: those in ``mlp_only_layers``, and those
    ``decoder_sparse_step`` skips (transformers: MoE where (i + 1) % step == 0)."""
    step = raw.get("decoder_sparse_step", 1) or 1
    only = set(raw.get("mlp_only_layers") or [])
    layers = require(raw, "num_hidden_layers")
    return tuple(i for i in range(layers) if i in only or (i + 1) % step)

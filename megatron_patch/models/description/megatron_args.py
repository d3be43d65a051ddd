"""Megatron-LM's saved training arguments -> the HF config.json of a family's model.

Megatron-LM (and Pai-Megatron-Patch, which trains with it) store the ``args`` namespace of the run
in every checkpoint: inside each legacy ``model_optim_rng.pt`` and in a torch_dist checkpoint's
``common.pt``. Those arguments say how the model was built, but not which HF family it is (a Llama
and a Qwen2 without biases are built alike) and often not the true vocabulary (only the padded one),
so the family is given by the user and the vocabulary must come from the arguments' ``vocab_size``.

The config starts from the family's own tiny config (so every key the family reads exists, under
the names it reads them) and takes every number Megatron-LM records; what Megatron-LM's arguments
do not record is listed in the returned notes, never silently assumed.
"""

from __future__ import annotations

import copy
import math

from megatron_patch.errors import UserError
from megatron_patch.models.description.family import ModelFamily

# megatron-core's defaults for --use-rope-scaling (llama3 RoPE): only the factor is an argument.
_MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# Template keys that describe a tokenizer or a test model rather than the architecture: dropped.
_NOT_ARCHITECTURE = ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype")
# Template keys Megatron-LM's arguments set, under any of the names families use.
_EXPERT_COUNT = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERT_FFN = ("moe_intermediate_size",)
_SHARED_FFN = ("shared_expert_intermediate_size",)


def _get(args: dict, key: str, default=None):
    value = args.get(key, default)
    return default if value is None else value


def saved_number(args: dict, key: str) -> float | None:
    """A finite number the saved arguments hold under ``key``, else None (the arguments are untrusted input: a
    string, a bool or a NaN says nothing)."""
    value = args.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def rope_variants(args: dict) -> list[str]:
    """The RoPE variants the saved arguments record that no family here builds, in words (none: an empty list):
    interleaved RoPE and position interpolation each change every logit. (RoPE on part of each head is a share a
    family's config says: set from the arguments, and compared with a config given.)"""
    found = []
    if args.get("rotary_interleaved") is True:
        found.append("interleaved RoPE (rotary_interleaved)")
    factor = saved_number(args, "rotary_seq_len_interpolation_factor")
    if factor is not None and factor != 1:
        found.append(f"RoPE position interpolation (rotary_seq_len_interpolation_factor {factor:g})")
    return found


def unbuilt_math(args: dict) -> list[str]:
    """What the saved arguments record of the model's math, beside RoPE (``rope_variants``), that no family here
    builds and no tensor shows, in words: each changes every logit while every name and shape still fits."""
    found = []
    if args.get("apply_layernorm_1p") is True:  # megatron-core's norms then hold gamma - 1 and add the 1 back
        found.append("norm weights stored as gamma - 1 (apply_layernorm_1p)")
    if args.get("qk_l2_norm") is True:
        found.append("L2-normalised queries and keys (qk_l2_norm)")
    kind = args.get("position_embedding_type")
    if isinstance(kind, str) and kind != "rope":
        found.append(f"{kind} position embeddings (position_embedding_type)")
    return found


def saved_attention_window(args: dict, layers: int) -> tuple[int, tuple[bool, ...]] | str | None:
    """The sliding window the saved arguments record (--window-size, --window-attn-skip-freq), as transformers
    says it: (keys a query sees, itself included; whether each layer attends within it). None: full attention
    (no window, or flash-attention's infinite -1). A string: a window no family here builds, in words."""
    window, skip = args.get("window_size"), args.get("window_attn_skip_freq")
    if window is None:
        return None

    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    layers = layers if whole(layers) and 0 < layers <= 2**20 else 0  # untrusted: the saved num_layers too

    if not (isinstance(window, (list, tuple)) and len(window) == 2 and all(map(whole, window))):
        return f"an attention window_size of {window!r}"
    back, ahead = window
    if back < 0 and ahead <= 0:
        return None
    if back < 0 or ahead != 0:
        return f"an attention window of {back} keys back and {ahead} ahead (window_size)"
    if skip is None:
        windowed = (True,) * layers
    elif whole(skip) and skip > 0:  # megatron-core: every skip-th layer (1-based) attends in full
        windowed = tuple((i + 1) % skip != 0 for i in range(layers))
    elif isinstance(skip, (list, tuple)) and len(skip) == layers and all(v in (0, 1) for v in skip):
        windowed = tuple(bool(v) for v in skip)
    else:
        return f"window_attn_skip_freq {skip!r} for {layers} layers"
    return back + 1, windowed


def hf_config_from_megatron_args(args: dict, family: ModelFamily) -> tuple[dict, list[str]]:
    """(HF config.json dict for ``family``, notes on what the arguments could not say)."""
    # what Megatron-LM's arguments have no words for: the family's template would stand in for the checkpoint's own
    beyond = ("multi-latent attention" if "kv_lora_rank" in family.tiny_config else
              "text model nested in a multimodal config" if "text_config" in family.tiny_config else
              "per-layer kinds of attention (layer_types)" if "layer_types" in family.tiny_config else None)
    if beyond is not None:
        raise UserError(f"{family.name}'s {beyond} cannot be rebuilt from Megatron-LM's arguments: give --hf-config "
                        "(the model's HF config.json)")
    problems = []
    if _get(args, "normalization", "RMSNorm") != "RMSNorm":
        problems.append(f"normalization {args['normalization']}")
    if not _get(args, "swiglu", True):
        problems.append("an MLP without SwiGLU")
    problems += unbuilt_math(args) + rope_variants(args)
    window = saved_attention_window(args, args.get("num_layers"))
    if isinstance(window, str):
        problems.append(window)
    if problems:
        raise UserError(f"the saved arguments describe a model with {', '.join(problems)}, which {family.name} is not "
                        "as rebuilt from them: give --hf-config (the model's HF config.json), if a family here "
                        "builds it")
    vocab = args.get("vocab_size")
    if not vocab:
        padded = args.get("padded_vocab_size")
        raise UserError("the saved arguments record only the padded vocabulary"
                        + (f" ({padded} rows)" if padded else "")
                        + ", not the tokenizer's: give --hf-config (the model's HF config.json has the true vocab_size)")
    heads = args["num_attention_heads"]
    # a deep copy: the derived config is the checkpoint's own, and its nested tables must not be the family's
    config = copy.deepcopy({k: v for k, v in family.tiny_config.items() if k not in _NOT_ARCHITECTURE})
    config.update(
        hidden_size=args["hidden_size"], num_hidden_layers=args["num_layers"], num_attention_heads=heads,
        num_key_value_heads=args.get("num_query_groups") if args.get("group_query_attention") else heads,
        intermediate_size=args["ffn_hidden_size"], vocab_size=vocab,
        head_dim=_get(args, "kv_channels", args["hidden_size"] // heads),
        rms_norm_eps=float(_get(args, "norm_epsilon", 1e-5)), rope_theta=float(_get(args, "rotary_base", 10000)),
        max_position_embeddings=_get(args, "max_position_embeddings", _get(args, "seq_length")),
        tie_word_embeddings=not _get(args, "untie_embeddings_and_output_weights", False),
        torch_dtype="bfloat16" if args.get("bf16") else "float16" if args.get("fp16") else "float32")
    # RoPE on part of each head, where the family's config says it (the comparison with the arguments refuses
    # the others: open_checkpoint's check_architecture)
    percent = saved_number(args, "rotary_percent") or 1.0
    if "partial_rotary_factor" in config:
        config["partial_rotary_factor"] = percent
    if "rotary_dim" in config:
        config["rotary_dim"] = int(config["head_dim"] * percent)
    if args.get("use_rope_scaling"):
        config["rope_scaling"] = {"rope_type": "llama3", "factor": float(_get(args, "rope_scaling_factor", 8.0)),
                                  **_MCORE_LLAMA3_ROPE}
    else:
        config.pop("rope_scaling", None)
    if isinstance(window, tuple) and all(window[1]):  # where the family reads one window for every layer (Mistral's)
        config["sliding_window"] = window[0]  # checked against the family's model as every saved number is
        if config.get("model_type") == "llama":  # a Llama with a window is transformers' Mistral (llama3_1 builds both)
            config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    if "attention_bias" in config:  # Llama-style configs name the biases; Qwen2's are implied by the family
        config["attention_bias"] = config["mlp_bias"] = bool(args.get("add_bias_linear"))
    experts = args.get("num_experts")
    notes = []
    if experts:
        def put(keys, value):
            for k in keys:
                if k in config:
                    config[k] = value
        put(_EXPERT_COUNT, experts)
        put(("num_experts_per_tok",), args.get("moe_router_topk"))
        put(_EXPERT_FFN, _get(args, "moe_ffn_hidden_size", args["ffn_hidden_size"]))
        put(_SHARED_FFN, _get(args, "moe_shared_expert_intermediate_size", 0))
        kept = sorted(k for k in config if k.startswith(("norm_topk", "router", "decoder_sparse", "mlp_only",
                                                         "first_k_dense", "moe_layer")))
        if kept:
            notes.append(f"taken from the {family.name} defaults, not the checkpoint: {', '.join(kept)}")
    elif any(k in config for k in _EXPERT_COUNT):
        raise UserError(f"the saved arguments describe a dense model, and {family.name} is a mixture of experts: "
                        "check --family")
    return config, notes

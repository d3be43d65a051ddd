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
    if _get(args, "position_embedding_type", "rope") != "rope":
        problems.append(f"{args['position_embedding_type']} position embeddings")
    problems += rope_variants(args)
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

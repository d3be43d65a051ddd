"""The transformers model of an HF folder, as the aligner and the parity check run it.

Never with remote code: a checkpoint is untrusted input. A family may claim a ``model_type`` that
transformers knows under another name (Kimi-K2's config.json says ``kimi_k2`` and points ``auto_map`` at
its own copy of DeepSeek-V3's code); the model is then built from transformers' own class for that
name (``ModelFamily.transformers_model_types``), with the folder's config values, and ``auto_map`` is
ignored. The folder's small files (config, generation config, index, tokenizer files) are checked as every
reader here checks them (``input_files``) before transformers opens them itself.
"""

from __future__ import annotations

from pathlib import Path

from megatron_patch.errors import UserError
from megatron_patch.input_files import check_folder_inputs
from megatron_patch.models.description.arch import read_config_json
from megatron_patch.models.description.registry import detect_family

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).


def load_causal_lm(hf_dir: str | Path, dtype, **kwargs):
    """The reference model of ``hf_dir`` (parity and align both run it), as its folder's own architecture computes.

    Eager attention: the same math on every machine, no backend-dependent kernel choice (transformers' default,
    sdpa, differs from it by more than parity's fp32 bound on some models: Gemma 4's 512-wide heads)."""
    # transformers (0.6 s to import on 2 cores) only where a model is loaded
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = read_config_json(hf_dir)
    check_folder_inputs(hf_dir)  # transformers opens config, generation and tokenizer files itself
    as_type = detect_family(raw).transformers_model_types.get(raw.get("model_type"))
    if as_type is not None:
        values = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
        kwargs["config"] = AutoConfig.for_model(as_type, **values)
    kwargs.setdefault("attn_implementation", "eager")
    if str(dtype) == "torch.float64":  # the fp32 floor (align, parity): torch's grouped GEMM has no float64 kernel
        kwargs.setdefault("experts_implementation", "eager")
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, trust_remote_code=False,
                                                              output_loading_info=True, **kwargs)
    except (AssertionError, ValueError, TypeError, KeyError, IndexError, RuntimeError) as exc:
        # The folder is the reference: one transformers cannot build (a pad_token_id beyond the vocabulary,
        # values its config class refuses) is bad input, named, not an internal error
        import transformers

        detail = " ".join(str(exc).split())[:300]
        raise UserError(f"transformers {transformers.__version__} cannot load the model in {hf_dir} "
                        f"({type(exc).__name__}: {detail}): fix what it names in the folder") from None
    if raw.get("tie_word_embeddings") and "lm_head.weight" in loading["missing_keys"]:
        # A multimodal folder (Qwen3.5) says tie at the top level, where its ForConditionalGeneration reads it; the
        # causal LM is built from its text_config, which says otherwise, and would keep a random lm_head.
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    check_finite_weights(model, hf_dir)
    return model


def check_finite_weights(model, hf_dir: str | Path) -> None:
    """Refuse, in one line, a reference model with a NaN or Inf weight: its activations are NaN from there on, the
    conversion carries the value exactly, and align and parity judged that as the conversion diverging (exit 1).
    Checked as loaded (``dtype``): a weight beyond float16's range is Inf in an fp16 run."""
    import torch  # torch: only where a model was loaded

    for name, weight in model.named_parameters():
        if weight.is_floating_point() and not bool(torch.isfinite(weight).all()):
            raise UserError(f"{hf_dir}: the weight {name} is not finite (it holds NaN or Inf as loaded in "
                            f"{str(weight.dtype).removeprefix('torch.')}): no conversion can be compared against it; "
                            "fix or re-download them")

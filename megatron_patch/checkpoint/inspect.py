"""What a checkpoint folder is, on one screen: ``mpatch inspect DIR [--json]``.

Reads only metadata (torch_dist's ``.metadata`` and ``common.pt``, the pickled structure of legacy
rank files, this project's sidecar), never the weights, so it answers in seconds for any size.
"""

from __future__ import annotations

from pathlib import Path

from megatron_patch.checkpoint.arch_source import what_to_give
from megatron_patch.checkpoint.foreign import find_checkpoint, tensor_facts
from megatron_patch.dtypes import PRECISION_OF_DTYPE_NAME
from megatron_patch.units import human_bytes

# Megatron-LM argument -> what it is called here, for the architecture a checkpoint's args describe.
_ARG_FIELDS = (("num_layers", "layers"), ("hidden_size", "hidden size"), ("ffn_hidden_size", "MLP size"),
               ("num_attention_heads", "attention heads"), ("num_query_groups", "query groups"),
               ("kv_channels", "head dim"), ("padded_vocab_size", "padded vocabulary"),
               ("vocab_size", "vocabulary"), ("num_experts", "experts"), ("moe_router_topk", "experts per token"),
               ("untie_embeddings_and_output_weights", "untied output layer"), ("qk_layernorm", "qk norm"),
               ("tensor_model_parallel_size", "trained at TP"), ("pipeline_model_parallel_size", "trained at PP"))


def describe_checkpoint(path: str | Path, iteration: int | None = None) -> dict:
    """Everything ``mpatch inspect`` shows, as a JSON-ready dict."""
    found = find_checkpoint(path, iteration)
    out: dict = {
        "path": str(found.folder),
        "format": found.fmt,
        "layout": (f"TP={found.layout.tp} PP={found.layout.pp} EP={found.layout.ep}" if found.layout
                   else "any (global tensors: loads at any TP/PP/EP)"),
        "iteration": found.iteration,
        "iterations": found.iterations,
        "written_by": found.writer,
        "dtype": PRECISION_OF_DTYPE_NAME.get(found.dtype, found.dtype),
        "tensors": found.num_tensors,
        "bytes": found.num_bytes,
        "optimizer_state": found.has_optimizer,
    }
    if found.layers_per_stage and len(found.layers_per_stage) > 1:
        out["layers_per_stage"] = found.layers_per_stage
    if found.sidecar_dir is not None:
        sidecar = found.sidecar
        arch = sidecar.arch
        out["family"] = sidecar.family
        out["architecture"] = {"layers": arch.num_layers, "hidden size": arch.hidden_size,
                               "attention heads": arch.num_heads, "query groups": arch.num_kv_heads,
                               "head dim": arch.head_dim, "MLP size": arch.ffn_hidden_size,
                               "vocabulary": arch.vocab_size, "padded vocabulary": arch.padded_vocab_size(),
                               "experts": arch.num_experts, "tied output layer": arch.tie_word_embeddings}
        out["architecture_source"] = str(found.sidecar_dir / "mpatch_checkpoint.json")
        if sidecar.lora:
            spec, base = sidecar.lora.get("spec") or {}, sidecar.lora.get("base")
            out["lora"] = {"rank": spec.get("rank"), "alpha": spec.get("alpha"), "targets": spec.get("targets"),
                           "base": base.get("path") if isinstance(base, dict) else None}
    elif found.args is not None:
        out["family"] = None
        out["architecture"] = {name: found.args.get(key) for key, name in _ARG_FIELDS if key in found.args}
        out["architecture_source"] = "saved Megatron-LM arguments"
    else:
        out["family"] = None
        out["architecture"] = {k: v for k, v in tensor_facts(found.shapes).items()}
        out["architecture_source"] = "tensor shapes only"
    out["mcore2hf_needs"] = (_lora_needs(out["lora"]) if "lora" in out
                             else what_to_give(found) or "nothing: the checkpoint describes itself")
    if found.notes:
        out["warnings"] = found.notes
    return out


def _lora_needs(lora: dict) -> str:
    """What mcore2hf of a LoRA checkpoint needs (``convert.lora_io``): the adapters alone or merged in."""
    where = (f"; --merge-lora reads the base weights from {lora['base']}" if lora["base"]
             else "; the base weights are in the checkpoint beside them")
    return ("--lora-adapter (the adapters as a peft folder) or --merge-lora (the model with them merged in)"
            + where)


def format_summary(info: dict) -> str:
    """The dict of ``describe_checkpoint`` as lines a person reads."""
    iterations = info["iterations"]
    listed = (f" (saved: {', '.join(map(str, iterations[-6:]))}{' ...' if len(iterations) > 6 else ''})"
              if len(iterations) > 1 else "")
    lines = [
        f"checkpoint     {info['path']}",
        f"format         {info['format']}, layout {info['layout']}",
        f"iteration      {info['iteration']}{listed}",
        f"written by     {info['written_by']}",
        f"weights        {info['tensors']} tensors, {human_bytes(info['bytes'])}, {info['dtype']}",
        f"optimizer      {'present (skipped on export)' if info['optimizer_state'] else 'none'}",
    ]
    if "layers_per_stage" in info:
        lines.append(f"stages         {' + '.join(map(str, info['layers_per_stage']))} layers")
    arch = ", ".join(f"{k} {v}" for k, v in info["architecture"].items() if v is not None)
    family = f"{info['family']}: " if info.get("family") else ""
    lines.append(f"model          {family}{arch}")
    lines.append(f"               (from {info['architecture_source']})")
    if "lora" in info:
        lora = info["lora"]
        targets = lora["targets"] if isinstance(lora["targets"], str) else ",".join(map(str, lora["targets"] or []))
        lines.append(f"LoRA           adapters of rank {lora['rank']}, alpha {lora['alpha']}, on {targets}"
                     + (f"; base model {lora['base']}" if lora["base"] else "; base weights included"))
    lines.append(f"mcore2hf needs {info['mcore2hf_needs']}")
    for w in info.get("warnings", []):
        lines.append(f"warning        {w}")
    return "\n".join(lines)

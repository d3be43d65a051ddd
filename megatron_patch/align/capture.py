"""Activations captured at the same points of an HF model and of an MCore GPTModel.

Points, in the order data flows through the model (``point_names``)::

    embedding, layers.{i}.attention, layers.{i}.mlp, layers.{i}.output, ..., final_norm, logits

``attention`` and ``mlp`` are the sub-block outputs before the residual add (HF ``self_attn`` /
``mlp``; MCore ``self_attention`` / ``mlp``, both after their row-parallel reduction), ``output`` is
the decoder layer's output. Every capture is float32 on CPU, shaped [batch, seq, ...] (MCore's
[seq, batch, ...] is transposed), so captures from either side compare directly.

On the MCore side each pipeline stage captures its own layers (global numbers from
``TransformerLayer.layer_number``); ``merge_captures`` joins the stages' pieces.

MoE layers also report which experts each token was sent to, ``routing.{i}``: the top-k expert
indices [batch, seq, k], sorted. HF's routers (transformers 5) return the chosen indices last; the
family names the router's path (``HFModules.router``). MCore's router returns its routing map.

Sparse-attention layers (DeepSeek-V3.2, GLM-5) report which keys each query attends to, ``selection.{i}``:
[batch, seq, seq] True at the keys the indexer kept that the query may see (a query with fewer earlier
tokens than the top-k keeps them all, whatever else fills its top-k). HF's indexer returns its top-k
indices; MCore's sparse core attention keeps its latest ones (``last_topk``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from megatron_patch.models.blocks.inference import forward_logits
from megatron_patch.models.description.family import HFModules
from megatron_patch.models.description.hf_model import load_causal_lm

Captures = dict[str, torch.Tensor]

SUBLAYER_POINTS = ("attention", "mlp", "output")


def point_names(num_layers: int) -> list[str]:
    names = ["embedding"]
    for i in range(num_layers):
        names += [f"layers.{i}.{p}" for p in SUBLAYER_POINTS]
    return names + ["final_norm", "logits"]


ROUTING = "routing."


SELECTION = "selection."


def selection_layers(captures: Captures) -> list[int]:
    """The sparse-attention layers whose key selections ``captures`` holds."""
    return sorted(int(n[len(SELECTION):]) for n in captures if n.startswith(SELECTION))


def selection_mask(topk: torch.Tensor) -> torch.Tensor:
    """[batch, seq, seq] bool of the top-k key indices [batch, seq, k] a query may see (causal)."""
    batch, seq = topk.shape[:2]
    chosen = torch.zeros(batch, seq, seq, dtype=torch.bool).scatter_(-1, topk.long().cpu(), True)
    return chosen & torch.ones(seq, seq, dtype=torch.bool).tril()


@contextmanager
def _selection_hooks(modules: dict[int, torch.nn.Module], store: Captures, mcore: bool):
    """Hooks that record each sparse-attention layer's key selection as ``selection.{layer}``."""

    def make(layer):
        def hook(module, args, output):
            topk = module.last_topk if mcore else _first(output)
            store[f"{SELECTION}{layer}"] = selection_mask(topk.detach())
        return hook

    handles = [m.register_forward_hook(make(i)) for i, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def routing_layers(captures: Captures) -> list[int]:
    """The MoE layers whose expert choices ``captures`` holds."""
    return sorted(int(n[len(ROUTING):]) for n in captures if n.startswith(ROUTING))


def point_layer(name: str) -> int | None:
    """The decoder layer a point belongs to (None for embedding, final norm and logits)."""
    return int(name.split(".")[1]) if name.startswith("layers.") else None


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


@contextmanager
def _hooks(targets: dict[str, torch.nn.Module], store: Captures, seq_first: bool):
    """Forward hooks that copy each module's (first) output into ``store`` under its point name."""

    def make(name):
        def hook(module, args, output):
            t = _first(output).detach()
            if seq_first and not name.endswith(".output") and isinstance(output, tuple) and torch.is_tensor(output[-1]):
                # megatron-core's sub-blocks return (output, bias) and add the bias later, with the residual
                t = t + output[-1].detach()
            if seq_first:
                t = t.transpose(0, 1)
            # Always a copy: with batch 1 the transposed output is already contiguous, and MCore adds the
            # residual into its sub-block outputs in place, which would change an aliased capture.
            store[name] = t.to("cpu", torch.float32, copy=True, memory_format=torch.contiguous_format)
        return hook

    handles = [m.register_forward_hook(make(n)) for n, m in targets.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _hf_expert_indices(output, top_k: int | None) -> torch.Tensor | None:
    """The expert indices a transformers router chose. 5.x routers return (logits, weights, indices), 4.x
    DeepSeek's (indices, weights), and 4.x Mixtral/Qwen-MoE gates are plain linears whose logits the
    block turns into its top-k (softmax first or not, the same experts)."""
    parts = output if isinstance(output, (tuple, list)) else (output,)
    indices = [t for t in parts if torch.is_tensor(t) and not t.is_floating_point()]
    if indices:
        return indices[0]
    if top_k and torch.is_tensor(parts[0]) and parts[0].dim() >= 2:
        return torch.topk(parts[0].float(), top_k, dim=-1).indices
    return None


@contextmanager
def _routing_hooks(routers: dict[int, torch.nn.Module], store: Captures, batch: int, seq: int, mcore: bool,
                   top_k: int | None = None):
    """Hooks that record each router's top-k expert indices as ``routing.{layer}`` [batch, seq, k]
    (``top_k``: the HF model's, for a gate that returns only logits)."""

    def make(layer):
        def hook(module, args, output):
            if mcore:  # (probs, routing_map [tokens, experts]); tokens run sequence-first
                chosen = output[1]
                k = int(chosen.sum(-1).max())
                idx = torch.topk(chosen.float(), k, dim=-1).indices.view(seq, batch, k).transpose(0, 1)
            else:
                idx = _hf_expert_indices(output, top_k)
                if idx is None:
                    raise TypeError(f"the router of layer {layer} returned no expert indices: check the family's "
                                    "HFModules.router path")
                idx = idx.reshape(batch, seq, -1)
            store[f"{ROUTING}{layer}"] = torch.sort(idx.detach().long().cpu(), dim=-1).values.contiguous()
        return hook

    handles = [m.register_forward_hook(make(i)) for i, m in routers.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _submodule(parent: torch.nn.Module, paths: str | tuple[str, ...]) -> torch.nn.Module:
    """The first of ``paths`` that ``parent`` has (AttributeError naming them all when none)."""
    for path in (paths,) if isinstance(paths, str) else paths:
        try:
            return parent.get_submodule(path)
        except AttributeError:
            continue
    raise AttributeError(f"{type(parent).__name__} has none of {paths}")


def hf_capture_targets(model, modules: HFModules) -> dict[str, torch.nn.Module]:
    """The HF modules behind each point, at the paths the model's family names."""
    targets = {"embedding": _submodule(model, modules.embedding)}
    for i, layer in enumerate(_submodule(model, modules.layers)):
        targets[f"layers.{i}.attention"] = _submodule(layer, modules.attention)
        targets[f"layers.{i}.mlp"] = _submodule(layer, modules.mlp)
        targets[f"layers.{i}.output"] = layer
    targets["final_norm"] = _submodule(model, modules.final_norm)
    return targets


def hf_routers(model, modules: HFModules) -> dict[int, torch.nn.Module]:
    """Each MoE layer's router, at the family's path (dense layers of a mixed model have none)."""
    if modules.router is None:
        return {}
    out = {}
    for i, layer in enumerate(_submodule(model, modules.layers)):
        try:
            out[i] = _submodule(layer, modules.router)
        except AttributeError:
            continue
    return out


def hf_indexers(model, modules: HFModules) -> dict[int, torch.nn.Module]:
    """Each sparse-attention layer's indexer, at the family's path."""
    if modules.indexer is None:
        return {}
    return {i: layer.get_submodule(modules.indexer) for i, layer in enumerate(_submodule(model, modules.layers))}


def capture_hf(model, tokens: torch.Tensor, modules: HFModules) -> Captures:
    """Run an HF causal LM on ``tokens`` and capture every point (``modules``: its family's paths)."""
    store: Captures = {}
    model.eval()
    batch, seq = tokens.shape
    with torch.no_grad(), _hooks(hf_capture_targets(model, modules), store, seq_first=False), \
            _routing_hooks(hf_routers(model, modules), store, batch, seq, mcore=False,
                           top_k=getattr(model.config, "num_experts_per_tok", None)), \
            _selection_hooks(hf_indexers(model, modules), store, mcore=False):
        store["logits"] = model(tokens).logits.float()
    return store


def load_hf_model(hf_dir, dtype: torch.dtype):
    # eager attention: the same math on every machine, no backend-dependent kernel choice.
    return load_causal_lm(hf_dir, dtype, attn_implementation="eager")


def mcore_capture_targets(model) -> dict[str, torch.nn.Module]:
    targets = {}
    if getattr(model, "pre_process", False):
        targets["embedding"] = model.embedding
    for layer in model.decoder.layers:
        i = layer.layer_number - 1
        targets[f"layers.{i}.attention"] = layer.self_attention
        targets[f"layers.{i}.mlp"] = layer.mlp
        targets[f"layers.{i}.output"] = layer
    if getattr(model, "post_process", False) and getattr(model.decoder, "final_layernorm", None) is not None:
        targets["final_norm"] = model.decoder.final_layernorm
    return targets


def mcore_routers(model) -> dict[int, torch.nn.Module]:
    return {layer.layer_number - 1: layer.mlp.router for layer in model.decoder.layers
            if getattr(layer.mlp, "router", None) is not None}


def mcore_indexers(model) -> dict[int, torch.nn.Module]:
    """Each sparse-attention layer's core attention (it keeps its latest top-k)."""
    return {layer.layer_number - 1: layer.self_attention.core_attention for layer in model.decoder.layers
            if hasattr(getattr(layer.self_attention, "core_attention", None), "last_topk")}


def capture_mcore(model, tokens: torch.Tensor, vocab_size: int) -> Captures:
    """This rank's points of an MCore GPTModel (its stage only), run through megatron's schedule."""
    store: Captures = {}
    batch, seq = tokens.shape
    with _hooks(mcore_capture_targets(model), store, seq_first=True), \
            _routing_hooks(mcore_routers(model), store, batch, seq, mcore=True), \
            _selection_hooks(mcore_indexers(model), store, mcore=True):
        logits = forward_logits(model, tokens, vocab_size)
    if logits is not None:
        store["logits"] = logits.float().cpu()
    return store


def merge_captures(pieces: list[Captures | None]) -> Captures:
    """Join per-rank captures (pipeline stages hold different points; replicas hold equal copies)."""
    out: Captures = {}
    for piece in pieces:
        for name, t in (piece or {}).items():
            out.setdefault(name, t)
    return out

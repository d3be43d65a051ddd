"""Activations captured at the same points of an HF model and of an MCore GPTModel.

Points, in the order data flows through the model (``point_names``)::

    embedding, layers.{i}.attention, [layers.{i}.residual,] layers.{i}.mlp, layers.{i}.output, ..., final_norm, logits

``attention`` and ``mlp`` are the sub-block outputs before the residual add (HF ``self_attn`` /
``mlp``; MCore ``self_attention`` / ``mlp``, both after their row-parallel reduction), ``output`` is
the decoder layer's output; ``residual``, where the family names it (``HFModules.attention_residual``), the
residual between the two (DeepSeek-V4: the streams after the attention's hyper-connection). Every capture is float32 on CPU, shaped [batch, seq, ...] (MCore's
[seq, batch, ...] is transposed), so captures from either side compare directly.

A model whose residual is several streams (DeepSeek-V4's hyper-connections) holds a layer's output as
[batch, seq, streams, hidden] in transformers; megatron-core's block carries them folded into the batch,
[seq, batch * streams, hidden] (the model's ``pipeline_batch_factor``), and is unfolded here to the reference's
layout. The embedding is one hidden state in the reference, copied into the streams after it
(``streams_like``).

On the MCore side each pipeline stage captures its own layers (global numbers from
``TransformerLayer.layer_number``); ``merge_captures`` joins the stages' pieces.

MoE layers also report which experts each token was sent to, ``routing.{i}``: the top-k expert
indices [batch, seq, k], sorted. HF's routers (transformers 5) return the chosen indices last; the
family names the router's path (``HFModules.router``). MCore's router returns its routing map.

Sparse-attention layers (DeepSeek-V3.2, GLM-5) report which keys each query attends to, ``selection.{i}``:
[batch, seq, seq] True at the keys the indexer kept that the query may see (a query with fewer earlier
tokens than the top-k keeps them all, whatever else fills its top-k). HF's indexer returns its top-k
indices; MCore's module that selects keeps its latest ones (``last_topk``: DeepSeek-V3.2's sparse core
attention, DeepSeek-V4's indexer). DeepSeek-V4's CSA indexer selects among compressed blocks of keys, the
same way (an index is a block, -1 where a query sees fewer blocks than the top-k).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from megatron_patch.models.blocks.inference import forward_logits
from megatron_patch.models.description.family import HFModules
from megatron_patch.models.description.hf_model import load_causal_lm

Captures = dict[str, torch.Tensor]

SUBLAYER_POINTS = ("attention", "mlp", "output")


RESIDUAL = "residual"


def point_names(num_layers: int, residual: bool = False) -> list[str]:
    """The points in data-flow order; ``residual``: with each layer's residual after its attention step."""
    sublayer = ("attention", RESIDUAL, "mlp", "output") if residual else SUBLAYER_POINTS
    names = ["embedding"]
    for i in range(num_layers):
        names += [f"layers.{i}.{p}" for p in sublayer]
    return names + ["final_norm", "logits"]


def captured_point_names(captures: Captures, num_layers: int) -> list[str]:
    """``point_names`` of what ``captures`` holds: with the residual points where the family's layers have them."""
    return point_names(num_layers, residual=any(n.endswith(f".{RESIDUAL}") for n in captures))


ROUTING = "routing."


SELECTION = "selection."


def selection_layers(captures: Captures) -> list[int]:
    """The sparse-attention layers whose key selections ``captures`` holds."""
    return sorted(int(n[len(SELECTION):]) for n in captures if n.startswith(SELECTION))


def selection_mask(topk: torch.Tensor) -> torch.Tensor:
    """[batch, seq, seq] bool of the top-k key indices [batch, seq, k] a query may see (causal); a negative
    index marks no choice (DeepSeek-V4's indexer, for a query that sees fewer blocks than the top-k)."""
    batch, seq = topk.shape[:2]
    topk = topk.long().cpu()
    none = seq  # one column past the keys, dropped
    chosen = torch.zeros(batch, seq, seq + 1, dtype=torch.bool).scatter_(-1, topk.where(topk >= 0, none), True)
    return chosen[..., :seq] & torch.ones(seq, seq, dtype=torch.bool).tril()


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


def unfold_streams(t: torch.Tensor, batch: int, streams: int) -> torch.Tensor:
    """A batch-first capture [batch * streams, seq, h] of streams folded into the batch, as the reference holds
    them: [batch, seq, streams, h]. Other tensors (a sub-block's [batch, seq, h]) as they are."""
    if streams == 1 or t.shape[0] != batch * streams:
        return t
    return t.unflatten(0, (batch, streams)).transpose(1, 2)


def stream_count(t: torch.Tensor) -> int:
    """The residual streams a capture holds ([batch, seq, streams, hidden]; 0 for [batch, seq, hidden])."""
    return t.shape[-2] if t.dim() == 4 else 0


def streams_like(ref: torch.Tensor, test: torch.Tensor) -> torch.Tensor:
    """``ref`` as ``test`` holds the point: a hidden state [batch, seq, h] copied into each of ``test``'s streams
    [batch, seq, streams, h] where only ``test`` holds them (the embedding: the reference expands it into the
    streams after its embedding module, megatron-core in a hook on it)."""
    if test.dim() == ref.dim() + 1 and test.shape[:-2] == ref.shape[:-1] and test.shape[-1] == ref.shape[-1]:
        return ref.unsqueeze(-2).expand_as(test)
    return ref


@contextmanager
def _hooks(targets: dict[str, torch.nn.Module], store: Captures, seq_first: bool, batch: int = 0, streams: int = 1):
    """Forward hooks that copy each module's (first) output into ``store`` under its point name; a sequence-first
    output with ``streams`` residual streams folded into its ``batch`` is unfolded (``unfold_streams``)."""

    def make(name):
        def hook(module, args, output):
            t = _first(output).detach()
            if seq_first and not name.endswith(".output") and isinstance(output, tuple) and torch.is_tensor(output[-1]):
                # megatron-core's sub-blocks return (output, bias) and add the bias later, with the residual
                t = t + output[-1].detach()
            if seq_first:
                t = unfold_streams(t.transpose(0, 1), batch, streams)
            # Always a copy: with batch 1 the transposed output is already contiguous, and MCore adds the
            # residual into its sub-block outputs in place, which would change an aliased capture.
            store[name] = t.to("cpu", torch.float32, copy=True, memory_format=torch.contiguous_format)
        return hook

    def make_before(name):  # a residual point: the module's input
        def hook(module, args):
            make(name)(module, args, args[0])
        return hook

    handles = [m.register_forward_pre_hook(make_before(n)) if n.endswith(f".{RESIDUAL}") else
               m.register_forward_hook(make(n)) for n, m in targets.items()]
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
        if modules.attention_residual is not None:
            targets[f"layers.{i}.{RESIDUAL}"] = _submodule(layer, modules.attention_residual)
    targets["final_norm"] = _submodule(model, modules.final_norm)
    return targets


def _in_layers(model, modules: HFModules, path) -> dict[int, torch.nn.Module]:
    """The module at ``path`` in each decoder layer that has one (none where ``path`` is None)."""
    if path is None:
        return {}
    out = {}
    for i, layer in enumerate(_submodule(model, modules.layers)):
        try:
            out[i] = _submodule(layer, path)
        except AttributeError:
            continue
    return out


def hf_routers(model, modules: HFModules) -> dict[int, torch.nn.Module]:
    """Each MoE layer's router, at the family's path (dense layers of a mixed model have none)."""
    return _in_layers(model, modules, modules.router)


def hf_indexers(model, modules: HFModules) -> dict[int, torch.nn.Module]:
    """Each sparse-attention layer's indexer, at the family's path (layers of other attention types have none:
    DeepSeek-V4's sliding and HCA layers)."""
    return _in_layers(model, modules, modules.indexer)


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
    return load_causal_lm(hf_dir, dtype)  # eager attention, as parity's


def mcore_capture_targets(model, modules: HFModules = HFModules()) -> dict[str, torch.nn.Module]:
    targets = {}
    if getattr(model, "pre_process", False):
        targets["embedding"] = model.embedding
    for layer in model.decoder.layers:
        i = layer.layer_number - 1
        targets[f"layers.{i}.attention"] = layer.self_attention
        targets[f"layers.{i}.mlp"] = layer.mlp
        targets[f"layers.{i}.output"] = layer
        if modules.attention_residual is not None:
            targets[f"layers.{i}.{RESIDUAL}"] = layer.get_submodule(modules.attention_residual)
    if getattr(model, "post_process", False) and getattr(model.decoder, "final_layernorm", None) is not None:
        targets["final_norm"] = model.decoder.final_layernorm
    return targets


def mcore_routers(model) -> dict[int, torch.nn.Module]:
    return {layer.layer_number - 1: layer.mlp.router for layer in model.decoder.layers
            if getattr(layer.mlp, "router", None) is not None}


def mcore_indexers(model) -> dict[int, torch.nn.Module]:
    """Each sparse-attention layer's module that selects keys and keeps its latest top-k (``last_topk``):
    DeepSeek-V3.2's sparse core attention, DeepSeek-V4's CSA indexer."""
    out = {}
    for layer in model.decoder.layers:
        keeper = next((m for m in layer.self_attention.modules() if hasattr(m, "last_topk")), None)
        if keeper is not None:
            out[layer.layer_number - 1] = keeper
    return out


def capture_mcore(model, tokens: torch.Tensor, vocab_size: int, modules: HFModules = HFModules()) -> Captures:
    """This rank's points of an MCore GPTModel (its stage only), run through megatron's schedule; ``modules``: the
    family's (for its residual point)."""
    from megatron_patch.models.blocks.builder import pipeline_batch_factor  # megatron-core, as the model

    store: Captures = {}
    batch, seq = tokens.shape
    streams = pipeline_batch_factor(model)  # residual streams folded into the batch (DeepSeek-V4's)
    with _hooks(mcore_capture_targets(model, modules), store, seq_first=True, batch=batch, streams=streams), \
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

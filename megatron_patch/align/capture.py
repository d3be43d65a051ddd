"""Activations captured at the same points of an HF model and of an MCore GPTModel.

Points, in the order data flows through the model (``align.points.point_names``)::

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

from megatron_patch.align.points import (EVERY_ID, RESIDUAL, ROUTING, SELECTION, Captures, every_expert_point,
                                        router_point)
from megatron_patch.models.blocks.inference import forward_logits
from megatron_patch.models.description.family import HFModules
from megatron_patch.models.description.hf_model import load_causal_lm

# ids per call: [4096, 1, hidden] fp32 is 64 MiB at hidden 4096
ID_CHUNK = 4096


def forced_routes(batch: int, seq: int, num_experts: int, top_k: int, seq_first: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert indices [tokens, k], weights [tokens, k]) of the forced routing: the token at (b, s), number
    n = b * seq + s, goes to experts n*k ... n*k + k-1 (mod the experts), weighted 1:2:...:k (a weight per slot, so
    two experts' weights swapped still show), in the order the router sees the tokens (``seq_first``: MCore's)."""
    grid = torch.arange(batch * seq).view(batch, seq)
    order = (grid.t() if seq_first else grid).reshape(-1)
    indices = (order[:, None] * top_k + torch.arange(top_k)) % num_experts
    weights = (torch.arange(top_k) + 1.0) / (top_k * (top_k + 1) / 2)
    return indices, weights.expand(len(order), top_k)


def _hf_correction_bias(router: torch.nn.Module, args: tuple) -> torch.Tensor | None:
    """An HF router's score-correction bias: its own buffer, or (MiniMax-M2) the MoE block's, passed in."""
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is None and len(args) > 1 and torch.is_tensor(args[1]) and args[1].dim() == 1:
        bias = args[1]
    return bias


@contextmanager
def _router_logit_hooks(routers: dict[int, torch.nn.Module], store: Captures, batch: int, seq: int, mcore: bool,
                        logits_path: str | None = None):
    """Record each router's logits and bias: HF's routers return the logits first, or (``logits_path``) a module
    of theirs does; MCore's are what its ``gating`` returns (wrapped on the instance for the duration), tokens
    sequence-first."""

    def keep(layer, logits, bias, seq_first):
        t = logits.detach().float()
        t = t.view(seq, batch, -1).transpose(0, 1) if seq_first else t.reshape(batch, seq, -1)
        bias = torch.zeros(t.shape[-1]) if bias is None else bias.detach().float().cpu()
        store[router_point(layer)] = torch.cat([t.cpu(), bias.expand_as(t)], dim=-1)

    def gating_of(layer, router, gating):
        def recorded(*args, **kwargs):
            logits = gating(*args, **kwargs)
            keep(layer, logits, getattr(router, "expert_bias", None), seq_first=True)
            return logits
        return recorded

    handles = []
    for layer, router in routers.items():
        if mcore:
            router.gating = gating_of(layer, router, router.gating)
        elif logits_path is not None:
            handles.append(_submodule(router, logits_path).register_forward_hook(
                lambda m, args, out, layer=layer: keep(layer, _first(out), None, False)))
        else:
            handles.append(router.register_forward_hook(
                lambda m, args, out, layer=layer: keep(layer, out[0], _hf_correction_bias(m, args), False)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if mcore:
            for router in routers.values():
                del router.gating  # the class's method again


@contextmanager
def _forced_routing(routers: dict[int, torch.nn.Module], batch: int, seq: int, mcore: bool):
    """Hooks that replace each router's choice by ``forced_routes``: HF's (logits, weights, indices) keep their
    logits; MCore's (probs [tokens, experts], routing_map) become the same choice, densely."""

    def hook(module, args, output):
        if mcore:
            probs, routing_map = output
            top_k = int(routing_map.sum(-1).max())
            indices, weights = forced_routes(batch, seq, probs.shape[-1], top_k, seq_first=True)
            indices = indices.to(probs.device)
            return (torch.zeros_like(probs).scatter_(1, indices, weights.to(probs)),
                    torch.zeros_like(routing_map).scatter_(1, indices, True))
        if not (isinstance(output, tuple) and len(output) == 3):
            raise TypeError(f"{type(module).__name__} returned no (logits, weights, indices): the forced routing "
                            "needs a transformers 5 router")
        logits, weights, _ = output
        indices, forced = forced_routes(batch, seq, logits.shape[-1], weights.shape[-1], seq_first=False)
        return logits, forced.to(weights), indices.to(weights.device)

    handles = [m.register_forward_hook(hook) for m in routers.values()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


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


def _embed_every_id(module: torch.nn.Module, call, vocab_size: int, store: Captures, seq_first: bool,
                    streams: int = 1) -> None:
    """``store[EVERY_ID]``: the embedding ``module`` on every id below ``vocab_size``, ``call(ids [n, 1])`` running
    it, captured by the same hook as the embedding point (so both sides' rows compare as that point does)."""
    pieces = []
    for start in range(0, vocab_size, ID_CHUNK):
        ids = torch.arange(start, min(start + ID_CHUNK, vocab_size)).view(-1, 1)
        one: Captures = {}
        with _hooks({EVERY_ID: module}, one, seq_first, batch=len(ids), streams=streams):
            call(ids)
        pieces.append(one[EVERY_ID])
    store[EVERY_ID] = torch.cat(pieces)


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


def capture_hf(model, tokens: torch.Tensor, modules: HFModules, vocab_size: int) -> Captures:
    """Run an HF causal LM on ``tokens`` and capture every point (``modules``: its family's paths), and its
    embedding on every id below ``vocab_size`` (the model's, unpadded)."""
    store: Captures = {}
    model.eval()
    batch, seq = tokens.shape
    targets, routers = hf_capture_targets(model, modules), hf_routers(model, modules)
    with torch.no_grad(), _hooks(targets, store, seq_first=False), \
            _routing_hooks(routers, store, batch, seq, mcore=False,
                           top_k=getattr(model.config, "num_experts_per_tok", None)), \
            _router_logit_hooks(routers, store, batch, seq, mcore=False, logits_path=modules.router_logits), \
            _selection_hooks(hf_indexers(model, modules), store, mcore=False):
        # one forward: no KV cache (transformers' cache of a model without attention layers fails to size a mask)
        store["logits"] = model(tokens, use_cache=False).logits.float()
    if routers:
        layers = _submodule(model, modules.layers)
        mlps = {every_expert_point(i): _submodule(layers[i], modules.mlp) for i in routers}
        with torch.no_grad(), _hooks(mlps, store, seq_first=False), _forced_routing(routers, batch, seq, mcore=False):
            model(tokens, use_cache=False)
    embedding = targets["embedding"]
    with torch.no_grad():
        _embed_every_id(embedding, lambda ids: embedding(ids.to(tokens.device)), vocab_size, store, seq_first=False)
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


def capture_mcore(model, tokens: torch.Tensor, vocab_size: int, modules: HFModules = HFModules(),
                  moe: bool = False) -> Captures:
    """This rank's points of an MCore GPTModel (its stage only), run through megatron's schedule; ``modules``: the
    family's (for its residual point); ``moe``: the model has MoE layers (on some stage: every stage runs the
    forced-routing forward with them)."""
    from megatron_patch.models.blocks.builder import pipeline_batch_factor  # megatron-core, as the model

    store: Captures = {}
    batch, seq = tokens.shape
    streams = pipeline_batch_factor(model)  # residual streams folded into the batch (DeepSeek-V4's)
    routers = mcore_routers(model)
    with _hooks(mcore_capture_targets(model, modules), store, seq_first=True, batch=batch, streams=streams), \
            _routing_hooks(routers, store, batch, seq, mcore=True), \
            _router_logit_hooks(routers, store, batch, seq, mcore=True), \
            _selection_hooks(mcore_indexers(model), store, mcore=True):
        logits = forward_logits(model, tokens, vocab_size)
    if moe:
        mlps = {every_expert_point(i): layer.mlp for layer in model.decoder.layers
                if (i := layer.layer_number - 1) in routers}
        with _hooks(mlps, store, seq_first=True, batch=batch, streams=streams), \
                _forced_routing(routers, batch, seq, mcore=True):
            forward_logits(model, tokens, vocab_size)
    if getattr(model, "pre_process", False):  # every TP rank of the first stage: the lookup reduces over them
        embedding = model.embedding
        device = next(model.parameters()).device

        def call(ids):
            ids = ids.to(device)
            return embedding(input_ids=ids, position_ids=torch.zeros_like(ids))

        with torch.no_grad():
            _embed_every_id(embedding, call, vocab_size, store, seq_first=True, streams=streams)
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

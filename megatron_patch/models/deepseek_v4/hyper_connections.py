"""DeepSeek-V4's manifold-constrained hyper-connections (mHC), as transformers 5.24 computes them
(``DeepseekV4HyperConnection``, ``DeepseekV4HyperHead``, ``DeepseekV4DecoderLayer.forward``), in megatron-core's
sequence-first layout.

The residual of every layer is ``hc_mult`` streams, ``[s, b, hc_mult, h]``:

- ``expand_streams``: the embedding's output copied into each stream (``DeepseekV4Model``);
- ``HyperConnection`` (a layer has one before its attention, ``attn_hc``, and one before its MLP, ``ffn_hc``):
  from the streams, RMS-normalised without a weight and projected by ``fn``, three mixes: ``pre`` collapses the
  streams into the sublayer's input, ``post`` spreads the sublayer's output over the streams, and ``comb`` mixes
  the streams themselves, made doubly stochastic by ``hc_sinkhorn_iters`` Sinkhorn-Knopp steps (each division
  floored by ``hc_eps``);
- ``hyper_connected``: one sublayer's residual step, ``post * norm(sublayer)(pre-collapsed streams) +
  comb^T @ streams``; ``HyperConnectedLayer`` runs a decoder layer's two (attention, then MLP), each with its
  layer's RMSNorm before the sublayer (transformers' ``input_layernorm`` and ``post_attention_layernorm``; the
  hub's ``attn_norm`` and ``ffn_norm``);
- ``HyperHead``: the streams collapsed into one hidden state after the last layer (``hc_head``), before the
  model's final norm.

Every parameter here is float32 and every mix is computed in float32, as transformers keeps them
(``_keep_in_fp32_modules_strict``); the streams keep the model's dtype. The parameters are replicated over tensor
parallelism; under sequence parallelism each TP rank sees other tokens, so their gradients are summed over the TP
group (megatron-core's ``sequence_parallel`` attribute, read by ``finalize_model_grads``).

Between pipeline stages the streams travel folded into the batch dimension, ``[s, b * hc_mult, h]``, a view of
the contiguous streams, and the schedule is given ``micro_batch_size * hc_mult`` (``pipeline_schedule_sizes``):
docs/deepseek.md, "DeepSeek-V4: hyper-connections".
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from megatron_patch.models.blocks.sandwich_norms import ReplicatedOverTP

Sublayer = Callable[[torch.Tensor], torch.Tensor]


def _weightless_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``DeepseekV4UnweightedRMSNorm`` (its input is already float32 here)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``comb`` ([..., n, n], positive) made doubly stochastic as transformers does: the columns normalised,
    then ``iters - 1`` times the rows and the columns, each sum floored by ``eps``."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _replicated(module: torch.nn.Module, config) -> None:
    """The module's parameters are the same on every TP rank; under sequence parallelism each rank's gradient comes
    from its own tokens, so megatron-core sums them over the TP group."""
    for p in module.parameters(recurse=False):
        p.sequence_parallel = bool(getattr(config, "sequence_parallel", False))


class HyperConnection(ReplicatedOverTP, torch.nn.Module):
    """One sublayer's mixes from the streams (``attn_hc``, ``ffn_hc``): ``fn`` [(2 + n) * n, n * h] projects the
    normalised streams to the pre, post and comb logits, ``base`` [(2 + n) * n] their biases, ``scale`` [3] a scale
    for each. ``forward(streams [s, b, n, h]) -> (post [s, b, n], comb [s, b, n, n], collapsed [s, b, h])``, post
    and comb in float32, collapsed in the streams' dtype."""

    def __init__(self, config, settings):
        super().__init__()
        n, h = settings.hc_mult, config.hidden_size
        self.hc_mult, self.sinkhorn_iters, self.eps = n, settings.hc_sinkhorn_iters, settings.hc_eps
        self.norm_eps = config.layernorm_epsilon
        # transformers' initialisation (normal fn of initializer_range, zero base, unit scale); a checkpoint's
        # values replace it
        self.fn = torch.nn.Parameter(torch.empty((2 + n) * n, n * h, dtype=torch.float32))
        self.base = torch.nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.ones(3, dtype=torch.float32))
        torch.nn.init.normal_(self.fn, std=getattr(config, "init_method_std", 0.02))
        _replicated(self, config)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.hc_mult
        mixes = F.linear(_weightless_rms(streams.flatten(-2).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_scale, post_scale, comb_scale = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_scale + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_scale + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_scale + comb_b.view(n, n), dim=-1) + self.eps
        comb = sinkhorn(comb, self.sinkhorn_iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
        return post, comb, collapsed


def mix_streams(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The new streams from a sublayer's ``output`` [s, b, h]: ``post`` spreads it over the streams, ``comb``
    (transposed: stream k takes sum_j comb[j, k] * stream j) mixes the old ones; in the streams' dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                              streams)


def hyper_connected(hc: HyperConnection, norm: Sublayer, sublayer: Sublayer, streams: torch.Tensor) -> torch.Tensor:
    """One sublayer's residual step on the streams [s, b, n, h]: collapsed by ``hc``'s pre mix, normalised by
    ``norm``, through ``sublayer`` ([s, b, h] -> [s, b, h]), and mixed back (``mix_streams``)."""
    post, comb, collapsed = hc(streams)
    return mix_streams(streams, sublayer(norm(collapsed)), post, comb)


class RMSNorm(ReplicatedOverTP, torch.nn.Module):
    """transformers' ``DeepseekV4RMSNorm``: normalised in float32, times a float32 weight, cast back once."""

    def __init__(self, config, hidden_size: int | None = None, eps: float | None = None, **kwargs):
        super().__init__()
        self.eps = config.layernorm_epsilon if eps is None else eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size or config.hidden_size, dtype=torch.float32))
        _replicated(self, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * y).to(x.dtype)


class HyperConnectedLayer(torch.nn.Module):
    """A V4 decoder layer's residual logic around two sublayers given at call time: ``input_layernorm`` and
    ``attn_hc`` before the attention, ``pre_mlp_layernorm`` and ``ffn_hc`` before the MLP (transformers'
    ``input_layernorm``, ``attn_hc``, ``post_attention_layernorm``, ``ffn_hc``).
    ``forward(streams [s, b, n, h], attention, mlp) -> streams``; the sublayers take and give [s, b, h] (bind
    their other inputs, the mask, the rotary embedding, the token ids of hash routing, before the call)."""

    def __init__(self, config, settings):
        super().__init__()
        self.input_layernorm = RMSNorm(config)
        self.attn_hc = HyperConnection(config, settings)
        self.pre_mlp_layernorm = RMSNorm(config)
        self.ffn_hc = HyperConnection(config, settings)

    def forward(self, streams: torch.Tensor, attention: Sublayer, mlp: Sublayer) -> torch.Tensor:
        streams = hyper_connected(self.attn_hc, self.input_layernorm, attention, streams)
        return hyper_connected(self.ffn_hc, self.pre_mlp_layernorm, mlp, streams)


def expand_streams(hidden: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """The embedding's output [s, b, h] as ``hc_mult`` equal streams [s, b, n, h] (contiguous)."""
    return hidden.unsqueeze(-2).expand(*hidden.shape[:-1], hc_mult, hidden.shape[-1]).contiguous()


class HyperHead(ReplicatedOverTP, torch.nn.Module):
    """The streams collapsed after the last layer (``hc_head``; the model's final norm follows): ``fn`` [n, n * h],
    ``base`` [n], ``scale`` [1]. ``forward(streams [s, b, n, h]) -> [s, b, h]`` in the streams' dtype."""

    def __init__(self, config, settings):
        super().__init__()
        n, h = settings.hc_mult, config.hidden_size
        self.eps, self.norm_eps = settings.hc_eps, config.layernorm_epsilon
        self.fn = torch.nn.Parameter(torch.empty(n, n * h, dtype=torch.float32))
        self.base = torch.nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.scale = torch.nn.Parameter(torch.ones(1, dtype=torch.float32))
        torch.nn.init.normal_(self.fn, std=getattr(config, "init_method_std", 0.02))
        _replicated(self, config)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(_weightless_rms(streams.flatten(-2).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


# Pipeline parallelism. megatron-core's schedules (0.16 and 0.19 alike) receive every stage's input into a tensor of
# (seq_length / CP [/ TP under sequence parallelism], micro_batch_size, config.hidden_size), and read
# micro_batch_size for nothing else; config.hidden_size is the model's own. So the streams cross stages folded into
# the batch: [s, b * n, h] is a view of the contiguous [s, b, n, h], and the schedule is given b * n.

def pipeline_schedule_sizes(seq_length: int, micro_batch_size: int, hc_mult: int) -> dict:
    """The ``seq_length`` and ``micro_batch_size`` to give megatron-core's forward-backward function, so that the
    tensor it sends and receives between stages holds the streams ([s, b * hc_mult, h])."""
    return {"seq_length": seq_length, "micro_batch_size": micro_batch_size * hc_mult}


def streams_to_stage_output(streams: torch.Tensor) -> torch.Tensor:
    """The streams [s, b, n, h] as the tensor a stage sends on, [s, b * n, h] (a view)."""
    s, b, n, h = streams.shape
    return streams.view(s, b * n, h)


def stage_input_to_streams(tensor: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """A stage's received input [s, b * n, h] as the streams [s, b, n, h] (a view)."""
    s, bn, h = tensor.shape
    return tensor.view(s, bn // hc_mult, hc_mult, h)

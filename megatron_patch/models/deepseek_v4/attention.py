"""DeepSeek-V4's attention as a megatron-core module: what transformers' ``DeepseekV4Attention`` computes, for each
of its three layer types, over a whole sequence or, in a generation, continuing a cache (``GenerationState``).

Every layer type is shared-KV multi-query attention over a sliding window of ``sliding_window`` tokens:
- queries through a low-rank path (``q_lora_rank``, RMSNorm on the latent, an unweighted RMSNorm per head), one
  key/value head that is both key and value (RMSNorm'd), RoPE on the trailing ``rope_head_dim`` of each head in
  interleaved pairs; the attention output's RoPE slice rotated back by its query's position (``-sin``), so that
  what each key contributes depends on the distance only;
- a learned sink logit per head in the softmax (its probability dropped, as gpt-oss);
- the grouped low-rank output projection: the heads in ``o_groups`` groups, each projected to ``o_lora_rank``
  on its own (``linear_o_group_proj``), then mixed to the hidden size (``linear_proj``).
Heavily compressed attention (HCA) adds a compressor: every ``compress_rate`` tokens pooled into one key/value
entry by a softmax gate (with a learned bias per slot of the window), RMSNorm'd, rotated at its window's first
position; a query sees the entries of windows that closed at or before it. Compressed sparse attention (CSA)
pools overlapping windows (two series per token: each entry mixes the previous window's first series with its
own window's second), and a lightning indexer (its own overlapping compressor at ``index_head_dim``, queries from
the query latent) keeps the ``index_topk`` best entries per query. CSA and HCA layers rotate everything with the
"compress" RoPE (``compress_rope_theta``, the config's YaRN scaling with an attention factor of 1), sliding
layers with the "main" one (``rope_theta``, no scaling): both from ``models/blocks/rope.py``'s formulas.

Tensor parallelism: what is per head is split with the heads (``linear_q_up_proj``'s rows, ``sinks``,
``linear_o_group_proj``'s groups, ``linear_proj``'s columns; ``o_groups`` and the heads divide by TP). What every
head reads is whole on every rank: the query latent (``linear_q_down_proj``, ``q_layernorm``, it feeds the
indexer too), the single key/value head, the compressors and the indexer. The indexer stays whole because its
top-k is a per-query choice all heads share: summing its heads across ranks before the top-k would cost an
all-reduce of [b, s, entries] scores per layer and make the choice depend on the reduction order. The shared
keys/values go through ``copy_to_tensor_model_parallel_region`` before the heads read them, so the whole
parameters get the gradient of every head on every rank.

Generation: under megatron-core's static inference context each layer keeps what a later token reads, so a new
token costs one token's forward: the last ``sliding_window - 1`` keys/values, the compressed entries (and the
indexer's keys) of every window that closed, and the hidden inputs of the tokens an entry still to close pools
(its window's, and for CSA's overlapping windows the window before it). A window closes when its last token
arrives, and its entry is computed then from those inputs, as the whole sequence's forward computes it.

The indexer runs without a gradient: its output is the top-k indices, so nothing reaches its weights (as in
transformers, which has no indexer loss). They are frozen (``requires_grad=False``), as DeepSeek-V3.2's indexer is
without its loss (models/blocks/sparse_attention.py), so that megatron's DDP expects no gradient for them.
"""

from __future__ import annotations

import copy
import dataclasses
import types

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region)
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

from megatron_patch.models.blocks import rope as rope_formulas
from megatron_patch.models.blocks.sparse_attention import IndexerLinear

from megatron_patch.models.deepseek_v4.mapping import weights_of
from megatron_patch.models.deepseek_v4.settings import CSA, HCA, LAYER_TYPES, SLIDING  # noqa: F401 (re-exported)

# transformers' DeepseekV4Config defaults: what a config.json that leaves a field out gets there.
HF_DEFAULTS = {
    "hidden_size": 4096, "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024, "o_groups": 8,
    "o_lora_rank": 1024, "sliding_window": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "num_hidden_layers": 43,
}
DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
# DeepSeek's own config.json names each layer by its compress ratio (``compress_ratios``)
RATIO_TO_LAYER_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


def _items(d: dict) -> tuple:
    return tuple(sorted(d.items()))


@dataclasses.dataclass(frozen=True)
class V4AttentionSettings:
    """What DeepSeek-V4's attention reads from config.json. ``main_rope`` / ``compress_rope``: the two RoPE
    parameter sets as (key, value) pairs (``rope_type``, ``rope_theta`` and YaRN's keys)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rms_norm_eps: float
    main_rope: tuple
    compress_rope: tuple
    compress_rates: tuple  # ((layer type, rate), ...)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    layer_types: tuple[str, ...]

    @classmethod
    def from_hf(cls, raw: dict) -> "V4AttentionSettings":
        """From a config.json dict, by transformers' field names, with the legacy names transformers folds in
        (``compress_ratios``, ``compress_rate_csa`` / ``_hca``, ``qk_rope_head_dim``, a flat ``rope_scaling``)."""
        def get(key):
            return raw[key] if raw.get(key) is not None else HF_DEFAULTS[key]

        head_dim = get("head_dim")
        partial = raw.get("partial_rotary_factor")
        if partial is None:
            partial = raw["qk_rope_head_dim"] / head_dim if raw.get("qk_rope_head_dim") else DEFAULT_PARTIAL_ROTARY_FACTOR
        rates = dict(raw.get("compress_rates") or DEFAULT_COMPRESS_RATES)
        for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if raw.get(key) is not None:
                rates[layer_type] = raw[key]
        n = get("num_hidden_layers")
        layer_types = raw.get("layer_types")
        if layer_types is None and raw.get("compress_ratios") is not None:
            layer_types = [RATIO_TO_LAYER_TYPE[r] for r in raw["compress_ratios"]]
        if layer_types is None:  # transformers' default: two HCA layers, then CSA and HCA in turn
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        layer_types = tuple(layer_types[:n])
        unknown = sorted(set(layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} are no DeepSeek-V4 attention type; known: {', '.join(LAYER_TYPES)}")
        main, compress = _rope_parameters(raw, get("rope_theta"), get("compress_rope_theta"))
        for name, params in (("main", main), ("compress", compress)):
            own = params.pop("partial_rotary_factor", partial)
            if own != partial:
                raise ValueError(f"rope_parameters.{name}.partial_rotary_factor {own} differs from the model's "
                                 f"{partial}: one RoPE width per head is supported")
        return cls(hidden_size=get("hidden_size"), num_heads=get("num_attention_heads"), head_dim=head_dim,
                   rope_head_dim=int(head_dim * partial), q_lora_rank=get("q_lora_rank"), o_groups=get("o_groups"),
                   o_lora_rank=get("o_lora_rank"), sliding_window=get("sliding_window"),
                   rms_norm_eps=get("rms_norm_eps"), main_rope=_items(main), compress_rope=_items(compress),
                   compress_rates=_items(rates), index_n_heads=get("index_n_heads"),
                   index_head_dim=get("index_head_dim"), index_topk=get("index_topk"), layer_types=layer_types)

    def compress_rate(self, layer_type: str) -> int:
        return dict(self.compress_rates)[layer_type]

    def rope(self, layer_type: str) -> dict:
        """The RoPE parameters a layer type's attention rotates with: "main" for sliding layers, "compress" for
        CSA and HCA (their compressors and indexer too)."""
        return dict(self.main_rope if layer_type == SLIDING else self.compress_rope)


def _rope_parameters(raw: dict, rope_theta: float, compress_rope_theta: float) -> tuple[dict, dict]:
    """transformers' (``DeepseekV4Config.__post_init__``) "main" and "compress" RoPE parameters: nested as given,
    or from a flat dict (the hub's ``rope_scaling``) that only the compress RoPE takes, YaRN's attention factor
    defaulting to 1 there (DeepSeek's reference does not scale cos and sin)."""
    given = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(given.get("main"), dict) and isinstance(given.get("compress"), dict):
        main, compress = dict(given["main"]), dict(given["compress"])
    else:
        flat = {k: v for k, v in given.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": rope_theta}
        compress = {**flat, "rope_theta": compress_rope_theta}
        if compress.get("rope_type", compress.get("type", "default")) == "yarn":
            compress.setdefault("attention_factor", 1.0)
    for params in (main, compress):
        params["rope_type"] = params.get("rope_type", params.pop("type", "default"))
        params.pop("type", None)
        if params["rope_type"] not in ("default", "linear", "yarn", "llama3"):
            raise ValueError(f"RoPE type {params['rope_type']!r} is not supported for DeepSeek-V4")
    return main, compress


def rope_inv_freq(params: dict, rope_head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rope_head_dim / 2] and the factor cos and sin are scaled by, with the project's RoPE
    formulas (models/blocks/rope.py, transformers' per type), over the rotated part of a head."""
    scaling = None if params["rope_type"] == "default" else params
    rotated = types.SimpleNamespace(head_dim=rope_head_dim, rotary_percent=1.0, rope_theta=params["rope_theta"],
                                    rope_scaling=scaling, mla=None)
    return rope_formulas.inv_freq_and_attention_factor(rotated)


class InterleavedRope(torch.nn.Module):
    """cos and sin [positions, rope_head_dim / 2] of one RoPE parameter set (one angle per interleaved pair)."""

    def __init__(self, params: dict, rope_head_dim: int):
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(params, rope_head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """V4's RoPE on the trailing ``2 * cos.shape[-1]`` channels of ``x`` [..., seq, dim], in interleaved pairs
    (x0, x1), (x2, x3), ..., in float32; ``cos`` / ``sin`` [seq, pairs] broadcast over the leading axes."""
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    width = cos.shape[-1]
    rest, rot = x[..., :-width], x[..., -width:]
    turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([rest, ((rot.float() * cos) + (turned.float() * sin)).to(x.dtype)], dim=-1)


class Float32RMSNorm(torch.nn.Module):
    """RMSNorm with a float32 weight, multiplied in float32 and cast once (transformers' DeepseekV4RMSNorm)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * y).to(x.dtype)


def _whole_on_every_rank(module: torch.nn.Module) -> torch.nn.Module:
    for p in module.parameters():  # identical gradients on every TP rank; 0.19 averages them, 0.16 leaves them
        p.average_gradients_across_tp_domain = True
    return module


class Compressor(torch.nn.Module):
    """Pools every ``rate`` tokens into one entry [b, windows, dim] (only whole windows; the remainder waits for
    more tokens): a softmax over the window's slots of gate + ``position_bias``, per channel, weighting the
    projected tokens, then RMSNorm and RoPE at the window's first position. ``overlap`` (CSA and its indexer):
    each token projects two series, and entry w pools window w-1's first series with window w's second."""

    def __init__(self, config, hidden_size: int, dim: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.linear_kv = IndexerLinear(hidden_size, width, config=config, init_method=config.init_method)
        self.linear_gate = IndexerLinear(hidden_size, width, config=config, init_method=config.init_method)
        self.position_bias = torch.nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.kv_layernorm = Float32RMSNorm(dim, eps)
        _whole_on_every_rank(self)

    def forward(self, x: torch.Tensor, rope: InterleavedRope, start: int = 0) -> torch.Tensor:
        """``x`` [b, s, hidden], tokens ``start`` .. (a multiple of ``rate``) -> the entries of the whole windows
        it holds [b, s // rate, dim]; with ``overlap`` its first window pools no window before it."""
        batch, seq, _ = x.shape
        windows, rate, dim = seq // self.rate, self.rate, self.dim
        if windows == 0:
            return x.new_zeros((batch, 0, dim))
        usable = windows * rate
        kv = self.linear_kv(x[:, :usable])[0].view(batch, windows, rate, -1)
        gate = self.linear_gate(x[:, :usable])[0].view(batch, windows, rate, -1) + self.position_bias
        if self.overlap:  # [b, windows, 2 * rate, dim]: window w-1's first series, then window w's second
            pooled_kv = kv.new_zeros((batch, windows, 2 * rate, dim))
            pooled_gate = gate.new_full((batch, windows, 2 * rate, dim), float("-inf"))
            pooled_kv[:, :, rate:] = kv[..., dim:]
            pooled_gate[:, :, rate:] = gate[..., dim:]
            pooled_kv[:, 1:, :rate] = kv[:, :-1, :, :dim]
            pooled_gate[:, 1:, :rate] = gate[:, :-1, :, :dim]
            kv, gate = pooled_kv, pooled_gate
        compressed = self.kv_layernorm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        cos, sin = rope(torch.arange(windows, device=x.device) * rate + start, compressed.dtype)
        return apply_rope(compressed, cos, sin)


def visible_entries(positions: torch.Tensor, entries: int, rate: int) -> torch.Tensor:
    """[s, entries] bool: entry w (tokens w*rate .. (w+1)*rate-1) is visible to the query at ``positions`` once its
    window has closed."""
    return torch.arange(entries, device=positions.device)[None, :] < ((positions + 1) // rate)[:, None]


class Indexer(torch.nn.Module):
    """CSA's lightning indexer: its own overlapping compressor at ``index_head_dim``, queries from the query latent
    (``linear_q_up_proj``, RoPE'd at the query's position), scored ``sum_h w_h(x) * relu(q_h . k) / sqrt(dim)``
    with ``w = linear_weights_proj(x) / sqrt(heads)``; the ``topk`` best visible entries per query, -1 where a
    query sees fewer."""

    def __init__(self, config, settings: V4AttentionSettings, rate: int):
        super().__init__()
        self.heads, self.dim, self.topk, self.rate = settings.index_n_heads, settings.index_head_dim, settings.index_topk, rate
        self.compressor = Compressor(config, settings.hidden_size, self.dim, rate, True, settings.rms_norm_eps)
        self.linear_q_up_proj = IndexerLinear(settings.q_lora_rank, self.heads * self.dim, config=config,
                                              init_method=config.init_method)
        self.linear_weights_proj = IndexerLinear(settings.hidden_size, self.heads, config=config,
                                                 init_method=config.init_method)
        _whole_on_every_rank(self)
        self.requires_grad_(False)  # module doc: top-k indices carry no gradient
        self.last_topk: torch.Tensor | None = None  # what the alignment report compares with transformers' choice

    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, rope: InterleavedRope,
                keys: torch.Tensor | None = None):
        """``x`` [b, s, hidden], ``q_latent`` [b, s, q_lora_rank] at ``positions`` -> [b, s, k] entry indices
        (-1: none), among ``keys`` [b, n, dim] (a generation's, every entry so far) or the entries of ``x``."""
        batch, seq, _ = x.shape
        if keys is None:
            keys = self.compressor(x, rope)
        cos, sin = rope(positions, x.dtype)
        q = self.linear_q_up_proj(q_latent)[0].view(batch, seq, self.heads, self.dim).transpose(1, 2)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [b, s, heads, dim]
        scores = F.relu(torch.matmul(q.float(), keys.transpose(-1, -2).float().unsqueeze(1))) * self.dim ** -0.5
        weights = self.linear_weights_proj(x)[0].float() * self.heads ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=2)  # [b, s, n]
        entries = keys.shape[1]
        if entries == 0:
            top = scores.topk(0, dim=-1).indices
        else:
            visible = visible_entries(positions, entries, self.rate)
            top = scores.masked_fill(~visible, float("-inf")).topk(min(self.topk, entries), dim=-1).indices
            top = torch.where(top >= ((positions + 1) // self.rate)[:, None], torch.full_like(top, -1), top)
        self.last_topk = top
        return top


@dataclasses.dataclass
class GenerationState:
    """What one layer's attention keeps between the forwards of a generation (module doc), for its rows of the
    batch: ``window_kv`` [b, <= sliding_window - 1, d] the last tokens' keys/values;
    ``entries`` [b, n, d] and ``index_keys`` [b, n, index dim] of the n windows that closed; ``pending``
    [b, m, hidden] the inputs from token ``pending_start`` on, which the entries still to close pool."""

    window_kv: torch.Tensor | None = None
    entries: torch.Tensor | None = None
    index_keys: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    pending_start: int = 0

    def close_windows(self, x: torch.Tensor, first: int, compressor: Compressor, indexer: "Indexer | None",
                      rope: InterleavedRope) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every entry (and indexer key) once ``x`` [b, s, hidden], tokens ``first`` .., joins the tokens seen:
        the kept ones, then those of the windows that ``x`` closes, pooled from the pending inputs as the whole
        sequence pools them."""
        rate, closed = compressor.rate, first // compressor.rate
        inputs = x if self.pending is None else torch.cat([self.pending, x], dim=1)
        skip = closed - self.pending_start // rate  # CSA: the window before the first to close, pooled again
        entries = compressor(inputs, rope, self.pending_start)[:, skip:]
        self.entries = entries if self.entries is None else torch.cat([self.entries, entries], dim=1)
        if indexer is not None:
            keys = indexer.compressor(inputs, rope, self.pending_start)[:, skip:]
            self.index_keys = keys if self.index_keys is None else torch.cat([self.index_keys, keys], dim=1)
        closed = (first + x.shape[1]) // rate
        start = max(closed - 1, 0) * rate if compressor.overlap else closed * rate
        self.pending, self.pending_start = inputs[:, start - self.pending_start:], start
        return self.entries, self.index_keys

    def keep_window(self, kv: torch.Tensor, sliding_window: int) -> None:
        """Keep those of the keys/values [b, L, d] (the last L tokens) that a later query can still see."""
        self.window_kv = kv[:, max(kv.shape[1] - (sliding_window - 1), 0):]


class DeepseekV4Attention(MegatronModule):
    """One decoder layer's attention (module doc). ``forward(hidden_states [s, b, h], inference_context=None)`` ->
    (output [s, b, h], None), positions 0 .. s-1, or in a generation those after the context's
    ``sequence_len_offset``."""

    def __init__(self, config, settings: V4AttentionSettings, layer_type: str, layer_number: int = 1):
        super().__init__(config=config)
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"unknown DeepSeek-V4 attention type {layer_type!r}; known: {', '.join(LAYER_TYPES)}")
        tp = config.tensor_model_parallel_size
        if settings.num_heads % tp or settings.o_groups % tp or settings.num_heads % settings.o_groups:
            raise ValueError(f"{settings.num_heads} heads in {settings.o_groups} output groups do not split over "
                             f"TP={tp}: both must divide by it, the heads by the groups")
        self.settings, self.layer_type, self.layer_number = settings, layer_type, layer_number
        s = settings
        # With sequence parallelism the attention gathers the whole sequence once (forward) and its output
        # projection reduce-scatters it back; everything in between runs as without it (whole sequence, heads
        # split), so the modules inside are built with a config that has it off. ``linear_proj`` keeps the model's.
        own_config, config = config, copy.copy(config)
        config.sequence_parallel = False
        self.local_heads, self.local_groups = s.num_heads // tp, s.o_groups // tp
        self.softmax_scale = s.head_dim ** -0.5
        self.rope = InterleavedRope(s.rope(layer_type), s.rope_head_dim)

        self.linear_q_down_proj = IndexerLinear(s.hidden_size, s.q_lora_rank, config=config, init_method=config.init_method)
        self.q_layernorm = Float32RMSNorm(s.q_lora_rank, s.rms_norm_eps)
        self.linear_q_up_proj = ColumnParallelLinear(s.q_lora_rank, s.num_heads * s.head_dim, config=config,
                                                     init_method=config.init_method, bias=False, gather_output=False)
        self.linear_kv_proj = IndexerLinear(s.hidden_size, s.head_dim, config=config, init_method=config.init_method)
        self.kv_layernorm = Float32RMSNorm(s.head_dim, s.rms_norm_eps)
        for module in (self.linear_q_down_proj, self.q_layernorm, self.linear_kv_proj, self.kv_layernorm):
            _whole_on_every_rank(module)
        # Per group [o_lora_rank, heads * head_dim / o_groups], groups stacked on the rows: rows split like a
        # column-parallel weight, each rank the groups of its heads. Only its weight is used (a grouped product).
        self.linear_o_group_proj = ColumnParallelLinear(s.num_heads * s.head_dim // s.o_groups,
                                                        s.o_groups * s.o_lora_rank, config=config,
                                                        init_method=config.init_method, bias=False, gather_output=False)
        self.linear_proj = RowParallelLinear(s.o_groups * s.o_lora_rank, s.hidden_size, config=own_config,
                                             init_method=config.output_layer_init_method, bias=False,
                                             input_is_parallel=True, skip_bias_add=True)
        self.sinks = torch.nn.Parameter(torch.zeros(self.local_heads, dtype=torch.float32))
        self.sinks.tensor_model_parallel, self.sinks.partition_dim, self.sinks.partition_stride = True, 0, 1

        self.compressor = self.indexer = None
        if layer_type != SLIDING:
            rate = s.compress_rate(layer_type)
            self.compressor = Compressor(config, s.hidden_size, s.head_dim, rate, layer_type == CSA, s.rms_norm_eps)
            if layer_type == CSA:
                self.indexer = Indexer(config, s, rate)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """megatron-core's, with the sinks split by heads (a bare parameter would be saved as whole on every rank),
        and the query latent's norm under the transformer-engine name the weight table uses (mapping.py's
        CHECKPOINT_NAMES), as megatron-core's layer renames multi-latent attention's (its sharded_state_dict_keys_map)."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key = f"{prefix}sinks"
        state[key] = make_tp_sharded_tensor_for_checkpoint(self.sinks, key, 0, prepend_offsets=sharded_offsets)
        norm = state[f"{prefix}q_layernorm.weight"]
        norm.key = norm.key.replace("q_layernorm.weight", "linear_q_up_proj.layer_norm_weight")
        return state

    def _generation_state(self, context) -> "GenerationState":
        """This layer's ``GenerationState`` for the rows from ``batch_size_offset`` of a generation in
        megatron-core's static inference context, kept under the layer's number in ``key_value_memory_dict`` (as
        an attention layer keeps its KV cache there); a prompt (``sequence_len_offset`` 0) starts a new one."""
        if not context.is_static_batching():
            raise NotImplementedError("DeepSeek-V4's attention keeps its generation state in megatron-core's static "
                                      "inference context only")
        key = (self.layer_number, "deepseek_v4 attention", context.batch_size_offset)
        if context.sequence_len_offset == 0:
            context.key_value_memory_dict[key] = GenerationState()
        return context.key_value_memory_dict[key]

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, inference_context=None, **kwargs):
        if kwargs.get("packed_seq_params") is not None:
            # launches refuse it first (training/validation.py); never attend across packed documents unsaid
            raise NotImplementedError("DeepSeek-V4's attention runs whole unpacked sequences")
        s = self.settings
        if self.config.sequence_parallel:
            # [s / tp, b, h] -> [s, b, h]. The gradient each rank computes for the whole sequence is already whole
            # (the heads' shares are summed where they meet: the query latent, the key/value), so the backward
            # keeps this rank's part instead of reduce-scattering.
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        x = hidden_states.transpose(0, 1)  # [b, s, h]: the layout of the attention arithmetic
        batch, seq, _ = x.shape
        state = None if inference_context is None else self._generation_state(inference_context)
        first = 0 if state is None else inference_context.sequence_len_offset
        positions = torch.arange(first, first + seq, device=x.device)
        cos, sin = self.rope(positions, x.dtype)

        q_latent = self.q_layernorm(self.linear_q_down_proj(x)[0])
        q = self.linear_q_up_proj(q_latent)[0].view(batch, seq, self.local_heads, s.head_dim).transpose(1, 2)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + s.rms_norm_eps).to(q.dtype)
        q = apply_rope(q, cos, sin)  # [b, heads, s, d]
        kv = apply_rope(self.kv_layernorm(self.linear_kv_proj(x)[0]), cos, sin)  # [b, s, d]

        if state is not None and state.window_kv is not None:
            kv = torch.cat([state.window_kv, kv], dim=1)
        if state is not None:
            state.keep_window(kv, s.sliding_window)
        keys_at = torch.arange(first + seq - kv.shape[1], first + seq, device=x.device)
        near = (keys_at[None, :] <= positions[:, None]) & (keys_at[None, :] > positions[:, None] - s.sliding_window)
        mask = torch.zeros(near.shape, dtype=q.dtype, device=x.device).masked_fill(~near, float("-inf"))
        mask = mask.expand(batch, *near.shape)
        if self.compressor is not None:
            if state is None:
                entries = self.compressor(x, self.rope)  # [b, n, d]
                index_keys = None
            else:
                entries, index_keys = state.close_windows(x, first, self.compressor, self.indexer, self.rope)
            n = entries.shape[1]
            if self.indexer is not None:
                top = self.indexer(x, q_latent, positions, self.rope, index_keys)  # [b, s, k]
                keep = torch.full((batch, seq, n + 1), float("-inf"), dtype=q.dtype, device=x.device)
                keep.scatter_(-1, torch.where(top >= 0, top, n), 0.0)
                entry_mask = keep[..., :n]
            else:
                visible = visible_entries(positions, n, self.compressor.rate)
                entry_mask = torch.zeros(seq, n, dtype=q.dtype, device=x.device).masked_fill(~visible, float("-inf"))
                entry_mask = entry_mask.expand(batch, seq, n)
            kv = torch.cat([kv, entries], dim=1)
            mask = torch.cat([mask, entry_mask], dim=-1)
        kv = copy_to_tensor_model_parallel_region(kv)  # every head's gradient reaches the whole KV (module doc)

        scores = torch.matmul(q, kv.transpose(1, 2).unsqueeze(1)) * self.softmax_scale + mask.unsqueeze(1)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(batch, -1, seq, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(kv.dtype)
        out = torch.matmul(probs, kv.unsqueeze(1))  # [b, heads, s, d]
        out = apply_rope(out, cos, -sin)  # keys are values: undo the key rotation at the query's position

        grouped = out.transpose(1, 2).reshape(batch * seq, self.local_groups, -1).transpose(0, 1)
        weight = self.linear_o_group_proj.weight
        weight = weight.view(self.local_groups, -1, weight.shape[-1]).transpose(1, 2)
        grouped = torch.bmm(grouped, weight).transpose(0, 1).reshape(batch, seq, -1)
        # sequence first: with sequence parallelism linear_proj reduce-scatters along the first dimension
        output, _ = self.linear_proj(grouped.transpose(0, 1))
        return output.contiguous(), None


def shard_from_transformers(hf: dict, layer_type: str, tp_rank: int = 0, tp_size: int = 1) -> dict:
    """This module's state dict at ``tp_rank`` of ``tp_size`` from a transformers ``DeepseekV4Attention``'s."""
    return {mine: split.shards([hf[theirs]], tp_size, None)[tp_rank] for mine, theirs, _, split in weights_of(layer_type)}

"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) on megatron-core's multi-latent attention, on CPU
and GPU alike, in fp32 and bf16.

megatron-core has DSA (``experimental_attention_variant="dsa"``) but its modules cannot run the released
models here: its indexer asserts bf16 and the ``fast_hadamard_transform`` CUDA extension, its linears are
transformer-engine's only, 0.16 puts the indexer's RoPE part after the rest of each head where DeepSeek and
transformers put it first, 0.16 has no RoPE on halves (DeepSeek-V3.2's indexer) and 0.19 no fixed k-norm
epsilon of 1e-6 (transformers' value). So:

- ``SparseAttentionIndexer`` is megatron-core's ``DSAIndexer`` (its parameters, names and checkpoint layout:
  ``linear_wq_b``, ``linear_wk``, ``k_norm`` with a bias, ``linear_weights_proj``, all whole on every TP
  rank) with the scoring of transformers' indexer: RoPE on the first ``qk_pos_emb_head_dim`` of each
  head, in interleaved pairs (GLM-5) or halves (DeepSeek-V3.2); ReLU of the scaled q.k per head, weighted
  by ``weights_proj`` over ``sqrt(heads)`` and summed, in float32; the top-k of the causal scores.
- The Hadamard rotation of q and k before scoring: megatron-core's ``rotate_activation`` where the extension
  is installed and the tensors are bf16 on a GPU; skipped elsewhere. The rotation is orthogonal
  (Hq.Hk = q.k) and only matters before an FP8 quantization of the scores, which no path here has, so
  skipping it is exact (transformers' indexer skips it too).
- ``SparseMLACoreAttention`` replaces MLA's core attention: the indexer's top-k per query, attention over
  those keys only and, while training with it, megatron-core's indexer loss (the KL divergence between the
  indexer's distribution and the attention's, summed over heads) attached to the output with its
  ``DSAIndexerLossAutoScaler``, scaled by ``dsa_indexer_loss_coeff``.
- Two paths. With a gradient (training): a dense score matrix masked to the kept keys, softmax in float32, as
  transformers' eager attention computes it (O(s^2) memory, like megatron's unfused attention); the indexer's
  scores whole when its loss needs them. Without one (inference, alignment, the frozen indexer of a training
  step): the indexer and the attention a chunk of queries at a time (``chunked_sparse_attention``): O(chunk * s)
  memory for both, the same arithmetic row by row; the work stays O(s^2) (see there why on a CPU).
- Generation with megatron-core's static inference context (``SparseMLASelfAttention`` lends it to the core
  attention): MLA caches its keys and values there and hands the core attention all of them; the indexer keeps its
  own keys (after its norm and RoPE) beside them (``indexer_key_cache``), so a new token is scored against every
  earlier one under the causal mask shifted to its position, and costs one token's forward.

The indexer reads the layer's input and the query latent detached, as megatron-core's does: the language
model loss never trains it, the indexer loss trains nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import torch.nn.functional as F
from megatron.core.pipeline_parallel import schedules
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant import dsa as mcore_dsa
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_patch.models.blocks.local_attention import RopeKeyGradsSummed

# transformers' DeepseekV32Indexer / GlmMoeDsaIndexer: nn.LayerNorm(head_dim, eps=1e-6), whatever rms_norm_eps is
INDEXER_K_NORM_EPS = 1e-6
# Queries scored (and, without a gradient, attended) at a time: what bounds the no-gradient paths' memory.
QUERY_CHUNK = 1024


def hadamard_extension_available() -> bool:
    return mcore_dsa.hadamard_transform is not None


def maybe_rotate(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's Hadamard rotation where its extension can run (bf16 on a GPU), else ``x`` unchanged:
    exact either way, as nothing is quantized between the rotation and the dot product."""
    if x.is_cuda and x.dtype == torch.bfloat16 and hadamard_extension_available():
        return mcore_dsa.rotate_activation(x)
    return x


def rope_path(x: torch.Tensor | None = None) -> str:
    """Which indexer path runs for ``x`` (for logs and docs)."""
    if x is not None and x.is_cuda and x.dtype == torch.bfloat16 and hadamard_extension_available():
        return "hadamard (fast_hadamard_transform)"
    return "no rotation (exact: orthogonal, no FP8 scoring)"


def describe(shape, cuda: bool) -> str:
    """One line for logs and dry runs: what a sparse-attention model's attention runs."""
    rotation = "Hadamard rotation in bf16 (fast_hadamard_transform)" if cuda and hadamard_extension_available() \
        else "no Hadamard rotation (exact without FP8 scoring)"
    return (f"DeepSeek sparse attention: top-{shape.topk} keys per query from a {shape.n_heads}-head indexer, "
            f"{rotation}; dense scores masked to them, fp32 softmax")


class IndexerLinear(torch.nn.Module):
    """A linear layer whole on every tensor-parallel rank (megatron-core's "duplicated" TE linear), for the
    local layer spec, which has none: ``weight`` only, returning (output, None) as megatron's linears do."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False, parallel_mode=None,
                 **kwargs):
        super().__init__()
        if bias:
            raise ValueError("the indexer's projections have no bias")
        # as megatron's linears keep it: whether its input is cut along the sequence (LoRA's adapters follow it)
        self.sequence_parallel = config.sequence_parallel
        self.config = config  # as megatron's linears keep it: PR=fp8's conversion reads the model's shape from it
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        if config.perform_initialization:
            init_method(self.weight)

    def forward(self, x: torch.Tensor):
        return self._forward_impl(x, self.weight), None

    @staticmethod
    def _forward_impl(input: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
        """The GEMM, megatron's linears' seam by name: PR=fp8 replaces it with a float8 one (blocks/float8.py)."""
        return F.linear(input, weight, bias)


class IndexerKeyNorm(torch.nn.LayerNorm):
    """The indexer's key LayerNorm (weight and bias), with transformers' epsilon."""

    def __init__(self, config, hidden_size: int, eps: float = INDEXER_K_NORM_EPS, **kwargs):
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        super().__init__(hidden_size, eps=INDEXER_K_NORM_EPS, dtype=config.params_dtype, device=device)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE on the last dimension as transformers applies it: on halves, or (``interleaved``) on pairs
    (x0, x1), (x2, x3), ... written out as halves (the order only matters through q.k, the same for both)."""
    if interleaved:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class SparseAttentionIndexer(mcore_dsa.DSAIndexer):
    """megatron-core's DSA indexer, scored as transformers scores it (module doc)."""

    def __init__(self, config, submodules, pg_collection=None, rope_interleaved: bool = False):
        super().__init__(config, submodules, pg_collection=pg_collection)
        self.rope_interleaved = rope_interleaved
        for p in self.parameters():  # whole on every TP rank: identical gradients, averaged (0.19) or not
            p.average_gradients_across_tp_domain = True

    def _cos_sin(self, first: int, seq_len: int, dtype: torch.dtype):
        out = self.rotary_pos_emb(first + seq_len, packed_seq=False)
        emb, mscale = out if isinstance(out, tuple) else (out, 1.0)
        emb = emb[first:].view(seq_len, 1, 1, -1)  # [s, 1, 1, rope dim]: the angles, twice
        return (emb.cos() * mscale).to(dtype), (emb.sin() * mscale).to(dtype)

    def project(self, x: torch.Tensor, qr: torch.Tensor, first: int = 0):
        """(q [b, s * heads, d], k [b, d, s], weights [b, s, heads]) in float32, RoPE applied (and rotated where
        the extension runs). ``x`` [s, b, hidden], ``qr`` [s, b, q_lora_rank] (sequence-parallel shards are
        gathered) of the tokens at positions ``first``.. ."""
        if self.config.sequence_parallel and self.pg_collection.tp.size() > 1:
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
            qr = gather_from_sequence_parallel_region(qr, group=self.pg_collection.tp)
        seq, batch, _ = x.shape
        heads, dim, rope_dim = self.index_n_heads, self.index_head_dim, self.qk_pos_emb_head_dim
        q, _ = self.linear_wq_b(qr)
        q = q.view(seq, batch, heads, dim)
        k, _ = self.linear_wk(x)
        k = self.k_norm(k).view(seq, batch, 1, dim)
        cos, sin = self._cos_sin(first, seq, q.dtype)
        q = torch.cat([_rope(q[..., :rope_dim], cos, sin, self.rope_interleaved), q[..., rope_dim:]], dim=-1)
        k = torch.cat([_rope(k[..., :rope_dim], cos, sin, self.rope_interleaved), k[..., rope_dim:]], dim=-1)
        q, k = maybe_rotate(q), maybe_rotate(k)
        # One batched product per sequence ([s * heads, d] x [d, t]): broadcasting k over the queries instead (as
        # transformers does) would have autograd keep a [b * s, d, t] copy of it.
        q_b = q.permute(1, 0, 2, 3).float().reshape(batch, seq * heads, dim)
        k_b = k.squeeze(2).permute(1, 2, 0).float()
        weights, _ = self.linear_weights_proj(x)
        return q_b, k_b, weights.float().permute(1, 0, 2) * heads ** -0.5

    def score(self, q_b: torch.Tensor, k_b: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor | None):
        """Index scores [b, c, t] of ``c`` queries (``project``'s q rows of them, their weights): ReLU of each
        head's scaled q.k, the heads weighted and summed, ``mask`` [c, t] added."""
        batch, rows = weights.shape[0], weights.shape[1]
        scores = F.relu(torch.bmm(q_b, k_b).view(batch, rows, self.index_n_heads, -1) * self.softmax_scale)
        index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
        return index_scores if mask is None else index_scores + mask

    def _queries_and_keys(self, x: torch.Tensor, qr: torch.Tensor, cache: IndexerKeyCache | None):
        """``project``'s queries, keys and weights of these tokens, the keys extended to every earlier token's
        where a generation's ``cache`` keeps them."""
        if cache is None:
            return self.project(x, qr)
        q_b, k_b, weights = self.project(x, qr, first=cache.first)
        return q_b, cache.extend(k_b), weights

    def forward_with_scores(self, x: torch.Tensor, qr: torch.Tensor, mask: torch.Tensor | None = None,
                            packed_seq_params=None, cache: IndexerKeyCache | None = None):
        """Index scores [b, sq, sk] (float32, ``mask`` added) and the top-k keys of each query [b, sq, k]."""
        if packed_seq_params is not None:
            raise NotImplementedError("DeepSeek sparse attention here runs unpacked sequences only")
        index_scores = self.score(*self._queries_and_keys(x, qr, cache), mask)
        topk = index_scores.topk(min(self.index_topk, index_scores.shape[-1]), dim=-1).indices
        return index_scores, topk

    @torch.no_grad()
    def select(self, x: torch.Tensor, qr: torch.Tensor, chunk: int = QUERY_CHUNK,
               cache: IndexerKeyCache | None = None):
        """The top-k keys of each query [b, sq, k] under the causal mask, without a gradient, ``chunk`` queries at a
        time: the per-head scores held are [b, chunk, heads, s], not [b, s, heads, s]. A sequence of at most
        ``chunk`` tokens is scored as ``forward_with_scores`` scores it. With a generation's ``cache`` the queries
        are the tokens after the cached ones, scored against all of them."""
        q_b, k_b, weights = self._queries_and_keys(x, qr, cache)
        seq, heads, skv = weights.shape[1], self.index_n_heads, k_b.shape[-1]
        first = skv - seq
        k = min(self.index_topk, skv)
        pieces = []
        for s0 in range(0, seq, chunk):
            s1 = min(seq, s0 + chunk)
            mask = causal_mask(s1 - s0, skv, q_b.device, first=first + s0)
            pieces.append(self.score(q_b[:, s0 * heads:s1 * heads], k_b, weights[:, s0:s1], mask)
                          .topk(k, dim=-1).indices)
        return torch.cat(pieces, dim=1)


@dataclasses.dataclass
class IndexerKeyCache:
    """A generation's indexer keys, for the rows of this forward: ``keys`` [max sequence, batch, d] float32, a view
    of the buffer the layer keeps in megatron-core's static inference context (``indexer_key_cache``), filled up to
    ``first``, the position of this forward's first token."""

    keys: torch.Tensor
    first: int

    def extend(self, k_b: torch.Tensor) -> torch.Tensor:
        """Every key [b, d, first + s] once this forward's ``k_b`` [b, d, s] is written after the cached ones."""
        end = self.first + k_b.shape[-1]
        if end > self.keys.shape[0]:
            raise ValueError(f"a generation of {end} tokens is longer than its inference context's "
                             f"{self.keys.shape[0]}")
        self.keys[self.first:end] = k_b.permute(2, 0, 1)
        return self.keys[:end].permute(1, 2, 0)


def indexer_key_cache(context, layer_number: int, batch: int, head_dim: int, device) -> IndexerKeyCache:
    """The indexer keys of layer ``layer_number`` for a generation in megatron-core's static inference context,
    kept beside the layer's KV cache (which holds MLA's keys and values, not the indexer's): a buffer of the
    context's max sequence and batch, under its own key in ``key_value_memory_dict``, rows from
    ``batch_size_offset``, filled up to ``sequence_len_offset``, as megatron-core's attention keeps its KV cache."""
    if not context.is_static_batching():
        raise NotImplementedError("DeepSeek sparse attention keeps its indexer keys in megatron-core's static "
                                  "inference context only")
    name = (layer_number, "indexer keys")
    if name not in context.key_value_memory_dict:
        context.key_value_memory_dict[name] = torch.zeros(context.max_sequence_length, context.max_batch_size,
                                                          head_dim, dtype=torch.float32, device=device)
    rows = context.key_value_memory_dict[name][:, context.batch_size_offset:context.batch_size_offset + batch]
    return IndexerKeyCache(rows, context.sequence_len_offset)


def causal_mask(sq: int, skv: int, device, first: int = 0) -> torch.Tensor:
    """float32 [sq, skv] for queries ``first`` .. ``first + sq - 1``: 0 where a query may attend, -inf after it."""
    return torch.triu(torch.full((sq, skv), float("-inf"), dtype=torch.float32, device=device), diagonal=1 + first)


def sparse_attention(query, key, value, topk: torch.Tensor, softmax_scale: float, mask: torch.Tensor):
    """Attention of each query over its top-k keys: ``query`` [sq, b, heads, d] (sq: these queries), ``key`` and
    ``value`` [skv, b, heads, d], ``topk`` [b, sq, k], ``mask`` the float causal mask of these queries [sq, skv];
    returns [sq, b, heads * value dim]. Scores in the tensors' dtype, the softmax in float32, as transformers'
    eager attention."""
    sq, b, heads, _ = query.shape
    skv, dv = key.shape[0], value.shape[-1]
    keep = torch.full((b, sq, skv), float("-inf"), device=query.device).scatter_(-1, topk, 0.0) + mask
    q, k, v = query.permute(1, 2, 0, 3), key.permute(1, 2, 3, 0), value.permute(1, 2, 0, 3)
    scores = torch.matmul(q, k) * softmax_scale
    probs = torch.softmax(scores.float() + keep.unsqueeze(1), dim=-1).to(value.dtype)
    out = torch.matmul(probs, v)  # [b, heads, sq, dv]
    return out.permute(2, 0, 1, 3).reshape(sq, b, heads * dv)


@torch.no_grad()
def chunked_sparse_attention(query, key, value, topk: torch.Tensor, softmax_scale: float,
                             chunk: int | None = None) -> torch.Tensor:
    """``sparse_attention`` without a gradient, ``chunk`` queries at a time, the queries the last ``sq`` of the
    ``skv`` keys (all of them but in a generation's later forwards, which attend the cached keys too): each chunk's
    scores against every key masked to its top-k (the same arithmetic row by row), so the scores held are
    [b, heads, chunk, s], not [b, heads, s, s]. The work stays O(s^2): gathering each query's top-k keys instead (O(s * k) work) moves
    k * heads * (qk + v dims) values per query, which on a CPU costs more than the matrix products it saves;
    that is for sparse kernels on a GPU (FlashMLA's, megatron-core 0.19's tilelang ones)."""
    sq, b, heads, _ = query.shape
    skv = key.shape[0]
    first = skv - sq
    if chunk is None:  # about 64 MiB of float32 scores per chunk
        chunk = max(1, min(sq, 2**24 // max(1, b * heads * skv)))
    pieces = [sparse_attention(query[s0:s0 + chunk], key, value, topk[:, s0:s0 + chunk], softmax_scale,
                               causal_mask(min(chunk, sq - s0), skv, query.device, first=first + s0))
              for s0 in range(0, sq, chunk)]
    return torch.cat(pieces, dim=0)


@functools.lru_cache(maxsize=1)
def _loss_takes_mask() -> bool:
    """megatron-core 0.19's indexer loss takes the causal mask; 0.16's builds it itself."""
    return "mask" in inspect.signature(mcore_dsa.compute_dsa_indexer_loss).parameters


# The indexer losses (coefficient applied) this process computed since the training loop last took them.
INDEXER_LOSS = {"sum": 0.0, "count": 0}


def _schedule_scales_indexer_loss() -> bool:
    """Whether megatron-core's pipeline schedule sets the indexer loss's backward scale (0.19 does; 0.16 only the
    MoE auxiliary loss's)."""
    return hasattr(schedules, "_get_experimental_attention_variant_loss_scale_func")


class IndexerLossScaler(mcore_dsa.DSAIndexerLossAutoScaler):
    """megatron-core's indexer-loss autoscaler, scaled as the schedule scales the main loss on either version:
    with 0.16's schedule, which sets only the MoE auxiliary loss's scale (grad scale / micro-batches, exactly
    what the indexer loss needs, and these models are MoE), it takes that one."""

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (loss,) = ctx.saved_tensors
        owner = mcore_dsa.DSAIndexerLossAutoScaler if _schedule_scales_indexer_loss() else MoEAuxLossAutoScaler
        scale = owner.main_loss_backward_scale
        scale = 1.0 if scale is None else scale.to(loss.device)
        return grad_output, torch.ones_like(loss) * scale


class SparseMLACoreAttention(MegatronModule):
    """MLA's core attention with DeepSeek sparse attention (module doc); constructed as megatron-core
    constructs a core attention, with its indexer from ``submodules``."""

    # megatron-core 0.19's MLA passes the layer input and the query latent to a core attention that asks
    requires_dsa_inputs = True

    def __init__(self, config, submodules, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 cp_comm_type=None, pg_collection: ProcessGroupCollection | None = None, **kwargs):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.last_topk: torch.Tensor | None = None
        # a generation's megatron-core inference context, lent for each forward by ``SparseMLASelfAttention``
        self.inference_context = None
        # DeepSeek's dense warm-up (MP_DSA_INDEXER_ONLY): attend to every earlier key, train the indexer alone
        self.dense_warmup = False
        self.indexer = build_module(submodules.indexer, config=config, pg_collection=pg_collection)
        if not self.loss_coeff:
            # Nothing trains the indexer without its loss (its inputs are detached, top-k has no gradient):
            # frozen, it stays as released instead of drifting under weight decay, and DDP expects no grads.
            self.indexer.requires_grad_(False)
        self.softmax_scale = softmax_scale if softmax_scale is not None else \
            (k_channels if k_channels is not None else config.kv_channels) ** -0.5

    @property
    def loss_coeff(self) -> float:
        return getattr(self.config, "dsa_indexer_loss_coeff", None) or 0.0

    def forward(self, query, key, value, attention_mask, x=None, qr=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        if x is None or qr is None:
            raise RuntimeError("sparse attention needs the layer input and the query latent (experimental_attention_"
                               "variant='dsa' and a q_lora_rank)")
        if packed_seq_params is not None:
            raise NotImplementedError("DeepSeek sparse attention here runs unpacked sequences only")
        context = self.inference_context
        # after a generation's prompt megatron-core asks for no mask, its keys being the cache's: still causal here
        continued = context is not None and attn_mask_type == AttnMaskType.no_mask
        if attn_mask_type not in (None, AttnMaskType.causal) and not continued:
            raise NotImplementedError(f"DeepSeek sparse attention here is causal only, not {attn_mask_type}")
        # In a generation MLA hands the cached keys and values too: the queries are the last sq positions.
        sq, skv = query.shape[0], key.shape[0]
        cache = None if context is None else indexer_key_cache(context, self.layer_number, query.shape[1],
                                                               self.indexer.index_head_dim, query.device)
        coeff = self.loss_coeff
        with_loss = self.training and torch.is_grad_enabled() and coeff > 0
        dense = torch.is_grad_enabled() and query.requires_grad  # training: the whole score matrix anyway
        mask = causal_mask(sq, skv, query.device, first=skv - sq) if with_loss or dense or self.dense_warmup else None
        if with_loss:  # the loss needs every index score, with its gradient
            index_scores, topk = self.indexer.forward_with_scores(x.detach(), qr.detach(), mask=mask, cache=cache)
        else:
            topk = self.indexer.select(x.detach(), qr.detach(), cache=cache)
        if self.dense_warmup:
            every = torch.arange(skv, device=query.device).expand(query.shape[1], sq, skv)
            output = sparse_attention(query, key, value, every, self.softmax_scale, mask)
        elif dense:
            output = sparse_attention(query, key, value, topk, self.softmax_scale, mask)
        else:
            output = chunked_sparse_attention(query, key, value, topk, self.softmax_scale)
        self.last_topk = topk.detach()  # what the alignment report compares with transformers' selection
        if with_loss:
            extra = {"mask": mask} if _loss_takes_mask() else {}
            loss = mcore_dsa.compute_dsa_indexer_loss(
                index_scores, topk, query.detach(), key.detach(), self.softmax_scale, coeff,
                bool(getattr(self.config, "dsa_indexer_use_sparse_loss", False)), self.indexer.pg_collection, **extra)
            INDEXER_LOSS["sum"] = INDEXER_LOSS["sum"] + loss.detach()  # no host sync per layer
            INDEXER_LOSS["count"] += 1
            output = IndexerLossScaler.apply(output, loss)
        return output


class SparseMLASelfAttention(RopeKeyGradsSummed, MLASelfAttention):
    """megatron-core's MLA, lending a generation's inference context to its sparse core attention for the forward:
    MLA caches its own keys and values there but calls its core attention without the context, and the indexer
    keeps the keys of earlier tokens there too."""

    def forward(self, hidden_states, attention_mask, **kwargs):
        self.core_attention.inference_context = kwargs.get("inference_context")
        try:
            return super().forward(hidden_states, attention_mask, **kwargs)
        finally:
            self.core_attention.inference_context = None


def core_attention_spec(rope_interleaved: bool) -> ModuleSpec:
    """The spec of MLA's ``core_attention`` for DeepSeek sparse attention, with the local indexer modules."""
    indexer = ModuleSpec(module=SparseAttentionIndexer, params={"rope_interleaved": rope_interleaved},
                         submodules=mcore_dsa.DSAIndexerSubmodules(linear_wq_b=IndexerLinear, linear_wk=IndexerLinear,
                                                                   k_norm=IndexerKeyNorm,
                                                                   linear_weights_proj=IndexerLinear))
    return ModuleSpec(module=SparseMLACoreAttention, submodules=mcore_dsa.DSAttentionSubmodules(indexer=indexer))

"""Core attention for megatron-core's local layer spec on ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` computes the full [b, heads, s, s] score matrix, an fp32
softmax of it and a second matmul: memory and time quadratic in the sequence, and the only attention a
GPU without transformer-engine had. SDPA runs torch's own kernels instead (flash, memory-efficient or
cuDNN on a GPU, a flash kernel on CPU), which keep O(s) memory and accumulate the softmax in fp32.

``SDPAttention`` is a ``DotProductAttention`` (same constructor, parameters, state dict and sharded state
dict, so checkpoints do not change) whose forward takes:

- causal self-attention (``is_causal``) and megatron's explicit boolean masks (True = masked);
- grouped-query attention: SDPA's ``enable_gqa`` where the kernel that runs takes it, keys and values
  expanded per head elsewhere;
- multi-latent attention (DeepSeek): ``k_channels``/``v_channels`` as MLA builds it; values narrower
  than queries are zero-padded to the query head size so the flash kernels run, and the padding is cut
  off the output (exact: the padded columns only ever multiply zeros);
- packed sequences in THD (``PackedSeqParams``): each document attends to itself, through torch's
  variable-length flash kernel on a GPU in 16-bit where torch has it, else one causal SDPA call per
  document.

Sliding windows and attention sinks (``window_size``, ``softmax_type`` other than "vanilla") are not
computed here yet: a layer that has them runs megatron's own arithmetic (the parent's forward), which
has both. ``fallback_reason`` is the one place that decides; the gpt-oss family (issue 23) plugs
SDPA's versions in there (a boolean window mask or varlen's ``window_size``; sinks as an extra
zero key with the sink logit as its bias).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_patch.models.blocks.local_attention import LocalMLACoreAttention

CAUSAL = {AttnMaskType.causal, AttnMaskType.padding_causal}
HALF = (torch.float16, torch.bfloat16)
# SDPA's enable_gqa keyword: torch >= 2.5 (the package allows 2.4, where heads are expanded instead).
SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def fallback_reason(config, layer_number: int) -> str | None:
    """Why layer ``layer_number`` (1-based) runs megatron's unfused arithmetic instead of SDPA, or None.

    The hook for sliding windows and sinks: a layer with either is computed by the parent class, which
    implements both, until SDPA versions of them land here."""
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return f"sliding window {config.window_size}"
    softmax = getattr(config, "softmax_type", "vanilla")
    if softmax != "vanilla":
        return f"softmax_type={softmax} (attention sinks)"
    return None


@functools.lru_cache(maxsize=1)
def _varlen():
    """(varlen_attn, its causal keyword arguments, whether it takes enable_gqa), or None where this torch has
    no variable-length attention. Its keywords changed across releases: causal is ``window_size=(-1, 0)``
    in newer ones and ``is_causal=True`` in the first."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params


class SDPAttention(LocalMLACoreAttention):
    """megatron-core's core attention, computed by torch SDPA (see the module's docstring). Built from
    ``LocalMLACoreAttention``, megatron's ``DotProductAttention`` that also takes MLA's key/value head sizes:
    the arithmetic below follows the tensors' own sizes."""

    # packing.use_packed_local_attention leaves it alone: THD is handled here
    handles_packed_sequences = True

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
        self.fallback = fallback_reason(config, self.layer_number)
        # megatron's softmax multiplies the scores by the layer number again under query-key layer scaling
        self.sdpa_scale = self.softmax_scale * (self.layer_number if config.apply_query_key_layer_scaling else 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("the SDPA core attention takes no attention bias (megatron's local attention has none)")
        causal = (attn_mask_type or self.attn_mask_type) in CAUSAL
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params, causal)
        if self.fallback:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type)
        sq, b, sk = query.shape[0], query.shape[1], key.shape[0]
        mask = None
        if attention_mask is not None:
            # megatron: True = masked out, and a given mask replaces the causal one; SDPA: True = attend
            mask, causal = ~attention_mask, False
        elif causal and sq == 1:
            causal = False  # one query (megatron builds no mask for it either)
        elif causal and sq != sk:
            raise ValueError(f"causal attention of {sq} queries over {sk} keys: megatron's local attention "
                             "takes self-attention only")
        # [s, b, heads, dim] -> [b, heads, s, dim] -> [b, heads, sq, dv] -> [sq, b, heads * dv]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        return self._attend(q, k, v, mask, causal).permute(2, 0, 1, 3).reshape(sq, b, -1)

    # --- the arithmetic ---------------------------------------------------------------------------------------

    def _attend(self, q, k, v, mask, causal: bool) -> torch.Tensor:
        """SDPA over [b, heads, s, dim] tensors (keys and values may have fewer heads, values another width)."""
        dv = v.shape[-1]
        if dv < q.shape[-1]:
            v = F.pad(v, (0, q.shape[-1] - dv))  # MLA: the flash kernels want one head size
        extra = {}
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            if self._gqa_in_kernel(q):
                extra["enable_gqa"] = True
            else:
                k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        p = self.attention_dropout.p if self.training else 0.0
        with self._dropout_rng(p):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                                 scale=self.sdpa_scale, **extra)
        return out[..., :dv] if out.shape[-1] != dv else out

    @staticmethod
    def _gqa_in_kernel(q) -> bool:
        """Whether the kernel that will run takes grouped keys/values: torch's CPU flash kernel does in any
        dtype; on a GPU the flash kernel (16-bit) does, the memory-efficient one (fp32) does not."""
        return SDPA_HAS_GQA and (q.device.type == "cpu" or q.dtype in HALF)

    def _dropout_rng(self, p: float):
        """Attention dropout draws from megatron's model-parallel RNG stream, as the parent's does."""
        if p == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    # --- packed sequences (THD) -------------------------------------------------------------------------------

    def _packed(self, query, key, value, params, causal: bool) -> torch.Tensor:
        """[t, heads, dim] rows of documents one after another -> [t, heads * dv], each document attending
        only to itself."""
        bounds = _document_bounds(params)
        out = None
        if self.fallback is None:
            out = self._varlen(query, key, value, params, causal)
        if out is None:
            pieces = []
            for start, end in zip(bounds[:-1], bounds[1:]):
                q, k, v = (t[start:end] for t in (query, key, value))
                if self.fallback:
                    pieces.append(super().forward(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None)
                                  .reshape(end - start, q.shape[1], -1))
                else:
                    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                    pieces.append(self._attend(q, k, v, None, causal)[0].transpose(0, 1))
            out = torch.cat(pieces)
        return out.reshape(out.shape[0], -1)

    def _varlen(self, query, key, value, params, causal: bool) -> torch.Tensor | None:
        """torch's variable-length flash attention over all documents at once (GPU, 16-bit, one head size,
        causal, no dropout), or None where it does not apply."""
        found = _varlen()
        eligible = (found is not None and query.is_cuda and query.dtype in HALF and causal
                    and query.shape[-1] == key.shape[-1] == value.shape[-1]
                    and not (self.training and self.attention_dropout.p > 0))
        if not eligible:
            return None
        varlen_attn, causal_kwargs, takes_gqa = found
        extra = dict(causal_kwargs)
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            if takes_gqa:
                extra["enable_gqa"] = True
            else:
                key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
        cu = params.cu_seqlens_q.to(device=query.device, dtype=torch.int32)
        longest = int(params.max_seqlen_q)
        return varlen_attn(query, key, value, cu, cu, longest, longest, scale=self.sdpa_scale, **extra)


def _document_bounds(params) -> list[int]:
    """The documents' boundaries of a self-attention THD batch, as Python ints."""
    cu_q, cu_kv = params.cu_seqlens_q, params.cu_seqlens_kv
    if cu_kv is not None and cu_kv is not cu_q and not torch.equal(cu_kv.cpu(), cu_q.cpu()):
        raise ValueError("packed sequences with different query and key boundaries: the SDPA core attention "
                         "takes self-attention only")
    padded = getattr(params, "cu_seqlens_q_padded", None)
    if padded is not None and not torch.equal(padded.cpu(), cu_q.cpu()):
        raise ValueError("packed sequences with padded boundaries (cu_seqlens_q_padded) are not supported by the "
                         "SDPA core attention")
    return [int(x) for x in cu_q.tolist()]

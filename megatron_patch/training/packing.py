"""Packed SFT sequences in megatron-core's THD format: one row of tokens, documents cut by ``cu_seqlens``.

A packed sample marks where each document starts (``doc_start``); the tail padding starts a segment
of its own. A micro-batch of such samples becomes one row ``[1, b*L]`` with cumulative boundaries,
handed to the model as ``PackedSeqParams(qkv_format="thd")``. Then

- attention stays inside each document: transformer-engine's attention and the SDPA core attention
  take the boundaries (TE ignores an explicit mask when the mask type is causal), and for megatron-core's
  unfused local attention ``accept_packed_sequences`` runs it once per document;
- RoPE positions restart at each document (megatron-core ignores ``position_ids`` for RoPE, and in
  THD rotates each segment from position 0).

So a packed run computes exactly what the same records padded one per sample compute.
"""

from __future__ import annotations

import torch

# megatron-core is imported inside the functions that use it, so that in a rank it loads after
# init_process_group has enabled runtime/cpu_compat (on CPU, megatron-core's CUDA-only spots are patched).


def thd_batch(batch: dict) -> tuple[dict, dict]:
    """A micro-batch of packed samples as one THD row, and the ``PackedSeqParams`` fields for it.

    Computed on the host (the boundaries are needed there anyway, as Python ints for max_seqlen).
    """
    starts = batch["doc_start"].reshape(-1).clone()
    length = batch["doc_start"].shape[-1]
    starts[::length] = True  # a sample boundary is always a document boundary
    bounds = torch.nonzero(starts).flatten().tolist() + [starts.numel()]
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    flat = {k: v.reshape(1, -1) for k, v in batch.items() if k != "doc_start"}
    return flat, {"cu_seqlens": cu_seqlens, "max_seqlen": longest}


def packed_seq_params(cu_seqlens: torch.Tensor, max_seqlen: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def accept_packed_sequences(attention: torch.nn.Module) -> torch.nn.Module:
    """megatron-core's local ``DotProductAttention`` made to accept THD packed sequences, in place.

    The local attention refuses ``packed_seq_params``; this runs it causally on each document's slice
    ``[s_i, 1, heads, dim]`` and concatenates the results, the same arithmetic as one document per sample.
    Unpacked calls go straight through. Its forward is replaced rather than the module wrapped: a wrapper renamed
    what the attention holds (gpt-oss's learnable ``softmax_offset`` became ``core_attention.inner.softmax_offset``,
    which no checkpoint has, so a converted checkpoint was refused and a run's own could not be exported).
    """
    unpacked = attention.forward

    def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return unpacked(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias)
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            q, k, v = (t[start:end].unsqueeze(1) for t in (query, key, value))
            pieces.append(unpacked(q, k, v, None, attn_mask_type=attn_mask_type))
        return torch.cat(pieces, dim=0)

    attention.forward = forward
    attention.handles_packed_sequences = True
    return attention


def use_packed_local_attention(model: torch.nn.Module) -> int:
    """Make every local core attention of ``model`` accept packed sequences (``accept_packed_sequences``); returns
    how many.

    transformer-engine's attention and the SDPA core attention (``models/blocks/sdpa_attention.py``) take THD
    themselves and are left alone.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    wrapped = 0
    for module in list(model.modules()):
        inner = getattr(module, "core_attention", None)
        if isinstance(inner, DotProductAttention) and not getattr(inner, "handles_packed_sequences", False):
            accept_packed_sequences(inner)
            wrapped += 1
    return wrapped


def documents_apart(sample: dict, eod: int) -> dict:
    """A pretraining sample with its documents kept apart (MP_SFT_PACKING=true in pretraining, as Pai's
    ``--reset-position-ids``): a document starts at the sample's first token and after each end-of-document token,
    so the end-of-document token closes its own document. Positions restart there, as megatron-core's
    ``reset_position_ids`` restarts them, and ``doc_start`` makes the step train the sample as THD packed
    sequences. Labels and loss mask are untouched: the end-of-document token still predicts the next document's
    first token, as in Megatron-LM and Pai."""
    tokens = sample["tokens"]
    doc_start = torch.zeros_like(tokens, dtype=torch.bool)
    doc_start[0] = True
    doc_start[1:] = tokens[:-1] == eod
    starts = torch.nonzero(doc_start).flatten()
    segment = torch.cumsum(doc_start.long(), 0) - 1
    return {**sample, "doc_start": doc_start, "position_ids": torch.arange(tokens.numel()) - starts[segment]}


class DocumentsApart(torch.utils.data.Dataset):
    """``documents_apart`` over every sample of a pretraining dataset (a blend's too)."""

    def __init__(self, inner, eod: int):
        self.inner, self.eod = inner, eod

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict:
        return documents_apart(self.inner[index], self.eod)

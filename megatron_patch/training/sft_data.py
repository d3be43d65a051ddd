"""SFT data as fixed-length samples with the loss on the responses only: JSON/JSONL records, and the SFT idxmap
that Pai-Megatron-Patch's ``toolkits/sft_data_preprocessing`` writes.

Records, one a line (or a JSON array):

- ``{"messages": [{"role", "content"}, ...]}``: a conversation;
- a prompt and a response, each under the first of its keys a record has (``PROMPT_KEYS``, ``RESPONSE_KEYS``;
  Pai's ``{"query", "content"}`` included). ``input`` is appended to the prompt as Pai renders it
  (``instruction + input``, nothing between), and a ``system`` field becomes a system turn;
- a list of such records: Pai's packed-SFT JSON, the records it groups into one sample when packed
  (MP_SFT_PACKING=true); unpacked, each record is a sample of its own.

Where the tokenizer folder has a chat template, every record is a conversation (system, user, assistant)
rendered by it, exactly as ``apply_chat_template`` renders it, tokenized whole, and the loss covers the
tokens of each assistant span (``tokenizer.ChatTemplate.assistant_spans``: the assistant's content and its
end-of-turn markup, nothing of the prompt). Pai renders the same records with the same template, and also trains
the assistant header, which here belongs to the prompt, as in transformers' assistant mask (the generation prompt
a model is given at inference). Without a template (or with a tiktoken file) the plain format is used:
``prompt\\nresponse`` and
``<|role|>\\ncontent\\n`` turns, with the end-of-document token closing the sample, trained.

The idxmap holds one sample per sequence of ``2*N`` token ids: N input ids, the last of each record stored
as ``-1 - id`` (Pai's end-of-record mark), then N labels, already shifted, -100 where there is no loss.
``data_files.check_sft_idxmap`` checks every id before the first step.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy
import torch

from megatron_patch.errors import UserError
from megatron_patch.tokenizer import load_tokenizer
from megatron_patch.training.compressed_files import DECOMPRESSION_ERRORS, open_decompressed
from megatron_patch.training.data_files import PIECE, read_sft_idxmap, run_tokenizer
from megatron_patch.training.sft_records import read_records, record_groups
from megatron_patch.training.sft_tokens import describe_format, tokenize_record, untrainable

# Pai's labels where there is no loss (torch's cross-entropy ignore_index).
IGNORED_LABEL = -100
# What the dry run shows of a sample's text, at most.
PREVIEW_CHARS = 3000


def _fixed(tokens, labels, loss_mask, length: int, pad: int, doc_starts: list[int] | None = None) -> dict:
    """One sample of ``length`` positions: tokens, labels and loss mask (each of at most ``length``), padded
    with ``pad`` and no loss. Packed samples also mark where each record (and the padding) starts: the
    training step turns the starts into THD boundaries (training/packing.py), RoPE positions restart there."""
    n = len(tokens)
    out = {"tokens": torch.full((length,), pad, dtype=torch.long), "labels": torch.full((length,), pad, dtype=torch.long),
           "loss_mask": torch.zeros(length), "position_ids": torch.arange(length)}
    out["tokens"][:n] = torch.as_tensor(tokens, dtype=torch.long)
    out["labels"][:n] = torch.as_tensor(labels, dtype=torch.long)
    out["loss_mask"][:n] = torch.as_tensor(loss_mask, dtype=torch.float)
    if doc_starts is not None:
        starts = sorted({s for s in doc_starts if s < length} | ({n} if n < length else set()))
        doc_start = torch.zeros(length, dtype=torch.bool)
        doc_start[starts] = True
        out["doc_start"] = doc_start
        out["position_ids"] = torch.arange(length) - torch.tensor(starts)[torch.cumsum(doc_start.long(), 0) - 1]
    return out


def _sample(ids: list[int], trained: list[int], length: int, pad: int, doc_starts: list[int] | None = None) -> dict:
    """A tokenized record (or several, packed) as a sample: each token predicts the next, the loss on the trained."""
    ids, trained = ids[:length + 1], trained[:length + 1]
    return _fixed(ids[:-1], ids[1:], trained[1:], length, pad, doc_starts)


class SFTDataset(torch.utils.data.Dataset):
    """JSON/JSONL SFT records, tokenized once, padded (or packed) to ``length``; epochs repeat in order."""

    def __init__(self, path: str | Path, tokenizer, length: int, *, packing: bool = False, vocab_size: int | None = None):
        if vocab_size is not None and tokenizer.vocab_size > vocab_size:
            raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's {vocab_size}")
        self.length, self.pad = length, tokenizer.eod
        # (whether a packed-SFT list, its records tokenized) for each line
        groups = [(packed, [tokenize_record(tokenizer, record, where) for record, where in group])
                  for packed, group in record_groups(path)]
        if packing:
            self.samples = self._pack(groups)
        else:
            self.samples = [_sample(ids, tr, length, self.pad) for _, group in groups for ids, tr in group]
        # A record whose trained tokens all lie past the cut to `length` trains nothing (its loss and gradient are
        # 0, while weight decay still moves the weights): all of them is refused (by the launcher already:
        # sft_tokens.refuse_untrainable), some are counted for the log.
        self.untrained = sum(1 for sample in self.samples if not sample["loss_mask"].any())
        if self.untrained == len(self.samples):
            raise untrainable(path, length)
        # records whose answers go on past the sample (the first token predicts the second: length + 1 ids fit)
        self.cut = sum(1 for _, group in groups for _, trained in group if any(trained[length + 1:]))

    def _pack(self, groups) -> list[dict]:
        """Single records packed in order while they fit; a packed-SFT list is a sample of its own (more when its
        records overflow one, cut between records as Pai's preprocessing cuts them)."""
        out, ids, tr, starts = [], [], [], []

        def flush():
            if ids:
                out.append(_sample(ids, tr, self.length, self.pad, starts))
            return [], [], []

        for listed, group in groups:
            if listed:
                ids, tr, starts = flush()
            for sid, st in group:
                sid, st = sid[:self.length + 1], st[:self.length + 1]
                if ids and len(ids) + len(sid) > self.length + 1:
                    ids, tr, starts = flush()
                starts.append(len(ids))
                ids, tr = ids + sid, tr + st
            if listed:
                ids, tr, starts = flush()
        flush()
        return out

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict:
        return self.samples[idx % len(self.samples)]


class IdxmapSFTDataset(torch.utils.data.Dataset):
    """Pai's SFT idxmap (module docstring), read as Pai's training reads it: the input ids with their end marks
    restored, the stored labels, the loss where a label is not -100; padded to ``length``.

    Packed (MP_SFT_PACKING=true), a sample is a stored sequence with its records kept apart (THD boundaries
    after each end mark, as Pai's ``--reset-position-ids``). Unpacked, each record is a sample of its own: Pai
    would train a sequence of several records as one, each attending to the records before it.
    """

    def __init__(self, prefix: str, length: int, *, packing: bool = False):
        self.rows = read_sft_idxmap(prefix)  # [sequences, 2*N], mapped
        self.half = self.rows.shape[1] // 2
        if self.half > length:
            raise UserError(f"{prefix} holds samples of {self.half} tokens, longer than SEQ_LEN={length}")
        self.length, self.packing = length, packing
        self.records = None if packing else self._records()

    def _records(self) -> numpy.ndarray:
        """(sequence, first token, end) of every record, in order: a record ends after its end mark (a sequence
        without one is one record)."""
        out, step = [], max(1, PIECE // self.rows.shape[1])
        for first in range(0, len(self.rows), step):
            marked = numpy.asarray(self.rows[first:first + step, :self.half]) < 0
            row, col = numpy.nonzero(marked)  # by sequence, then position
            ends = col + 1
            starts = numpy.where(numpy.r_[False, row[1:] == row[:-1]], numpy.r_[0, ends[:-1]], 0)
            unmarked = numpy.flatnonzero(~marked.any(axis=1))
            found = numpy.concatenate([numpy.stack([row, starts, ends], 1),
                                       numpy.stack([unmarked, 0 * unmarked, 0 * unmarked + self.half], 1)])
            found = found[numpy.lexsort((found[:, 1], found[:, 0]))]
            out.append(found + [first, 0, 0])
        return numpy.concatenate(out).astype(numpy.int64)

    def __len__(self) -> int:
        return len(self.rows) if self.packing else len(self.records)

    def __getitem__(self, idx: int) -> dict:
        if self.packing:
            tokens, labels, trained, ends = _idxmap_piece(self.rows, idx % len(self.rows), 0, self.half)
            return _fixed(tokens, labels, trained, self.length, 0, [0] + (numpy.flatnonzero(ends) + 1).tolist())
        tokens, labels, trained, _ = _idxmap_piece(self.rows, *(int(v) for v in self.records[idx % len(self.records)]))
        return _fixed(tokens, labels, trained, self.length, 0)


def _idxmap_piece(rows, row: int, start: int, end: int):
    """(input ids, labels, loss mask, end marks) of positions [start, end) of an idxmap's stored sequence."""
    half = rows.shape[1] // 2
    data = numpy.asarray(rows[row], dtype=numpy.int64)
    tokens, labels = data[start:end], data[half + start:half + end]
    ends, trained = tokens < 0, labels != IGNORED_LABEL
    return numpy.where(ends, -1 - tokens, tokens), numpy.where(trained, labels, 0), trained, ends


def build_sft_datasets(cfg, vocab_size: int):
    """(train, valid or None, a line saying how the data is read) for SFT: JSON records (MP_DATASET_TYPE=raw) or
    Pai's SFT idxmap (mmap)."""
    paths = [cfg.dataset_path[0], *(cfg.valid_dataset_path or [])[:1]]
    if cfg.dataset_type == "mmap":
        datasets = [IdxmapSFTDataset(p, cfg.sample_length, packing=cfg.sft_packing) for p in paths]
        how = (f"Pai's SFT idxmap {paths[0]}: {len(datasets[0].rows)} samples of {datasets[0].half} tokens"
               + (", each record a sample of its own (MP_SFT_PACKING=false)" if not cfg.sft_packing else ""))
    else:
        tok = load_tokenizer(cfg.tokenizer)
        datasets = [SFTDataset(p, tok, cfg.sample_length, packing=cfg.sft_packing, vocab_size=vocab_size) for p in paths]
        how = describe_format(tok)
        if datasets[0].untrained:
            how += (f"; {datasets[0].untrained} of its {len(datasets[0])} samples keep no trained token within "
                    f"{cfg.sample_length} tokens (the responses lie past the cut) and train nothing")
        if datasets[0].cut:
            how += (f"; {datasets[0].cut} records are cut at {cfg.sample_length} tokens with trained tokens past it, "
                    "which are not trained")
    return datasets[0], (datasets[1] if len(datasets) > 1 else None), how


# --- the dry run's sample -----------------------------------------------------------------------------------

FIRST_LINE_CHARS = 1 << 24  # the dry run's first record is read from a line of at most this many characters


def _first_record(path: Path):
    """The first record of a JSONL file, read without the rest (else of the whole file). A first line that is a
    list is a packed-SFT line or a one-line JSON array: either way its first item is the first record."""
    try:
        # a byte-order mark is taken, and a .gz/.zst file decompressed, as read_records does
        with open_decompressed(path) as raw, io.TextIOWrapper(raw, encoding="utf-8-sig") as f:
            # a bounded line: one longer is cut, fails to parse and goes to read_records, which bounds the whole
            first = f.readline(FIRST_LINE_CHARS)
            while first and not first.strip():
                first = f.readline(FIRST_LINE_CHARS)
        item = json.loads(first)
    except (ValueError, RecursionError, *DECOMPRESSION_ERRORS):  # read_records names the problem
        item = read_records(path)[0]
    return item[0] if isinstance(item, list) and item else item


def marked_text(tokenizer, ids, trained) -> str:
    """The tokens as text, each run of trained tokens between ``[[`` and ``]]``."""
    out, run, on = [], [], None
    for tid, t in [*zip(ids, trained), (None, None)]:
        if t != on and run:
            text = tokenizer.decode(run) if tokenizer is not None else " ".join(map(str, run))
            out.append(f"[[{text}]]" if on else text)
            run = []
        on = t
        if tid is not None:
            run.append(tid)
    return "".join(out)


def preview(cfg) -> dict:
    """The first training sample as the model sees it: how it was read, its text with the trained tokens marked,
    and how many tokens carry the loss (the dry run prints it)."""
    path = cfg.dataset_path[0]
    if cfg.dataset_type == "raw":
        tok = load_tokenizer(cfg.tokenizer)
        where = f"{path} record 1"
        ids, trained = tokenize_record(tok, _first_record(Path(path)), where)
        source, how = where, describe_format(tok)
    else:
        tok = run_tokenizer(cfg)
        rows = read_sft_idxmap(path)
        marks = numpy.flatnonzero(numpy.asarray(rows[0, :rows.shape[1] // 2]) < 0)
        ids, _, loss_mask, _ = _idxmap_piece(rows, 0, 0, int(marks[0]) + 1 if len(marks) else rows.shape[1] // 2)
        ids, trained = ids.tolist(), [0] + loss_mask[:-1].astype(int).tolist()  # a token is trained where it is a label
        source = f"{path} record 1"
        how = ("Pai's SFT idxmap: ids and labels as its sft_data_preprocessing wrote them (the chat template was "
               "applied there), the loss where a label is not -100" + ("" if tok else "; ids shown, set MP_TOKENIZER "
                                                                       "to see the text"))
    text = marked_text(tok, ids, trained)
    # what a sample keeps: its first sample_length tokens and the label of the last (_sample)
    kept = int(sum(trained[1:cfg.sample_length + 1]))
    return {"source": source, "format": how, "tokens": len(ids), "loss_tokens": int(sum(trained)), "kept_loss_tokens": kept,
            "sample_length": cfg.sample_length, "text": text[:PREVIEW_CHARS], "cut": len(text) > PREVIEW_CHARS}

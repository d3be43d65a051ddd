"""The pretraining data (``PREFIX.bin`` / ``PREFIX.idx``, megatron-core's mmap indexed format), checked before
the first step.

megatron-core trusts the pair: an ``.idx`` of another corpus, or a ``.bin`` cut short, trains on whatever the
pointers land on, or stops a rank with an assertion or an IndexError deep in a data loader. Here, once per
launch and before any rank starts, each prefix is checked for what megatron-core relies on:

- its manifest (``PREFIX.mpatch_manifest.json``, written last by ``mpatch preprocess``), where there is one:
  both files' sizes and digests. ``mpatch preprocess`` removes the old manifest before it replaces the pair,
  so a preprocess killed between its two renames leaves no manifest vouching for the mixed pair;
- the ``.idx`` against itself and the ``.bin``: megatron-core's header, a token dtype, exactly the size its
  counts give, sequence lengths that are not negative, pointers that tile the ``.bin`` in order, document
  boundaries that run from 0 to the last sequence, and a ``.bin`` exactly as long as the tokens they add up
  to (and not empty);
- every token id against the model's vocabulary, negative ones too (an id outside it would index past the
  embedding: an IndexError on a CPU, a device-side assert on a GPU).

With SFT=true an mmap prefix is Pai-Megatron-Patch's SFT idxmap (``check_sft_idxmap``): the same pair checks,
then samples of one length, input ids within the vocabulary once their end marks are restored, and labels that
are -100 or the next input id.

Each failure is one line. The cost is one read of the ``.idx`` and of the ``.bin`` (and of both again for the
manifest's digests), in pieces of at most ``PIECE`` elements, so memory stays bounded for any corpus.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy

from megatron_patch.checkpoint_files.manifest import DIGEST, MANIFEST_NAME, read_manifest, verify_manifest
from megatron_patch.errors import UserError
from megatron_patch.tokenizer import check_tokenizer_path, ids_end, load_tokenizer, vocabulary_digest
from megatron_patch.training.preprocess import TOKENIZER_RECORD
from megatron_patch.training.sft_records import record_groups
from megatron_patch.training.sft_tokens import refuse_untrainable

# megatron-core's indexed_dataset.py: header, version 1, token dtype code, sequence and document counts, then
# int32 sequence lengths, int64 byte offsets into the .bin, int64 document boundaries (and, for multimodal
# data, one int8 mode per sequence).
IDX_HEADER = b"MMIDIDX\x00\x00"
_COUNTS = struct.Struct("<QBQQ")
IDX_PREFIX = len(IDX_HEADER) + _COUNTS.size
# megatron-core's DType codes that hold token ids (6 and 7 are float64 and float32).
TOKEN_DTYPES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64, 8: numpy.uint16}
PIECE = 1 << 24


def manifest_path(prefix: str) -> Path:
    """Where ``mpatch preprocess`` writes the manifest of ``prefix``'s pair."""
    return Path(prefix).parent / f"{Path(prefix).name}.{MANIFEST_NAME}"


def recorded_digests(prefix: str) -> list[str] | None:
    """The digests of ``prefix``'s .bin and .idx that its manifest records (checked against the files before the
    first step), or None where no manifest lists both: what a pair rebuilt with the same sizes differs by."""
    manifest = manifest_path(prefix)
    if not manifest.is_file():
        return None
    files = read_manifest(manifest)["files"]
    entries = [files.get(Path(prefix + suffix).name) for suffix in (".bin", ".idx")]
    return None if None in entries else [entry[DIGEST] for entry in entries]


def check_mmap_data(prefix: str, vocab_size: int) -> int:
    """Check the pair at ``prefix`` (module docstring); returns its token count. One-line ``UserError``s."""
    dtype, lengths, pointers, documents = _checked_pair(prefix)
    total = _check_layout(prefix, dtype, lengths, pointers, documents)
    _check_token_ids(prefix, dtype, total, vocab_size, pointers, documents)
    return total


def split_counts(split: str, elements: int) -> list[int]:
    """How many of ``elements`` megatron-core's ``split`` ("99,1,0") gives training, validation and test: each
    share's bookends rounded, as its builder cuts a prefix's elements."""
    shares = [float(x) for x in split.split(",")]
    ends = [0.0]
    for share in shares:
        ends.append(ends[-1] + share / sum(shares))
    cuts = [int(round(e * float(elements))) for e in ends]
    return [b - a for a, b in zip(cuts[:-1], cuts[1:])]


def check_split(prefix: str, split: str) -> None:
    """MP_SPLIT leaves each prefix sequences to train on and to validate on: megatron-core looped forever building
    an empty validation set (a few dozen documents at 99,1,0). Its GPTDataset splits by sequence
    (``numel_low_level_dataset``), not by document: ``mpatch preprocess`` writes one sequence a document, and
    Megatron-LM's and Pai's sentence-split data several."""
    _, lengths, _, boundaries = _read_idx(prefix)
    sequences, documents = len(lengths), len(boundaries) - 1
    counted = f"{sequences} documents" if sequences == documents else f"{sequences} sequences ({documents} documents)"
    train, valid, _ = split_counts(split, sequences)
    for count, what in ((train, "training"), (valid, "validation")):
        if count == 0:
            raise UserError(f"MP_SPLIT={split} leaves none of the {counted} of {prefix} for {what} (each share is "
                            f"counted in whole sequences, as megatron-core splits GPT data): give {what} a larger "
                            "share, or validate on VALID_DATASET_PATH without MP_SPLIT")


def one_epoch(prefix: str, seq_len: int, split: str | None = None, share: int = 0) -> tuple[int, int]:
    """(tokens, samples) of one epoch of ``prefix``, or of its MP_SPLIT ``share`` (0 training, 1 validation), as
    megatron-core's GPTDataset counts them: each sample reads SEQ_LEN + 1 tokens, its last one the next's first."""
    _, lengths, _, _ = _read_idx(prefix)
    if split:
        counts = split_counts(split, len(lengths))
        first = sum(counts[:share])
        lengths = lengths[first:first + counts[share]]
    tokens = int(lengths.sum(dtype=numpy.int64))
    return tokens, max(0, (tokens - 1) // seq_len)


def inferred_weights(cfg, num_train_samples: int) -> list[int] | None:
    """DATASET_PATH's prefixes weighted by the samples of one epoch of each, where they are listed without weights
    and the run reads more samples than that epoch holds. megatron-core builds one epoch of such a list (and
    Megatron-LM stops when it runs out), which the run read again and again in the same order; weighted, each prefix
    is built for its share of the run's samples, over as many epochs as that takes (its documents shuffled across
    them, as one prefix alone), in the proportions of that epoch."""
    if cfg.dataset_weights is not None or len(cfg.dataset_path) < 2:
        return None
    samples = [one_epoch(prefix, cfg.seq_len, cfg.split)[1] for prefix in cfg.dataset_path]
    return samples if num_train_samples > sum(samples) else None


# megatron-core's GPTDataset: a last epoch holding under this share of an epoch's samples is shuffled apart
LAST_EPOCH_APART = 0.80
# megatron-core's GPTDatasetConfig.mid_level_dataset_surplus: a weighted blend builds each prefix this much more
MID_LEVEL_SURPLUS = 0.005


def sample_order(cfg, train_samples: int, weights: list | None) -> list[tuple[str, int, bool]]:
    """What megatron-core's order of the training samples rests on, for a run of ``train_samples`` over DATASET_PATH
    blended by ``weights`` (the given or inferred ones; None: one epoch of each): each prefix's epochs and whether
    the last one is shuffled apart, as its GPTDataset decides them from the samples its builder asks of it (a
    weighted blend's share plus its surplus). Two lengths with the same list read the same order, the shorter's
    samples first: each index is built from these alone, and a blend's is built sample by sample (greedily)."""
    paths = cfg.dataset_path
    if weights is None:  # one prefix, or a list within one epoch: each built over one epoch
        sizes = [train_samples] if len(paths) == 1 else [None] * len(paths)
    elif len(paths) == 1 and not cfg.split:  # blend_per_split builds one prefix as it is, weighted or not
        sizes = [train_samples]
    else:  # megatron-core's normalize and _get_size_per_split_per_dataset, in the same floating-point steps
        shares = (numpy.array(weights, dtype=numpy.float64) / numpy.sum(numpy.array(weights, dtype=numpy.float64)))
        sizes = [int(math.ceil(math.ceil(train_samples * w) * (1 + MID_LEVEL_SURPLUS))) for w in shares.tolist()]
    order = []
    for prefix, size in zip(paths, sizes):
        tokens, per_epoch = one_epoch(prefix, cfg.seq_len, cfg.split)
        epochs = 1 if size is None or tokens <= 0 else max(1, -(-(size * cfg.seq_len + 1) // tokens))
        apart = epochs > 1 and size - ((epochs - 1) * tokens - 1) // cfg.seq_len < int(LAST_EPOCH_APART * per_epoch)
        order.append((prefix, epochs, apart))
    return order


def check_unweighted_blend(name: str, paths: list[str], seq_len: int, split: str | None) -> None:
    """A list of prefixes without weights is blended by one epoch of each, weighted by its samples (megatron-core's
    builder; Megatron-LM infers the weights from the lengths): a prefix too short for one sample would weigh 0,
    and megatron-core's BlendedDataset stopped on it, an internal error (the data audit). The same prefix alone,
    or weighted, is repeated over epochs."""
    if len(paths) < 2:
        return
    for prefix in paths:
        for share in (0, 1) if split else (0,):
            tokens, samples = one_epoch(prefix, seq_len, split, share)
            if not samples:
                held = f"its MP_SPLIT={split} {('training', 'validation')[share]} share holds" if split else "holds"
                raise UserError(f"{name} lists {len(paths)} prefixes without weights, which are blended by the "
                                f"samples of one epoch of each (as Megatron-LM infers the weights from the lengths), "
                                f"and {prefix} {held} {tokens} tokens: not one sample of SEQ_LEN {seq_len} + 1. Give "
                                f"the blend weights ('W1 P1 W2 P2 ...': a small prefix is then repeated), or leave it "
                                "out")


def check_documents_end_with(prefix: str, eod: int, text: str) -> None:
    """Every document of ``prefix`` ends with the end-of-document token ``eod``, where pretraining keeps documents
    apart at it (MP_SFT_PACKING): data preprocessed without it (--no-append-eod) had none kept apart, silently."""
    dtype, lengths, pointers, documents = _read_idx(prefix)
    last = documents[1:][documents[1:] > documents[:-1]] - 1  # each document's last sequence (Pai writes empty ones)
    last = last[lengths[last] > 0]
    tokens = numpy.memmap(Path(prefix + ".bin"), dtype=dtype, mode="r")
    missing = int((tokens[pointers[last] // dtype.itemsize + lengths[last] - 1] != eod).sum())
    if missing:
        raise UserError(f"{missing} of the {len(last)} documents of {prefix} do not end with the end-of-document "
                        f"token {eod} ({text!r}), at which MP_SFT_PACKING=true keeps pretraining documents apart: "
                        "preprocess them with it appended (mpatch preprocess does by default; Pai's --append-eod), "
                        "or drop MP_SFT_PACKING")


def _checked_pair(prefix: str):
    """The .idx's arrays (``_read_idx``), after the manifest's sizes and digests where there is one."""
    manifest = manifest_path(prefix)
    if manifest.is_file():
        listed = set(read_manifest(manifest)["files"])
        missing = [Path(prefix + s).name for s in (".bin", ".idx") if Path(prefix + s).name not in listed]
        if missing:
            raise UserError(f"{manifest} does not list {missing[0]}: it is not the manifest of this data; remove it "
                            "or preprocess again")
        verify_manifest(manifest)
    return _read_idx(prefix)


# --- Pai-Megatron-Patch's SFT idxmap ------------------------------------------------------------------------
# toolkits/sft_data_preprocessing/build_idxmap_sft_dataset.py writes each sample as one sequence of 2*N ids: the N
# input ids of its records (and padding), the last id of each record stored as -1 - id, then the N labels, already
# shifted (label t is input id t+1), -100 where there is no loss. Its training reads N = SEQ_LEN.

SFT_IGNORED_LABEL = -100


def read_sft_idxmap(prefix: str) -> numpy.ndarray:
    """The samples of Pai's SFT idxmap at ``prefix`` as one mapped ``[samples, 2*N]`` array (its shape checked,
    its ids by ``check_sft_idxmap``)."""
    dtype, lengths, pointers, documents = _read_idx(prefix)
    _check_layout(prefix, dtype, lengths, pointers, documents)
    idx = Path(prefix + ".idx").name
    if dtype.kind == "u":
        raise UserError(f"{prefix}.bin holds unsigned ids ({dtype}), so it has no -100 labels or end marks: it is not "
                        "an SFT idxmap of Pai's sft_data_preprocessing (pretraining data takes SFT=false)")
    if int(lengths.min()) != int(lengths.max()) or int(lengths[0]) % 2:
        raise UserError(f"{idx} holds sequences of {int(lengths.min())} to {int(lengths.max())} tokens, where an SFT "
                        "idxmap of Pai's sft_data_preprocessing holds samples of 2*N (ids, then labels): with SFT=true "
                        "an mmap prefix is read as one; pretraining data takes SFT=false")
    return numpy.memmap(Path(prefix + ".bin"), dtype=dtype, mode="r", shape=(len(lengths), int(lengths[0])))


def check_sft_idxmap(prefix: str, vocab_size: int, sample_length: int) -> int:
    """Check Pai's SFT idxmap at ``prefix`` before the first step: the pair (manifest, layout), samples of 2*N with
    N <= ``sample_length``, input ids (end marks restored) in [0, vocab_size), labels -100 or the next input id,
    and some label to train on. Returns the number of samples."""
    _checked_pair(prefix)
    rows = read_sft_idxmap(prefix)
    half = rows.shape[1] // 2
    binary = f"{prefix}.bin"
    if half > sample_length:
        raise UserError(f"{binary} holds samples of {half} tokens (its sft_data_preprocessing's seq_len), longer than "
                        f"SEQ_LEN={sample_length}: set SEQ_LEN to {half}, or preprocess with the length you train")
    trained = 0
    for first in range(0, len(rows), max(1, PIECE // rows.shape[1])):
        part = numpy.asarray(rows[first:first + max(1, PIECE // rows.shape[1])])  # its own signed dtype: no copy
        tokens, labels = part[:, :half], part[:, half:]
        bad = (tokens < -vocab_size) | (tokens >= vocab_size)
        if bad.any():
            r, c = (int(v[0]) for v in numpy.nonzero(bad))
            raise UserError(f"{binary} holds input id {int(tokens[r, c])} (sample {first + r}, token {c}), outside the "
                            f"model's vocabulary [0, {vocab_size}) (-1 - id marks a record's end): preprocess the data "
                            "with the model's tokenizer")
        restored = numpy.where(tokens < 0, -1 - tokens, tokens)
        labelled = labels != SFT_IGNORED_LABEL
        wrong = labelled[:, :-1] & (labels[:, :-1] != restored[:, 1:])
        wrong = numpy.c_[wrong, labelled[:, -1]]  # the last position has no next id to predict
        if wrong.any():
            r, c = (int(v[0]) for v in numpy.nonzero(wrong))
            raise UserError(f"{binary}: sample {first + r} labels token {c} with {int(labels[r, c])}, which is not the "
                            "next input id (nor -100): it is not an SFT idxmap of Pai's sft_data_preprocessing, or it "
                            "is damaged; preprocess the data again")
        trained += int(labelled.sum())
    if trained == 0:
        raise UserError(f"{binary} labels no token (every label is -100): there is nothing to train on")
    return len(rows)


def _read_idx(prefix: str):
    """(token dtype, sequence lengths, pointers, document boundaries) of ``PREFIX.idx``, mapped, not read."""
    idx = Path(prefix + ".idx")
    what = f"{idx} is not an index written by megatron-core or 'mpatch preprocess'"
    size = idx.stat().st_size
    with open(idx, "rb") as f:
        head = f.read(IDX_PREFIX)
    if len(head) < IDX_PREFIX or head[:len(IDX_HEADER)] != IDX_HEADER:
        raise UserError(f"{what} (no MMIDIDX header): preprocess the corpus again")
    version, code, sequences, documents = _COUNTS.unpack(head[len(IDX_HEADER):])
    if version != 1:
        raise UserError(f"{what} (version {version}; megatron-core reads version 1)")
    if code not in TOKEN_DTYPES:
        raise UserError(f"{what} (dtype code {code} is not one of token ids)")
    base = IDX_PREFIX + 12 * sequences + 8 * documents
    if size not in (base, base + sequences):  # + one int8 mode per sequence for multimodal data
        raise UserError(f"{idx} is {size} bytes, but its counts ({sequences} sequences, {documents} documents) need "
                        f"{base}: it is truncated or damaged; preprocess the corpus again")
    mapped = numpy.memmap(idx, mode="r") if size > IDX_PREFIX else numpy.zeros(IDX_PREFIX, numpy.uint8)
    lengths = numpy.frombuffer(mapped, numpy.int32, sequences, IDX_PREFIX)
    pointers = numpy.frombuffer(mapped, numpy.int64, sequences, IDX_PREFIX + 4 * sequences)
    bounds = numpy.frombuffer(mapped, numpy.int64, documents, IDX_PREFIX + 12 * sequences)
    return numpy.dtype(TOKEN_DTYPES[code]), lengths, pointers, bounds


def _check_layout(prefix: str, dtype: numpy.dtype, lengths, pointers, documents) -> int:
    """The .idx's arrays agree with each other and with the .bin's size; returns the token count."""
    idx, binary = Path(prefix + ".idx"), Path(prefix + ".bin")
    fix = (f"{binary.name} is cut short, or the two files are not one pair (an interrupted preprocess, or files of two "
           "corpora): preprocess again")
    total = 0
    for start in range(0, len(lengths), PIECE):
        part = lengths[start:start + PIECE].astype(numpy.int64)
        if len(part) and part.min() < 0:
            raise UserError(f"{idx} gives sequence {start + int(part.argmin())} a negative length: {fix}")
        starts = (total + numpy.concatenate(([0], numpy.cumsum(part)[:-1]))) * dtype.itemsize
        wrong = numpy.flatnonzero(pointers[start:start + PIECE] != starts)
        if len(wrong):
            raise UserError(f"{idx} points sequence {start + int(wrong[0])} at byte "
                            f"{int(pointers[start + int(wrong[0])])} of {binary.name}, where the lengths before it "
                            f"end at byte {int(starts[wrong[0]])}: {fix}")
        total += int(part.sum())
    if len(documents) < 1 or documents[0] != 0 or documents[-1] != len(lengths) or \
            any(numpy.any(numpy.diff(documents[i:i + PIECE + 1]) < 0) for i in range(0, len(documents), PIECE)):
        raise UserError(f"{idx}'s document boundaries do not run from 0 to its {len(lengths)} sequences: {fix}")
    size = binary.stat().st_size
    if size != total * dtype.itemsize:
        raise UserError(f"{binary} is {size} bytes, but {idx.name} describes {total} tokens of {dtype} "
                        f"({total * dtype.itemsize} bytes): {fix}")
    if total == 0:
        raise UserError(f"{binary} holds no tokens: preprocess a corpus with text in it")
    return total


def _check_token_ids(prefix: str, dtype: numpy.dtype, total: int, vocab_size: int, pointers, documents) -> None:
    """Every token id in [0, vocab_size); the first that is not is named with its document."""
    binary = Path(prefix + ".bin")
    tokens = numpy.memmap(binary, dtype=dtype, mode="r", shape=(total,))
    for start in range(0, total, PIECE):
        part = tokens[start:start + PIECE]
        if int(part.min()) >= 0 and int(part.max()) < vocab_size:
            continue
        at = start + int(numpy.flatnonzero((part < 0) | (part >= vocab_size))[0])
        sequence = int(numpy.searchsorted(pointers, at * dtype.itemsize, side="right")) - 1
        document = int(numpy.searchsorted(documents, sequence, side="right")) - 1
        fix = ("negative ids (-100 labels, -1 - id end marks) are what an SFT idxmap of Pai's sft_data_preprocessing "
               "holds: train it with SFT=true" if int(tokens[at]) < 0 else
               "preprocess the corpus with the model's tokenizer")
        raise UserError(f"{binary} holds token id {int(tokens[at])} (token {at}, document {document}), outside the "
                        f"model's vocabulary [0, {vocab_size}): {fix}")


def run_tokenizer(cfg):
    """MP_TOKENIZER (an HF folder, a tiktoken file or a folder holding one), else the checkpoint's tokenizer where it
    carries one, else None."""
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer)
    # the folder that carries the checkpoint's tokenizer: a run's checkpoint/ folder holds none itself, the
    # iteration it loads does (from there, pretraining data went unchecked: the data audit)
    home = cfg.checkpoint_tokenizer or cfg.pretrain_checkpoint
    if home:
        try:
            check_tokenizer_path(home)
        except UserError:  # the checkpoint carries no tokenizer
            return None
        return load_tokenizer(home)
    return None


def end_of_document(cfg) -> tuple[int, str]:
    """The id pretraining documents end with (what ``mpatch preprocess`` appends: the tokenizer's end-of-document
    token) and its text, for MP_SFT_PACKING=true in pretraining, which keeps documents apart there."""
    tokenizer = run_tokenizer(cfg)
    if tokenizer is None:
        raise UserError("MP_SFT_PACKING=true in pretraining keeps documents apart at the tokenizer's end-of-document "
                        "token: set MP_TOKENIZER to the tokenizer the data was preprocessed with, or give a "
                        "PRETRAIN_CHECKPOINT_PATH that carries tokenizer.json")
    return tokenizer.eod, tokenizer.decode([tokenizer.eod])


def check_training_data(cfg) -> list[str]:
    """Every mmap prefix a run reads (training, validation), before its first step: pretraining data, or with
    SFT=true Pai's SFT idxmap; or each SFT JSON/JSONL file's records, for their shape. Returns the notes to show."""
    if cfg.dataset_type == "raw":
        # the files build_sft_datasets reads, and whether any of their records trains a token (the ranks' own
        # refusal came after minutes of imports on each)
        tokenizer = load_tokenizer(cfg.tokenizer)
        for path in dict.fromkeys([cfg.dataset_path[0], *(cfg.valid_dataset_path or [])[:1]]):
            refuse_untrainable(path, record_groups(path), tokenizer, cfg.sample_length, cfg.sft_packing)
        return []
    eod = end_of_document(cfg) if cfg.sft_packing and not cfg.sft else None  # the setting's own refusal first
    for prefix in dict.fromkeys(cfg.dataset_path + (cfg.valid_dataset_path or [])):
        # The model's own vocabulary, not megatron's padded one: the loss masks the padding rows out.
        if cfg.sft:
            check_sft_idxmap(prefix, cfg.arch.vocab_size, cfg.sample_length)
        else:
            check_mmap_data(prefix, cfg.arch.vocab_size)
    return check_data_settings(cfg, eod)


def check_data_settings(cfg, eod: tuple[int, str] | None = None) -> list[str]:
    """What the run's settings need of pretraining data, from its index and one token per document (the dry run
    checks it too; the whole check reads every token): ids of the run's tokenizer (``check_data_tokenizer``),
    documents that end with the end-of-document token ``eod`` (found here when not given) where MP_SFT_PACKING keeps
    them apart, documents for each MP_SPLIT share, and a sample in each prefix of a list without weights. Returns
    the notes to show (what could not be checked)."""
    if cfg.sft or cfg.dataset_type == "raw":
        return []
    notes = check_data_tokenizer(cfg)
    if cfg.sft_packing and eod is None:
        eod = end_of_document(cfg)
    for prefix in dict.fromkeys(cfg.dataset_path + (cfg.valid_dataset_path or [])):
        if eod is not None:
            check_documents_end_with(prefix, *eod)
        if cfg.split:
            check_split(prefix, cfg.split)
    if cfg.dataset_weights is None:
        check_unweighted_blend("DATASET_PATH", cfg.dataset_path, cfg.seq_len, cfg.split)
    if cfg.valid_dataset_path and cfg.valid_dataset_weights is None:
        check_unweighted_blend("VALID_DATASET_PATH", cfg.valid_dataset_path, cfg.seq_len, None)
    return notes


def check_data_tokenizer(cfg) -> list[str]:
    """Pretraining data tokenized by the run's tokenizer (MP_TOKENIZER, else the checkpoint's), by the record
    ``mpatch preprocess`` keeps in each prefix's manifest: another tokenizer's ids stand for other tokens, which the
    vocabulary's size alone does not show (Llama-3 and a Llama-3 derivative with other merges both have 128256
    ids), and the model would train on other text than the corpus. Refused in one line; returns notes for what
    cannot be compared (data without a record, a run without a tokenizer) and for documents that end with another
    end-of-document token than the run's tokenizer's."""
    records, unrecorded = {}, []
    for prefix in dict.fromkeys(cfg.dataset_path + (cfg.valid_dataset_path or [])):
        record = _tokenizer_record(prefix)
        if record is None:
            unrecorded.append(prefix)
        else:
            records[prefix] = record
    notes = []
    if unrecorded:
        more = f" and {len(unrecorded) - 2} more" if len(unrecorded) > 2 else ""
        notes.append(f"{', '.join(unrecorded[:2])}{more}: no record of the tokenizer the data was preprocessed with "
                     "(another tool's data, or mpatch preprocess's before it kept one), so its ids are checked against "
                     "the model's vocabulary size only")
    tokenizer = run_tokenizer(cfg) if records else None
    if records and tokenizer is None:
        notes.append("the data's tokenizer is not compared with the model's: the run has none (set MP_TOKENIZER, or "
                     "give a PRETRAIN_CHECKPOINT_PATH that carries tokenizer.json)")
    if tokenizer is None:
        return notes
    source = (f"MP_TOKENIZER {cfg.tokenizer}" if cfg.tokenizer else
              f"the tokenizer of PRETRAIN_CHECKPOINT_PATH {cfg.checkpoint_tokenizer or cfg.pretrain_checkpoint}")
    end, digests = ids_end(tokenizer), {}  # the run's vocabulary digested once per bound, not once per prefix
    for prefix, record in records.items():
        # the data's ids mean the same tokens in the run's tokenizer, which may extend the data's (a pad or chat token
        # added, the model's vocabulary resized for it: the data audit)
        if record["ids"] not in digests:
            digests[record["ids"]] = vocabulary_digest(tokenizer, below=record["ids"])
        if end < record["ids"] or digests[record["ids"]] != record["vocabulary_sha256"]:
            sizes = (f"both {end} ids" if record["ids"] == end else f"{record['ids']} ids against {end}")
            raise UserError(f"{prefix} was preprocessed with the tokenizer of {record['path']}, whose ids do not all "
                            f"stand for the same tokens in {source} ({sizes}): the model would train on other text "
                            "than the corpus; preprocess it with the model's tokenizer (mpatch preprocess --tokenizer)")
        ends = record["end_of_document"]
        if ends is not None and ends["id"] != tokenizer.eod:
            notes.append(f"the documents of {prefix} end with {ends['token']!r} (id {ends['id']}), the "
                         f"end-of-document token of the tokenizer it was preprocessed with; {source} ends a document "
                         f"with {tokenizer.decode([tokenizer.eod])!r} (id {tokenizer.eod})")
    return notes


def _tokenizer_record(prefix: str) -> dict | None:
    """The tokenizer record of ``prefix``'s manifest (``preprocess.tokenizer_record``), checked for shape (the
    manifest is untrusted input), or None where there is no manifest or it keeps none."""
    manifest = manifest_path(prefix)
    if not manifest.is_file():
        return None
    record = read_manifest(manifest).get(TOKENIZER_RECORD)
    if record is None:
        return None
    ends = record.get("end_of_document") if isinstance(record, dict) else None
    if not (isinstance(record, dict) and isinstance(record.get("path"), str)
            and isinstance(record.get("vocabulary_sha256"), str) and _is_int(record.get("ids"))
            and (ends is None or isinstance(ends, dict) and _is_int(ends.get("id"))
                 and isinstance(ends.get("token"), str))):
        raise UserError(f"{manifest}: its '{TOKENIZER_RECORD}' record is malformed: the manifest is damaged; "
                        "preprocess the data again")
    return record


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

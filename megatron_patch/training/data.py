"""Training data: megatron-core GPTDataset over mmap indexed files (pretraining) and raw JSON SFT samples.

Both are map-style datasets indexed by a global sample number, so the data position is one integer:
iteration ``i`` reads samples ``[i*GBS, (i+1)*GBS)``, each data-parallel rank its contiguous share,
cut into micro-batches. A resumed run at iteration ``i`` therefore reads exactly what the
uninterrupted run read.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_patch.errors import UserError
from megatron_patch.training import data_cache

# megatron-core is imported inside the functions that use it, so that in a rank it loads after
# init_process_group has enabled runtime/cpu_compat (on CPU, megatron-core's CUDA-only spots are patched).


class _DatasetTokenizer:
    """What GPTDatasetConfig reads from a tokenizer: vocabulary size and end-of-document id."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size = vocab_size
        self.eod = eod
        # Part of the dataset's cache key (megatron hashes the config, tokenizer included).
        self.unique_identifiers = {"class": "mpatch", "vocab_size": vocab_size, "eod": eod}


def build_pretraining_datasets(cfg, num_train_samples: int, num_valid_samples: int):
    """(train, valid or None) GPTDatasets built by megatron-core's BlendedMegatronDatasetBuilder, from a cache
    in OUTPUT_BASEPATH/data_cache that is checked before megatron-core reads it (``training.data_cache``)."""
    cache = data_cache.run_cache_folder(cfg.output_basepath)
    first = not dist.is_initialized() or dist.get_rank() == 0
    for attempt in range(2):
        if first:  # rank 0 builds first; the others read the cache only after its build (megatron's barrier)
            data_cache.keep_sound_files(cache)
        datasets = _build(cfg, cache, num_train_samples, num_valid_samples)
        unfit = data_cache.unfit_indices(datasets)
        if not unfit:
            break
        if attempt:
            raise UserError(f"megatron-core built dataset indices in {cache} that do not fit the data ({unfit[0][1]})")
        _barrier()  # every rank has looked before rank 0 removes them
        if first:
            data_cache.remove_unfit(cache, unfit)
        _barrier()
    if first:
        data_cache.record(cache)
    return datasets


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _build(cfg, cache: Path, num_train_samples: int, num_valid_samples: int):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    arch = cfg.arch
    eos = arch.hf_config.get("eos_token_id", 0)
    eod = eos[0] if isinstance(eos, list) else int(eos or 0)
    valid = (cfg.valid_dataset_path, cfg.valid_dataset_weights) if cfg.valid_dataset_path else None
    config = GPTDatasetConfig(
        random_seed=cfg.seed, sequence_length=cfg.seq_len,
        blend_per_split=[(cfg.dataset_path, cfg.dataset_weights), valid, None],
        path_to_cache=str(cache),
        tokenizer=_DatasetTokenizer(arch.padded_vocab_size(), eod),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        mmap_bin_files=True,
    )
    sizes = [num_train_samples, num_valid_samples if valid else None, None]
    train, valid_ds, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train, valid_ds


# --- SFT on raw JSON / JSONL -------------------------------------------------------------------------------

PROMPT_KEYS = ("prompt", "instruction", "query", "question")
RESPONSE_KEYS = ("response", "output", "answer", "completion")


def read_records(path: str | Path) -> list[dict]:
    """A JSON array or JSONL file of SFT records; a bad line names its line number."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})")
    else:
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path} line {lineno} is not valid JSON ({exc.msg})")
    if not records:
        raise UserError(f"{path} holds no SFT records")
    return records


def segments(record: dict, where: str, chat_template=None) -> list[tuple[str, bool]]:
    """A record as (text, trained-on) pieces: prompt/response pairs or chat messages.

    Chat messages are rendered with ``chat_template`` (the tokenizer folder's, see
    ``tokenizer.ChatTemplate``) when there is one, else in a plain ``<|role|>`` format; either way
    only the assistant turns are trained on.
    """
    if not isinstance(record, dict):
        raise UserError(f"{where}: an SFT record must be a JSON object, found {type(record).__name__}")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise UserError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
                raise UserError(f"{where}: each message needs a 'role' and a string 'content'")
        if not any(m["role"] == "assistant" for m in msgs):
            raise UserError(f"{where}: the conversation has no assistant message to train on")
        if chat_template is not None:
            return chat_template.segments(msgs, where)
        out = []
        for m in msgs:
            out.append((f"<|{m['role']}|>\n", False))
            out.append((m["content"] + "\n", m["role"] == "assistant"))
        return out
    prompt = next((record[k] for k in PROMPT_KEYS if k in record), None)
    response = next((record[k] for k in RESPONSE_KEYS if k in record), None)
    if not isinstance(prompt, str) or not isinstance(response, str):
        raise UserError(f"{where}: an SFT record needs string prompt and response fields "
                        f"({'/'.join(PROMPT_KEYS)} and {'/'.join(RESPONSE_KEYS)}) or a 'messages' list")
    if isinstance(record.get("input"), str) and record["input"]:
        prompt = prompt + "\n" + record["input"]
    return [(prompt + "\n", False), (response, True)]


def tokenize_record(tokenizer, record: dict, where: str) -> tuple[list[int], list[int]]:
    """(token ids, per-token 1 where the token is trained on), EOD closing the sample.

    Without a chat template the EOD is trained (the model learns to stop after the response). A
    chat-template conversation ends as the template renders it (its end-of-turn markup, trained
    inside the assistant span); EOD is appended as the document end unless it is already the last
    token, trained only when the conversation ends with an assistant turn.
    """
    template = getattr(tokenizer, "chat_template", None) if "messages" in record else None
    ids, trained = [], []
    for text, on in segments(record, where, template):
        piece = tokenizer.encode(text)
        ids += piece
        trained += [int(on)] * len(piece)
    if template is None:
        ids.append(tokenizer.eod)
        trained.append(1)
    elif not ids or ids[-1] != tokenizer.eod:
        ids.append(tokenizer.eod)
        trained.append(int(record["messages"][-1]["role"] == "assistant"))
    return ids, trained


def _sample(ids: list[int], trained: list[int], length: int, pad: int, doc_starts: list[int] | None = None) -> dict:
    """tokens/labels/loss_mask/position_ids of one fixed-length sample (loss on response labels only)."""
    ids, trained = ids[:length + 1], trained[:length + 1]
    n = len(ids) - 1
    tokens = torch.full((length,), pad, dtype=torch.long)
    labels = torch.full((length,), pad, dtype=torch.long)
    loss_mask = torch.zeros(length)
    tokens[:n] = torch.tensor(ids[:-1])
    labels[:n] = torch.tensor(ids[1:])
    loss_mask[:n] = torch.tensor(trained[1:], dtype=torch.float)
    position_ids = torch.arange(length)
    out = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
    if doc_starts is not None:
        # Packed: each document (and the padding after the last) is a segment of its own; the
        # training step turns the starts into THD boundaries (training/packing.py).
        starts = sorted({s for s in doc_starts if s < length} | ({n} if n < length else set()))
        doc_start = torch.zeros(length, dtype=torch.bool)
        doc_start[starts] = True
        out["doc_start"] = doc_start
        out["position_ids"] = torch.arange(length) - torch.tensor(starts)[torch.cumsum(doc_start.long(), 0) - 1]
    return out


class SFTDataset(torch.utils.data.Dataset):
    """Raw JSON SFT records, tokenized once, padded (or packed) to ``length``; epochs repeat in order."""

    def __init__(self, path: str | Path, tokenizer, length: int, *, packing: bool = False, vocab_size: int | None = None):
        records = read_records(path)
        self.length, self.pad = length, tokenizer.eod
        tokenized = [tokenize_record(tokenizer, r, f"{path} record {i + 1}") for i, r in enumerate(records)]
        if vocab_size is not None and tokenizer.vocab_size > vocab_size:
            raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's {vocab_size}")
        if packing:
            self.samples = self._pack(tokenized)
        else:
            self.samples = [_sample(ids, tr, length, self.pad) for ids, tr in tokenized]

    def _pack(self, tokenized) -> list[dict]:
        out, ids, tr, starts = [], [], [], []
        for sid, st in tokenized:
            sid, st = sid[:self.length + 1], st[:self.length + 1]
            if ids and len(ids) + len(sid) > self.length + 1:
                out.append(_sample(ids, tr, self.length, self.pad, starts))
                ids, tr, starts = [], [], []
            starts.append(len(ids))
            ids, tr = ids + sid, tr + st
        if ids:
            out.append(_sample(ids, tr, self.length, self.pad, starts))
        return out

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict:
        return self.samples[idx % len(self.samples)]


# --- batches -------------------------------------------------------------------------------------------------

def micro_batches(dataset, iteration: int, cfg, dp_rank: int, dp_size: int) -> list[dict]:
    """This data-parallel rank's micro-batches of global step ``iteration`` (0-based)."""
    per_rank = cfg.global_batch_size // dp_size
    first = iteration * cfg.global_batch_size + dp_rank * per_rank
    out = []
    for m in range(per_rank // cfg.micro_batch_size):
        start = first + m * cfg.micro_batch_size
        items = [dataset[(start + k) % len(dataset)] for k in range(cfg.micro_batch_size)]
        out.append({key: torch.stack([it[key] for it in items]) for key in items[0]})
    return out

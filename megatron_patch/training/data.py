"""Training data: megatron-core GPTDataset over mmap indexed files (pretraining; SFT's are ``sft_data``'s), and the
micro-batches of a step.

Both are map-style datasets indexed by a global sample number, so the data position is one integer:
iteration ``i`` reads samples ``[i*GBS, (i+1)*GBS)``, each data-parallel rank its contiguous share,
cut into micro-batches. A resumed run at iteration ``i`` therefore reads exactly what the
uninterrupted run read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_patch.errors import UserError
from megatron_patch.outputs.full_disk import free_space, full_disk_error
from megatron_patch.training import data_cache
from megatron_patch.training.data_files import inferred_weights, recorded_digests

# megatron-core is imported inside the functions that use it, so that in a rank it loads after
# init_process_group has enabled runtime/cpu_compat (on CPU, megatron-core's CUDA-only spots are patched).


class _DatasetTokenizer:
    """What GPTDatasetConfig reads from a tokenizer: vocabulary size and end-of-document id."""

    def __init__(self, vocab_size: int, eod: int, data: dict | None = None):
        self.vocab_size = vocab_size
        self.eod = eod
        # Part of the dataset's cache key (megatron hashes the config, tokenizer included). ``data``: the files'
        # sizes, as megatron-core keys its cache by the data's path alone (a corpus rewritten there with other
        # document lengths read the old indices: padded samples trained silently, or an IndexError)
        self.unique_identifiers = {"class": "mpatch", "vocab_size": vocab_size, "eod": eod, "data": data or {}}


def data_identity(prefixes: list[str]) -> dict[str, list]:
    """Each mmap prefix's .bin and .idx sizes, and their digests where its manifest records them: the same on every
    node (a copy's modification time is not). A corpus preprocessed again with the same sizes (the same documents
    in another order: Pai's preprocessing line replaces its pair) read the old indices without the digests."""
    return {prefix: [os.path.getsize(prefix + suffix) for suffix in (".bin", ".idx")] + (recorded_digests(prefix) or [])
            for prefix in prefixes}


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
    # MP_SPLIT: megatron-core cuts each prefix's documents into train, validation and test shares (Pai's --split)
    # (each share holds sequences: data_files.check_split, before any rank started)
    weights = cfg.dataset_weights or inferred_weights(cfg, num_train_samples)
    blend = (dict(blend=(cfg.dataset_path, weights), split=cfg.split) if cfg.split else
             dict(blend_per_split=[(cfg.dataset_path, weights), valid, None]))
    config = GPTDatasetConfig(
        random_seed=cfg.seed, sequence_length=cfg.seq_len, **blend,
        path_to_cache=str(cache),
        tokenizer=_DatasetTokenizer(arch.padded_vocab_size(), eod,
                                    data_identity([*cfg.dataset_path, *(cfg.valid_dataset_path or [])])),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        mmap_bin_files=True,
    )
    # a split's unused test share is asked for no samples: None (as many as there are) is refused for a weighted blend
    sizes = [num_train_samples, num_valid_samples if valid or cfg.split else None, 0 if cfg.split else None]
    try:
        train, valid_ds, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    except Exception as exc:
        _refuse_a_cache_not_seen(exc, cache)
        failed = _cache_write_error(exc)
        if failed is None:
            raise
        raise UserError(f"writing the data cache in {cache} failed ({failed}), {free_space(cache)} there: free space "
                        "(or choose another OUTPUT_BASEPATH) and rerun") from None
    return train, valid_ds


def _refuse_a_cache_not_seen(exc: BaseException, cache: Path) -> None:
    """A rank that does not find the cache rank 0 built (after megatron-core's barrier) sees another folder: its
    node does not share OUTPUT_BASEPATH's filesystem."""
    if (dist.is_initialized() and dist.get_rank() != 0 and isinstance(exc, FileNotFoundError) and exc.filename
            and Path(os.fsdecode(exc.filename)).parent == cache):
        raise UserError(f"rank {dist.get_rank()} does not find the data cache rank 0 built in {cache} "
                        f"({Path(os.fsdecode(exc.filename)).name}): every node must see OUTPUT_BASEPATH on one shared "
                        "filesystem") from None


def _cache_write_error(exc: BaseException) -> OSError | None:
    """The OSError that stopped megatron-core writing its dataset indices, which a full disk raises without an errno
    (numpy's "N requested and M written"); under a process group megatron-core wraps it ("Failed to write dataset
    materials ...", raised from it)."""
    if isinstance(exc, OSError) and exc.errno is None:
        return exc
    full = full_disk_error(exc)
    if full is not None:
        return full
    cause = exc.__cause__
    return cause if isinstance(cause, OSError) and "Failed to write dataset materials" in str(exc) else None


# --- batches -------------------------------------------------------------------------------------------------

BLEND_SOURCE = "dataset_id"


def micro_batches(dataset, iteration: int, cfg, dp_rank: int, dp_size: int) -> list[dict]:
    """This data-parallel rank's micro-batches of global step ``iteration`` (0-based)."""
    per_rank = cfg.global_batch_size // dp_size
    first = iteration * cfg.global_batch_size + dp_rank * per_rank
    out = []
    for m in range(per_rank // cfg.micro_batch_size):
        start = first + m * cfg.micro_batch_size
        items = [dataset[(start + k) % len(dataset)] for k in range(cfg.micro_batch_size)]
        # a blend's samples also say which dataset they came from (megatron's BlendedDataset: a numpy scalar,
        # "dataset_id"), which the step does not read
        out.append({key: torch.stack([it[key] for it in items]) for key in items[0] if key != BLEND_SOURCE})
    return out

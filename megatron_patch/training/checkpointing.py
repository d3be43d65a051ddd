"""Training checkpoints: torch_dist with model, optimizer, scheduler, RNG and data position.

Layout under ``OUTPUT_BASEPATH/checkpoint``::

    latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint
    iter_0000010/                       torch_dist (model + optimizer shards, common.pt with the
                                        scheduler, iteration and consumed samples), rng/rank_*.pt,
                                        train_state.json

A save writes into a partial folder (``checkpoint_layout``), renamed to ``iter_XXXXXXX`` only after
every rank has finished, and only then is the latest marker replaced. A run killed mid-save leaves
the previous checkpoint as the latest.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_patch.checkpoint_layout import (
    RELEASE, TRACKER_NAME, iteration_dir, load_models_torch_dist, partial_dir, publish, read_tracker,
    remove_stale_partials, write_tracker)
from megatron_patch.errors import UserError

# megatron-core 0.16's default distributed-optimizer format is rejected by its own dist_checkpointing;
# fully_reshardable also reloads at another TP/PP/DP (see docs/cpu-runtime.md).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def latest_iteration(root: str | Path) -> int | None:
    tracker = Path(root) / TRACKER_NAME
    latest = read_tracker(root)
    if latest is None:
        return None
    if latest == RELEASE:
        raise UserError(f"{tracker} says '{RELEASE}': {root} holds converted weights, not a training run's checkpoints; "
                        "give it as PRETRAIN_CHECKPOINT_PATH and choose another OUTPUT_BASEPATH")
    if not iteration_dir(root, latest).is_dir():
        raise UserError(f"{tracker} points at iteration {latest}, but {iteration_dir(root, latest)} is missing")
    return latest


def _rng_state() -> dict:
    import numpy as np
    from megatron.core import tensor_parallel

    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _model_keys(models: list) -> list[str]:
    """Megatron-LM's names for the model part of a checkpoint: 'model', or 'model0', 'model1'... per chunk."""
    return ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]


def _sharded_state(models: list, optimizer, is_loading: bool) -> dict:
    """Each chunk's sharded state dict under its Megatron-LM key; the optimizer's built from all of them.

    The sharded tensors carry global names (layer numbers with the chunk's offset), so the stored
    shards do not depend on how the layers were split into stages and chunks.
    """
    state = {key: m.module.sharded_state_dict() for key, m in zip(_model_keys(models), models)}
    state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    return state


def _param_gather_hooks(cfg, models: list, enable: bool) -> None:
    if cfg.overlap_param_gather:
        for m in models:
            # disabling finishes the pending parameter all-gather first
            m.enable_forward_pre_hook() if enable else m.disable_forward_pre_hook()


def save(cfg, iteration: int, models: list, optimizer, scheduler) -> Path:
    """``models``: this rank's DDP-wrapped model chunks (one without a virtual pipeline)."""
    from megatron.core import dist_checkpointing

    root = cfg.checkpoint_dir
    final = iteration_dir(root, iteration)
    rank = dist.get_rank()
    tmp = _shared_partial_dir(final)
    start = time.time()
    _param_gather_hooks(cfg, models, enable=False)
    state = _sharded_state(models, optimizer, is_loading=False)
    state.update(scheduler=scheduler.state_dict(), iteration=iteration,
                 consumed_samples=iteration * cfg.global_batch_size)
    dist_checkpointing.save(state, str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), tmp / "rng" / f"rank_{rank:05d}.pt")
    _param_gather_hooks(cfg, models, enable=True)
    dist.barrier()
    if rank == 0:
        (tmp / "train_state.json").write_text(json.dumps(
            {"iteration": iteration, "consumed_samples": iteration * cfg.global_batch_size,
             "world_size": dist.get_world_size(), "family": cfg.family, "hf_config": cfg.hf_config,
             "config": cfg.to_dict()}, indent=2, default=str) + "\n")
        # The converter's sidecar too, so 'mpatch convert mcore2hf' reads any iteration folder directly.
        from megatron_patch.convert.sidecar import Sidecar
        from megatron_patch.dtypes import precision_dtype

        Sidecar.create("torch_dist", cfg.arch, cfg.layout, precision_dtype(cfg.precision),
                       source=f"mpatch train, iteration {iteration}").write(tmp)
        publish(tmp, final)
        write_tracker(root, iteration)
    dist.barrier()
    if rank == 0:
        print(f"saved checkpoint {final} in {time.time() - start:.1f}s", flush=True)
    return final


def load(cfg, iteration: int, models: list, optimizer, scheduler) -> int:
    """Restore everything saved at ``iteration``; returns the consumed samples."""
    from megatron.core import dist_checkpointing

    folder = iteration_dir(cfg.checkpoint_dir, iteration)
    state = dist_checkpointing.load(_sharded_state(models, optimizer, is_loading=True), str(folder))
    for key, m in zip(_model_keys(models), models):
        m.module.load_state_dict(state[key])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    saved = json.loads((folder / "train_state.json").read_text())
    rng = folder / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if saved.get("world_size") == dist.get_world_size() and rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    elif dist.get_rank() == 0:
        print(f"note: {folder} was written by {saved.get('world_size')} processes; random state starts afresh",
              flush=True)
    if state["iteration"] != iteration:
        raise UserError(f"{folder} holds iteration {state['iteration']}, not {iteration}: the checkpoint is damaged")
    return int(state["consumed_samples"])


def load_converted_into_chunks(chunks: list, ckpt_dir) -> None:
    """A checkpoint from 'mpatch convert hf2mcore' (or a ``final/`` export) into virtual-pipeline chunks.

    The chunks' sharded tensors name their layers by global number (megatron's layer offset for the
    chunk's vp_stage), so a checkpoint written at any TP/PP, without chunks, fills them correctly.
    """
    from megatron_patch.convert.sidecar import read_sidecar

    ckpt_dir = Path(ckpt_dir)
    if read_sidecar(ckpt_dir).checkpoint_format != "torch_dist":
        raise UserError(f"{ckpt_dir} is a legacy checkpoint, which loads only at the layout it was written for: "
                        "convert with --format torch_dist to train with MP_VP")
    load_models_torch_dist(chunks, ckpt_dir / RELEASE)


def _shared_partial_dir(final: Path, inner: str = "") -> Path:
    """Rank 0 makes a fresh partial folder for ``final`` (and its sub-folder ``inner``) and tells every
    rank its name."""
    holder = [None]
    if dist.get_rank() == 0:
        remove_stale_partials(final)
        tmp = partial_dir(final)
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / inner).mkdir(parents=True)
        holder = [str(tmp)]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


FINAL_DIR = "final"


def export_model(cfg, iteration: int, models: list, dtype: torch.dtype) -> Path:
    """The trained weights alone, in the layout 'mpatch convert hf2mcore' writes (``OUTPUT_BASEPATH/final``).

    'mpatch convert mcore2hf --load-dir OUTPUT_BASEPATH/final' turns it into an HF folder, and it can be
    the PRETRAIN_CHECKPOINT_PATH of the next run (e.g. SFT after pretraining), at any TP/PP.
    Tokenizer files of the starting checkpoint are carried along.
    """
    from megatron.core import dist_checkpointing

    from megatron_patch.convert.sidecar import Sidecar

    final = Path(cfg.output_basepath) / FINAL_DIR
    rank = dist.get_rank()
    tmp = _shared_partial_dir(final, inner=RELEASE)
    _param_gather_hooks(cfg, models, enable=False)
    # One state dict, as hf2mcore writes it. What is stored is named by each sharded tensor's global
    # key; the dict keys only need to be distinct, and chunks reuse local module names
    # ("decoder.layers.0..."), hence the chunk prefix.
    if len(models) == 1:
        state = models[0].module.sharded_state_dict()
    else:
        state = {f"chunk{i}.{k}": v for i, m in enumerate(models) for k, v in m.module.sharded_state_dict().items()}
    dist_checkpointing.save(state, str(tmp / RELEASE))
    _param_gather_hooks(cfg, models, enable=True)
    dist.barrier()
    if rank == 0:
        from megatron_patch.convert.outputs import copy_carried

        carried = copy_carried(cfg.pretrain_checkpoint, tmp) if cfg.pretrain_checkpoint else []
        if not carried and cfg.tokenizer and Path(cfg.tokenizer).is_dir():
            carried = copy_carried(cfg.tokenizer, tmp)
        Sidecar.create("torch_dist", cfg.arch, cfg.layout, dtype, carried_files=carried,
                       source=f"mpatch train, iteration {iteration}, {cfg.output_basepath}").write(tmp)
        write_tracker(tmp, RELEASE)
        publish(tmp, final)
        print(f"exported the trained model to {final} (mpatch convert mcore2hf --load-dir {final} ...)", flush=True)
    dist.barrier()
    return final

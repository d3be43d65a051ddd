"""Load a Megatron-Core checkpoint (``hf_to_mcore``'s, a run's ``final/``, or another tool's) into this rank's
live model: the one function that loads pretrained weights, for training, the aligner and the tests.

torch_dist: megatron-core's own ``dist_checkpointing.load`` with the model's sharded state dict, at
any TP/PP/EP and into virtual-pipeline chunks (``checkpoint_files.layout.load_models_torch_dist``: the
chunks' sharded tensors name their layers by global number). legacy: this rank's ``model_optim_rng.pt``
at exactly the layout it was written for.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_patch.checkpoint.arch_source import open_checkpoint
from megatron_patch.checkpoint.engine import reshard_for_local_spec
from megatron_patch.checkpoint.legacy import open_rank_file, rank_file
from megatron_patch.checkpoint.model_io import current_coord, load_state_dict_strict
from megatron_patch.checkpoint.sidecar import Sidecar, legacy_layout_problem
from megatron_patch.checkpoint_files.layout import load_models_torch_dist
from megatron_patch.checkpoint_files.manifest import IntegrityError, manifest_for, verify_manifest
from megatron_patch.errors import UserError
from megatron_patch.models.blocks.builder import model_spec_name
from megatron_patch.models.description.registry import get_family
from megatron_patch.models.mapping import RankCoord
from megatron_patch.models.mapping.naming import to_spec


def load_checkpoint_into_model(model, ckpt_dir: str | Path, layout=None, hf_config: dict | str | Path | None = None,
                               verify: bool = True) -> Sidecar:
    """Fill ``model`` (built by ``build_model`` on this rank; a list: its virtual-pipeline chunks) from
    ``ckpt_dir``; returns its sidecar.

    A checkpoint without this project's sidecar (another tool's) needs ``hf_config``, the model's
    config the caller built ``model`` from (``checkpoint.arch_source.open_checkpoint``). ``verify``: its files are
    checked against its manifest first (``IntegrityError``: the caller names its switch that skips this)."""
    chunks = model if isinstance(model, list) else [model]
    opened = open_checkpoint(ckpt_dir, hf_config=hf_config, verify=verify)
    if verify:
        verify_before_load(opened.found.folder)
    sidecar = opened.sidecar
    if sidecar.checkpoint_format == "torch_dist":
        load_models_torch_dist(chunks, opened.found.folder)
    elif len(chunks) > 1:
        raise UserError(f"{ckpt_dir} is a legacy checkpoint, which loads only at the layout it was written for: "
                        "convert with --format torch_dist to train with a virtual pipeline (MP_VP, MP_VP_CHUNKS)")
    else:
        load_legacy(chunks[0], opened.found.folder, sidecar, layout)
    return sidecar


def verify_before_load(folder: Path) -> None:
    """Check a checkpoint written here against its manifest before any rank reads it: rank 0 hashes the files,
    every rank learns the outcome (a collective every rank is ready for), so all refuse alike."""
    manifest = manifest_for(folder)
    if manifest is None:
        return

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        verify_manifest(manifest)
        return
    holder: list = [None]
    if dist.get_rank() == 0:
        try:
            verify_manifest(manifest)
        except UserError as exc:
            holder = [str(exc)]
    dist.broadcast_object_list(holder, src=0)
    if holder[0] is not None:
        raise IntegrityError(holder[0])


def load_legacy(model, folder: str | Path, sidecar: Sidecar, layout=None) -> None:
    """This rank's legacy rank file from the weights folder ``folder`` (``release/`` or ``iter_XXXXXXX/``)."""
    ckpt_layout = sidecar.parallel_layout
    problem = None if layout is None else legacy_layout_problem(sidecar, layout)
    if problem is not None:
        raise UserError(problem)
    coord = current_coord()
    path = rank_file(folder, RankCoord(coord.tp, coord.pp, coord.ep, coord.tp), ckpt_layout)
    # Read without unpickling anything but tensors: rank files of other tools also hold their args.
    lazy, refs = open_rank_file(path)
    state = {k: lazy.load(v) for k, v in refs.items()}
    if not any(k.startswith("mtp.") for k in model.state_dict()):  # converted with --mtp, run without it
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    spec = model_spec_name(model)
    if spec == "local":  # rank files hold TE's shards; a few parameters the local spec cuts otherwise
        arch = sidecar.arch
        state = reshard_for_local_spec(get_family(arch.family), arch, ckpt_layout, coord, state)
    load_state_dict_strict(model, to_spec(state, spec))

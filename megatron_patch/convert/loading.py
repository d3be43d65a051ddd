"""Load a checkpoint written by ``hf_to_mcore`` into this rank's live GPTModel.

torch_dist: megatron-core's own ``dist_checkpointing.load`` with the model's sharded state dict, at
any TP/PP/EP (``checkpoint_layout.load_models_torch_dist``). legacy: this rank's ``model_optim_rng.pt``
at exactly the layout it was written for.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_patch.checkpoint_layout import RELEASE, load_models_torch_dist
from megatron_patch.convert.sidecar import Sidecar, read_sidecar
from megatron_patch.errors import UserError


def load_checkpoint_into_model(model, ckpt_dir: str | Path, layout=None) -> Sidecar:
    """Fill ``model`` (built by ``build_model`` on this rank) from ``ckpt_dir``; returns its sidecar."""
    ckpt_dir = Path(ckpt_dir)
    sidecar = read_sidecar(ckpt_dir)
    if sidecar.checkpoint_format == "torch_dist":
        load_models_torch_dist([model], ckpt_dir / RELEASE)
    else:
        load_legacy(model, ckpt_dir, sidecar, layout)
    return sidecar


def load_legacy(model, ckpt_dir: str | Path, sidecar: Sidecar, layout=None) -> None:
    from megatron_patch.convert.legacy import rank_file
    from megatron_patch.models.mapping import RankCoord
    from megatron_patch.convert.model_io import current_coord, load_state_dict_strict
    from megatron_patch.models.mapping.naming import to_spec
    from megatron_patch.models.builder import model_spec_name

    ckpt_layout = sidecar.parallel_layout
    if layout is not None and (layout.tp, layout.pp, layout.ep, layout.expert_tp) != \
            (ckpt_layout.tp, ckpt_layout.pp, ckpt_layout.ep, ckpt_layout.expert_tp):
        raise UserError(f"this legacy checkpoint is for {ckpt_layout}, not {layout}: convert again at that layout "
                        "or use --format torch_dist, which loads at any layout")
    coord = current_coord()
    path = rank_file(Path(ckpt_dir) / RELEASE, RankCoord(coord.tp, coord.pp, coord.ep, coord.tp), ckpt_layout)
    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    state = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    if not any(k.startswith("mtp.") for k in model.state_dict()):  # converted with --mtp, run without it
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    spec = model_spec_name(model)
    if spec == "local":  # rank files hold TE's shards; a few parameters the local spec cuts otherwise
        from megatron_patch.convert.engine import reshard_for_local_spec
        from megatron_patch.models.registry import get_family, parse_arch

        arch = parse_arch(sidecar.hf_config)
        state = reshard_for_local_spec(get_family(arch.family), arch, ckpt_layout, coord, state)
    load_state_dict_strict(model, to_spec(state, spec))


def checkpoint_logits_worker(ckpt_dir: str, layout, tokens: torch.Tensor, dtype=torch.float32):
    """Runs on every rank: build the model at ``layout``, load the checkpoint, return logits (last stage)."""
    from megatron_patch.models.registry import parse_arch
    from megatron_patch.models.builder import build_model
    from megatron_patch.models.inference import forward_logits
    from megatron_patch.runtime import init_model_parallel

    sidecar = read_sidecar(ckpt_dir)
    arch = parse_arch(sidecar.hf_config)
    init_model_parallel(layout)
    model = build_model(arch, layout, dtype)
    load_checkpoint_into_model(model, ckpt_dir, layout)
    return forward_logits(model, tokens, arch.vocab_size)

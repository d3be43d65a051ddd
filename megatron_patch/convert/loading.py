"""Load a checkpoint written by ``hf_to_mcore`` into this rank's live GPTModel.

torch_dist: megatron-core's own ``dist_checkpointing.load`` with the model's sharded state dict, at
any TP/PP/EP. legacy: this rank's ``model_optim_rng.pt`` at exactly the layout it was written for.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_patch.convert.sidecar import RELEASE_DIR, Sidecar, read_sidecar
from megatron_patch.errors import UserError


def load_checkpoint_into_model(model, ckpt_dir: str | Path, layout=None) -> Sidecar:
    """Fill ``model`` (built by ``build_model`` on this rank) from ``ckpt_dir``; returns its sidecar."""
    ckpt_dir = Path(ckpt_dir)
    sidecar = read_sidecar(ckpt_dir)
    if sidecar.checkpoint_format == "torch_dist":
        load_torch_dist(model, ckpt_dir / RELEASE_DIR)
    else:
        load_legacy(model, ckpt_dir, sidecar, layout)
    return sidecar


def load_torch_dist(model, release_dir: str | Path) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_patch.convert.torch_dist import TorchDistReader

    sharded = model.sharded_state_dict()
    # Transformer-engine modules may ask for _extra_state objects a CPU-written checkpoint lacks;
    # they hold only FP8 bookkeeping, which starts fresh.
    stored = TorchDistReader(release_dir).keys()
    sharded = {k: v for k, v in sharded.items()
               if not (isinstance(v, ShardedObject) and k.endswith("_extra_state") and v.unique_key not in stored)}
    state = dist_checkpointing.load(sharded, str(release_dir))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise UserError(f"torch_dist checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def load_legacy(model, ckpt_dir: str | Path, sidecar: Sidecar, layout=None) -> None:
    from megatron_patch.convert.legacy import rank_file
    from megatron_patch.convert.mapping import RankCoord
    from megatron_patch.convert.model_io import current_coord, load_state_dict_strict
    from megatron_patch.convert.naming import to_spec
    from megatron_patch.models.builder import model_spec_name

    ckpt_layout = sidecar.parallel_layout
    if layout is not None and (layout.tp, layout.pp, layout.ep, layout.expert_tp) != \
            (ckpt_layout.tp, ckpt_layout.pp, ckpt_layout.ep, ckpt_layout.expert_tp):
        raise UserError(f"this legacy checkpoint is for {ckpt_layout}, not {layout}: convert again at that layout "
                        "or use --format torch_dist, which loads at any layout")
    coord = current_coord()
    path = rank_file(Path(ckpt_dir) / "release", RankCoord(coord.tp, coord.pp, coord.ep, coord.tp), ckpt_layout)
    state = torch.load(path, map_location="cpu", weights_only=True)["model"]
    from megatron_patch.models import parse_arch

    state = to_spec({k: v for k, v in state.items() if not k.endswith("_extra_state")}, model_spec_name(model),
                    parse_arch(sidecar.hf_config).is_moe)
    dtype = next(model.parameters()).dtype
    load_state_dict_strict(model, {k: v.to(dtype) for k, v in state.items()})


def checkpoint_logits_worker(ckpt_dir: str, layout, tokens: torch.Tensor, dtype=torch.float32):
    """Runs on every rank: build the model at ``layout``, load the checkpoint, return logits (last stage)."""
    from megatron_patch.models import parse_arch
    from megatron_patch.models.builder import build_model
    from megatron_patch.models.inference import forward_logits
    from megatron_patch.runtime import init_model_parallel

    sidecar = read_sidecar(ckpt_dir)
    arch = parse_arch(sidecar.hf_config)
    init_model_parallel(layout)
    model = build_model(arch, layout, dtype)
    load_checkpoint_into_model(model, ckpt_dir, layout)
    return forward_logits(model, tokens, arch.vocab_size)

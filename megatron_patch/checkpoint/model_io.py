"""Move weights between HF tensors and a live, possibly sharded, MCore model in this process."""

from __future__ import annotations

import torch

from megatron_patch.checkpoint.engine import (
    MappingError, check_hf_names, check_tied_copies, plan, rank_state_dict_from_hf)
from megatron_patch.models.blocks.builder import model_spec_name
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.registry import get_family
from megatron_patch.models.mapping import RankCoord
from megatron_patch.models.mapping.naming import checkpoint_name
from megatron_patch.runtime.distributed import ParallelLayout

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# processes that import this module without building a megatron-core model (align's main process, the
# launcher's dry run and resume checks) do not pay for it.


def current_coord() -> RankCoord:
    from megatron.core import parallel_state as ps

    return RankCoord(
        tp=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        ep=ps.get_expert_model_parallel_rank(),
        etp=ps.get_expert_tensor_parallel_rank(),
    )


def load_state_dict_strict(model, state_dict: dict[str, torch.Tensor]) -> None:
    """load_state_dict that names what is missing or extra (TE's _extra_state entries aside). Each
    tensor takes the dtype of the model's own (a float32 router bias stays float32 in a bf16 model)."""
    model_names = {checkpoint_name(k): k for k in model.state_dict() if not k.endswith("_extra_state")}
    state = model.state_dict()
    own = {k: state[m] for k, m in model_names.items()}
    missing, extra = set(own) - set(state_dict), set(state_dict) - set(own)
    if missing or extra:
        raise MappingError(f"state dict does not fit the model: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
    for name, tensor in state_dict.items():
        if tuple(own[name].shape) != tuple(tensor.shape):
            raise MappingError(f"{name}: checkpoint shape {tuple(tensor.shape)} but the model expects {tuple(own[name].shape)}")
    model.load_state_dict({model_names[k]: v.to(own[k].dtype) for k, v in state_dict.items()}, strict=False)


def load_hf_weights(model, arch: Arch, layout: ParallelLayout, reader, pp_first_stage_layers: int | None = None) -> None:
    """Fill this rank's model from an HF checkpoint (``reader``: ``keys()`` and ``get(name)``, e.g.
    ``HFCheckpointReader``), each tensor cast to the model's own dtype. As strict as the converter."""
    family = get_family(arch.family)
    reader = family.hf_reader(reader)
    check_hf_names(family, arch, plan(family, arch, ParallelLayout()), reader.keys())
    check_tied_copies(family, arch, reader.get, set(reader.keys()))
    sd = rank_state_dict_from_hf(family, arch, layout, current_coord(), reader.get, model_spec_name(model),
                                 pp_first_stage_layers)
    load_state_dict_strict(model, sd)

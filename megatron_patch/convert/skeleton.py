"""What the MCore model of an ``Arch`` looks like, taken from megatron-core itself, without weights.

The converter never guesses megatron's layout: it builds the GPTModel once at TP=PP=EP=1 with
uninitialised storage (nothing is written to it, so it costs no resident memory), and reads

- the shape of every parameter, to check each HF tensor against config.json before any byte is
  read, and
- every entry of ``model.sharded_state_dict()``: the torch_dist key, global shape and offset of each
  tensor chunk (layers stacked on a leading axis, experts on a second one, the SwiGLU ``linear_fc1``
  as [gate; up]), and the ``_extra_state`` objects a model asks for when loading.

A torch_dist checkpoint holds global tensors, so these single-rank entries describe it completely,
whatever TP/PP/EP it is later loaded at.

The model is built in a helper process: building one needs megatron's process groups and, without
CUDA, the CPU compatibility layer, which patches torch process-wide (transformers models loaded
afterwards in the same process are not reliable). The caller's process stays untouched.
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass

import torch

from megatron_patch.models.mapping.naming import local_to_te_names
from megatron_patch.errors import UserError
from megatron_patch.models.arch import Arch


@dataclass(frozen=True)
class ChunkEntry:
    """One ShardedTensor of the single-rank model: a block of ``key`` taken from parameter ``name``."""

    name: str                        # TE-spec parameter name (the weight tables' MCore name)
    key: str                         # torch_dist key
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]     # with the prepended (layer, expert) axes as 1s
    prepend: int                     # number of prepended axes

    def region(self) -> tuple[slice, ...]:
        """Which part of the full (TP=1) parameter this chunk holds."""
        return tuple(slice(o, o + s) for o, s in zip(self.global_offset[self.prepend:], self.local_shape[self.prepend:]))


@dataclass(frozen=True)
class ObjectEntry:
    """A ShardedObject (``_extra_state``): stored as the torch.save bytes of ``[data]`` under ``unique_key``."""

    unique_key: str
    payload: bytes


@dataclass(frozen=True)
class ModelSkeleton:
    shapes: dict[str, tuple[int, ...]]   # TE name -> full (TP=1) shape
    chunks: list[ChunkEntry]
    objects: list[ObjectEntry]


def _ensure_single_rank_state() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_patch.runtime import ParallelLayout, init_model_parallel

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise UserError("checkpoint conversion runs in a single process: do not launch it with torchrun")
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() == 1 \
            and ps.get_pipeline_model_parallel_world_size() == 1 and ps.get_expert_model_parallel_world_size() == 1:
        return
    init_model_parallel(ParallelLayout())


def describe_model(arch: Arch) -> ModelSkeleton:
    """The skeleton of ``arch``'s MCore model (computed in a helper process; independent of dtype)."""
    return _describe_cached(json.dumps(arch.hf_config, sort_keys=True), arch.mtp_layers, arch.vocab_padded_to)


@functools.lru_cache(maxsize=8)
def _describe_cached(hf_config_json: str, mtp_layers: int, vocab_padded_to: int | None) -> ModelSkeleton:
    from megatron_patch.runtime.launch import run_local

    return run_local(_describe_worker, 1, hf_config_json, mtp_layers, vocab_padded_to)[0]


def _describe_worker(hf_config_json: str, mtp_layers: int, vocab_padded_to: int | None) -> ModelSkeleton:
    import dataclasses

    from megatron_patch.models.registry import parse_arch

    return describe_model_here(dataclasses.replace(parse_arch(json.loads(hf_config_json)), mtp_layers=mtp_layers,
                                                   vocab_padded_to=vocab_padded_to))


def describe_model_here(arch: Arch) -> ModelSkeleton:
    """``describe_model`` in this process (sets up a world of one and megatron's CPU layer)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from megatron_patch.models.builder import build_model

    _ensure_single_rank_state()
    # Storage is allocated but never touched (no initialisation), so it never becomes resident.
    model = build_model(arch, _single_layout(), torch.float32, use_te=False, pre_process=True, post_process=True,
                        perform_initialization=False, use_cpu_initialization=True)
    local_state = model.state_dict()
    te_name = local_to_te_names(local_state)
    shapes = {te_name[k]: tuple(v.shape) for k, v in local_state.items() if not k.endswith("_extra_state") and v is not None}
    chunks: list[ChunkEntry] = []
    objects: list[ObjectEntry] = []
    for sd_name, entry in model.sharded_state_dict().items():
        built = entry.build() if isinstance(entry, ShardedTensorFactory) else entry
        for item in built if isinstance(built, list) else [built]:
            if isinstance(item, ShardedTensor):
                if item.flattened_range is not None:
                    raise UserError("flattened sharded tensors are not expected in a model state dict")
                prepend = item.prepend_axis_num
                chunks.append(ChunkEntry(
                    name=te_name.get(sd_name, sd_name), key=item.key, global_shape=tuple(item.global_shape),
                    global_offset=tuple(item.global_offset), local_shape=(1,) * prepend + tuple(item.local_shape),
                    prepend=prepend))
            elif isinstance(item, ShardedObject):
                buf = io.BytesIO()
                torch.save([item.data], buf)  # megatron stores a list of the objects sharing a key
                objects.append(ObjectEntry(item.unique_key, buf.getvalue()))
            else:
                raise UserError(f"unexpected entry {type(item).__name__} in the model's sharded state dict")
    del model
    return ModelSkeleton(shapes, chunks, objects)


def _single_layout():
    from megatron_patch.runtime import ParallelLayout

    return ParallelLayout()

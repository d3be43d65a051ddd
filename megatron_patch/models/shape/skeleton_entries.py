"""What a model skeleton holds (``skeleton.describe_model``): every parameter's shape, the torch_dist
chunks and ``_extra_state`` objects of the single-rank model, and the HF shapes its config implies.

Shared by the two ways of knowing it: asking megatron-core (``skeleton``) and the rules that derive it
without megatron-core (``derived_skeleton``).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.registry import get_family
from megatron_patch.models.mapping import MappingError, Transfer, names_list, plan_transfers
from megatron_patch.models.mapping.splits import Replicated
from megatron_patch.runtime.distributed import ParallelLayout

SKELETON_FORMAT = 3  # 3: a chunk's place in its parameter when it is a piece stored under a key of its own


@dataclass(frozen=True)
class ChunkEntry:
    """One ShardedTensor of the single-rank model: a block of ``key`` taken from parameter ``name``."""

    name: str                        # TE-spec parameter name (the weight tables' MCore name)
    key: str                         # torch_dist key
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]     # with the prepended (layer, expert) axes as 1s
    prepend: int                     # number of prepended axes
    # Where in the parameter a piece stored as a tensor of its own starts (megatron-core's Gated DeltaNet keeps
    # its input projection as query, key, value, z, beta and alpha); None: at its global offset.
    position: tuple[int, ...] | None = None

    def region(self) -> tuple[slice, ...]:
        """Which part of the full (TP=1) parameter this chunk holds."""
        start = self.global_offset[self.prepend:] if self.position is None else self.position
        return tuple(slice(o, o + s) for o, s in zip(start, self.local_shape[self.prepend:]))


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
    hf_shapes: dict[str, tuple[int, ...]]  # HF name -> the shape config.json implies
    # Entries of ``shapes`` that are buffers, not parameters (DeepSeek's router ``expert_bias``): saved
    # and converted like weights, but no optimizer or gradient buffer holds them.
    buffers: frozenset[str] = frozenset()

    def to_json(self) -> dict:
        return {"format": SKELETON_FORMAT,
                "shapes": {k: list(v) for k, v in self.shapes.items()},
                "buffers": sorted(self.buffers),
                "hf_shapes": {k: list(v) for k, v in self.hf_shapes.items()},
                "chunks": [[c.name, c.key, list(c.global_shape), list(c.global_offset), list(c.local_shape), c.prepend,
                            None if c.position is None else list(c.position)] for c in self.chunks],
                "objects": [[o.unique_key, base64.b64encode(o.payload).decode()] for o in self.objects]}

    @classmethod
    def from_json(cls, data: dict) -> "ModelSkeleton":
        if data.get("format") != SKELETON_FORMAT:
            raise ValueError(f"skeleton format {data.get('format')!r}")
        return cls(shapes={k: tuple(v) for k, v in data["shapes"].items()},
                   chunks=[ChunkEntry(n, k, tuple(g), tuple(o), tuple(s), int(p), None if at is None else tuple(at))
                           for n, k, g, o, s, p, at in data["chunks"]],
                   objects=[ObjectEntry(k, base64.b64decode(p)) for k, p in data["objects"]],
                   hf_shapes={k: tuple(v) for k, v in data["hf_shapes"].items()},
                   buffers=frozenset(data["buffers"]))


def expected_hf_shapes(arch: Arch, shapes: dict[str, tuple[int, ...]], transfers: list[Transfer] | None = None
                       ) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor, derived from the parameters megatron-core builds for ``arch`` (the
    weight table's splits run backwards on shapes). ``transfers``: the table at TP=PP=EP=1, if planned.

    Also checks that the weight table writes every parameter of the model and nothing else.
    """
    planned, out = set(), {}
    if transfers is None:
        transfers = plan_transfers(get_family(arch.family).weight_rules(arch), arch, ParallelLayout())
    for t in transfers:
        name = t.placements[0].mcore_name
        planned.add(name)
        if name not in shapes:
            raise MappingError(f"the {arch.family} weight table writes {name}, which the MCore model does not have")
        shape = shapes[name]
        hf_shapes = [shape] * len(t.hf_names) if isinstance(t.split, Replicated) else \
            t.split.merged_shapes(shape, t.context)
        for hf_name, s in zip(t.hf_names, hf_shapes):
            out.setdefault(hf_name, tuple(s))
    unplanned = set(shapes) - planned
    if unplanned:
        raise MappingError(f"no {arch.family} mapping rule writes {len(unplanned)} MCore parameter(s): {names_list(unplanned)}")
    return out

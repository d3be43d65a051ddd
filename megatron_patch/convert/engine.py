"""The in-memory mapping engine: HF tensors <-> per-rank MCore state dicts, for any family's table.

Forward: ``hf_to_mcore(family, arch, layout, coord, get_hf)`` builds one rank's state dict.
Inverse: ``mcore_to_hf(family, arch, layout, rank_state_dicts)`` rebuilds every HF tensor.
Both are strict: a missing HF tensor, an HF tensor no rule consumed, or a rank parameter no rule
produced is an error that names them.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch

from megatron_patch.convert.mapping import RankCoord, Transfer, plan_transfers, split_context
from megatron_patch.convert.naming import from_spec, to_spec
from megatron_patch.errors import UserError
from megatron_patch.models.arch import Arch
from megatron_patch.runtime.distributed import ParallelLayout


class MappingError(UserError):
    pass


def _names(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def plan(family, arch: Arch, layout: ParallelLayout, pp_first_stage_layers: int | None = None) -> list[Transfer]:
    return plan_transfers(family.weight_rules(arch), arch, layout, pp_first_stage_layers)


def hf_names_consumed(transfers: list[Transfer]) -> set[str]:
    return {n for t in transfers for n in t.hf_names}


def check_hf_names(transfers: list[Transfer], available: Iterable[str], arch: Arch) -> None:
    """Every tensor the plan needs exists, and every HF tensor is consumed by the plan."""
    available = set(available)
    needed = hf_names_consumed(transfers)
    missing = needed - available
    if missing:
        raise MappingError(f"HF checkpoint lacks {len(missing)} tensor(s) a {arch.family} model needs: {_names(missing)}")
    # A tied checkpoint may still carry lm_head; it must then equal the embedding (checked by callers).
    extra = available - needed - ({"lm_head.weight"} if arch.tie_word_embeddings else set())
    extra = {n for n in extra if not n.endswith("rotary_emb.inv_freq")}
    if extra:
        raise MappingError(f"HF checkpoint has {len(extra)} tensor(s) no {arch.family} mapping rule consumes: {_names(extra)}")


def hf_to_mcore(family, arch: Arch, layout: ParallelLayout, coord: RankCoord,
                get_hf: Callable[[str], torch.Tensor], spec: str = "te",
                pp_first_stage_layers: int | None = None) -> dict[str, torch.Tensor]:
    """One rank's MCore state dict (names for ``spec``) from HF tensors fetched by name."""
    ctx = split_context(arch)
    out: dict[str, torch.Tensor] = {}
    for transfer in plan(family, arch, layout, pp_first_stage_layers):
        mine = [p for p in transfer.placements if coord.holds(transfer, p)]
        if not mine:
            continue
        shards = transfer.split.shards([get_hf(n) for n in transfer.hf_names], transfer.num_shards, ctx)
        for p in mine:
            out[p.mcore_name] = shards[p.shard]
    return to_spec(out, spec, arch.is_moe)


def mcore_to_hf(family, arch: Arch, layout: ParallelLayout,
                rank_state_dicts: Mapping[RankCoord, Mapping[str, torch.Tensor]], spec: str = "te",
                pp_first_stage_layers: int | None = None) -> dict[str, torch.Tensor]:
    """Every HF tensor from the state dicts of the ranks that together hold the model.

    ``rank_state_dicts`` needs at least one rank per distinct shard; extra (data-parallel) copies
    are ignored. Replicated tensors are checked to agree across the ranks merged.
    """
    ctx = split_context(arch)
    named = {c: from_spec(sd, spec, arch.is_moe) for c, sd in rank_state_dicts.items()}
    used: set[tuple] = set()  # (stage, EP rank or None for dense, name)
    hf: dict[str, torch.Tensor] = {}
    for transfer in plan(family, arch, layout, pp_first_stage_layers):
        if len(transfer.hf_names) == 1 and transfer.hf_names[0] in hf:
            # Tied output layer on the last stage: a copy of the embedding, check it is one.
            shards = _gather(transfer, named, used)
            if not torch.equal(transfer.split.merge(shards, ctx)[0], hf[transfer.hf_names[0]]):
                raise MappingError("the last stage's output layer differs from the tied embedding")
            continue
        merged = transfer.split.merge(_gather(transfer, named, used), ctx)
        hf.update(zip(transfer.hf_names, merged))
    # Data-parallel copies are legitimately left unread; a name no rank of its stage contributed is not.
    unused = {name for c, sd in named.items() for name in sd
              if (c.pp, None, name) not in used and (c.pp, c.ep, name) not in used}
    if unused:
        raise MappingError(f"MCore state dict has {len(unused)} parameter(s) no mapping rule reads: {_names(unused)}")
    return hf


def _gather(transfer: Transfer, named, used) -> list[torch.Tensor]:
    shards = []
    for index in range(transfer.num_shards):
        placements = [p for p in transfer.placements if p.shard == index]
        tensor = None
        for p in placements:
            for coord, sd in named.items():
                if coord.holds(transfer, p) and p.mcore_name in sd:
                    tensor = sd[p.mcore_name]
                    used.add((coord.pp, coord.ep if transfer.expert else None, p.mcore_name))
                    break
            if tensor is not None:
                break
        if tensor is None:
            want = placements[0]
            raise MappingError(
                f"no rank state dict holds {want.mcore_name} (stage {want.pp}, shard {index}"
                + (f", EP rank {want.ep})" if want.ep is not None else ")"))
        shards.append(tensor)
    return shards

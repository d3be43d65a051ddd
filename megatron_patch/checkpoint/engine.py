"""The mapping engine: a family's weight table run between HF tensors and per-rank MCore state dicts.

In memory (parity checks, the aligner, tests):

- ``rank_state_dict_from_hf(family, arch, layout, coord, get_hf)``: one rank's state dict;
- ``hf_tensors_from_ranks(family, arch, layout, rank_state_dicts)``: every HF tensor back.

The strictness checks live here once, and the streaming converter (``convert.checkpoint``) runs the
same ones: ``check_hf_names`` (a needed HF tensor missing, an HF tensor no rule consumes),
``check_tied_copies`` (an HF copy of a tied tensor that differs), ``RankShards`` (a transfer's shards
gathered from the ranks that hold them; afterwards every parameter no rule read is named) and
``HFAssembler`` (shards merged into HF tensors; a last-stage copy of a tied embedding that differs
from the embedding, or replicas that disagree, are errors).
"""

from __future__ import annotations

import dataclasses

from typing import Callable, Generic, Iterable, Mapping, TypeVar

from megatron_patch.lazy import LazyModule
from megatron_patch.models.description.arch import Arch, validate_layout
from megatron_patch.models.description.family import ModelFamily
from megatron_patch.models.mapping import (  # noqa: F401 (MappingError, names_list: the converter's errors)
    REPLICATED, MappingError, RankCoord, Transfer, names_list, plan_transfers)
from megatron_patch.models.mapping.naming import from_spec, to_spec
from megatron_patch.models.mapping.stacks import member_index, stacked_names
from megatron_patch.runtime.distributed import ParallelLayout

T = TypeVar("T")
torch = LazyModule("torch", __name__)  # the streaming converter uses the checks here without tensors


def plan(family: ModelFamily, arch: Arch, layout: ParallelLayout, pp_first_stage_layers: int | None = None,
         spec: str = "te", *, checked: bool = False) -> list[Transfer]:
    """The family's table expanded at ``layout`` (refused, naming why, if the layout cannot hold ``arch``;
    ``checked``: the caller has refused such a layout already, as a conversion does once, before anything slow)."""
    if not checked:
        validate_layout(arch, layout, pp_first_stage_layers=pp_first_stage_layers)
    return plan_transfers(family.weight_rules(arch), arch, layout, pp_first_stage_layers, spec)


def check_hf_names(family: ModelFamily, arch: Arch, transfers: list[Transfer], available: Iterable[str]) -> None:
    """Every tensor the plan needs exists, and every HF tensor is consumed by the plan (or is a buffer
    the family ignores, or the stored copy of a tied tensor)."""
    available = set(available)
    needed = stacked_names({n for t in transfers for n in t.hf_names}, family.hf_stacked(arch))
    missing = needed - available
    if missing:
        raise MappingError(f"HF checkpoint lacks {len(missing)} tensor(s) a {arch.family} model needs: {names_list(missing)}")
    copies = set(family.tied_hf_names(arch)) | set(family.hf_copies(arch))
    # a model built without its multi-token-prediction layers leaves theirs unread (the converter says so)
    unbuilt = family.hf_mtp_names(arch, available) if not arch.mtp_layers else set()
    extra = {n for n in available - needed - copies - unbuilt if not (family.is_ignored(n) or family.is_carried(n))}
    if extra:
        raise MappingError(f"HF checkpoint has {len(extra)} tensor(s) no {arch.family} mapping rule consumes: {names_list(extra)}")


def check_tied_copies(family: ModelFamily, arch: Arch, get_hf: Callable[[str], torch.Tensor], available) -> None:
    """A tied checkpoint may still store the copy (lm_head), and an MTP layer stores copies of the
    embedding and head (``ModelFamily.hf_copies``): each must equal what it copies."""
    for name, source in family.tied_hf_names(arch).items():
        if name in available and not torch.equal(get_hf(name), get_hf(source)):
            raise MappingError(f"config.json ties the embeddings but {name} differs from {source}: "
                               "set tie_word_embeddings=false")
    for name, source in family.hf_copies(arch).items():
        if name in available and not torch.equal(get_hf(name), get_hf(source)):
            raise MappingError(f"{name} differs from {source}, which megatron-core shares with it: the checkpoint "
                               "cannot be represented")


class RankShards(Generic[T]):
    """A transfer's shards, gathered from the state dicts of the ranks that hold them.

    ``state_dicts`` needs at least one rank per distinct shard; extra (data-parallel) copies are left
    unread. ``load`` turns an entry into a tensor (identity in memory, a disk read for lazy files).
    """

    def __init__(self, state_dicts: Mapping[RankCoord, Mapping[str, T]], load: Callable[[T], torch.Tensor] = lambda t: t):
        self.state_dicts, self.load = state_dicts, load
        self.used: set[tuple] = set()  # (stage, EP rank or None for dense, name)

    def shards(self, transfer: Transfer) -> list[torch.Tensor]:
        out = []
        for index in range(transfer.num_shards):
            placements = [p for p in transfer.placements if p.shard == index]
            found = next(((coord, p) for p in placements for coord, sd in self.state_dicts.items()
                          if coord.holds(transfer, p) and p.mcore_name in sd), None)
            if found is None:
                want = placements[0]
                raise MappingError(
                    f"no rank state dict holds {want.mcore_name} (stage {want.pp}, shard {index}"
                    + (f", EP rank {want.ep})" if want.ep is not None else ")"))
            coord, p = found
            out.append(self.load(self.state_dicts[coord][p.mcore_name]))
            self.used.add((coord.pp, coord.ep if transfer.expert else None, p.mcore_name))
        return out

    def check_all_read(self) -> None:
        """Data-parallel copies are legitimately left unread; a name no rank of its stage contributed is not."""
        unused = {name for c, sd in self.state_dicts.items() for name in sd
                  if (c.pp, None, name) not in self.used and (c.pp, c.ep, name) not in self.used}
        if unused:
            raise MappingError(f"MCore state dict has {len(unused)} parameter(s) no mapping rule reads: {names_list(unused)}")


class HFAssembler:
    """Merges each transfer's shards back into HF tensors, in plan order.

    ``assemble(t)`` returns, per HF name of ``t``, the merged tensor (``pieces=False``) or the list of
    contiguous pieces whose concatenation on dim 0 is its bytes (``pieces=True``, for writers that
    stream). A transfer that only re-reads an HF tensor already produced (the last stage's copy of a
    tied embedding) returns None after checking the copy equals it.
    """

    def __init__(self, arch: Arch, source, pieces: bool = False):
        self.source, self.pieces = source, pieces
        self.first_user: dict[str, Transfer] = {}

    def merge(self, t: Transfer) -> list:
        """``t``'s HF tensors (or pieces) from its shards, without the tied-copy bookkeeping."""
        shards = self.source.shards(t)
        try:
            return t.split.merge_pieces(shards, t.context) if self.pieces else t.split.merge(shards, t.context)
        except ValueError as exc:  # replicas that disagree
            raise MappingError(f"{t.placements[0].mcore_name}: {exc}")

    def assemble(self, t: Transfer) -> list | None:
        if len(t.hf_names) == 1 and t.hf_names[0] in self.first_user:
            again = self.first_user[t.hf_names[0]]
            copy = t.split.merge(self.source.shards(t), t.context)[0]
            if not torch.equal(copy, again.split.merge(self.source.shards(again), again.context)[0]):
                raise MappingError("the last stage's output layer differs from the tied embedding: the checkpoint "
                                   "was changed in a way HF cannot represent (untie the embeddings in config.json)")
            return None
        merged = self.merge(t)
        for n in t.hf_names:
            self.first_user[n] = t
        return merged


def member_getter(family: ModelFamily, arch: Arch, get_hf: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """``get_hf`` that also gives a stacked tensor's members (models/mapping/stacks.py), keeping the last
    stacked tensor read (a table reads one's members one after another)."""
    index = member_index(family.hf_stacked(arch))
    if not index:
        return get_hf
    last: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in index:
            return get_hf(name)
        stacked, i = index[name]
        if stacked not in last:
            last.clear()
            last[stacked] = get_hf(stacked)
        return last[stacked][i]

    return get


def stack_members(family: ModelFamily, arch: Arch, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf`` with each stacked tensor's members joined into it."""
    for stacked, members in family.hf_stacked(arch).items():
        hf[stacked] = torch.stack([hf.pop(m) for m in members])
    return hf


def rank_state_dict_from_hf(family: ModelFamily, arch: Arch, layout: ParallelLayout, coord: RankCoord,
                            get_hf: Callable[[str], torch.Tensor], spec: str = "te",
                            pp_first_stage_layers: int | None = None) -> dict[str, torch.Tensor]:
    """One rank's MCore state dict (names for ``spec``: "te" or "local") from HF tensors fetched by name."""
    get_hf = member_getter(family, arch, get_hf)
    out: dict[str, torch.Tensor] = {}
    for transfer in plan(family, arch, layout, pp_first_stage_layers, spec):
        mine = [p for p in transfer.placements if coord.holds(transfer, p)]
        if not mine:
            continue
        shards = transfer.split.shards([get_hf(n) for n in transfer.hf_names], transfer.num_shards, transfer.context)
        for p in mine:
            out[p.mcore_name] = shards[p.shard]
    return to_spec(out, spec)


def hf_tensors_from_ranks(family: ModelFamily, arch: Arch, layout: ParallelLayout,
                          rank_state_dicts: Mapping[RankCoord, Mapping[str, torch.Tensor]], spec: str = "te",
                          pp_first_stage_layers: int | None = None) -> dict[str, torch.Tensor]:
    """Every HF tensor from the state dicts of the ranks that together hold the model."""
    source = RankShards({c: from_spec(sd, spec) for c, sd in rank_state_dicts.items()})
    assembler = HFAssembler(arch, source)
    hf: dict[str, torch.Tensor] = {}
    for transfer in plan(family, arch, layout, pp_first_stage_layers, spec):
        merged = assembler.assemble(transfer)
        if merged is not None:
            hf.update(zip(transfer.hf_names, merged))
    source.check_all_read()
    hf.update({copy: hf[source_name] for copy, source_name in family.hf_copies(arch).items()})
    return stack_members(family, arch, hf)


def _same_split(a, b) -> bool:
    """Whether two splits cut alike: each plan builds its family's rules anew, so a split without a local variant
    is an equal object of its own in each (splits compare by identity)."""
    return a is b or (type(a) is type(b) and dataclasses.is_dataclass(a)
                      and dataclasses.astuple(a) == dataclasses.astuple(b))


def reshard_for_local_spec(family: ModelFamily, arch: Arch, layout: ParallelLayout, coord: RankCoord,
                           state: dict[str, torch.Tensor], pp_first_stage_layers: int | None = None) -> dict:
    """One rank's TE-layout state dict (TE names) with the parameters the local spec shards otherwise
    re-cut for it: TE keeps them whole on every rank (MLA's down projections), so this rank's piece of
    the local split is cut from the whole tensor it already holds."""
    te, local = plan(family, arch, layout, pp_first_stage_layers), plan(family, arch, layout, pp_first_stage_layers, "local")
    out = dict(state)
    for t_te, t_local in zip(te, local):
        if _same_split(t_te.split, t_local.split):
            continue
        if not isinstance(t_te.split, type(REPLICATED)):
            raise MappingError(f"cannot re-cut {t_te.placements[0].mcore_name} for the local spec from a {t_te.split} split")
        for p in t_local.placements:
            if coord.holds(t_local, p) and p.mcore_name in out:
                out[p.mcore_name] = t_local.split.shards([out[p.mcore_name]], t_local.num_shards,
                                                         t_local.context)[p.shard]
    return out

"""A weight table expanded for one model and one parallel layout.

``plan_transfers`` turns a family's rules into concrete transfers: each reads its HF tensors once and
yields every shard with the ranks it belongs to (pipeline stage with stage-local layer numbers, EP
rank with EP-local expert numbers, TP or expert-TP shard). The in-memory engine and the streaming
converter both run these plans.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from typing import Iterable

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import Arch, AttentionShape, pipeline_layer_ranges
from megatron_patch.models.mapping.rules import AS_STORED, KEPT_AS_STORED, Rule, Scope
from megatron_patch.models.mapping.splits import Split, SplitContext
from megatron_patch.runtime.distributed import ParallelLayout


class MappingError(UserError):
    """A weight table and a model (or checkpoint) that do not agree."""


def names_list(names: Iterable[str], limit: int = 8) -> str:
    """Names for an error message: sorted, at most ``limit``, with how many more there are."""
    names = sorted(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


@dataclass(frozen=True)
class Placement:
    """Where one shard lives: pipeline stage, EP rank (None: on every EP rank), shard index."""

    pp: int
    ep: int | None
    shard: int
    mcore_name: str


@dataclass(frozen=True)
class Transfer:
    hf_names: tuple[str, ...]
    split: Split
    expert: bool             # shard index counts expert-tensor-parallel ranks, not TP ranks
    num_shards: int
    placements: tuple[Placement, ...]
    # the numbers ``split`` cuts by: its layer's own (a layer may have an attention shape of its own)
    context: SplitContext
    dtype: str | None = None  # a dtype name kept whatever the checkpoint's dtype (Rule.dtype)

    def dtype_in(self, checkpoint_dtype: str) -> str:
        """The dtype name this transfer's tensors have in a checkpoint of ``checkpoint_dtype`` (a name)."""
        if self.dtype in KEPT_AS_STORED:
            raise MappingError(f"internal error: {self.hf_names[0]} keeps its stored dtype, not yet read from its file")
        return self.dtype or checkpoint_dtype

    def as_stored(self, dtype_of) -> "Transfer":
        """This transfer with an ``AS_STORED`` or ``FLOAT_AS_STORED`` dtype replaced by ``dtype_of(self)`` (the dtype
        name its tensor has where it is read from); any other transfer as it is."""
        return dataclasses.replace(self, dtype=dtype_of(self)) if self.dtype in KEPT_AS_STORED else self

    @property
    def floating(self) -> bool:
        """Whether its tensors are float weights, refused where they are read stored otherwise (cast by value, an
        integer or boolean tensor would be silently another weight): every tensor but an integer table."""
        return self.dtype != AS_STORED


@dataclass(frozen=True)
class RankCoord:
    """One rank's place in the layout (what parallel_state reports for it)."""

    tp: int = 0
    pp: int = 0
    ep: int = 0
    etp: int = 0

    def holds(self, transfer: Transfer, placement: Placement) -> bool:
        if placement.pp != self.pp:
            return False
        if transfer.expert:
            return placement.ep == self.ep and placement.shard == self.etp
        return placement.shard == self.tp


def split_context(arch: Arch, layer: int | None = None) -> SplitContext:
    """The numbers the splits cut by: decoder layer ``layer``'s own attention shape, else the model's."""
    shape = arch.attention_shape(layer) if layer is not None else AttentionShape(arch.num_kv_heads, arch.head_dim)
    return SplitContext(arch.num_heads, shape.num_kv_heads, shape.head_dim, arch.vocab_size, arch.padded_vocab_size())


def plan_transfers(rules: list[Rule], arch: Arch, layout: ParallelLayout,
                   pp_first_stage_layers: int | None = None, spec: str = "te") -> list[Transfer]:
    """Every transfer of ``rules`` at ``layout``, sharded as the ``spec`` ("te" or "local") layer
    spec shards it (checkpoint files use TE's; a live CPU model, the local spec's)."""
    ranges = pipeline_layer_ranges(arch.num_layers, layout.pp, pp_first_stage_layers)
    experts_per_rank = arch.num_experts // layout.ep if arch.is_moe else 0
    transfers: list[Transfer] = []
    contexts = {None: split_context(arch)}

    def add(hf_names, rule, expert, placements_for_shard, layer=None):
        n = layout.expert_tp if expert else layout.tp
        placements = tuple(p for i in range(n) for p in placements_for_shard(i))
        split = rule.local_split if spec == "local" and rule.local_split is not None else rule.split
        shape = arch.attention_shape(layer) if layer is not None else None
        if shape not in contexts:
            contexts[shape] = split_context(arch, layer)
        transfers.append(Transfer(tuple(hf_names), split, expert, n, placements, contexts[shape], rule.dtype))

    for rule in rules:
        if rule.scope is Scope.FIRST_STAGE:
            add(rule.hf, rule, False, lambda i, r=rule: [Placement(0, None, i, r.mcore)])
        elif rule.scope is Scope.LAST_STAGE:
            hf = rule.hf
            if rule.tied_to is not None and arch.tie_word_embeddings:
                # Tied: a single stage shares the embedding itself; with PP > 1 the last stage keeps
                # its own copy of the embedding, as megatron does.
                if layout.pp == 1:
                    continue
                hf = (rule.tied_to,)
            add(hf, rule, False, lambda i, r=rule: [Placement(layout.pp - 1, None, i, r.mcore)])
        else:
            if rule.mtp:  # multi-token-prediction layers follow the decoder, on the last stage
                spots = [(layout.pp - 1, k, arch.num_layers + k) for k in range(arch.mtp_layers)]
            else:
                spots = [(stage, local, layer) for stage, layers in enumerate(ranges) for local, layer in enumerate(layers)]
            for stage, local, layer in spots:
                if not rule.covers(arch, layer):
                    continue
                mcore = rule.mcore.replace("{layer}", str(local))
                # an MTP layer's HF name counts on from the decoder's ({layer}) or from 0 ({mtp_layer})
                hf = [h.replace("{layer}", str(layer)).replace("{mtp_layer}", str(local)) for h in rule.hf]
                if rule.scope is Scope.LAYER:
                    add(hf, rule, False, lambda i, m=mcore, s=stage: [Placement(s, None, i, m)], layer)
                    continue
                for expert in range(arch.num_experts):
                    ep_rank, local_expert = divmod(expert, experts_per_rank)
                    add([h.replace("{expert}", str(expert)) for h in hf], rule, True,
                        lambda i, m=mcore.replace("{expert}", str(local_expert)), s=stage, e=ep_rank:
                        [Placement(s, e, i, m)], layer)
    return transfers

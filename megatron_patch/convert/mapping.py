"""Weight mappings as data: MCore name pattern <- HF name pattern(s), with the split that joins them.

Patterns use ``{layer}`` (global layer index on the HF side, stage-local on the MCore side) and
``{expert}`` (global expert index on the HF side, EP-rank-local on the MCore side). MCore names are
written in the transformer-engine spec's naming, the one checkpoints use; ``naming.py`` renames them
for the local spec.

``plan_transfers`` expands a table for one model and one parallel layout into concrete transfers:
each reads its HF tensors once and yields every shard with the ranks it belongs to. The in-memory
engine and the streaming converter both run these plans.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from megatron_patch.convert.splits import Split, SplitContext
from megatron_patch.models.arch import Arch, pipeline_layer_ranges
from megatron_patch.runtime.distributed import ParallelLayout


class Scope(Enum):
    FIRST_STAGE = "first"    # embedding: on pipeline stage 0
    LAST_STAGE = "last"      # final norm, output layer
    LAYER = "layer"          # once per decoder layer
    EXPERT = "expert"        # once per (layer, expert); split across expert-tensor-parallel ranks


@dataclass(frozen=True)
class Rule:
    mcore: str
    hf: tuple[str, ...]
    split: Split
    scope: Scope = Scope.LAYER
    # Only for one kind of layer (e.g. dense MLP vs MoE); None for every layer.
    when: str | None = None

    def __post_init__(self):
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))


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


def split_context(arch: Arch) -> SplitContext:
    return SplitContext(arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size, arch.padded_vocab_size())


def layer_kind(arch: Arch, layer: int) -> str:
    return "moe" if arch.is_moe else "dense"


def plan_transfers(rules: list[Rule], arch: Arch, layout: ParallelLayout,
                   pp_first_stage_layers: int | None = None) -> list[Transfer]:
    ranges = pipeline_layer_ranges(arch.num_layers, layout.pp, pp_first_stage_layers)
    experts_per_rank = arch.num_experts // layout.ep if arch.is_moe else 0
    transfers: list[Transfer] = []

    def add(hf_names, rule, expert, placements_for_shard):
        n = layout.expert_tp if expert else layout.tp
        placements = tuple(p for i in range(n) for p in placements_for_shard(i))
        transfers.append(Transfer(tuple(hf_names), rule.split, expert, n, placements))

    for rule in rules:
        if rule.scope is Scope.FIRST_STAGE:
            add(rule.hf, rule, False, lambda i, r=rule: [Placement(0, None, i, r.mcore)])
        elif rule.scope is Scope.LAST_STAGE:
            hf = rule.hf
            if rule.mcore == "output_layer.weight" and arch.tie_word_embeddings:
                # Tied: a single stage shares the embedding itself; with PP > 1 the last stage keeps
                # its own copy of the embedding, as megatron does.
                if layout.pp == 1:
                    continue
                hf = ("model.embed_tokens.weight",)
            add(hf, rule, False, lambda i, r=rule: [Placement(layout.pp - 1, None, i, r.mcore)])
        else:
            for stage, layers in enumerate(ranges):
                for local, layer in enumerate(layers):
                    if rule.when is not None and rule.when != layer_kind(arch, layer):
                        continue
                    mcore = rule.mcore.replace("{layer}", str(local))
                    hf = [h.replace("{layer}", str(layer)) for h in rule.hf]
                    if rule.scope is Scope.LAYER:
                        add(hf, rule, False, lambda i, m=mcore, s=stage: [Placement(s, None, i, m)])
                        continue
                    for expert in range(arch.num_experts):
                        ep_rank, local_expert = divmod(expert, experts_per_rank)
                        add([h.replace("{expert}", str(expert)) for h in hf], rule, True,
                            lambda i, m=mcore.replace("{expert}", str(local_expert)), s=stage, e=ep_rank:
                            [Placement(s, e, i, m)])
    return transfers

"""The weight-mapping vocabulary: rules, split kinds, their expansion into per-layout transfers, and
the two MCore layer specs' names. It belongs to the models layer: a family's table is written in it,
and the converter, the in-memory engine and the aligner only run what the tables say.
"""

from megatron_patch.models.mapping.plan import (  # noqa: F401
    MappingError, Placement, RankCoord, Transfer, names_list, plan_transfers, split_context)
from megatron_patch.models.mapping.rules import AS_STORED, FLOAT_AS_STORED, LORA_TARGETS, LayerKind, LoraSite, Rule, Scope, tied_hf_names  # noqa: F401
from megatron_patch.models.mapping.splits import (  # noqa: F401
    COLUMN, GATE_UP, GATE_UP_FUSED, GATE_UP_INTERLEAVED, QKV, QKV_GATED, REPLICATED, ROW, ROW_TRANSPOSED, VOCAB, Block,
    ConcatPieces, GroupedDeltaNetInput, Split, SplitContext)

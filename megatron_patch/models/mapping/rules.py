"""The words a weight table is written in: which MCore parameter comes from which HF tensors, and how.

A family's table (``models/<family>/mapping.py``) is a list of ``Rule``s. Patterns use ``{layer}``
(global layer index on the HF side, stage-local on the MCore side) and ``{expert}`` (global expert
index on the HF side, EP-rank-local on the MCore side). MCore names are written in the
transformer-engine spec's naming, the one checkpoints use; ``naming.py`` renames them for the local
spec. ``plan.py`` expands a table for one model and one parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from megatron_patch.models.mapping.splits import Split


class LayerKind(Enum):
    """Which decoder layers a LAYER/EXPERT rule covers (an MoE model may also have dense layers)."""

    DENSE = "dense"
    MOE = "moe"


# What MP_LORA_TARGETS names: the groups of MCore linear layers that take LoRA adapters.
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "experts", "shared_experts", "indexer")


# Rule.dtype of a tensor kept in the dtype it is stored in, whatever that is (resolved by the converter per file):
# an integer table
AS_STORED = "as stored"
# Rule.dtype of a float parameter kept in the float dtype it is stored in (one a model holds in float32 whatever
# its dtype, which a bf16 checkpoint may hold in bf16 or float32); checked floating as every weight is
FLOAT_AS_STORED = "float, as stored"
KEPT_AS_STORED = (AS_STORED, FLOAT_AS_STORED)


@dataclass(frozen=True)
class LoraSite:
    """A rule whose MCore parameter is the weight of a linear layer that takes LoRA adapters, as peft puts
    them on the HF side: one adapter per HF module (q, k and v each their own, gate and up each their own),
    on the rule's HF tensors.

    ``target``: its MP_LORA_TARGETS group. ``hf_param``: for routed experts, the HF parameter that holds
    every expert of a layer (transformers 5 stacks them: ``mlp.experts.gate_up_proj`` [E, 2I, H]), written
    relative to the HF layer; peft reaches it through ``target_parameters`` with one adapter per layer
    whose A and B stack the experts' (the rule's own HF names are the per-expert tensors of the checkpoint
    files, and of adapters made with transformers 4).
    """

    target: str
    hf_param: str | None = None

    def __post_init__(self):
        if self.target not in LORA_TARGETS:
            raise ValueError(f"LoRA target {self.target!r} is not one of {LORA_TARGETS}")


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
    # The HF tensor this one is a copy of when config.json ties the embeddings (lm_head ->
    # embed_tokens): then HF stores at most a copy, and MCore shares the embedding on one stage or
    # keeps its own copy on the last stage.
    tied_to: str | None = None
    # Only layers of this kind (None: every layer).
    layers: LayerKind | None = None
    # Only layers whose attention is of this type (Arch.attention_type: "linear_attention", ...; None: every
    # layer), for models that mix attention types with different weights (Qwen3-Next).
    attention: str | None = None
    # Only these decoder layers (their numbers in the model; None: every layer), for a model whose layers differ
    # by position (Gemma 4's KV-shared last layers have no key/value weights).
    only: frozenset[int] | None = None
    # How the local spec shards it, where that differs from the TE spec's ``split`` (MLA's down
    # projections: TE keeps them whole on every rank, megatron-core's local spec splits their rows).
    local_split: Split | None = None
    # A multi-token-prediction layer's rule: expanded over the MTP layers (on the last pipeline stage),
    # ``{layer}`` being the MTP index on the MCore side and the HF layer after the decoder's on the HF side
    # (``{mtp_layer}``: the MTP index there too, as Qwen3-Next's ``mtp.layers.{k}`` count).
    mtp: bool = False
    # A dtype it keeps whatever the checkpoint's dtype (DeepSeek's router bias: float32 in the hub's
    # checkpoints and in megatron-core, where routing decisions depend on its exact values), by name
    # ("float32"): the converter plans bytes by dtype name, without importing torch. ``AS_STORED``: the dtype
    # the tensor has where it is read from (the HF file on hf2mcore, the MCore checkpoint on mcore2hf), as an
    # integer table is kept in whichever integer dtype its checkpoint chose; ``FLOAT_AS_STORED`` the same for a
    # float parameter.
    dtype: str | None = None
    # The linear layer this rule's weight belongs to takes LoRA adapters (None: it does not).
    lora: LoraSite | None = None

    def covers(self, arch, layer: int) -> bool:
        """Whether this LAYER/EXPERT rule has a tensor in decoder layer ``layer`` of ``arch``."""
        if self.layers is not None and (self.layers is LayerKind.MOE) != arch.is_moe_layer(layer):
            return False
        if self.attention is not None and self.attention != arch.attention_type(layer):
            return False
        return self.only is None or layer in self.only

    def __post_init__(self):
        if isinstance(self.hf, str):
            object.__setattr__(self, "hf", (self.hf,))
        if self.tied_to is not None and len(self.hf) != 1:
            raise ValueError(f"{self.mcore}: only a rule with one HF tensor can be tied to another")


def tied_hf_names(rules: list[Rule]) -> dict[str, str]:
    """HF name -> the HF name it copies when the embeddings are tied (e.g. lm_head -> embed_tokens)."""
    return {rule.hf[0]: rule.tied_to for rule in rules if rule.tied_to is not None}

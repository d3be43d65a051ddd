"""A model's parameters and training FLOPs, known in one place: from the shapes megatron-core builds.

megatron-core builds (in the skeleton's helper process, cached on disk: ``models/shape/skeleton.py``) one
decoder layer of each kind the model has, with the embedding, the final norm, the output layer and any
multi-token-prediction layers. A layer's kind is everything that can change its parameters: its MLP
(dense or MoE) and, where config.json gives per-layer types (``layer_types``), its attention (full,
sliding-window or linear). Everything below is arithmetic over those shapes and the family's weight
table, which says how each parameter is cut for a layout:

- **total** parameters: the whole model; **active**: what one token passes through (in an MoE layer
  the router, the shared experts and top-k of the E routed experts; everything else whole, the
  embedding and output layer included, as published sizes count them);
- **per rank**: the parameters one rank of a TP/PP/EP layout holds, in module order (the memory plan
  lays its DDP buffers out from them);
- **training FLOPs per token**, in Megatron-LM's convention (``num_floating_point_operations``):
  6 FLOPs (2 forward, 4 backward) per weight-matrix element a token passes through (MoE layers at
  top-k, the output layer's logits included, the embedding lookup not), plus causal attention's
  score and value products, 6 * (s/2) * heads * (qk head dim + v head dim) per attention layer for a
  sequence of s tokens (half the score matrix is masked). This holds for GQA and MLA alike, since
  both terms come from the built shapes. A sliding-window layer counts the keys its window leaves
  (on average W - W^2/2s of them for s > W, s/2 otherwise); a linear-attention layer (Gated DeltaNet)
  has no score matrix, and counts its recurrent state instead: per token and value head, 6 * 2 * (key
  head dim * value head dim) for the state update and the read-out. Megatron-LM leaves the router's GEMM and the norms out; the
  router is counted here (it is a matrix), which changes a total by well under 0.1%.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from megatron_patch.models.description.arch import (
    FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION, Arch, pipeline_layer_ranges)
from megatron_patch.models.description.registry import get_family
from megatron_patch.models.mapping import RankCoord, plan_transfers
from megatron_patch.models.mapping.splits import Replicated
from megatron_patch.models.shape.skeleton import ModelSkeleton, describe_models, only_layers
from megatron_patch.runtime.distributed import ParallelLayout

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"\.mlp\.experts\.")
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"


def layer_kind(arch: Arch, layer: int) -> str:
    """What decides a decoder layer's parameters: its MLP (dense or MoE), for a model with per-layer types its
    attention, and what the family's settings make differ (``FamilyConfig.layer_kind``)."""
    mlp = "moe" if arch.is_moe_layer(layer) else "dense"
    kind = f"{arch.attention_type(layer)}+{mlp}" if arch.layer_types else mlp
    own = arch.family_config.layer_kind(layer) if arch.family_config is not None else ""
    return f"{kind}+{own}" if own else kind


def representative_layers(arch: Arch) -> tuple[int, ...]:
    """The first layer of each kind, in model order: what megatron-core is asked to build."""
    first: dict[str, int] = {}
    for i in range(arch.num_layers):
        first.setdefault(layer_kind(arch, i), i)
    return tuple(sorted(first.values()))


@dataclass(frozen=True)
class RankParam:
    """One parameter as one rank holds it."""

    name: str
    numel: int
    expert: bool = False            # a routed expert's weight
    shared_embedding: bool = False  # tied embeddings across pipeline stages: a bucket of its own


@dataclass(frozen=True)
class ModelShape:
    """Full (TP=PP=EP=1) parameter shapes, in module order: the model's ends and one layer of each kind
    (parameters only: buffers such as DeepSeek's router ``expert_bias`` are neither counted nor trained)."""

    arch: Arch
    ends: dict[str, tuple[int, ...]]                    # embedding, final norm, output layer, MTP layers
    layers: dict[str, dict[str, tuple[int, ...]]]       # kind -> layer-relative name -> shape
    reduced: Arch                                       # the model megatron-core built: one layer per kind
    _divisors: dict = field(default_factory=dict, compare=False, repr=False)

    # --- totals ---------------------------------------------------------------------------------------

    def _share(self, name: str, active: bool) -> float:
        """How much of a parameter counts: all of it, except a routed expert's when counting what one token
        uses (top-k of E)."""
        if active and _EXPERT.search("." + name):
            return self.arch.moe_topk / self.arch.num_experts
        return 1.0

    def _kind_counts(self) -> Counter:
        return Counter(layer_kind(self.arch, i) for i in range(self.arch.num_layers))

    def layer_params(self, kind: str, *, active: bool = False) -> float:
        return sum(math.prod(shape) * self._share(name, active) for name, shape in self.layers[kind].items())

    def params(self, *, active: bool = False) -> int:
        """Parameters of the whole model (MTP layers included when the model carries them); ``active``:
        those one token passes through."""
        body = sum(c * self.layer_params(k, active=active) for k, c in self._kind_counts().items())
        ends = sum(math.prod(shape) * self._share(name, active) for name, shape in self.ends.items())
        return round(body + ends)

    # --- FLOPs ----------------------------------------------------------------------------------------

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of a ``seq_len`` sequence (forward and backward; see the module doc)."""
        arch = self.arch
        matrices = sum(count * sum(_matrix(n, s) * self._share(n, True) for n, s in self.layers[kind].items())
                       for kind, count in self._kind_counts().items())
        matrices += sum(_matrix(n, s) * self._share(n, True) for n, s in self.ends.items() if n.startswith("mtp."))
        vocab_rows = self.ends[EMBEDDING][0]
        matrices += vocab_rows * arch.hidden_size * (1 + arch.mtp_layers)  # logits, once per prediction head
        attention = 0.0
        for i in range(arch.num_layers + arch.mtp_layers):
            head = arch.attention_shape(i).head_dim  # a layer's own head size where its attention type has one
            qk, v = (arch.mla.qk_head_dim, arch.mla.v_head_dim) if arch.mla else (head, head)
            attention += _attention_terms(arch, arch.attention_type(i), seq_len, qk, v)
        return 6.0 * (matrices + attention)

    # --- one rank of a layout ------------------------------------------------------------------------

    def rank_params(self, layout: ParallelLayout, pp_rank: int, vp_stage: int = 0, *,
                    pp_first_stage_layers: int | None = None, spec: str = "local") -> list[RankParam]:
        """The parameters of model chunk ``vp_stage`` of pipeline rank ``pp_rank`` (TP, EP and expert-TP
        rank 0), in the order ``named_parameters()`` gives them, sharded as the ``spec`` layer spec shards
        them ("local": megatron-core's own layers; "te": transformer-engine's)."""
        arch, vp = self.arch, layout.vp or 1
        chunk = chunk_layers(arch, layout, pp_rank, vp_stage, pp_first_stage_layers)
        first = pp_rank == 0 and vp_stage == 0
        last = pp_rank == layout.pp - 1 and vp_stage == vp - 1
        divisor = self._shard_divisors(layout, spec)
        # the reduced model's layer of each kind
        built = {layer_kind(arch, i): j for j, i in enumerate(representative_layers(arch))}
        tied_across = arch.tie_word_embeddings and layout.pp > 1
        vocab_shards = divisor[EMBEDDING][0]
        out: list[RankParam] = []
        if first:
            out.append(RankParam(EMBEDDING, math.prod(self.ends[EMBEDDING]) // vocab_shards,
                                 shared_embedding=tied_across and not last))
        for local, layer in enumerate(chunk):
            kind = layer_kind(arch, layer)
            for rel, shape in self.layers[kind].items():
                held = divisor.get(f"decoder.layers.{built[kind]}.{rel}")
                if held is not None:  # not an expert of another EP rank
                    out.append(RankParam(f"decoder.layers.{local}.{rel}", math.prod(shape) // held[0], held[1]))
        if last:
            for name, shape in self.ends.items():
                held = divisor.get(name)
                if name not in (EMBEDDING, OUTPUT) and held is not None:
                    out.append(RankParam(name, math.prod(shape) // held[0], held[1]))
            if not (arch.tie_word_embeddings and first):
                # tied with PP > 1: the last stage's own copy of the embedding, as megatron keeps it
                output = self.ends.get(OUTPUT, self.ends[EMBEDDING])
                out.append(RankParam(OUTPUT, math.prod(output) // vocab_shards, shared_embedding=tied_across))
        return out

    def _shard_divisors(self, layout: ParallelLayout, spec: str) -> dict[str, tuple[int, bool]]:
        """For every parameter rank 0 of ``layout`` holds (pipeline stages aside): by how much its full
        shape is divided, and whether it is an expert's. From the family's weight table, the converter's."""
        key = (layout.tp, layout.ep, layout.expert_tp, spec)
        if key not in self._divisors:
            reduced = self.reduced
            flat = ParallelLayout(tp=layout.tp, ep=layout.ep, etp=layout.expert_tp)
            out: dict[str, tuple[int, bool]] = {}
            for t in plan_transfers(get_family(reduced.family).weight_rules(reduced), reduced, flat, spec=spec):
                for p in t.placements:
                    if RankCoord().holds(t, p):
                        out[p.mcore_name] = (1 if isinstance(t.split, Replicated) else t.num_shards, t.expert)
            self._divisors[key] = out
        return self._divisors[key]


def chunk_layers(arch: Arch, layout: ParallelLayout, pp_rank: int, vp_stage: int = 0,
                 pp_first_stage_layers: int | None = None) -> range:
    """The global decoder layers of model chunk ``vp_stage`` of pipeline rank ``pp_rank``."""
    if pp_first_stage_layers is not None:
        return pipeline_layer_ranges(arch.num_layers, layout.pp, pp_first_stage_layers)[pp_rank]
    return pipeline_layer_ranges(arch.num_layers, layout.pp * (layout.vp or 1), None)[vp_stage * layout.pp + pp_rank]


# The attention types whose FLOPs ``_attention_terms`` knows; any other is counted as full causal attention.
COUNTED_ATTENTION = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION)


def flops_uncounted(arch: Arch) -> str | None:
    """Why ``flops_per_token`` does not count this model's attention (None: it does). A layer type it does not know
    (DeepSeek-V4's compressed attention: a sliding window plus compressed or top-k entries, an indexer) would be
    counted as full causal attention, s/2 keys per query, far more than such a layer's useful work."""
    other = sorted({arch.attention_type(i) for i in range(arch.num_layers)} - set(COUNTED_ATTENTION))
    if not other:
        return None
    return (f"the FLOPs formula (models/shape/model_shape.py) counts {', '.join(COUNTED_ATTENTION)} layers; "
            f"{', '.join(other)} would be counted as full causal attention")


def _attention_terms(arch: Arch, kind: str, seq_len: int, qk: int, v: int) -> float:
    """Multiply-adds per token of one layer's attention beyond its weights (module doc)."""
    if kind == LINEAR_ATTENTION:
        linear = arch.linear_attention
        return 2 * linear.num_value_heads * linear.key_head_dim * linear.value_head_dim
    keys = seq_len / 2
    if kind == SLIDING_ATTENTION and arch.sliding_window and seq_len > arch.sliding_window:
        keys = arch.sliding_window - arch.sliding_window ** 2 / (2 * seq_len)
    return keys * arch.num_heads * (qk + v)


def _matrix(name: str, shape: tuple[int, ...]) -> int:
    """Elements of a weight a token is multiplied by (2-D weights; norms, biases and the lookup are not)."""
    return math.prod(shape) if len(shape) == 2 and name != EMBEDDING else 0


def model_shape(arch: Arch) -> ModelShape:
    return model_shapes([arch])[0]


def model_shapes(archs: list[Arch]) -> list[ModelShape]:
    """The shapes of several models, with one megatron-core import for all that are not cached."""
    reps = [representative_layers(a) for a in archs]
    skeletons = describe_models([(a, r) for a, r in zip(archs, reps)])
    return [_from_skeleton(a, r, s) for a, r, s in zip(archs, reps, skeletons)]


def _from_skeleton(arch: Arch, reps: tuple[int, ...], skeleton: ModelSkeleton) -> ModelShape:
    kinds = [layer_kind(arch, i) for i in reps]
    layers: dict[str, dict[str, tuple[int, ...]]] = {k: {} for k in kinds}
    ends: dict[str, tuple[int, ...]] = {}
    for name, shape in skeleton.shapes.items():
        if name in skeleton.buffers:
            continue
        m = _LAYER.match(name)
        if m:
            layers[kinds[int(m.group(1))]][m.group(2)] = tuple(shape)
        else:
            ends[name] = tuple(shape)
    return ModelShape(arch, ends, layers, only_layers(arch, reps))

"""What a model is, read once from its Hugging Face config.json, independent of transformers' version.

``Arch`` holds every number the MCore model, the weight mapping and the checks need. Families fill it
from their config.json (``models/<family>/config.py``); everything downstream reads only ``Arch``.
"""

from __future__ import annotations

import math

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_patch.errors import UserError
from megatron_patch.input_files import read_json_object
from megatron_patch.runtime.distributed import ParallelLayout

# Megatron pads the vocabulary so each TP rank holds an equal, aligned slice.
VOCAB_PAD_MULTIPLE = 128
# config.json's layer_types.
FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION = "full_attention", "sliding_attention", "linear_attention"


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention (DeepSeek-V2/V3): queries through a low-rank latent (or a plain
    projection when ``q_lora_rank`` is None), keys and values from one shared latent, and a RoPE part of
    each head apart from the rest."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class SparseAttentionShape:
    """DeepSeek sparse attention (DeepSeek-V3.2, GLM-5): a lightning indexer scores every earlier token
    with ``n_heads`` small heads of ``head_dim`` (RoPE on the first ``rope_head_dim`` of each, interleaved
    pairs or halves), and each query attends to its ``topk`` best."""

    topk: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    rope_interleaved: bool


@dataclass(frozen=True)
class LinearAttentionShape:
    """Gated DeltaNet (Qwen3-Next's linear attention): key and value heads, their sizes, and the causal
    convolution's kernel over the q/k/v channels. ``in_proj``: the HF tensors its input projection is made of,
    each named by the pieces it holds (q, k: a key head's size each; v, z: a value head's; b, a: one per value
    head): Qwen3-Next's in_proj_qkvz and in_proj_ba, Qwen3.5's in_proj_qkv, _z, _b and _a."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    in_proj: tuple[str, ...] = ("qkvz", "ba")

    def in_proj_rows(self) -> tuple[int, ...]:
        """The rows of each of ``in_proj``'s HF tensors."""
        rows = {"q": self.num_key_heads * self.key_head_dim, "k": self.num_key_heads * self.key_head_dim,
                "v": self.num_value_heads * self.value_head_dim, "z": self.num_value_heads * self.value_head_dim,
                "b": self.num_value_heads, "a": self.num_value_heads}
        return tuple(sum(rows[piece] for piece in name) for name in self.in_proj)


@dataclass(frozen=True)
class AttentionShape:
    """One attention type's own key/value heads and head size, where its layers differ from the model's
    ``num_kv_heads`` and ``head_dim`` (Gemma 4's full-attention layers: wider heads, other key/value heads);
    the query heads are the model's."""

    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class FamilyConfig:
    """A family's own typed settings, which only its model reads (``Arch.family_config``): a family subclasses
    this (a frozen dataclass) in its folder instead of adding fields here, which every family would carry.

    Where the settings make some layers differ from others (Gemma 4's KV-shared last layers), they say how
    (``layer_kind``: the shape probe builds one layer of each kind), follow a renumbering of the layers
    (``only_layers``: the probe's model of a few layers), and refuse the layouts the model cannot run
    (``check_layout``, called by ``validate_layout``).

    ``replicated_kv_heads``: the family's attention keeps its key/value heads whole on every TP rank (DeepSeek-V4's
    one shared head), so TP need not divide them. ``padding_is_neutral``: what evaluation may do with its
    layers."""

    replicated_kv_heads = False
    # Whether padding after a sequence leaves its log-likelihoods alone (evaluation/loading.py).
    padding_is_neutral = True
    # Pieces of the names of parameters its model keeps frozen (requires_grad False), which the memory plan holds
    # outside the gradient buffers and the optimizer (DeepSeek-V4's indexer: ".indexer.").
    frozen_parameters = ()  # tuple[str, ...]
    # Names of the modules whose parameters its model keeps in float32 in a 16-bit run (each a whole component of
    # the parameter's name, as models/blocks/precision.py marks them: DeepSeek-V4's hyper-connections, norms,
    # sinks), which the memory plan counts at 4 bytes, their own master copy.
    float32_parameters = ()  # tuple[str, ...]
    # Whether its layers run megatron-core's core attention, whose kernel the memory plan names (DeepSeek-V4's
    # attention computes its own scores).
    core_attention = True
    # Hyper-connections (DeepSeek-V4): (residual streams, Sinkhorn-Knopp iterations of the stream mix), which the
    # memory plan counts; None: one residual stream, as every other family.
    hyper_connections = None  # tuple[int, int] | None

    def layer_kind(self, layer: int) -> str:
        return ""

    def only_layers(self, layers: tuple[int, ...]) -> "FamilyConfig":
        return self

    def check_layout(self, arch: "Arch", layout: ParallelLayout, pp_first_stage_layers: int | None) -> None:
        return None

    def routes_by_token_id(self, layer: int) -> bool:
        """Whether MoE layer ``layer`` picks its experts from a fixed table of the token id (DeepSeek-V4's hash
        layers: ``tid2eid[token_id]``), not from router scores: no rounding can change that choice, so the aligner
        holds it to the reference exactly."""
        return False

    def least_weight_elements(self, arch: "Arch") -> int | None:
        """The family's own lower bound of its checkpoint files' bytes (config_checks.least_weight_elements),
        where the common one, the weights it counts at one byte each, would exceed what the family's published
        files hold; None: the common one."""
        return None


@dataclass(frozen=True)
class Arch:
    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    # Every linear layer has a bias (q/k/v, output projection, MLP): megatron-core's add_bias_linear.
    linear_bias: bool = False
    # RoPE scaling as config.json gives it ({"rope_type": "linear" | "llama3" | "yarn", ...}, see
    # ROPE_TYPES); None for plain RoPE. models/blocks/rope.py turns it into frequencies.
    rope_scaling: dict | None = None
    # The share of each head's dimensions RoPE rotates (config.json's partial_rotary_factor: the first
    # int(head_dim * it) dimensions, the rest pass through); megatron-core's rotary_percent.
    rotary_percent: float = 1.0
    # Mixture of experts (0 experts: dense).
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    # Whether top-k routing probabilities are renormalised to sum to one.
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    # Layers of an MoE model that have a dense MLP (of ffn_hidden_size) instead of experts.
    dense_layers: tuple[int, ...] = ()
    # Multi-latent attention instead of GQA (head_dim is then the value head dimension).
    mla: MLAShape | None = None
    # DeepSeek sparse attention's indexer, on top of multi-latent attention.
    sparse_attention: SparseAttentionShape | None = None
    # Each decoder layer's attention as config.json's ``layer_types`` names it ("full_attention",
    # "sliding_attention", "linear_attention"); empty: full attention in every layer.
    layer_types: tuple[str, ...] = ()
    # The key window of "sliding_attention" layers (transformers' sliding_window: a query sees itself and
    # the sliding_window - 1 keys before it).
    sliding_window: int | None = None
    # A learnt per-head logit joins every softmax and takes its share (gpt-oss's attention sinks).
    attention_sinks: bool = False
    # The "linear_attention" layers' shape.
    linear_attention: LinearAttentionShape | None = None
    # Multi-token-prediction layers the MCore model carries (DeepSeek-V3's; 0 unless converted with them).
    mtp_layers: int = 0
    # The embedding's row count when a checkpoint written elsewhere padded the vocabulary otherwise
    # (Megatron-LM pads to a multiple of 128 x TP): the model is built with exactly its rows.
    vocab_padded_to: int | None = None
    # The attention types whose layers have a shape of their own, as (type, AttentionShape) pairs; every other
    # layer has the model's num_kv_heads and head_dim (``attention_shape``).
    own_attention_shapes: tuple[tuple[str, AttentionShape], ...] = ()
    # What only the family's own modules read (Gemma 3's local RoPE base, its softmax scale): its FamilyConfig.
    family_config: FamilyConfig | None = None
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def attention_type(self, layer: int) -> str:
        """Layer ``layer``'s attention (``layer_types``), "full_attention" when config.json names none; an MTP
        layer after the decoder's has full attention."""
        return self.layer_types[layer] if layer < len(self.layer_types) else FULL_ATTENTION

    def attention_shape(self, layer: int) -> AttentionShape:
        """Layer ``layer``'s key/value heads and head size: its attention type's own, else the model's."""
        return dict(self.own_attention_shapes).get(self.attention_type(layer),
                                                   AttentionShape(self.num_kv_heads, self.head_dim))

    @property
    def attention_shapes(self) -> tuple[AttentionShape, ...]:
        """Every distinct attention shape of the model's layers, the model's own first."""
        return tuple(dict.fromkeys([AttentionShape(self.num_kv_heads, self.head_dim),
                                    *(s for _, s in self.own_attention_shapes)]))

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer not in self.dense_layers

    def routes_by_token_id(self, layer: int) -> bool:
        """Whether MoE layer ``layer``'s experts are a table of the token id (``FamilyConfig.routes_by_token_id``)."""
        own = self.family_config
        return self.is_moe_layer(layer) and own is not None and own.routes_by_token_id(layer)

    @property
    def has_dense_layers(self) -> bool:
        """Whether any layer has a dense MLP (every layer of a dense model; some of a mixed MoE model)."""
        return not self.is_moe or bool(self.dense_layers)

    @property
    def moe_layer_pattern(self) -> list[int]:
        """megatron-core's ``moe_layer_freq`` list: 1 for an MoE layer, 0 for a dense one."""
        return [int(self.is_moe_layer(i)) for i in range(self.num_layers)]

    def padded_vocab_size(self, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
        """Vocabulary rounded up so that every TP size dividing ``multiple`` splits it evenly.

        Independent of TP on purpose: a torch_dist checkpoint then loads at any TP <= multiple.
        A checkpoint from another tool keeps its own padding (``vocab_padded_to``).
        """
        if self.vocab_padded_to is not None:
            return self.vocab_padded_to
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict:
        return asdict(self)


def read_config_json(path: str | Path, hint: str = "point at a Hugging Face model folder that has a config.json"
                     ) -> dict[str, Any]:
    """The raw config.json of an HF model folder (or the file itself), with one-line errors; a folder's
    config.json must be a regular file inside it (``input_files``)."""
    path = Path(path)
    if path.is_dir():
        return read_json_object(path / "config.json", inside=path, hint=hint)
    return read_json_object(path, hint=hint)


def require(raw: dict, key: str, kind=int, *, aliases: tuple[str, ...] = ()):
    """A config.json field that must be present (under ``key`` or one of its ``aliases``: transformers
    writes some fields under other names than the hub's configs); a wrong or missing one is named."""
    found = next((k for k in (key, *aliases) if raw.get(k) is not None), None)
    if found is None:
        raise UserError(f"config.json lacks '{key}', which a {raw.get('model_type', '?')} model needs")
    value = raw[found]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise UserError(f"config.json '{found}' must be a positive integer, found {value!r}")
    if kind is float and not isinstance(value, (int, float)):
        raise UserError(f"config.json '{found}' must be a number, found {value!r}")
    return value


# Keys each supported RoPE type reads from config.json (besides rope_theta); None: optional.
ROPE_TYPES: dict[str, dict[str, bool]] = {
    "default": {},
    "linear": {"factor": True},
    "llama3": {"factor": True, "low_freq_factor": True, "high_freq_factor": True,
               "original_max_position_embeddings": True},
    "yarn": {"factor": True, "original_max_position_embeddings": True, "beta_fast": False, "beta_slow": False,
             "mscale": False, "mscale_all_dim": False, "attention_factor": False, "truncate": False},
}


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(scaling: dict) -> float:
    """The factor transformers' YaRN scales cos and sin by: config.json's ``attention_factor``, else the ratio
    of the two mscales where both are given, else the plain YaRN one."""
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
    return yarn_mscale(factor)


def check_partial_yarn(scaling: dict | None, rotary_percent: float) -> None:
    """YaRN's factor scales cos and sin, so only the rotated part of each head: the models here fold it into the
    softmax scale, which scales the whole score, and that is the same only where RoPE covers the head."""
    if not scaling or scaling.get("rope_type") != "yarn" or rotary_percent >= 1:
        return
    factor = yarn_attention_factor(scaling)
    if factor != 1.0:
        raise UserError(f"YaRN on part of each head (partial rotary factor {rotary_percent:g}) is not supported: "
                        f"transformers scales the rotated part alone by its attention factor {factor:.6g}, which "
                        "megatron-core here would apply to the whole score")


def rope_source(raw: dict) -> dict:
    """The dict of RoPE settings transformers 5 reads: ``rope_scaling`` (4.x's name) where given, else
    ``rope_parameters``; a ``rope_theta`` or ``partial_rotary_factor`` inside it wins over the top-level one
    (``standardize_rope_params`` only sets them where the dict lacks them)."""
    return raw.get("rope_scaling") or raw.get("rope_parameters") or {}


def partial_rotary_factor(raw: dict, default: float | None = 1.0) -> float | None:
    """config.json's ``partial_rotary_factor`` (5.x keeps it in ``rope_parameters``, 4.x at the top),
    ``default`` when absent."""
    params = rope_source(raw)
    value = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise UserError(f"config.json partial_rotary_factor must be a number in (0, 1], found {value!r}")
    return float(value)


def rope_settings(raw: dict, *, partial: bool = False) -> tuple[float, dict | None]:
    """(theta, scaling or None) from either config.json convention; the scaling dict holds
    ``rope_type`` and the fields ``ROPE_TYPES`` lists for it, exactly as config.json gives them.

    transformers < 5 writes ``rope_theta`` and ``rope_scaling``; 5.x writes ``rope_parameters``.
    A RoPE megatron-core cannot be given (any other type) is refused, and so is a partial rotary
    dimension unless the family's model has one (``partial``: ``partial_rotary_factor`` then gives it).
    """
    source = rope_source(raw)
    theta = source.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = source.get("rope_type", source.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise UserError(f"RoPE type '{rope_type}' is not supported: supported are {', '.join(ROPE_TYPES)}")
    factor = partial_rotary_factor(raw)
    if factor != 1.0 and not partial:
        raise UserError(f"partial_rotary_factor={factor} (RoPE on part of each head) is not supported for "
                        f"{raw.get('model_type', 'this model')}: only full rotary embeddings convert exactly")
    if rope_type == "default":
        return float(theta), None
    out: dict = {"rope_type": rope_type}
    for key, needed in ROPE_TYPES[rope_type].items():
        value = source.get(key)
        if key == "original_max_position_embeddings":
            # As transformers reads it: a top-level value wins (Phi-3 style), else the scaling's own,
            # else the model's context length.
            value = raw.get(key) or value or raw.get("max_position_embeddings")
        if value is None:
            if needed:
                raise UserError(f"config.json {rope_type} RoPE scaling lacks {key}")
            continue
        out[key] = value if isinstance(value, bool) else float(value)
    return float(theta), out


def validate_layout(arch: Arch, layout: ParallelLayout, *, pp_first_stage_layers: int | None = None,
                    uneven_pipelines: bool = True) -> None:
    """Refuse a layout that cannot split this model, before any work, saying what to change. ``uneven_pipelines``:
    the asking command takes MP_PP0_LAYERS (the launcher, Pai's converter scripts); the others are told where an
    uneven first stage is taken instead."""
    for name, value in (("TP", layout.tp), ("PP", layout.pp), ("EP", layout.ep), ("ETP", layout.expert_tp), ("CP", layout.cp)):
        if value < 1:
            raise UserError(f"{name} must be >= 1, got {value}")
    tp = layout.tp
    if arch.num_heads % tp:
        raise UserError(f"TP={tp} does not divide the {arch.num_heads} attention heads: choose a TP that divides {arch.num_heads}")
    replicated_kv = arch.family_config is not None and arch.family_config.replicated_kv_heads
    for shape in () if replicated_kv else arch.attention_shapes:
        if shape.num_kv_heads % tp:
            raise UserError(
                f"TP={tp} does not divide the {shape.num_kv_heads} query groups (key/value heads): "
                f"choose a TP that divides {shape.num_kv_heads}")
    linear = arch.linear_attention
    if linear is not None and (linear.num_key_heads % tp or linear.num_value_heads % tp):
        raise UserError(f"TP={tp} does not divide the linear attention's {linear.num_key_heads} key and "
                        f"{linear.num_value_heads} value heads: choose a TP that divides both")
    if arch.has_dense_layers and arch.ffn_hidden_size % tp:
        raise UserError(f"TP={tp} does not divide the MLP size {arch.ffn_hidden_size}: choose another TP")
    if arch.padded_vocab_size() % tp:
        raise UserError(f"TP={tp} does not divide the padded vocabulary {arch.padded_vocab_size()}: use a power-of-two TP")
    layers = f"{arch.num_layers} layers" + (f" ({len(arch.dense_layers)} dense, then MoE)" if arch.dense_layers else "")
    if pp_first_stage_layers is None:
        if arch.num_layers % layout.pp:
            first = first_stage_that_fits(arch.num_layers, layout.pp)
            hint = "" if not first else (
                f", or MP_PP0_LAYERS={first} ({stage_split(arch.num_layers, layout.pp, first)})" if uneven_pipelines
                else f" (the training launcher takes PP={layout.pp} with MP_PP0_LAYERS={first}, and loads a torch_dist "
                     "checkpoint converted at any PP)")
            raise UserError(f"PP={layout.pp} does not divide the {layers}: choose a PP that divides "
                            f"{arch.num_layers}{hint}")
    elif not (0 < pp_first_stage_layers < arch.num_layers) or (arch.num_layers - pp_first_stage_layers) % max(layout.pp - 1, 1):
        first = first_stage_that_fits(arch.num_layers, layout.pp)
        raise UserError(
            f"a first stage of {pp_first_stage_layers} of the {layers} leaves {arch.num_layers - pp_first_stage_layers} "
            f"that PP-1={layout.pp - 1} stages cannot share evenly" + (f": try MP_PP0_LAYERS={first}" if first else ""))
    if arch.is_moe:
        if arch.num_experts % layout.ep:
            raise UserError(f"EP={layout.ep} does not divide the {arch.num_experts} experts: choose an EP that divides {arch.num_experts}")
        if arch.moe_ffn_hidden_size % layout.expert_tp:
            raise UserError(f"ETP={layout.expert_tp} does not divide the expert MLP size {arch.moe_ffn_hidden_size}")
        if arch.shared_expert_ffn_hidden_size % tp:
            raise UserError(f"TP={tp} does not divide the shared-expert MLP size {arch.shared_expert_ffn_hidden_size}")
        if arch.linear_bias and layout.expert_tp > 1:
            raise UserError(f"ETP={layout.expert_tp}: megatron-core's experts take biases ({arch.family}) only unsplit: "
                            "set ETP=1")
    elif layout.ep > 1 or layout.etp not in (None, tp):
        # named by what was given: "set EP=1" to an ETP given alone (the tools audit)
        given = f"EP={layout.ep}" if layout.ep > 1 else f"ETP={layout.etp}"
        unset = "set EP=1" if layout.ep > 1 else f"give ETP={tp} (the TP) or none"
        raise UserError(f"{arch.family} is a dense model: EP and ETP apply only to MoE models ({given}), {unset}")
    if layout.cp > 1:
        kinds = set(arch.layer_types)
        unsplit = ("attention sinks" if arch.attention_sinks else "sliding-window attention" if SLIDING_ATTENTION in kinds
                   else "linear attention (Gated DeltaNet)" if LINEAR_ATTENTION in kinds else None)
        if unsplit:
            raise UserError(f"CP={layout.cp}: megatron-core's context parallelism does not split {unsplit} "
                            f"({arch.family}): set CP=1")
    if arch.family_config is not None:
        arch.family_config.check_layout(arch, layout, pp_first_stage_layers)


def default_expert_tp(arch: Arch, layout: ParallelLayout) -> tuple[ParallelLayout, str | None]:
    """``layout`` with the expert-tensor-parallel size, where none was given (megatron-core's default: TP), set to
    what the model supports; and the line that says so (None when that is TP anyway)."""
    if layout.etp is None and layout.tp > 1 and arch.is_moe and arch.linear_bias:
        return replace(layout, etp=1), (f"ETP=1, not TP={layout.tp}: {arch.family}'s experts take their biases only "
                                        "unsplit (--etp sets it)")
    return layout, None


def stage_split(num_layers: int, pp: int, first: int) -> str:
    """'the first stage 1 layer, the other 2 layers' / 'the first stage 2 layers, the 3 others 3 layers each'."""
    rest, others = num_layers - first, pp - 1

    def n(count: int) -> str:
        return f"{count} layer" + ("s" if count != 1 else "")

    return (f"the first stage {n(first)}, " +
            (f"the other {n(rest)}" if others == 1 else f"the {others} others {n(rest // others)} each"))


def first_stage_that_fits(num_layers: int, pp: int) -> int | None:
    """A first-stage size (closest to an even share) that lets the other PP-1 stages split the rest
    evenly, or None."""
    if pp < 2:
        return None
    fits = [f for f in range(1, num_layers) if (num_layers - f) % (pp - 1) == 0 and num_layers - f >= pp - 1]
    return min(fits, key=lambda f: abs(f - num_layers / pp)) if fits else None


def pipeline_layer_ranges(num_layers: int, pp: int, first_stage_layers: int | None = None) -> list[range]:
    """Global layer indices held by each pipeline stage (megatron's even split, or an uneven first stage)."""
    if first_stage_layers is None or pp == 1:
        per = num_layers // pp
        return [range(s * per, (s + 1) * per) for s in range(pp)]
    rest = (num_layers - first_stage_layers) // (pp - 1)
    return [range(0, first_stage_layers)] + [
        range(first_stage_layers + s * rest, first_stage_layers + (s + 1) * rest) for s in range(pp - 1)]

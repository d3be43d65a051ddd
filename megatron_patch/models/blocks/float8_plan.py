"""Which GEMMs of a model run in float8 under torchao (``PR=fp8`` without transformer-engine), decided from
shapes alone: the launcher's checks, its dry run and the memory plan read it without torch, and
``models/blocks/float8.py`` decides each live linear with the same functions.

A GEMM is one HF ``nn.Linear``'s: megatron-core fuses q, k and v into ``linear_qkv`` and gate and up into
``linear_fc1``, and torchao, which sees the HF model's linears, scales and filters each part on its own, so the
parts of a fused weight are decided (and scaled) apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_patch.errors import UserError

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
ROWWISE = ("rowwise", "rowwise_with_gw_hp")  # scales per row, which torch 2.11's CPU float8 GEMM cannot take
KINDS = ("qkv", "proj", "fc1", "fc2", "experts", "shared_experts")
OTHER = "other"  # a parallel linear of a family's own layers (linear attention's projections)
FILTERS = ("auto", "all")

# Layer-relative module names -> kind. Multi-latent attention's projections count as qkv.
_KIND_PATTERNS = (
    (re.compile(r"(^|\.)mlp\.experts\."), "experts"),
    (re.compile(r"(^|\.)mlp\.shared_experts?\."), "shared_experts"),
    (re.compile(r"(^|\.)self_attention\.linear_(qkv|q_proj|q_down_proj|q_up_proj|kv_down_proj|kv_up_proj)$"), "qkv"),
    (re.compile(r"(^|\.)self_attention\.linear_proj$"), "proj"),
    (re.compile(r"(^|\.)mlp\.linear_fc1$"), "fc1"),
    (re.compile(r"(^|\.)mlp\.linear_fc2$"), "fc2"),
)
# The modules of a layer that are megatron-core parallel linears (what float8.decoder_linears converts): its own
# linear_* names and linear attention's in_proj/out_proj; not the router, nor Gemma 4's replicated per-layer-input
# linears (plain torch linears, bf16 like the embedding).
_PARALLEL_LINEAR = re.compile(r"(^|\.)(linear_[a-z0-9_]+|in_proj|out_proj)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.0\.transformer_layer\.(.+)$")


def linear_kind(module: str) -> str:
    """The kind of a decoder layer's linear (its module name inside the layer): one of ``KINDS`` or ``OTHER``."""
    for pattern, kind in _KIND_PATTERNS:
        if pattern.search(module):
            return kind
    return OTHER


def parse_filter(name: str, raw: str):
    """MP_FP8_FILTER / align's --fp8-filter: "auto", "all", or a tuple of kinds."""
    value = raw.strip().lower()
    if value in FILTERS:
        return value
    kinds = tuple(k.strip() for k in value.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise UserError(f"{name} takes auto, all or a comma list of {','.join(KINDS)}, got '{raw}'")
    return tuple(k for k in KINDS if k in kinds)


def family_kinds(arch) -> tuple[str, ...]:
    """The kinds of GEMM ``arch``'s decoder layers have (``KINDS`` order), from its description alone (no model)."""
    have = {"qkv", "proj"}
    if arch.has_dense_layers:
        have |= {"fc1", "fc2"}
    if arch.is_moe:
        have.add("experts")
    if arch.is_moe and arch.shared_expert_ffn_hidden_size:
        have.add("shared_experts")
    return tuple(k for k in KINDS if k in have)


def check_filter_kinds(arch, fp8_filter, asked: str) -> None:
    """A filter of kinds that names one ``arch`` lacks: refused, as MP_LORA_TARGETS is (it ran every GEMM of a kind
    list of only such kinds in bf16, without a word)."""
    if isinstance(fp8_filter, str):
        return
    have = family_kinds(arch)
    missing = [k for k in fp8_filter if k not in have]
    if missing:
        raise UserError(f"{asked} names {','.join(missing)}, which a {arch.family} model does not have: its kinds are "
                        f"{','.join(have)}")


def filter_text(fp8_filter) -> str:
    return fp8_filter if isinstance(fp8_filter, str) else ",".join(fp8_filter)


def torchao_auto_filter(recipe: str, out_features: int, in_features: int) -> bool:
    """torchao 0.18's auto-filter (``_auto_filter_for_recipe``) on one HF linear of shape [out, in]: whether its
    GEMM gains from float8 on an H100 (dimensions multiples of 16, large enough). Written out so that the dry run
    decides without torch; tests/test_fp8.py holds it to torchao's. rowwise_with_gw_hp, for which torchao has no
    filter, takes rowwise's."""
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def fits_gpu_float8(out_features: int, in_features: int, split: int) -> bool:
    """Whether a GEMM of whole shape [out, in] can run in float8 on a GPU when one of its dimensions is split over
    ``split`` ranks: torch._scaled_mm takes only dimensions that are multiples of 16 there (the CPU's takes any).
    Either dimension may be the split one, so both must stay multiples of 16 after the split."""
    return all(d % split == 0 and (d // split) % 16 == 0 for d in (out_features, in_features))


def chosen(kind: str, recipe: str, fp8_filter, out_features: int, in_features: int,
           gpu_split: int | None = None) -> bool:
    """Whether one GEMM (an HF linear's, [out, in] of the whole model) of ``kind`` runs in float8. ``gpu_split``:
    on a GPU, the TP size that splits it (or ETP's, for experts); a GEMM whose shard float8 cannot run there stays
    in bf16 whatever the filter says. None: on the CPU."""
    if gpu_split is not None and not fits_gpu_float8(out_features, in_features, gpu_split):
        return False
    if fp8_filter == "auto":
        return torchao_auto_filter(recipe, out_features, in_features)
    if fp8_filter == "all":
        return True
    return kind in fp8_filter


def qkv_layout(rows: int, *, heads: int, groups: int, head_dim: int) -> tuple[int, tuple[int, ...], tuple[str, ...]]:
    """How ``linear_qkv``'s rows (whole model) divide into HF's q_proj, k_proj and v_proj, given the layer's own
    query heads, key/value heads (query groups) and head size: (groups, rows of each part per group, names).
    The layouts megatron-core and this project's layers build differ in their row count, so it tells them apart:

    - per query group [q heads; k; v]: ``GroupedQKV``;
    - with an output gate (Qwen3-Next, Qwen3.5: ``GatedQKV``), [q heads; gate heads; k; v]: HF's q_proj holds the
      queries and their gates, so its part is both (the same rows in another order, scaled and filtered alike);
    - keys doubling as values (Gemma 4's global layers with ``attention_k_eq_v``), [q heads; k]: no v_proj;
    - queries only (Gemma 4's KV-sharing layers, which reuse an earlier layer's keys and values): q_proj alone."""
    q = heads // groups * head_dim
    for widths, names in (((q, head_dim, head_dim), ("q", "k", "v")), ((2 * q, head_dim, head_dim), ("q", "k", "v")),
                          ((q, head_dim), ("q", "k")), ((q,), ("q",))):
        if groups * sum(widths) == rows:
            return groups, widths, names
    raise ValueError(f"linear_qkv of {rows} rows is no layout of {heads} heads, {groups} query groups of {head_dim}")


def fused_parts(module: str, out_features: int, *, heads: int, groups: int, head_dim: int, gated: bool,
                mla: bool, linear_attention=None) -> tuple[int, tuple[int, ...], tuple[str, ...]]:
    """How the output rows of a decoder linear ``module`` (whole model: ``out_features`` rows) divide into HF
    tensors: (repeats, rows of each part per repeat, the parts' names). q, k and v interleave per query group
    in ``linear_qkv`` (``qkv_layout``; ``heads``, ``groups`` and ``head_dim`` are the layer's own); gate and up
    are the two halves of a gated ``linear_fc1``; a Gated DeltaNet's ``in_proj`` ([q; k; v; z; b; a] on each TP
    rank) holds its HF tensors' pieces in that order (``linear_attention``: the model's ``LinearAttentionShape``),
    each HF tensor's rows a part, split over TP as gate and up are."""
    if module.endswith("self_attention.in_proj") and linear_attention is not None:
        rows = linear_attention.in_proj_rows()
        if sum(rows) != out_features:
            raise ValueError(f"in_proj of {out_features} rows is not {linear_attention.in_proj}'s {rows}")
        return 1, rows, linear_attention.in_proj
    if module.endswith("self_attention.linear_qkv") and not mla and groups:
        repeats, widths, names = qkv_layout(out_features, heads=heads, groups=groups, head_dim=head_dim)
        return (1, (out_features,), names) if len(names) == 1 else (repeats, widths, names)
    if module.endswith("linear_fc1") and gated:
        return 1, (out_features // 2, out_features // 2), ("gate", "up")
    return 1, (out_features,), ("",)


@dataclass(frozen=True)
class Gemm:
    """One GEMM of a layer: the module, the HF part it computes ("" for a whole weight), its kind, whole shape and
    whether it runs in float8."""

    module: str
    part: str
    kind: str
    out_features: int
    in_features: int
    float8: bool


def layer_gemms(linears: dict[str, tuple[int, int]], recipe: str, fp8_filter, *, heads: int, groups: int,
                head_dim: int, gated: bool, mla: bool, gpu_tp: tuple[int, int] | None = None,
                linear_attention=None) -> list[Gemm]:
    """Every GEMM of one layer from its linears' whole shapes (module name -> [out, in]). ``gpu_tp``: on a GPU, the
    (TP, ETP) sizes that split its GEMMs (``chosen``'s ``gpu_split``); None on the CPU."""
    out = []
    for module, (rows, cols) in linears.items():
        kind = linear_kind(module)
        split = None if gpu_tp is None else gpu_tp[1] if kind == "experts" else gpu_tp[0]
        repeats, widths, names = fused_parts(module, rows, heads=heads, groups=groups, head_dim=head_dim,
                                             gated=gated, mla=mla, linear_attention=linear_attention)
        for width, part in zip(widths, names):
            out.append(Gemm(module, part, kind, repeats * width, cols,
                            chosen(kind, recipe, fp8_filter, repeats * width, cols, split)))
    return out


def arch_gemms(arch, recipe: str, fp8_filter, gpu_tp: tuple[int, int] | None = None) -> dict[str, list[Gemm]]:
    """Each layer kind's GEMMs (models/shape/model_shape.py's layer kinds, and "mtp" for the multi-token-prediction
    layers' transformer layer where the model carries them), from the model's shape (``gpu_tp``: ``layer_gemms``')."""
    from megatron_patch.models.shape.model_shape import (  # imported here: megatron-core's skeleton, once
        layer_kind, model_shape, representative_layers)

    shape = model_shape(arch)
    layers = {}  # kind -> (its parameters' shapes, its attention's own heads and head size)
    for i in representative_layers(arch):
        layers[layer_kind(arch, i)] = shape.layers[layer_kind(arch, i)], arch.attention_shape(i)
    mtp = {m.group(1): s for name, s in shape.ends.items() if (m := _MTP_LAYER.match(name))}
    if mtp:  # an MTP layer has full attention with the model's own heads (Arch.attention_type)
        layers["mtp"] = (mtp, arch.attention_shape(arch.num_layers))
    out = {}
    for kind, (params, attention) in layers.items():
        linears = {}
        for name, dims in params.items():
            module = re.sub(r"\.weight\d*$", "", name)
            if len(dims) == 2 and name != module and _PARALLEL_LINEAR.search(module):
                linears[module] = tuple(dims)
        out[kind] = layer_gemms(linears, recipe, fp8_filter, heads=arch.num_heads, groups=attention.num_kv_heads,
                                head_dim=attention.head_dim, gated=True, mla=arch.mla is not None, gpu_tp=gpu_tp,
                                linear_attention=arch.linear_attention)
    return out


def row_parallel(module: str) -> bool:
    """Whether a decoder linear (its layer-relative name) is row-parallel: TP splits its input dimension."""
    return module.endswith(("linear_proj", "linear_fc2", "out_proj"))


def describe(gemms: dict[str, list[Gemm]], recipe: str, fp8_filter) -> list[str]:
    """What the dry run says: the implementation and recipe, and each layer kind's GEMMs in float8 and in bf16."""
    lines = [f"torchao float8, recipe {recipe}, filter {filter_text(fp8_filter)}; communication in bf16; the "
             "embedding, the output layer, routers and norms in bf16"]
    for kind, layer in gemms.items():
        def names(rows):  # an expert's GEMMs named with their kind: routed and shared experts share module names
            return ", ".join(sorted({f"{g.kind + '.' if g.kind in ('experts', 'shared_experts') else ''}"
                                     f"{g.module.split('.')[-1]}{'.' + g.part if g.part else ''}" for g in rows}))

        fp8 = [g for g in layer if g.float8]
        bf16 = [g for g in layer if not g.float8]
        lines.append(f"{kind} layers: float8 {names(fp8) or 'none'}; bf16 {names(bf16) or 'none'}")
    return lines


def cpu_recipe_problem(recipe: str, rowwise_ok: bool, torch_version: str | None, asked: str) -> str | None:
    """Why ``recipe`` cannot run on this CPU (``rowwise_ok``: ``runtime.machine.cpu_float8_rowwise()``), or None;
    ``asked`` is how the user chose it (MP_FP8_RECIPE=..., --fp8-recipe ...)."""
    if recipe in ROWWISE and not rowwise_ok:
        return (f"{asked} scales float8 per row, and torch {torch_version}'s CPU float8 GEMM takes one scale per "
                "tensor only (torch 2.13 takes both): use the tensorwise recipe on this CPU, or a newer torch")
    return None

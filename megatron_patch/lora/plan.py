"""The adapters of a model, planned from its family's weight table: which MCore linear layers take them,
one adapter per HF module, their shapes and their names.

A rule with ``lora`` (``models.mapping.LoraSite``) marks an MCore linear layer whose weight fuses the rule's
HF tensors (q, k and v into ``linear_qkv``; gate and up into ``linear_fc1``). Each HF module keeps an adapter
of its own, as peft puts them: q, k and v each an A [r, in] and a B [rows, r], so an adapter made by peft
imports without loss and an exported one is peft's. The fused layer adds the adapters' outputs in its own row
layout, cut from the HF rows by the rule's split, exactly as the converter cuts the weights.

Routed experts follow transformers 5, where a layer's experts are one 3-D parameter (``gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I]) and peft's ``target_parameters`` gives each expert one A over the fused
gate/up input and one B over both its halves. Here each expert's adapter is its own (A [r, H], B [2I, r]); its
B covers the rule's two HF parts (gate rows, then up rows).

Checkpoints store every adapter whole, under a key made of its HF name (``lora.<module>.lora_A``), so they
load at any TP / PP / EP: a rank's shard is a box of the whole tensor.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from megatron_patch.errors import UserError
from megatron_patch.lora.spec import LoraSpec
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.registry import get_family
from megatron_patch.models.mapping import Rule, Scope, split_context
from megatron_patch.models.mapping.splits import (
    Column, GateUp, GroupedQKV, InterleavedGateUp, Replicated, Row, RowPieces, TransposedRow)
from megatron_patch.models.shape.model_shape import RankParam, chunk_layers, layer_kind, model_shape

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

KEY_PREFIX = "lora."          # torch_dist keys of adapter tensors
PEFT_PREFIX = "base_model.model."  # peft's prefix of module names in adapter_model.safetensors
MC_LAYER = "decoder.layers.{layer}."


@dataclass(frozen=True)
class Adapter:
    """One adapter (peft's unit): A [rank, in_features], B [sum(rows), rank].

    ``name``: peft's name of the HF module, or of the stacked 3-D parameter for routed experts (then
    ``expert`` says which expert's slice this is). ``parts``: which of its site's HF tensors B's rows
    cover, in order, and ``rows`` their row counts.
    """

    name: str
    expert: int | None
    rank: int
    alpha: float
    in_features: int
    parts: tuple[int, ...]
    rows: tuple[int, ...]

    @property
    def storage(self) -> str:
        """The name checkpoints store it under: the HF module, or the stacked parameter with the expert."""
        if self.expert is None:
            return self.name
        module, _, leaf = self.name.rpartition(".")
        return f"{module}.{self.expert}.{leaf}"

    @property
    def key_a(self) -> str:
        return f"{KEY_PREFIX}{self.storage}.lora_A"

    @property
    def key_b(self) -> str:
        return f"{KEY_PREFIX}{self.storage}.lora_B"

    @property
    def shape_a(self) -> tuple[int, int]:
        return (self.rank, self.in_features)

    @property
    def shape_b(self) -> tuple[int, int]:
        return (sum(self.rows), self.rank)

    @property
    def numel(self) -> int:
        return self.rank * (self.in_features + sum(self.rows))


@dataclass(frozen=True)
class Site:
    """One MCore linear layer with adapters, in global numbers (decoder layer, routed expert)."""

    rule: Rule
    layer: int
    expert: int | None
    hf_names: tuple[str, ...]        # the rule's HF tensors here
    part_rows: tuple[int, ...]       # their rows
    in_features: int
    adapters: tuple[Adapter, ...]

    @property
    def target(self) -> str:
        return self.rule.lora.target

    @property
    def mcore_name(self) -> str:
        """The weight's MCore name (TE naming), with the global layer and expert numbers."""
        name = self.rule.mcore.replace("{layer}", str(self.layer))
        return name if self.expert is None else name.replace("{expert}", str(self.expert))

    def covering(self, part: int) -> tuple[int, int] | None:
        """(adapter index, first row in its B) of HF part ``part``, or None when no adapter covers it
        (a partial adapter: its rows of the fused layer get nothing added)."""
        for i, a in enumerate(self.adapters):
            if part in a.parts:
                k = a.parts.index(part)
                return i, sum(a.rows[:k])
        return None


COLUMN, ROW, WHOLE = "column", "row", "whole"


def site_split(site: Site, spec_name: str):
    """The split of the layer of ``site`` in the ``spec_name`` ("te" / "local") layer spec."""
    return site.rule.local_split if spec_name == "local" and site.rule.local_split is not None else site.rule.split


def split_mode(split) -> str:
    """How a layer whose weight is cut by ``split`` is parallel."""
    if isinstance(split, (Column, GroupedQKV, GateUp, InterleavedGateUp, RowPieces)):
        return COLUMN
    if isinstance(split, (Row, TransposedRow)):
        return ROW
    if isinstance(split, Replicated):
        return WHOLE
    raise UserError(f"LoRA does not know how a layer split as {split} is parallel")


def b_whole(split, part_rows: tuple[int, ...], ctx, n: int) -> bool:
    """Whether the adapters' B of a column-parallel layer stay whole on every TP rank: a split described by row
    pieces whose rank takes rows of an HF part from several places (Qwen3.5's in_proj_qkv: its q, k and v) has
    no block per rank to keep (nor a checkpoint box); the rank then reads its rows from the whole B, and B's
    gradient, each rank's rows of it, is summed over TP. Every other split: one contiguous block per rank."""
    if not isinstance(split, RowPieces) or n == 1:
        return False
    pieces = split.pieces(ctx, n)
    for k in range(n):
        for part, rows in enumerate(part_rows):
            mine = sorted((a, b) for p, a, b in pieces[k] if p == part)
            per = rows // n
            if mine[0][0] != k * per or mine[-1][1] != (k + 1) * per or any(x[1] != y[0] for x, y in zip(mine, mine[1:])):
                return True
    return False


def lora_rules(arch: Arch) -> list[Rule]:
    """The family's rules that take adapters (multi-token-prediction layers never do)."""
    return [r for r in get_family(arch.family).weight_rules(arch) if r.lora is not None and not r.mtp]


def family_targets(arch: Arch) -> tuple[str, ...]:
    """The MP_LORA_TARGETS groups this model has."""
    return tuple(dict.fromkeys(r.lora.target for r in lora_rules(arch)))


def target_modules(arch: Arch) -> dict[str, list[str]]:
    """For each MP_LORA_TARGETS group of the model, the HF modules (relative to a decoder layer) that take its
    adapters, as peft names them: ``target_modules``, or the stacked parameters peft reaches through
    ``target_parameters`` (marked so). The docs' table of targets per family is made of it."""
    loaded = functools.partial(loaded_name, get_family(arch.family).hf_loaded_prefixes)
    out: dict[str, list[str]] = {}
    for rule in lora_rules(arch):
        if rule.lora.hf_param is not None:
            names = [rule.lora.hf_param.rpartition(".layers.{layer}.")[2] + " (parameter)"]
        else:
            names = [loaded(h).rpartition(".layers.{layer}.")[2].removesuffix(".weight") for h in rule.hf]
        group = out.setdefault(rule.lora.target, [])
        group += [n for n in names if n not in group]
    return out


def check_targets(arch: Arch, targets: tuple[str, ...]) -> None:
    have = family_targets(arch)
    missing = [t for t in targets if t not in have]
    if missing:
        raise UserError(f"MP_LORA_TARGETS names {','.join(missing)}, which a {arch.family} model does not have: "
                        f"its targets are {','.join(have)}")


def _applies(rule: Rule, arch: Arch, layer: int) -> bool:
    return rule.covers(arch, layer)  # e.g. not a layer of another attention type (Qwen3-Next's full vs linear)


def hf_part_shapes(rule: Rule, arch: Arch, mcore_shape: tuple[int, ...], layer: int) -> list[tuple[int, ...]]:
    """The HF tensors' shapes a rule's full (TP=1) MCore weight of ``mcore_shape`` stands for, as a linear layer
    sees them ([out, in]) in decoder layer ``layer``: the split run backwards on a shape-only tensor (as the
    skeleton derives every HF shape), a weight stored transposed ([in, out]: gpt-oss's experts) read the other
    way round."""
    import torch

    if isinstance(rule.split, Replicated):
        return [tuple(mcore_shape)]
    shapes = [tuple(t.shape) for t in rule.split.merge([torch.empty(mcore_shape, device="meta")],
                                                     split_context(arch, layer))]
    return [s[::-1] for s in shapes] if rule.split.transposed else shapes


def plan_sites(arch: Arch, spec: LoraSpec, shape=None) -> list[Site]:
    """Every site of the model with its adapters, by decoder layer, then in the weight table's order.

    ``shape``: the model's ``models.shape.model_shape.ModelShape`` (read from megatron-core when not given)."""
    if shape is None:
        shape = model_shape(arch)

    rules = [r for r in lora_rules(arch) if r.lora.target in spec.targets]
    loaded = functools.partial(loaded_name, get_family(arch.family).hf_loaded_prefixes)
    part_shapes: dict = {}  # (rule index, layer kind) -> (HF part shapes)
    sites: list[Site] = []
    wanted = None if spec.modules is None else set(spec.modules)
    saved = spec.modules_to_save
    for layer in range(arch.num_layers):
        kind = layer_kind(arch, layer)
        for index, rule in enumerate(rules):
            if not _applies(rule, arch, layer):
                continue
            if (index, kind) not in part_shapes:
                rel = rule.mcore[len(MC_LAYER):].replace("{expert}", "0")
                part_shapes[index, kind] = hf_part_shapes(rule, arch, shape.layers[kind][rel], layer)
            parts = part_shapes[index, kind]
            hf = tuple(h.replace("{layer}", str(layer)) for h in rule.hf)
            experts = range(arch.num_experts) if rule.scope is Scope.EXPERT else [None]
            for expert in experts:
                names = hf if expert is None else tuple(h.replace("{expert}", str(expert)) for h in hf)
                adapters = _adapters(rule, spec, layer, expert, tuple(map(loaded, names)), parts, wanted, saved)
                if adapters:
                    sites.append(Site(rule, layer, expert, names, tuple(p[0] for p in parts), parts[0][1],
                                      tuple(adapters)))
    return sites


def loaded_name(prefixes: tuple[tuple[str, str], ...], name: str) -> str:
    """A checkpoint tensor's name in the model transformers loads from it (``ModelFamily.hf_loaded_prefixes``):
    what peft names its adapters by."""
    return _renamed(prefixes, name, 0)


def stored_name(prefixes: tuple[tuple[str, str], ...], name: str) -> str:
    """The inverse of ``loaded_name``: a loaded model's tensor name as the checkpoint stores it."""
    return _renamed(prefixes, name, 1)


def _renamed(prefixes: tuple[tuple[str, str], ...], name: str, side: int) -> str:
    """``name`` with the first of ``prefixes``' side ``side`` that starts it replaced by the other side; a
    ``{layer}`` in a prefix stands for one name part (a layer's number, or ``{layer}`` itself in a table's pattern)."""
    for pair in prefixes:
        found = _prefix_pattern(pair[side]).match(name)
        if found:
            other = pair[1 - side].replace("{layer}", found.group("layer")) if "{layer}" in pair[side] else pair[1 - side]
            return other + name[found.end():]
    return name


@functools.lru_cache(maxsize=None)
def _prefix_pattern(prefix: str) -> re.Pattern:
    return re.compile(re.escape(prefix).replace(re.escape("{layer}"), r"(?P<layer>[^.]+)", 1))


def _saved(name: str, saved: tuple[str, ...]) -> bool:
    """peft leaves a module that modules_to_save names (or one inside it) without an adapter."""
    return any(re.match(rf"(^|.*\.){m}($|\..*)", name) for m in saved)


def _adapters(rule: Rule, spec: LoraSpec, layer: int, expert, names, parts, wanted, saved) -> list[Adapter]:
    if rule.lora.hf_param is not None:  # a routed expert: one adapter on its slice of the stacked parameter
        name = rule.lora.hf_param.replace("{layer}", str(layer))
        if (wanted is not None and name not in wanted) or _saved(name, saved):
            return []
        rank, alpha = spec.rank_alpha(name)
        return [Adapter(name, expert, rank, alpha, parts[0][1], tuple(range(len(parts))), tuple(p[0] for p in parts))]
    # layers_to_transform picks the layers of a spec's targets; an imported adapter's modules are exact names,
    # checked against its config as peft reads it (peft_io._as_configured: a module named in full is in any layer)
    if spec.layers is not None and wanted is None and layer not in spec.layers:
        return []
    out = []
    for i, (hf_name, part) in enumerate(zip(names, parts)):
        module = hf_name.removesuffix(".weight")
        if (wanted is not None and module not in wanted) or _saved(module, saved):
            continue
        rank, alpha = spec.rank_alpha(module)
        out.append(Adapter(module, None, rank, alpha, part[1], (i,), (part[0],)))
    return out


def count_params(sites: list[Site]) -> int:
    return sum(a.numel for s in sites for a in s.adapters)


def stacked_depth(sites: list[Site]) -> dict[str, int]:
    """For each stacked parameter with adapters, how deep peft nests its wrapper: peft wraps the targeted
    parameters of one module in the module's parameter order (the weight table's order of the rules), the
    first innermost, so its keys gain one ``base_layer.`` per parameter wrapped after it."""
    by_module: dict[str, list[str]] = {}
    for s in sites:
        for a in s.adapters:
            if a.expert is not None:
                module = a.name.rpartition(".")[0]
                if a.name not in by_module.setdefault(module, []):
                    by_module[module].append(a.name)
    return {name: len(names) - 1 - i for names in by_module.values() for i, name in enumerate(names)}


def rank_adapter_params(sites: list[Site], arch: Arch, layout, pp_rank: int, vp_stage: int = 0,
                        pp_first_stage_layers: int | None = None, spec_name: str = "local") -> list:
    """The adapter parameters of model chunk ``vp_stage`` of pipeline rank ``pp_rank`` (TP, EP and expert-TP
    rank 0) as ``models.shape.model_shape.RankParam``s, in the order the chunk's ``LoraAdapters`` holds them (A's, then
    B's, site by site): what the memory plan lays into the DDP buffers."""
    layers = set(chunk_layers(arch, layout, pp_rank, vp_stage, pp_first_stage_layers))
    per_rank = arch.num_experts // layout.ep if arch.is_moe else 0
    out = []
    for i, s in enumerate(sites):
        if s.layer not in layers or (s.expert is not None and s.expert >= per_rank):
            continue
        expert = s.expert is not None
        split = site_split(s, spec_name)
        mode = split_mode(split)
        n = (layout.expert_tp if expert else layout.tp) if mode in (COLUMN, ROW) else 1
        b_n = 1 if b_whole(split, s.part_rows, split_context(arch, s.layer), n) else n
        for k, a in enumerate(s.adapters):
            out.append(RankParam(f"lora.sites.{i}.a{k}", a.rank * (a.in_features // n if mode == ROW else a.in_features),
                                 expert))
        j = 0
        for part, rows in enumerate(s.part_rows):
            cover = s.covering(part)
            if cover is not None:
                a = s.adapters[cover[0]]
                out.append(RankParam(f"lora.sites.{i}.b{j}", a.rank * (rows // b_n if mode == COLUMN else rows), expert))
                j += 1
    return out

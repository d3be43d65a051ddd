"""Pass or fail, point by point, against a bound a user can trust.

The reference is always the HF model in fp32.

- fp32: every point must agree to relative L2 error <= ``FP32_REL_L2`` and the logits also to mean
  per-token KL <= ``FP32_KL`` (the bounds ``mpatch parity`` uses). Two correct fp32 implementations
  differ only by summation order, ~1e-7 here; every mapping fault we plant is orders above the bound.
  That rounding adds up with depth, though (a correct 12-layer Qwen3-Next drifts past 1e-5 by layer 4), so an
  fp32 run over the fixed bound is judged again with a floor (``fp32_floor``: HF's own fp32 captures against
  HF fp64's): a point then passes within the larger of the fixed bound and ``tolerance`` x HF's own fp32
  error (KL: tolerance squared). The bound never falls below the fixed one, so running the fp64 model only
  after a failure gives the verdict running it always would.
- bf16 / fp16: there is no fixed bound that means anything, because HF itself is off by ~1e-2 in
  bf16. The **noise floor** at each point is HF's own error in that dtype (HF-dtype vs HF-fp32); the
  model under test is judged by its error against the same fp32 reference divided by the floor. A
  correct conversion lands near 1x (its rounding is as large as HF's, just different); the default
  bound is ``DEFAULT_TOLERANCE`` x (and tolerance squared for the logits' KL, which grows
  quadratically with a perturbation).

Points are judged in data-flow order, so the first failing point localises a fault: a wrong query
head order in layer 2 leaves the embedding and layers 0-1 exact and breaks ``layers.2.attention``.

MoE layers add a discrete step that rounding cannot be compared through: when two experts' router
scores nearly tie, bf16 rounding on either side may pick the other one, and that token's MLP output
jumps by a whole expert's difference. So routing is judged on its own noise floor: per MoE layer, the
tokens whose top-k expert set differs from HF fp32's (the tested side's flips) must stay within
``tolerance`` x HF's own flips in that dtype (at least ``MIN_FLOOR_FLIPS`` allowed; in fp32, at most
``FP32_ROUTING_FLIPS`` of the tokens). The other points are then compared on the tokens the flips did
not reach: a flip at layer L changes that token's MLP output at L and, through attention, every later
position of its sequence from layer L + 1 on; those tokens are left out (on both sides, floor too),
and each point records how many tokens it was judged on. A planted fault that keeps the routing (two
experts' weights swapped) still fails at the MLP point; one that changes it (router rows swapped)
fails at the routing check.

Sparse attention (DeepSeek-V3.2, GLM-5) adds another discrete step, the indexer's top-k keys per query, judged
the same way: per sparse-attention layer, the tokens whose selected keys (among those they may see) differ
from HF fp32's must stay within ``tolerance`` x HF's own such tokens in that dtype (at least
``MIN_FLOOR_FLIPS``; in fp32 at most ``FP32_ROUTING_FLIPS`` of the tokens); a near-tie that flips in bf16 is
noise, a selection that differs systematically fails there. A token whose selection flipped is left out from
its layer's attention output on, and the positions after it from the next layer on. Each layer's selection
agreement (the share of tokens that keep HF fp32's keys) is reported. DeepSeek-V4's CSA indexer, which keeps
the top-k compressed blocks of keys per query, is judged the same way.

An MoE layer whose experts are a table of the token id (DeepSeek-V4's hash layers: ``tid2eid[token_id]``,
``Arch.routes_by_token_id``) has no score to tie: rounding cannot change its choice, so its routing must be HF
fp32's exactly, in every dtype, and a single token routed otherwise is a fault (a wrong table row).

A point held as several residual streams (DeepSeek-V4's hyper-connections: a layer's output [batch, seq, streams,
hidden]) is judged as a whole and each stream on its own, by the same bound: it passes when every stream does,
and a failure names the streams over the line (a fault in one stream's mix shows in that stream alone).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Collection

import torch

from megatron_patch.align.capture import stream_count, streams_like
from megatron_patch.align.points import (EVERY_EXPERT, EVERY_ID, ROUTER, ROUTING, SELECTION, Captures,
                                        captured_point_names, every_expert_point, point_layer, router_point,
                                        routing_layers, selection_layers)
from megatron_patch.align.metrics import compare, compare_logits
from megatron_patch.align.bounds import DEFAULT_TOLERANCE, FP32_KL, FP32_REL_L2, fp32_kl_limit, fp32_rel_l2_limit

# Routing flips HF's own rounding is credited with at least: a floor of zero would forbid any flip, and
# at the few flips per layer a short run sees (256 tokens: 0-5), a ratio of 2 is within counting noise.
MIN_FLOOR_FLIPS = 3
# fp32 has no floor run: at most this share of tokens may choose other experts than HF fp32.
FP32_ROUTING_FLIPS = 0.01


def min_floor(dtype: str) -> float:
    """Smallest floor used as a divisor: a point HF computes exactly in ``dtype`` (an embedding whose
    fp32 weights happen to be representable) must not turn rounding-level error into a huge ratio."""
    # fp8 (float8 GEMMs, torchao): its activations are bf16
    eps = {"bf16": torch.finfo(torch.bfloat16).eps, "fp16": torch.finfo(torch.float16).eps,
           "fp8": torch.finfo(torch.bfloat16).eps}[dtype]
    return eps / 16


@dataclass
class StreamResult:
    """One residual stream of a point held as streams, judged as the point is."""

    stream: int
    metrics: dict
    floor: dict | None
    ratio: float | None
    passed: bool


@dataclass
class PointResult:
    name: str
    layer: int | None
    metrics: dict            # test vs HF fp32
    floor: dict | None       # HF in the test dtype vs HF fp32 (in fp32: HF fp64 vs HF fp32, where measured)
    ratio: float | None      # test rel_l2 / floor rel_l2 (None in fp32 without a floor)
    limit: str               # the bound, in words
    passed: bool
    tokens: int | None = None  # tokens judged (those no routing flip reached); None: all
    streams: list[StreamResult] = field(default_factory=list)  # per residual stream, where the point holds them

    @property
    def failed_streams(self) -> list[StreamResult]:
        return [r for r in self.streams if not r.passed]


@dataclass
class RoutingResult:
    """One MoE layer: tokens whose top-k expert set differs from HF fp32's; or (``kind`` "selection") one
    sparse-attention layer: tokens whose selected keys differ from HF fp32's."""

    layer: int
    tokens: int
    flipped: int               # tested side
    floor_flipped: int | None  # HF in the test dtype (None in fp32, which allows a share of the tokens)
    ratio: float | None        # flipped / max(floor_flipped, MIN_FLOOR_FLIPS)
    limit: str
    passed: bool
    kind: str = "routing"
    exact: bool = False        # experts from a table of the token id: held to HF fp32 exactly

    @property
    def agreement(self) -> float:
        """The share of tokens whose choice is HF fp32's."""
        return 1.0 - self.flipped / max(self.tokens, 1)


@dataclass
class Verdict:
    aligned: bool
    dtype: str
    tolerance: float
    summary: str
    first_failure: str | None = None
    first_failure_layer: int | None = None
    worst_point: str | None = None
    worst_ratio: float | None = None
    points: list[PointResult] = field(default_factory=list)
    routing: list[RoutingResult] = field(default_factory=list)
    selection: list[RoutingResult] = field(default_factory=list)
    fp32_floor: bool = False  # an fp32 verdict judged with HF's own fp32 rounding (HF fp64) as a floor

    def to_dict(self) -> dict:
        out = asdict(self)
        for r, d in zip(self.selection, out["selection"]):
            d["agreement"] = r.agreement
        return out


def _judge_fp32(name: str, m: dict) -> tuple[bool, str]:
    if name == "logits":
        return m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, f"rel_l2 <= {FP32_REL_L2:g}, KL <= {FP32_KL:g}"
    return m["rel_l2"] <= FP32_REL_L2, f"rel_l2 <= {FP32_REL_L2:g}"


def _judge_fp32_floor(name: str, m: dict, floor: dict, tol: float) -> tuple[bool, float, str]:
    bound = fp32_rel_l2_limit(floor["rel_l2"], tol)
    ok = m["rel_l2"] <= bound
    limit = f"rel_l2 <= {bound:.1e} (max of {FP32_REL_L2:g}, {tol:g}x floor)"
    if name == "logits":
        kl_bound = fp32_kl_limit(floor["kl"], tol)
        ok = ok and m["kl"] <= kl_bound
        limit += f", KL <= {kl_bound:.1e}"
    return ok, m["rel_l2"] / max(floor["rel_l2"], torch.finfo(torch.float64).tiny), limit


def _judge_floor(name: str, m: dict, floor: dict, dtype: str, tol: float) -> tuple[bool, float, str]:
    ratio = m["rel_l2"] / max(floor["rel_l2"], min_floor(dtype))
    ok = ratio <= tol
    limit = f"rel_l2 <= {tol:g}x floor"
    if name == "logits":
        kl_ratio = m["kl"] / max(floor["kl"], 1e-30)
        m["kl_ratio"] = kl_ratio
        ok = ok and kl_ratio <= tol ** 2
        limit += f", KL <= {tol ** 2:g}x floor"
    return ok, ratio, limit


def _flips(ref: Captures, other: Captures, layer: int, prefix: str = ROUTING) -> torch.Tensor:
    """[batch, seq] True where ``other`` sends the token to another expert set (or, ``prefix`` SELECTION,
    has it attend to other keys) than ``ref``."""
    a, b = ref[f"{prefix}{layer}"], other[f"{prefix}{layer}"]
    if a.shape != b.shape:
        raise RuntimeError(f"{prefix}{layer} has shape {tuple(b.shape)}, the reference {tuple(a.shape)}")
    return (a != b).any(-1)


def _reach(flips: torch.Tensor) -> torch.Tensor:
    """Positions a flip reaches through causal attention: from the first flip of each sequence on."""
    return torch.cummax(flips.int(), dim=1).values.bool()


def _judge_routing(ref: Captures, test: Captures, floor: Captures | None, dtype: str, tolerance: float,
                   layer: int, prefix: str = ROUTING, exact: bool = False) -> tuple[RoutingResult, torch.Tensor]:
    """The routing (or, ``prefix`` SELECTION, key selection) result of ``layer`` and the tokens that flipped
    on either side; ``exact``: a choice no rounding can change (routed by token id), any flip fails."""
    test_flips = _flips(ref, test, layer, prefix)
    floor_flips = _flips(ref, floor, layer, prefix) if floor is not None else torch.zeros_like(test_flips)
    n, flipped = test_flips.numel(), int(test_flips.sum())
    kind = "selection" if prefix == SELECTION else "routing"
    floor_flipped = None if floor is None or dtype == "fp32" else int(floor_flips.sum())  # fp32: a share, no floor
    if exact:
        result = RoutingResult(layer, n, flipped, floor_flipped, None, "none (routed by token id)", flipped == 0, kind,
                               exact=True)
    elif dtype == "fp32":  # with HF fp64 as a floor too: its flips are left out of the points, not counted here
        allowed = int(FP32_ROUTING_FLIPS * n)
        result = RoutingResult(layer, n, flipped, None, None, f"<= {FP32_ROUTING_FLIPS:.0%} of tokens", flipped <= allowed,
                               kind)
    else:
        base = max(int(floor_flips.sum()), MIN_FLOOR_FLIPS)
        ratio = flipped / base
        result = RoutingResult(layer, n, flipped, int(floor_flips.sum()), ratio,
                               f"<= {tolerance:g}x HF {dtype}'s flips (at least {MIN_FLOOR_FLIPS})", ratio <= tolerance,
                               kind)
    return result, test_flips | floor_flips


def _clean_tokens(ref: Captures, test: Captures, floor: Captures | None, dtype: str, tolerance: float,
                  num_layers: int, exact_routing: Collection[int] = ()
                  ) -> tuple[list[RoutingResult], list[RoutingResult], dict[str, torch.Tensor | None]]:
    """Routing and key-selection results, and for each point the tokens to judge it on (None: all of them)."""
    moe, sparse = routing_layers(ref), selection_layers(ref)
    if not moe and not sparse:
        return [], [], {}
    routing, selection, masks = [], [], {}
    reached = None  # tokens a flip in an earlier layer reaches
    excluded = None  # tokens left out at the current point
    for name in captured_point_names(ref, num_layers):
        layer = point_layer(name)
        if layer is not None and name.endswith(".attention"):
            excluded = reached
            if layer in sparse:
                result, flips = _judge_routing(ref, test, floor, dtype, tolerance, layer, SELECTION)
                selection.append(result)
                excluded = flips if excluded is None else excluded | flips
        elif layer is not None and name.endswith(".mlp") and layer in moe:
            result, flips = _judge_routing(ref, test, floor, dtype, tolerance, layer, exact=layer in exact_routing)
            routing.append(result)
            excluded = flips if excluded is None else excluded | flips
        elif layer is None:
            excluded = reached
        masks[name] = None if excluded is None else ~excluded
        if name.endswith(".output") and excluded is not None:
            reached = _reach(excluded)
    return routing, selection, masks


def judge(ref: Captures, test: Captures, dtype: str, num_layers: int, floor: Captures | None = None,
          tolerance: float = DEFAULT_TOLERANCE, what: str = "MCore", exact_routing: Collection[int] = ()) -> Verdict:
    """Compare ``test`` with the fp32 reference ``ref`` at every point; ``floor`` holds HF's own
    captures in ``dtype`` (required unless dtype is fp32; in fp32, optional: HF fp64's, ``fp32_floor``). MoE
    layers' routing is judged on its own and the other points on the tokens no routing flip reached (see the
    module docstring);
    ``exact_routing``: the MoE layers routed by token id (``exact_routing_layers``), whose routing must agree
    exactly."""
    if dtype != "fp32" and floor is None:
        raise ValueError("a bf16/fp16 verdict needs HF's own captures in that dtype (the noise floor)")
    routing, selection, masks = _clean_tokens(ref, test, floor, dtype, tolerance, num_layers, exact_routing)
    results: list[PointResult] = []
    for name in judged_point_names(ref, num_layers):
        if name == EVERY_ID:
            results.append(_judge_every_id(ref, test, floor, dtype, tolerance))
            continue
        if name not in ref or name not in test:
            missing = "reference" if name not in ref else what
            raise RuntimeError(f"point {name} was not captured on the {missing} side")
        cmp = compare_logits if name == "logits" else compare
        # a router's logits: on the tokens its layer's attention output is judged on (its input comes after it)
        mask = masks.get(f"layers.{point_layer(name)}.attention" if name.endswith(f".{ROUTER}") else name)
        tokens = None if mask is None else int(mask.sum())
        if tokens == 0:  # every token's routing diverged before this point: the routing check speaks for it
            results.append(PointResult(name, point_layer(name), {}, None, None, "no token left to judge", True, 0))
            continue

        def pick(t, mask=mask):
            return t if mask is None else t[mask]

        r, t = pick(streams_like(ref[name], test[name])), pick(test[name])
        f = None if floor is None else pick(streams_like(floor[name], test[name]))
        point = _judge_point(name, r, t, f, dtype, tolerance, cmp)
        point.tokens = tokens
        # per stream where the reference itself holds streams (not the embedding it copies into them)
        point.streams = [_judge_stream(name, k, r, t, f, dtype, tolerance) for k in range(stream_count(ref[name]))]
        point.passed = point.passed and not point.failed_streams
        results.append(point)
    verdict = _verdict(results, routing, dtype, tolerance, what, selection)
    verdict.fp32_floor = dtype == "fp32" and floor is not None
    return verdict


def judged_point_names(ref: Captures, num_layers: int) -> list[str]:
    """The points a verdict judges, in data-flow order: the embedding of every id first, each MoE layer's
    forced-routing MLP output (``every_expert_point``) after its own MLP output."""
    names = [EVERY_ID] if EVERY_ID in ref else []
    for name in captured_point_names(ref, num_layers):
        layer = point_layer(name)
        if name.endswith(".mlp") and router_point(layer) in ref:
            names.append(router_point(layer))
        names.append(name)
        if name.endswith(".mlp") and every_expert_point(layer) in ref:
            names.append(every_expert_point(layer))
    return names


def _row_errors(r: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Each row's relative L2 error (a NaN counting as infinite)."""
    r, t = r.flatten(1).double(), t.flatten(1).double()
    err = (t - r).norm(dim=1) / r.norm(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(err, nan=float("inf"))


def _judge_every_id(ref: Captures, test: Captures, floor: Captures | None, dtype: str, tolerance: float
                    ) -> PointResult:
    """The embedding on every token id, judged row by row (one id's row among a vocabulary's would vanish in a
    whole-tensor error): the worst id's error against the bound a point has, its id named."""
    if EVERY_ID not in test:
        raise RuntimeError(f"point {EVERY_ID} was not captured on the tested side")
    r, t = streams_like(ref[EVERY_ID], test[EVERY_ID]), test[EVERY_ID]
    err = _row_errors(r, t)
    # the whole table's metrics, with rel_l2 the worst id's
    def worst_of(other, worst):
        whole = compare(r, other)
        return {**whole, "whole_rel_l2": whole["rel_l2"], "rel_l2": float(err[worst])}

    if floor is None:
        worst = int(err.argmax())
        metrics = {**worst_of(t, worst), "worst_id": worst, "ids": len(err)}
        return PointResult(EVERY_ID, None, metrics, None, None, f"every id's rel_l2 <= {FP32_REL_L2:g}",
                           bool(err[worst] <= FP32_REL_L2))
    f = streams_like(floor[EVERY_ID], t)
    own = _row_errors(r, f)
    if dtype == "fp32":  # each id within the larger of the fixed bound and tolerance x its own fp32 error
        bounds = (tolerance * own).clamp_min(FP32_REL_L2)  # fp32_rel_l2_limit, id by id
        worst = int((err / bounds).argmax())
        metrics = {**worst_of(t, worst), "worst_id": worst, "ids": len(err)}
        return PointResult(EVERY_ID, None, metrics, {**compare(r, f), "rel_l2": float(own[worst])},
                           float(err[worst] / own[worst].clamp_min(torch.finfo(torch.float64).tiny)),
                           f"every id's rel_l2 <= max({FP32_REL_L2:g}, {tolerance:g}x its floor)",
                           bool(err[worst] <= bounds[worst]))
    ratios = err / own.clamp_min(min_floor(dtype))
    worst = int(ratios.argmax())
    metrics = {**worst_of(t, worst), "worst_id": worst, "ids": len(err)}
    return PointResult(EVERY_ID, None, metrics, {**compare(r, f), "rel_l2": float(own[worst])}, float(ratios[worst]),
                       f"every id's rel_l2 <= {tolerance:g}x its floor", bool(ratios[worst] <= tolerance))


def _judge_point(name: str, r: torch.Tensor, t: torch.Tensor, f: torch.Tensor | None, dtype: str, tolerance: float,
                 cmp=compare) -> PointResult:
    m = cmp(r, t)
    if f is None:
        ok, limit = _judge_fp32(name, m)
        return PointResult(name, point_layer(name), m, None, None, limit, ok)
    floor = cmp(r, f)
    judged = _judge_fp32_floor(name, m, floor, tolerance) if dtype == "fp32" else \
        _judge_floor(name, m, floor, dtype, tolerance)
    ok, ratio, limit = judged
    return PointResult(name, point_layer(name), m, floor, ratio, limit, ok)


def _judge_stream(name: str, k: int, r: torch.Tensor, t: torch.Tensor, f: torch.Tensor | None, dtype: str,
                  tolerance: float) -> StreamResult:
    one = _judge_point(name, r[..., k, :], t[..., k, :], None if f is None else f[..., k, :], dtype, tolerance)
    return StreamResult(k, one.metrics, one.floor, one.ratio, one.passed)


def exact_routing_layers(arch) -> list[int]:
    """The MoE layers of ``arch`` whose experts are a table of the token id: their routing is judged exactly."""
    return [i for i in range(arch.num_layers) if arch.routes_by_token_id(i)]


def _where(p: PointResult) -> str:
    streams = p.failed_streams
    if streams:  # the streams over the line, after the point
        what = f"{p.name}, stream{'s' if len(streams) > 1 else ''} {', '.join(str(r.stream) for r in streams)}"
        return f"layer {p.layer} ({what})" if p.layer is not None else f"{p.name} ({what})"
    return f"layer {p.layer} ({p.name})" if p.layer is not None else p.name


def _in_flow_order(results: list[PointResult], routing: list[RoutingResult],
                   selection: list[RoutingResult] = ()) -> list:
    """Points and discrete checks in data-flow order: a layer's key selection comes before its attention
    output, its routing before its MLP output."""
    by_layer = {r.layer: r for r in routing}
    selected = {r.layer: r for r in selection}
    out = []
    for p in results:
        if p.name.endswith(".attention") and p.layer in selected:
            out.append(selected[p.layer])
        if p.name.endswith(".mlp") and p.layer in by_layer:
            out.append(by_layer[p.layer])
        out.append(p)
    return out


def _why(first, dtype: str, tol: float) -> tuple[str, str]:
    """(where, why) of the first failure, in words."""
    if isinstance(first, RoutingResult):
        where = f"layer {first.layer} ({first.kind})"
        choice = "attend to other keys" if first.kind == "selection" else "choose other experts"
        if first.exact:
            return where, (f"{first.flipped} of {first.tokens} tokens {choice} than HF fp32, where their token id "
                           "alone decides them (a table, tid2eid: no rounding can flip it)")
        if first.floor_flipped is None:
            return where, f"{first.flipped} of {first.tokens} tokens {choice} than HF fp32 (limit {first.limit})"
        return where, (f"{first.flipped} of {first.tokens} tokens {choice} than HF fp32, "
                       f"{first.ratio:.1f}x HF's own {dtype} flips ({first.floor_flipped}) > {tol:g}x")
    # a point held as streams: the numbers of its worst stream over the line
    worst = max(first.failed_streams, key=lambda r: r.ratio if r.ratio is not None else r.metrics["rel_l2"],
                default=first)
    if dtype == "fp32" and first.floor is not None:
        bound = fp32_rel_l2_limit(worst.floor["rel_l2"], tol)
        why = (f"rel_l2 {worst.metrics['rel_l2']:.1e} > {bound:.1e}, the larger of {FP32_REL_L2:g} and {tol:g}x HF's "
               f"own fp32 error ({worst.floor['rel_l2']:.1e} against HF fp64)")
        if first.name == "logits" and first.metrics["rel_l2"] <= bound:
            why = (f"KL {first.metrics['kl']:.1e} > {fp32_kl_limit(first.floor['kl'], tol):.1e}, the larger of "
                   f"{FP32_KL:g} and {tol ** 2:g}x HF's own fp32 KL against HF fp64")
    elif dtype == "fp32":
        why = f"rel_l2 {worst.metrics['rel_l2']:.1e} > {FP32_REL_L2:g}"
        if first.name == "logits" and first.metrics["rel_l2"] <= FP32_REL_L2:
            why = f"KL {first.metrics['kl']:.1e} > {FP32_KL:g}"
    else:
        why = f"error {worst.ratio:.1f}x HF's own {dtype} rounding > {tol:g}x"
    if first.tokens is not None:
        why += f" (on the {first.tokens} tokens no routing or selection flip reached)"
    if first.name.endswith(f".{EVERY_EXPERT}"):
        why += " (every expert: the tokens sent to each in turn, on both sides alike)"
    if first.name == EVERY_ID:
        return f"the embedding of token id {first.metrics['worst_id']} (every id's row compared)", why
    return _where(first), why


def _fp32_limit(point: PointResult, tol: float, metric: str = "rel_l2") -> str:
    """An fp32 point's bound on ``metric`` in words: the fixed one, or the one its floor raised it to."""
    if point.floor is None:
        return f"{FP32_REL_L2 if metric == 'rel_l2' else FP32_KL:g}"
    limit = fp32_rel_l2_limit if metric == "rel_l2" else fp32_kl_limit
    return f"{limit(point.floor[metric], tol):.1e}"


def _nan_worst(value: float) -> float:
    """``value`` for max(), NaN counting as the worst (max() over a NaN keeps whatever it met first)."""
    return float("inf") if value != value else value


def _verdict(results: list[PointResult], routing: list[RoutingResult], dtype: str, tol: float, what: str,
             selection: list[RoutingResult] = ()) -> Verdict:
    first = next((p for p in _in_flow_order(results, routing, selection) if not p.passed), None)
    judged = [p for p in results if p.metrics]
    logits = results[-1]
    if dtype == "fp32":
        worst = max(judged, key=lambda p: _nan_worst(p.metrics["rel_l2"]))
        worst_ratio = None
        head = (f"fp32 logits agree to rel_l2 {logits.metrics['rel_l2']:.1e} (limit {_fp32_limit(logits, tol)}), "
                f"KL {logits.metrics['kl']:.1e} (limit {_fp32_limit(logits, tol, 'kl')}); worst point {worst.name} at "
                f"{worst.metrics['rel_l2']:.1e}" if logits.metrics else
                f"fp32: worst point {worst.name} at {worst.metrics['rel_l2']:.1e}")
        if logits.floor is not None:
            head += (f" (the fp32 run went over {FP32_REL_L2:g}: judged against HF's own fp32 error from HF fp64, "
                     f"{logits.floor['rel_l2']:.1e} at the logits, as a floor)")
    else:
        worst = max(judged, key=lambda p: _nan_worst(p.ratio))
        worst_ratio = worst.ratio
        head = (f"{what}'s {dtype} error is {logits.ratio:.2f}x HF's own {dtype} rounding at the logits "
                f"(worst {worst.ratio:.2f}x at {worst.name}; limit {tol:g}x)" if logits.metrics else
                f"{what}'s {dtype} error: worst {worst.ratio:.2f}x HF's own rounding at {worst.name}")
    if routing:
        flipped = sum(r.flipped for r in routing)
        floor = sum(r.floor_flipped or 0 for r in routing)
        exact = sum(r.exact for r in routing)
        head += (f"; routing: {flipped} token-layer flips against HF fp32 over {len(routing)} MoE layers"
                 + (f" (HF {dtype}'s own: {floor})" if dtype != "fp32" else "")
                 + (f", {exact} of them routed by token id and held exact" if exact else ""))
    if selection:
        flipped = sum(r.flipped for r in selection)
        floor = sum(r.floor_flipped or 0 for r in selection)
        head += (f"; key selection: {flipped} token-layer flips against HF fp32 over {len(selection)} sparse-attention "
                 "layers" + (f" (HF {dtype}'s own: {floor})" if dtype != "fp32" else "")
                 + f", agreement {min(r.agreement for r in selection):.1%} at worst")
    if first is None:
        summary = f"{head}: aligned"
    else:
        where, why = _why(first, dtype, tol)
        summary = f"NOT aligned: first divergence at {where}: {why}. {head}"
    first_name = None if first is None else (f"layers.{first.layer}.{first.kind}" if isinstance(first, RoutingResult)
                                             else first.name)
    return Verdict(aligned=first is None, dtype=dtype, tolerance=tol, summary=summary,
                   first_failure=first_name, first_failure_layer=None if first is None else first.layer,
                   worst_point=worst.name, worst_ratio=worst_ratio, points=results, routing=routing,
                   selection=list(selection))

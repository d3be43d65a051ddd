"""Pass or fail, point by point, against a bound a user can trust.

The reference is always the HF model in fp32.

- fp32: every point must agree to relative L2 error <= ``FP32_REL_L2`` and the logits also to mean
  per-token KL <= ``FP32_KL`` (the bounds ``mpatch parity`` uses). Two correct fp32 implementations
  differ only by summation order, ~1e-7 here; every mapping fault we plant is orders above the bound.
- bf16 / fp16: there is no fixed bound that means anything, because HF itself is off by ~1e-2 in
  bf16. The **noise floor** at each point is HF's own error in that dtype (HF-dtype vs HF-fp32); the
  model under test is judged by its error against the same fp32 reference divided by the floor. A
  correct conversion lands near 1x (its rounding is as large as HF's, just different); the default
  bound is ``DEFAULT_TOLERANCE`` x (and tolerance squared for the logits' KL, which grows
  quadratically with a perturbation).

Points are judged in data-flow order, so the first failing point localises a fault: a wrong query
head order in layer 2 leaves the embedding and layers 0-1 exact and breaks ``layers.2.attention``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from megatron_patch.align.capture import Captures, point_layer, point_names
from megatron_patch.align.metrics import compare, compare_logits
from megatron_patch.align.parity import FP32_KL, FP32_REL_L2

DEFAULT_TOLERANCE = 2.0


def min_floor(dtype: str) -> float:
    """Smallest floor used as a divisor: a point HF computes exactly in ``dtype`` (an embedding whose
    fp32 weights happen to be representable) must not turn rounding-level error into a huge ratio."""
    eps = {"bf16": torch.finfo(torch.bfloat16).eps, "fp16": torch.finfo(torch.float16).eps}[dtype]
    return eps / 16


@dataclass
class PointResult:
    name: str
    layer: int | None
    metrics: dict            # test vs HF fp32
    floor: dict | None       # HF in the test dtype vs HF fp32 (None in fp32)
    ratio: float | None      # test rel_l2 / floor rel_l2 (None in fp32)
    limit: str               # the bound, in words
    passed: bool


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

    def to_dict(self) -> dict:
        return asdict(self)


def _judge_fp32(name: str, m: dict) -> tuple[bool, str]:
    if name == "logits":
        return m["rel_l2"] <= FP32_REL_L2 and m["kl"] <= FP32_KL, f"rel_l2 <= {FP32_REL_L2:g}, KL <= {FP32_KL:g}"
    return m["rel_l2"] <= FP32_REL_L2, f"rel_l2 <= {FP32_REL_L2:g}"


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


def judge(ref: Captures, test: Captures, dtype: str, num_layers: int, floor: Captures | None = None,
          tolerance: float = DEFAULT_TOLERANCE, what: str = "MCore") -> Verdict:
    """Compare ``test`` with the fp32 reference ``ref`` at every point; ``floor`` holds HF's own
    captures in ``dtype`` (required unless dtype is fp32)."""
    if dtype != "fp32" and floor is None:
        raise ValueError("a bf16/fp16 verdict needs HF's own captures in that dtype (the noise floor)")
    results: list[PointResult] = []
    for name in point_names(num_layers):
        if name not in ref or name not in test:
            missing = "reference" if name not in ref else what
            raise RuntimeError(f"point {name} was not captured on the {missing} side")
        cmp = compare_logits if name == "logits" else compare
        m = cmp(ref[name], test[name])
        if dtype == "fp32":
            ok, limit = _judge_fp32(name, m)
            results.append(PointResult(name, point_layer(name), m, None, None, limit, ok))
        else:
            f = cmp(ref[name], floor[name])
            ok, ratio, limit = _judge_floor(name, m, f, dtype, tolerance)
            results.append(PointResult(name, point_layer(name), m, f, ratio, limit, ok))
    return _verdict(results, dtype, tolerance, what)


def _where(p: PointResult) -> str:
    return f"layer {p.layer} ({p.name})" if p.layer is not None else p.name


def _verdict(results: list[PointResult], dtype: str, tol: float, what: str) -> Verdict:
    first = next((p for p in results if not p.passed), None)
    logits = results[-1]
    if dtype == "fp32":
        worst = max(results, key=lambda p: p.metrics["rel_l2"])
        worst_ratio = None
        head = (f"fp32 logits agree to rel_l2 {logits.metrics['rel_l2']:.1e} (limit {FP32_REL_L2:g}), "
                f"KL {logits.metrics['kl']:.1e} (limit {FP32_KL:g}); worst point {worst.name} at "
                f"{worst.metrics['rel_l2']:.1e}")
    else:
        worst = max(results, key=lambda p: p.ratio)
        worst_ratio = worst.ratio
        head = (f"{what}'s {dtype} error is {logits.ratio:.2f}x HF's own {dtype} rounding at the logits "
                f"(worst {worst.ratio:.2f}x at {worst.name}; limit {tol:g}x)")
    if first is None:
        summary = f"{head}: aligned"
    else:
        if dtype == "fp32":
            why = f"rel_l2 {first.metrics['rel_l2']:.1e} > {FP32_REL_L2:g}"
            if first.name == "logits" and first.metrics["rel_l2"] <= FP32_REL_L2:
                why = f"KL {first.metrics['kl']:.1e} > {FP32_KL:g}"
        else:
            why = f"error {first.ratio:.1f}x HF's own {dtype} rounding > {tol:g}x"
        summary = f"NOT aligned: first divergence at {_where(first)}: {why}. {head}"
    return Verdict(aligned=first is None, dtype=dtype, tolerance=tol, summary=summary,
                   first_failure=first.name if first else None,
                   first_failure_layer=first.layer if first else None,
                   worst_point=worst.name, worst_ratio=worst_ratio, points=results)

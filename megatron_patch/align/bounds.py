"""The fp32 bounds that parity (``mpatch parity``) and alignment (``mpatch align``) judge by: torch-free, so that the
CLI's help and ``mpatch``'s start, which print them, import no torch."""

from __future__ import annotations

# fp32 bounds from the project's requirements: relative L2 error and mean per-token KL.
FP32_REL_L2 = 1e-5
FP32_KL = 1e-10
# fp32 rounding adds up with depth (a correct 12-layer Qwen3-Next went over 1e-5: the cfg audit), so a comparison
# over the fixed bounds is judged again against transformers' own fp32 error from its fp64 run: within this many
# times it (KL: squared) where that is more than the fixed bound. align's --tolerance, whose default this is, sets it
# there.
FP32_FLOOR_TOLERANCE = 2.0
# align's --tolerance: bf16's allowed multiple of HF's own rounding per point, and the fp32 floor's
DEFAULT_TOLERANCE = FP32_FLOOR_TOLERANCE


def fp32_rel_l2_limit(floor_rel_l2: float, tolerance: float = FP32_FLOOR_TOLERANCE) -> float:
    """The rel_l2 bound of an fp32 comparison where HF fp32 is ``floor_rel_l2`` from HF fp64."""
    return max(FP32_REL_L2, tolerance * floor_rel_l2)


def fp32_kl_limit(floor_kl: float, tolerance: float = FP32_FLOOR_TOLERANCE) -> float:
    """The logits' KL bound of an fp32 comparison where HF fp32's KL from HF fp64 is ``floor_kl``."""
    return max(FP32_KL, tolerance ** 2 * floor_kl)

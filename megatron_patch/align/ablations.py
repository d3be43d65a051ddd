"""Known sources of HF/MCore numerical difference, each switchable on the MCore side (``--ablate``).

Each variant changes one thing about the MCore model the package builds (the *baseline*) and is run on
the same inputs; its error against HF fp32 and its difference to HF in the same dtype show that
source's share of the total, as in the Pai-Megatron-Patch study (RMSNorm implementation and the
bias-SwiGLU fusion dominate, RoPE is small). Variants that need CUDA kernels (transformer-engine
RMSNorm, fused RoPE, fused softmax, flash/fused attention) run only where a GPU is present; elsewhere
the report lists them as skipped with the reason. The core attention variants build the local spec with
the attention the baseline does not run here (torch SDPA or megatron's unfused one).

A variant is a set of TransformerConfig overrides, a core attention, and/or a patch applied while the model
runs.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch

from megatron_patch.models.blocks import builder
from megatron_patch.models.description.registry import get_family
from megatron_patch.models.blocks.core_attention import SDPA, UNFUSED, default_core_attention, describe
from megatron_patch.runtime.deferred_compile import compiled_megatron_fusions

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# processes that import this module without building a megatron-core model (align's main process, the
# launcher's dry run and resume checks) do not pay for it.


@dataclass(frozen=True)
class Ablation:
    name: str
    source: str              # the known source of difference it probes
    change: str              # what differs from the baseline, in words
    overrides: dict = field(default_factory=dict)
    patch: Callable | None = None   # (model) -> context manager
    needs_gpu: bool = False
    needs_te: bool = False
    needs_fused_softmax: bool = False  # Apex's scaled-masked-softmax kernels
    needs_unfused_softmax: bool = False  # changes megatron's own softmax, which SDPA does not run
    core_attention: str | None = None  # the local spec's core attention (None: the baseline's)


@contextmanager
def _rope_in_fp32(model):
    """Rotate q/k in fp32 and round once (the baseline, like HF, multiplies in the model dtype)."""
    from megatron.core.models.common.embeddings import rope_utils

    original = rope_utils._apply_rotary_pos_emb_bshd
    calls = []

    def fp32(t, freqs, *args, **kwargs):
        calls.append(1)
        return original(t.float(), freqs.float(), *args, **kwargs).to(t.dtype)

    rope_utils._apply_rotary_pos_emb_bshd = fp32
    try:
        yield
    finally:
        rope_utils._apply_rotary_pos_emb_bshd = original
    if not calls:  # DeepSeek-V4's own RoPE (the s63 audit: listed as a run equal to the baseline)
        raise NotApplicable("the model rotates q/k with a RoPE of its own, not megatron-core's that this variant "
                            "changes")


class NotApplicable(Exception):
    """A variant that would change nothing in this model (why): the report lists it as skipped, not as a run equal
    to the baseline."""


def _norm_modules(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]


@contextmanager
def _replace_norm_forward(model, forward, required: bool = True):
    norms = _norm_modules(model)
    if required and not norms:
        raise NotApplicable("the model's norms are a class of its own, not torch's RMSNorm that this variant changes")
    for m in norms:
        m.forward = forward.__get__(m)
    try:
        yield
    finally:
        for m in norms:
            del m.forward


def _hf_rmsnorm_forward(self, x):
    # transformers' LlamaRMSNorm: normalise in fp32, round to the model dtype, then scale in it.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight.to(x.dtype) * h.to(x.dtype)


def _lowp_rmsnorm_forward(self, x):
    # Everything in the model dtype: what an implementation without an fp32 upcast computes.
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return self.weight.to(x.dtype) * h


def _rmsnorm_hf(model):
    return _replace_norm_forward(model, _hf_rmsnorm_forward)


def _rmsnorm_lowp(model):
    return _replace_norm_forward(model, _lowp_rmsnorm_forward)


@contextmanager
def _fp32_residual(model):
    """Keep the residual stream in fp32.

    megatron-core 0.16's bias-dropout-add casts the residual to the sub-block output's dtype, so
    ``fp32_residual_connection`` alone only changes the embedding; here the add also happens in fp32.
    The norms then feed the model-dtype linears in that dtype, as the fused GPU norms do (torch's
    RMSNorm would return fp32), and take their model-dtype weights in fp32, as those norms do (torch refuses
    its fused kernel to an fp32 input with a bf16 weight, and says so).
    """
    from megatron.core.fusions import fused_bias_dropout

    dtype = model.config.params_dtype
    original = fused_bias_dropout._bias_dropout_add_func

    def add_in_fp32(x_with_bias, residual, prob, training):
        x, bias = x_with_bias
        x = x.float() if bias is None else x.float() + bias.float()
        return residual.float() + torch.nn.functional.dropout(x, p=prob, training=training)

    def norm_forward(self, x):
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps).to(dtype)

    # a family's own norm classes (Gemma's zero-centred ones, DeepSeek-V4's) return the dtype they are given: their
    # fp32 output went into a model-dtype linear (the cmp audit: gemma3's --ablate stopped there)
    def in_model_dtype(module, args, output):
        return output.to(dtype) if torch.is_tensor(output) and output.is_floating_point() else output

    own_norms = [m for m in model.modules()
                 if type(m).__name__.endswith("Norm") and not isinstance(m, torch.nn.RMSNorm)]
    hooks = [m.register_forward_hook(in_model_dtype) for m in own_norms]
    fused_bias_dropout._bias_dropout_add_func = add_in_fp32
    try:
        with _replace_norm_forward(model, norm_forward, required=False):
            yield
    finally:
        fused_bias_dropout._bias_dropout_add_func = original
        for hook in hooks:
            hook.remove()


@contextmanager
def _megatron_fusions_compiled(model):
    """megatron-core's jit-fused functions compiled, as on a GPU (on CPU they run eager unless a run asks:
    runtime/deferred_compile.py)."""
    with compiled_megatron_fusions(True):
        yield


ABLATIONS: list[Ablation] = [
    Ablation("rope_fp32", "RoPE implementation", "q/k rotated in fp32, rounded once (baseline: in the model dtype)",
             patch=_rope_in_fp32),
    Ablation("rope_fused", "RoPE implementation", "transformer-engine fused RoPE kernel",
             overrides={"apply_rope_fusion": True}, needs_gpu=True, needs_te=True),
    Ablation("rmsnorm_hf", "RMSNorm compute dtype",
             "HF's RMSNorm order: fp32 normalise, round, scale in the model dtype (baseline: torch.rms_norm)",
             patch=_rmsnorm_hf),
    Ablation("rmsnorm_lowp", "RMSNorm compute dtype", "RMSNorm computed entirely in the model dtype",
             patch=_rmsnorm_lowp),
    Ablation("rmsnorm_te", "RMSNorm compute dtype", "transformer-engine fused RMSNorm (TE layer spec)",
             needs_gpu=True, needs_te=True),
    Ablation("softmax_lowp", "attention softmax dtype", "attention softmax in the model dtype (baseline: fp32)",
             overrides={"attention_softmax_in_fp32": False}, needs_unfused_softmax=True),
    Ablation("softmax_fused", "attention and softmax implementation", "megatron's fused scale-mask-softmax CUDA kernel",
             overrides={"masked_softmax_fusion": True}, needs_gpu=True, needs_fused_softmax=True,
             needs_unfused_softmax=True),
    Ablation("attention_te", "attention and softmax implementation", "transformer-engine flash/fused attention",
             needs_gpu=True, needs_te=True),
    Ablation("attention_sdpa", "attention and softmax implementation",
             "torch SDPA core attention (softmax accumulated in fp32 inside the kernel)", core_attention=SDPA),
    Ablation("attention_unfused", "attention and softmax implementation",
             "megatron's unfused core attention (scores in the model dtype, fp32 softmax)", core_attention=UNFUSED),
    Ablation("residual_fp32", "residual precision", "residual stream kept in fp32 (fp32_residual_connection)",
             overrides={"fp32_residual_connection": True, "pipeline_dtype": torch.float32}, patch=_fp32_residual),
    Ablation("bias_swiglu_fused", "bias-SwiGLU fusion", "megatron's jit-fused bias-SwiGLU (torch.compile)",
             overrides={"bias_activation_fusion": True}, patch=_megatron_fusions_compiled),
]
BY_NAME = {a.name: a for a in ABLATIONS}


def get(name: str) -> Ablation:
    return BY_NAME[name]


def baseline_core_attention() -> str | None:
    """The core attention the baseline builds on this machine: None where it is transformer-engine's spec."""
    return None if builder.te_available() else default_core_attention()


def describe_baseline_attention() -> str:
    """What attention the baseline runs here, for the report."""
    local = baseline_core_attention()
    return describe(local) if local else "transformer-engine's attention (TE layer spec)"


def skip_reason(ablation: Ablation, arch=None) -> str | None:
    """Why a variant cannot run on this machine, or for the model of ``arch`` (None: it can)."""
    if arch is not None and "bias_activation_fusion" in ablation.overrides:
        # the builder keeps a fusion off where the family turns it off: the variant would be the baseline again
        if get_family(arch.family).transformer_config_kwargs(arch).get("bias_activation_fusion") is False:
            return "the model's activation is not one megatron-core fuses (it runs eager): the baseline's"
    if ablation.needs_gpu and not torch.cuda.is_available():
        return "needs a CUDA GPU (skipped on CPU)"
    if ablation.needs_te and not builder.te_available():
        return "needs transformer-engine (not installed)"
    if ablation.needs_fused_softmax and not builder.fused_softmax_available():
        return "needs Apex's fused softmax kernels (scaled_masked_softmax_cuda, not installed)"
    baseline = baseline_core_attention()
    if ablation.core_attention and baseline is None:
        return "the transformer-engine spec runs its own attention here (the local spec's core attentions do not)"
    if ablation.core_attention and ablation.core_attention == baseline:
        return f"the baseline already runs it here ({describe(baseline)})"
    if ablation.needs_unfused_softmax and baseline == SDPA:
        return "the baseline's SDPA kernels have no separate softmax to change (they accumulate it in fp32)"
    return None


def config_overrides(name: str | None) -> dict:
    return dict(BY_NAME[name].overrides) if name else {}


def core_attention(name: str | None) -> str | None:
    """The core attention the run builds: the variant's, else the baseline's (None: the builder's default)."""
    ablation = BY_NAME.get(name) if name else None
    return ablation.core_attention if ablation is not None and ablation.core_attention else baseline_core_attention()


def use_te(name: str | None) -> bool | None:
    """TE-spec variants build the TE layer spec; everything else keeps the builder's default."""
    return True if name in ("rmsnorm_te", "attention_te") else None


@contextmanager
def patched(name: str | None, model):
    """Apply the variant's run-time patch (if any) to ``model`` for the duration of the block."""
    with ExitStack() as stack:
        ablation = BY_NAME.get(name) if name else None
        if ablation is not None and (ablation.core_attention or ablation.needs_unfused_softmax):
            unchanged = _core_attention_unchanged(model, ablation.core_attention)
            if unchanged:
                raise NotApplicable(unchanged)
        if ablation is not None and ablation.patch is not None:
            stack.enter_context(ablation.patch(model))
        yield


def _core_attention_unchanged(model, kind: str | None) -> str | None:
    """Why building ``kind``'s core attention (None: changing megatron's softmax in it) changes nothing in ``model``:
    no layer has a core attention (DeepSeek-V4's own attention), or every one computes megatron's unfused arithmetic
    in SDPA's module (gpt-oss's sinks: the s63 audit found both listed as runs equal to the baseline)."""
    cores = [m for name, m in model.named_modules() if name.endswith("self_attention.core_attention")]
    if not cores:
        return "the model's attention is its own: it has no megatron-core core attention for this variant to change"
    fallbacks = {getattr(m, "fallback", None) for m in cores}
    if kind == SDPA and None not in fallbacks:
        return f"every layer's attention runs megatron's unfused arithmetic inside SDPA's module ({min(fallbacks)})"
    return None

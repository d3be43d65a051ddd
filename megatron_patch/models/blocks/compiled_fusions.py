"""``torch.compile`` of the local spec's memory-bound pieces, for machines without transformer-engine's
fused kernels (``MP_COMPILE_FUSIONS=true``).

Each of these reads and writes whole activations for a few flops per element, so in eager PyTorch it is
several kernels and round trips through memory; compiled, one generated kernel each (Triton on a GPU,
C++ on CPU). The pieces, and how each is compiled:

- RMSNorm (torch's ``RMSNorm`` modules of the local spec): their forward calls one compiled ``rms_norm``;
- RoPE: megatron-core's ``_apply_rotary_pos_emb_bshd`` (packed THD calls it per document), replaced in its
  module by a compiled copy for the process;
- SwiGLU and the bias-dropout-add of the residual: megatron-core's own fused versions, which it compiles
  with ``torch.compile`` itself (``megatron.core.jit``), switched on by ``bias_activation_fusion`` and
  ``bias_dropout_fusion`` (on a GPU they are on by default; ``MP_COMPILE_FUSIONS=false`` turns them off for
  an all-eager baseline).

The modules' classes, parameters and state dicts do not change, so checkpoints are the same either way.
The numbers are those of the same arithmetic in another order (fp32 losses agree to about 1e-6;
tests/test_compiled_fusions.py). Compiling costs seconds per piece on the first step (tens of seconds on a
small CPU), which training's throughput already leaves out as the warm-up iteration.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# processes that import this module without building a megatron-core model (align's main process, the
# launcher's dry run and resume checks) do not pay for it.


@functools.lru_cache(maxsize=1)
def _compiled_rms_norm():
    def rms_norm(x, weight, shape: tuple, eps: float | None):
        return F.rms_norm(x, shape, weight, eps)

    return torch.compile(rms_norm)


def _rms_norm_forward(self, x):
    return _compiled_rms_norm()(x, self.weight, tuple(self.normalized_shape), self.eps)


@functools.lru_cache(maxsize=1)
def compile_rope() -> None:
    """megatron-core's unfused RoPE, compiled, for the rest of this process (every model in it)."""
    from megatron.core.models.common.embeddings import rope_utils

    rope_utils._apply_rotary_pos_emb_bshd = torch.compile(rope_utils._apply_rotary_pos_emb_bshd)


def compile_fusions(models) -> dict:
    """Compile the pieces of ``models`` (model chunks built with ``training.megatron_settings.fusion_overrides(True)``); returns what
    was compiled, for the log."""
    norms = 0
    for model in models:
        for module in model.modules():
            if isinstance(module, torch.nn.RMSNorm) and "forward" not in vars(module):
                module.forward = _rms_norm_forward.__get__(module)
                norms += 1
    compile_rope()
    config = models[0].config
    return {"rmsnorm": norms, "rope": True, "swiglu": bool(config.bias_activation_fusion),
            "bias_dropout_add": bool(config.bias_dropout_fusion)}


def describe(compiled: dict) -> str:
    parts = [f"{compiled['rmsnorm']} RMSNorm modules", "RoPE"]
    parts += [name for name in ("swiglu", "bias_dropout_add") if compiled[name]]
    return "torch.compile: " + ", ".join(parts)

"""Which kernel torch SDPA runs for megatron-core's local spec (``sdpa_attention.SDPAttention``) on a machine, named
for the dry run and the training log, and the FlashAttention-3/-4 implementations torch can route SDPA's flash
backend to (``torch.nn.attention.activate_flash_attention_impl``), switched on where their package is installed.

On a GPU, in 16-bit, causal self-attention without a mask:

- FlashAttention-4 (the ``flash-attn-4`` package, Hopper and Blackwell) or FlashAttention-3 (``flash-attn-3``,
  Hopper): torch's flash backend runs it once activated;
- else cuDNN SDPA, which torch prefers on Hopper (and later) from 2.11;
- else torch's own flash SDPA (FlashAttention-2's kernel, built into torch).

fp32 runs the memory-efficient kernel (flash and cuDNN take 16-bit only); CPU runs torch's CPU flash kernel.
Layers whose masks SDPA cannot take (sliding windows, attention sinks) keep megatron-core's unfused arithmetic
(``sdpa_attention.fallback_reason``); the name says so.
"""

from __future__ import annotations

from megatron_patch.runtime.machine import version_tuple

# torch is imported inside the function that activates a kernel (``activate``): the launcher and its dry run name the
# kernel without it.

FA4, FA3 = "FA4", "FA3"


def flash_implementation(cuda: bool, capability: tuple[int, int] | None, fa3: bool, fa4: bool) -> str | None:
    """The FlashAttention implementation torch SDPA's flash backend can be routed to here, or None."""
    if not cuda or capability is None:
        return None
    if fa4 and capability >= (9, 0):
        return FA4
    if fa3 and capability[0] == 9:
        return FA3
    return None


def sdpa_kernel(cuda: bool, capability: tuple[int, int] | None, torch_version: str | None, half: bool,
                fa3: bool = False, fa4: bool = False) -> str:
    """The SDPA kernel causal 16-bit (``half``) or fp32 self-attention runs with."""
    if not cuda:
        return "torch SDPA, CPU flash kernel"
    if not half:
        return "torch SDPA, memory-efficient kernel (fp32: flash and cuDNN take 16-bit only)"
    impl = flash_implementation(cuda, capability, fa3, fa4)
    if impl is not None:
        return (f"FlashAttention-{impl[-1]} through torch SDPA (torch.nn.attention.activate_flash_attention_impl"
                f"('{impl}'))")
    if capability is not None and capability >= (9, 0) and version_tuple(torch_version) >= (2, 11):
        return "cuDNN SDPA (torch's preferred kernel on Hopper and later from 2.11)"
    return "torch flash SDPA (FlashAttention-2's kernel, built into torch)"


def fallback_note(arch) -> str:
    """What layers whose masks SDPA cannot take run instead ('' for a model without them)."""
    reasons = [r for r, present in (("sliding windows", arch.sliding_window is not None),
                                    ("attention sinks", arch.attention_sinks)) if present]
    if not reasons:
        return ""
    return f"; layers with {' and '.join(reasons)} fall back to megatron-core's unfused attention"


def activate(impl: str | None) -> str | None:
    """Route torch SDPA's flash backend to ``impl`` (FA3, FA4) for this process; returns what was activated, or None
    where torch or the package cannot (the log then names the kernel torch keeps)."""
    if impl is None:
        return None
    import torch.nn.attention as attention

    if not hasattr(attention, "activate_flash_attention_impl"):
        return None
    try:
        attention.activate_flash_attention_impl(impl)
    except Exception:  # noqa: BLE001 - a package that fails to register leaves torch's own kernels, which still run
        return None
    return impl

"""Set-up only a GPU run needs, done on every rank before the model is built or trained.

- transformer-engine's userbuffers for TP communication overlap (``tp_comm_overlap``): without
  them the first TE linear fails with "UB manager is not initialized".
- A warm-up of megatron-core's fused kernels, which ``torch.compile`` compiles on first use, so the
  first iteration's time is not mostly compilation.

transformer-engine is imported inside the functions (it is absent on CPU machines), and its API is
recognised by signature, as its arguments changed across releases.
"""

from __future__ import annotations

import ctypes
import inspect
import os

import torch

# megatron-core is imported inside the functions that use it, so that in a rank it loads after
# init_process_group has enabled runtime/cpu_compat (on CPU, megatron-core's CUDA-only spots are patched).

# cuDeviceGetAttribute's CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (CUDA >= 12.1).
_CU_MULTICAST_SUPPORTED = 132


def multicast_supported(device_index: int = 0) -> bool | None:
    """Whether the driver offers NVLink multicast on this GPU; None when it cannot be asked."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        if libcuda.cuInit(0) != 0:
            return None
        device, value = ctypes.c_int(), ctypes.c_int()
        if libcuda.cuDeviceGet(ctypes.byref(device), device_index) != 0:
            return None
        if libcuda.cuDeviceGetAttribute(ctypes.byref(value), _CU_MULTICAST_SUPPORTED, device) != 0:
            return None
        return bool(value.value)
    except OSError:
        return None


def userbuffer_shape(cfg, hidden_size: int) -> list[int]:
    """[tokens of one micro-batch on this context-parallel rank, hidden]: what TP overlap moves per GEMM."""
    return [cfg.sample_length * cfg.micro_batch_size // cfg.cp, hidden_size]


def initialize_tp_communicators(cfg, hidden_size: int, *, te_base=None, multicast: bool | None = None,
                                env=None) -> dict:
    """Create transformer-engine's userbuffers for ``cfg`` (after model-parallel init, before the model).

    Returns the keyword arguments ``initialize_ub`` was called with. ``te_base`` defaults to
    ``transformer_engine.pytorch.module.base``; ``multicast`` to what the driver says.
    """
    env = os.environ if env is None else env
    if te_base is None:
        # transformer-engine only where TP communication overlap asks for it (a GPU machine that has it)
        from transformer_engine.pytorch.module import base as te_base
    params = inspect.signature(te_base.initialize_ub).parameters
    fp8 = cfg.precision.fp8
    kwargs: dict = {"shape": userbuffer_shape(cfg, hidden_size), "tp_size": cfg.tp}
    if "quantization_modes" in params:  # transformer-engine >= 2.7
        modes = te_base.UserBufferQuantizationMode
        kwargs["quantization_modes"] = [modes.FP8 if fp8 else modes.NONE]
    else:
        kwargs["use_fp8"] = fp8
    if "bootstrap_backend" in params:
        kwargs["bootstrap_backend"] = "nccl"
    if multicast is None:
        multicast = multicast_supported(torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if multicast is False and "UB_SKIPMC" not in env:
        # Userbuffers allocate through NVLink multicast unless told not to; without it they fail at start.
        env["UB_SKIPMC"] = "1"
    te_base.initialize_ub(**kwargs)
    return kwargs


def warm_up_fused_kernels(cfg, arch, dtype: torch.dtype, device: torch.device) -> None:
    """Run megatron-core's compiled SwiGLU and bias-dropout-add once per shape and grad mode the step uses.

    Megatron-LM does this before training (``_warmup_jit_function``): both are ``torch.compile``d on
    first call, in forward and in recompute (input with and without grad).
    """
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    tokens = cfg.tokens_per_gemm
    widths = {arch.ffn_hidden_size // cfg.tp} if arch.has_dense_layers else set()
    if arch.is_moe:
        widths.add(arch.moe_ffn_hidden_size // cfg.layout.expert_tp)
        if arch.shared_expert_ffn_hidden_size:
            widths.add(arch.shared_expert_ffn_hidden_size // cfg.tp)
    rows = tokens // cfg.tp if cfg.sequence_parallel else tokens
    for input_grad in (False, True):
        for width in sorted(widths):
            x = torch.rand(tokens, 2 * width, dtype=dtype, device=device, requires_grad=input_grad)
            for _ in range(3):
                bias_swiglu_impl(x, None)
        hidden = torch.rand(rows, 1, arch.hidden_size, dtype=dtype, device=device, requires_grad=input_grad)
        residual = torch.rand(rows, 1, arch.hidden_size, dtype=dtype, device=device, requires_grad=True)
        for _ in range(3):
            bias_dropout_add_fused_train((hidden, None), residual, 0.0)
    torch.cuda.empty_cache()

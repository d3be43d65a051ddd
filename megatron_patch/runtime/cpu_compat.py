"""Let megatron-core run on a machine without CUDA, by presenting the CPU as "the CUDA device".

megatron-core assumes a GPU in many small places: tensors created with ``device="cuda"`` or
``torch.cuda.current_device()``, ``.cuda()`` calls, ``torch.cuda.*Tensor`` type checks, CUDA
streams, events and synchronisation, the CUDA RNG behind its model-parallel RNG tracker, and
collectives that NCCL has but gloo lacks. Each is redirected here to its CPU equivalent.

The layer is applied only when CUDA is absent (``enable()`` does nothing otherwise, so the GPU path
is never touched) and only for the megatron-core versions it was written against: a newer release
may have moved the calls it patches, so it refuses with a clear message rather than half-working.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist

from megatron_patch.errors import UserError

# Releases whose CUDA-only spots were audited for this layer.
SUPPORTED_MCORE = ("0.16.",)
_ENABLED = False


def is_needed() -> bool:
    return not torch.cuda.is_available()


def is_enabled() -> bool:
    return _ENABLED


def check_mcore_version() -> str:
    from megatron.core import package_info

    version = package_info.__version__
    if not version.startswith(SUPPORTED_MCORE) and os.environ.get("MP_CPU_COMPAT_ANY_MCORE") != "1":
        raise UserError(
            f"the CPU compatibility layer was written for megatron-core {'/'.join(v + 'x' for v in SUPPORTED_MCORE)}, "
            f"found {version}: install megatron-core==0.16.1, run on a GPU, or set MP_CPU_COMPAT_ANY_MCORE=1 to try anyway"
        )
    return version


# --- devices -----------------------------------------------------------------------------------

def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # torch.cuda.current_device() returns an index
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _cpu_kwargs(kwargs: dict) -> dict:
    if _is_cuda_device(kwargs.get("device")):
        kwargs["device"] = "cpu"
    # Pinned host memory needs an accelerator; on CPU it is only a transfer optimisation.
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


def _redirect_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **_cpu_kwargs(kwargs))

    wrapper.__mp_original__ = fn
    return wrapper


_FACTORIES = (
    "tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
    "randperm", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
    "eye", "linspace", "empty_strided",
)
_TENSOR_FACTORIES = ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


def _make_tensor_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = ("cpu",) + args[1:]
        return original(self, *args, **_cpu_kwargs(kwargs))

    to.__mp_original__ = original
    return to


# Type-string checks such as ``param.type() == 'torch.cuda.FloatTensor'`` (optimizer, grad
# clipping) must see the CPU tensors as the tensors of "the device".
def _make_tensor_type(original):
    @functools.wraps(original)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original(self)
            return name.replace("torch.", "torch.cuda.", 1) if self.device.type == "cpu" else name
        if isinstance(dtype, str):
            dtype = dtype.replace("torch.cuda.", "torch.")
        return original(self, dtype, non_blocking, **kwargs)

    type_.__mp_original__ = original
    return type_


# --- streams, events, RNG ----------------------------------------------------------------------

class _NullStream:
    """CPU work is synchronous: a stream has nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _NullEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def _get_rng_state(device="cuda", *args, **kwargs):
    return torch.get_rng_state()


def _set_rng_state(new_state, device=-1, *args, **kwargs):
    torch.set_rng_state(new_state)


def _manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda():
    cuda = torch.cuda
    patches = {
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "Stream": _NullStream,
        "Event": _NullEvent,
        "current_stream": lambda device=None: _NullStream(),
        "default_stream": lambda device=None: _NullStream(),
        "stream": lambda stream=None: contextlib.nullcontext(),
        "get_rng_state": _get_rng_state,
        "set_rng_state": _set_rng_state,
        "manual_seed": _manual_seed,
        "manual_seed_all": _manual_seed,
        "memory_stats": lambda device=None: {},
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "max_memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
    }
    for name, value in patches.items():
        setattr(cuda, name, value)
    nvtx = cuda.nvtx
    nvtx.range_push = lambda msg: None
    nvtx.range_pop = lambda: None
    nvtx.range = lambda *a, **k: contextlib.nullcontext()


def _patch_torch_tensors():
    for name in _FACTORIES:
        setattr(torch, name, _redirect_factory(getattr(torch, name)))
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _redirect_factory(getattr(torch.Tensor, name)))
    torch.Tensor.cuda = _tensor_cuda
    torch.Tensor.to = _make_tensor_to(torch.Tensor.to)
    torch.Tensor.type = _make_tensor_type(torch.Tensor.type)


# --- gloo collectives --------------------------------------------------------------------------

class _DoneWork:
    """Handle for a collective that already finished synchronously."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _patch_collectives():
    # gloo has no reduce-scatter; megatron's distributed optimizer and sequence parallelism use it.
    # All-reduce then keep our shard: same result, more traffic, fine for development runs.
    original_rs = dist.reduce_scatter_tensor

    @functools.wraps(original_rs)
    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not _is_gloo(group):
            return original_rs(output, input, op=op, group=group, async_op=async_op)
        reduced = input.clone()
        dist.all_reduce(reduced, op=op, group=group)
        rank = dist.get_rank(group)
        n = output.numel()
        output.copy_(reduced.reshape(-1)[rank * n:(rank + 1) * n].view_as(output))
        return _DoneWork() if async_op else None

    dist.reduce_scatter_tensor = reduce_scatter_tensor
    # megatron also reaches the private alias.
    dist._reduce_scatter_base = reduce_scatter_tensor


def _patch_megatron():
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)

    from megatron.core.transformer.moe import moe_utils

    # Imported from transformer-engine inside a try block; absent TE leaves the name undefined.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def enable() -> bool:
    """Apply the layer if CUDA is absent. Idempotent. Returns whether the layer is active."""
    global _ENABLED
    if _ENABLED:
        return True
    if not is_needed():
        return False
    check_mcore_version()
    _patch_torch_cuda()
    _patch_torch_tensors()
    _patch_collectives()
    _patch_megatron()
    _ENABLED = True
    return True

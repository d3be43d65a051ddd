"""Let megatron-core run on a machine without CUDA, by presenting the CPU as "the CUDA device".

megatron-core assumes a GPU in many small places: tensors created with ``device="cuda"`` or
``torch.cuda.current_device()``, ``.cuda()`` calls, ``torch.cuda.*Tensor`` type checks, CUDA
streams, events and synchronisation, the CUDA RNG behind its model-parallel RNG tracker. Each is
redirected here to its CPU equivalent. A few megatron-core spots that only a CPU run reaches are
fixed too, each where it is patched: the alltoall MoE dispatcher's token counts, the uneven
all-gather gloo lacks, sequence parallelism for the torch norm (no Apex without CUDA), and the
distributed optimizer's checkpoint path with torch's Adam (no TE/Apex without CUDA).

No torch collective is redirected: gloo (torch >= 2.3) has reduce_scatter_tensor,
all_gather_into_tensor, their coalesced forms and uneven all_to_all_single itself
(tests/test_runtime.py checks each with known answers).

The layer is applied only when CUDA is absent (``enable()`` does nothing otherwise, so the GPU path
is never touched) and only for the megatron-core releases it was audited against (``PATCHES`` says,
patch by patch, which releases need it and why): another release may have moved the calls it
patches, so it refuses with a clear message rather than half-working. Two of its patches are about
transformer-engine being absent, not CUDA (``without_te``): on a GPU without TE, ``enable()`` applies
those alone, where TE is not installed (megatron-core 0.16 crashes there otherwise, in every MoE router
and every MLA forward).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import logging
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._device import _device_constructors

from megatron_patch.errors import UserError
from megatron_patch.runtime.machine import installed_folder, megatron_core_version

# megatron-core's modules are imported by the patches that change them, applied only on CPU (or without
# transformer-engine) and only for the releases they were audited against (PATCHES).

# Releases (major.minor) whose CUDA-only spots were audited for this layer.
SUPPORTED_MCORE = ("0.16", "0.19")
_ENABLED = False
_APPLIED: tuple[str, ...] = ()


def is_needed() -> bool:
    return not torch.cuda.is_available()


def is_enabled() -> bool:
    return _ENABLED


def applied() -> tuple[str, ...]:
    """Names of the patches ``enable()`` applied (empty when the layer is off)."""
    return _APPLIED


def release_of(version: str) -> str:
    """'0.19.2' -> '0.19'; a pre-release such as '0.19.0rc1' belongs to its release too."""
    major, minor = version.split(".")[:2]
    return f"{major}.{''.join(c for c in minor if c.isdigit())}"


def check_mcore_version() -> str:
    from megatron.core import package_info

    version = package_info.__version__
    if release_of(version) not in SUPPORTED_MCORE and os.environ.get("MP_CPU_COMPAT_ANY_MCORE") != "1":
        raise UserError(
            f"the CPU compatibility layer was written for megatron-core {' and '.join(v + '.x' for v in SUPPORTED_MCORE)}, "
            f"found {version}{_found_before_the_installed(package_info.__file__)}: install megatron-core 0.16.1 "
            f"(Python 3.10/3.11) or 0.19.x (Python 3.12/3.13), run on a GPU, or set MP_CPU_COMPAT_ANY_MCORE=1 to try "
            "anyway"
        )
    return version


def _found_before_the_installed(module_file: str) -> str:
    """Where the megatron-core imported comes from, when a folder on PYTHONPATH (a Megatron-LM checkout) put it
    before the installed one, which is what the user installed and thinks is running."""
    found, installed = Path(module_file).resolve().parents[2], installed_folder("megatron-core", "megatron_core")
    if installed == found:
        return ""
    if installed is None:
        return f" in {found}"
    return (f" in {found}, which comes before the megatron-core {megatron_core_version()} installed in {installed} "
            "(take it off PYTHONPATH to use that one)")


def _audited_release(version: str) -> str:
    """The audited release whose patches an unaudited one (MP_CPU_COMPAT_ANY_MCORE=1) tries: the newest
    audited release not newer than it, else the oldest."""
    def key(release):
        return tuple(int(x) for x in release.split("."))

    older = [r for r in SUPPORTED_MCORE if key(r) <= key(release_of(version))]
    return max(older, key=key) if older else min(SUPPORTED_MCORE, key=key)


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
    # torch's device contexts (`with torch.device("meta"):`, used by transformers to build models
    # before loading weights) recognise constructors by identity, from a cache filled on first use.
    # Fill it with the real constructors before they are wrapped, or a model built under such a
    # context afterwards gets real, uninitialised tensors where it expects meta ones.

    _device_constructors()
    for name in _FACTORIES:
        setattr(torch, name, _redirect_factory(getattr(torch, name)))
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _redirect_factory(getattr(torch.Tensor, name)))
    torch.Tensor.cuda = _tensor_cuda
    torch.Tensor.to = _make_tensor_to(torch.Tensor.to)
    torch.Tensor.type = _make_tensor_type(torch.Tensor.type)


def _patch_model_parallel_rng():
    """The model-parallel RNG tracker saves and restores "the CUDA generator" through megatron's own
    helpers, which call CUDA directly: give it the CPU generator."""
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda device=None, clone=False, graph_safe=False: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    # Its fork() then warns whenever the CPU generator moved inside it, which here is every random op it forks
    # for (LoRA's dropout: 96 lines in 3 iterations), though it puts the state back itself as it exits.
    logging.getLogger(mp_random.__name__).addFilter(_cpu_is_the_cuda_generator)


def _cpu_is_the_cuda_generator(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("CPU RNG state changed within GPU RNG context")


def _patch_moe_te_general_gemm():
    """moe_utils imports ``te_general_gemm`` from transformer-engine inside a try block; absent TE
    leaves the name undefined (NameError in the router). 0.19 sets it to None itself."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_moe_token_counts():
    """The alltoall dispatcher turns its token counts into host numpy arrays only for CUDA tensors
    (`tensor.is_cuda`); on CPU they stay tensors and all_to_all_single rejects tensor split sizes.
    Give the CPU the same host copy the GPU path makes. token_dispatcher holds its own reference."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original_move = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original_move)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().numpy().copy()
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__mp_original__ = original_move
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_mla_without_te():
    """megatron-core's transformer-engine extension imports without TE and leaves mock classes behind,
    so multi-latent attention believes TE is there (``HAVE_TE``) and calls ``isinstance`` with a mock,
    a TypeError. Without CUDA there is no TE: say so."""

    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def _patch_yarn_rotary_device():
    """Multi-latent attention builds ``YarnRotaryEmbedding`` without ``use_cpu_initialization``, which
    then places its frequencies under ``torch.device(torch.cuda.current_device())``: with the device
    index 0 (what the layer's current_device returns) torch asks for an accelerator and fails. On CPU
    the frequencies are made on the CPU, as ``use_cpu_initialization`` does."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    original = YarnRotaryEmbedding.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        kwargs["use_cpu_initialization"] = True
        original(self, *args, **kwargs)

    __init__.__mp_original__ = original
    YarnRotaryEmbedding.__init__ = __init__


def _patch_uneven_all_gather():
    """Uneven all-gather on gloo, as the alltoall MoE dispatcher needs with expert TP > 1.

    `mappings._gather_along_first_dim(..., output_split_sizes)` calls `dist.all_gather` with
    differently sized outputs: NCCL accepts that, gloo raises "invalid tensor size". Pad every
    shard to the longest, gather equal shards, cut the padding off. (Its backward, the uneven
    reduce-scatter, gloo does natively.)
    """
    from megatron.core.tensor_parallel import mappings

    original = mappings._gather_along_first_dim

    @functools.wraps(original)
    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or dist.get_backend(group) != "gloo":
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest,) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)], dim=0)

    _gather_along_first_dim.__mp_original__ = original
    mappings._gather_along_first_dim = _gather_along_first_dim


def _patch_torch_norm():
    """Sequence parallelism for the local spec's norm, which is torch's own when Apex is absent.

    Without CUDA there is no Apex, so `get_gpt_layer_local_spec` builds `WrappedTorchNorm`, which
    refuses `sequence_parallel`. MoE with TP>1 needs sequence parallelism when training
    (`MoELayer.forward` raises otherwise). A norm is per token, so it is correct on a sequence
    shard; only its weight gradient is partial, and `finalize_model_grads` all-reduces it over the
    TP group for every parameter tagged `sequence_parallel`, as Apex's FusedLayerNorm tags its own.
    """

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    __new__.__mp_original__ = original_new
    WrappedTorchNorm.__new__ = staticmethod(__new__)


def _patch_torch_adam_checkpointing():
    """Restoring the distributed optimizer when its inner optimizer is torch's Adam.

    Without CUDA there is neither Transformer Engine nor Apex, so megatron-core falls back to
    `torch.optim.Adam`/`AdamW`, whose per-parameter `step` tensor its 0.16 checkpoint code handles
    in three places only half-way (each seen on CPU; the TE/Apex FusedAdam path is untouched):
    - `state_dict()` asserts one common step, but a fresh torch Adam has no state until its first
      step, so `sharded_state_dict(is_loading=True)` fails before anything is read: give the fresh
      optimizer zero state at step 0 (what `load_state_dict` then overwrites);
    - the 'fully_reshardable' loader copies every key of the optimizer's state from the checkpoint
      but deliberately leaves 'step' out of what it read (KeyError: 'step'): keep the step that
      `load_state_dict` already set from the param groups;
    - `load_state_dict` gives all parameters one shared `step` tensor, which torch's Adam then bumps
      once per parameter per step (bias correction runs far ahead, updates differ after resume):
      give each parameter its own copy.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer

    original_sharded_state_dict = cls.sharded_state_dict

    @functools.wraps(original_sharded_state_dict)
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        inner = self.optimizer
        if is_loading and isinstance(inner, torch.optim.Adam | torch.optim.AdamW) and len(inner.state) == 0:
            for group in inner.param_groups:
                for param in group["params"]:
                    inner.state[param] = {
                        "step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param),
                    }
        if model_sharded_state_dict is None:
            model_sharded_state_dict = {}
        return original_sharded_state_dict(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    original_set_states = cls._set_main_param_and_optimizer_states

    @functools.wraps(original_set_states)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                tensors = dict(tensors, step=state["step"])
        return original_set_states(self, model_param, tensors)

    original_load_state_dict = cls.load_state_dict

    @functools.wraps(original_load_state_dict)
    def load_state_dict(self, state_dict):
        original_load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    for name, fn, original in (
        ("sharded_state_dict", sharded_state_dict, original_sharded_state_dict),
        ("_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states, original_set_states),
        ("load_state_dict", load_state_dict, original_load_state_dict),
    ):
        fn.__mp_original__ = original
        setattr(cls, name, fn)


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    releases: tuple[str, ...]  # the audited megatron-core releases (major.minor) that need it
    apply: Callable[[], None]
    why: str
    without_te: bool = False  # also needed on a GPU when transformer-engine is absent


_BOTH = ("0.16", "0.19")

# The version rule, patch by patch. docs/cpu-runtime.md shows the same table.
PATCHES = (
    Patch("torch.cuda", _BOTH, _patch_torch_cuda,
          "current_device/streams/events/synchronize/CUDA RNG calls all over megatron-core"),
    Patch("torch tensors", _BOTH, _patch_torch_tensors,
          'device="cuda" factories, .cuda(), .to("cuda"), torch.cuda.*Tensor type checks'),
    Patch("model-parallel RNG", _BOTH, _patch_model_parallel_rng,
          "tensor_parallel.random's _get/_set_cuda_rng_state call CUDA directly"),
    Patch("MoE te_general_gemm", ("0.16",), _patch_moe_te_general_gemm,
          "0.16 leaves the name undefined without TE; 0.19 sets it to None itself", without_te=True),
    Patch("MoE token counts", _BOTH, _patch_moe_token_counts,
          "maybe_move_tensor_to_cpu makes host numpy split sizes only for CUDA tensors"),
    Patch("uneven all-gather", _BOTH, _patch_uneven_all_gather,
          "gloo's all_gather refuses the uneven shards of the alltoall dispatcher at ETP>1"),
    Patch("YaRN rotary device", _BOTH, _patch_yarn_rotary_device,
          "MLA builds YarnRotaryEmbedding on torch.device(current_device())"),
    Patch("MLA without TE", ("0.16",), _patch_mla_without_te,
          "0.16's MLA takes HAVE_TE from a try-import that succeeds on TE's mocks; 0.19 reads the real flag",
          without_te=True),
    Patch("torch norm sequence parallel", _BOTH, _patch_torch_norm,
          "WrappedTorchNorm refuses sequence_parallel, which MoE with TP>1 needs"),
    Patch("torch Adam checkpointing", _BOTH, _patch_torch_adam_checkpointing,
          "the distributed optimizer's checkpoint path assumes FusedAdam's step handling", without_te=True),
)


def fill_gaps_without_te() -> tuple[str, ...]:
    """On a GPU without transformer-engine: the ``without_te`` patches this megatron-core release needs (each
    only fills in what TE would have provided, so it changes nothing where TE is there). Returns their names."""

    if importlib.util.find_spec("transformer_engine") is not None:
        return ()
    from megatron.core import package_info

    version = package_info.__version__
    todo = [p for p in patches_for(version) if p.without_te]
    for patch in todo:
        patch.apply()
    return tuple(p.name for p in todo)


def patches_for(version: str) -> tuple[Patch, ...]:
    release = _audited_release(version)
    return tuple(p for p in PATCHES if release in p.releases)


def enable() -> bool:
    """Apply the layer if CUDA is absent (with CUDA and without transformer-engine, its ``without_te``
    patches). Idempotent. Returns whether the layer is active."""
    global _ENABLED, _APPLIED
    if _ENABLED:
        return True
    if not is_needed():
        fill_gaps_without_te()
        return False
    version = check_mcore_version()
    todo = patches_for(version)
    for patch in todo:
        patch.apply()
    _APPLIED = tuple(p.name for p in todo)
    _ENABLED = True
    return True

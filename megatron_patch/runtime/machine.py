"""What this machine has: installed packages, the GPU, and the training features they make usable.

`mpatch info` prints it and the launcher decides on it (``Capabilities``), so both read this one place.
torch is imported inside the functions: the launcher and the converter start without it.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from megatron_patch.runtime.known_warnings import quiet_known_warnings

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.


def _first_installed(dists: tuple[str, ...]) -> md.Distribution | None:
    """The first of ``dists`` that is installed (distributions spell names two ways)."""
    for dist in dists:
        try:
            return md.distribution(dist)
        except md.PackageNotFoundError:
            continue
    return None


def installed_version(*dists: str) -> str | None:
    """The version of the first of ``dists`` that is installed."""
    found = _first_installed(dists)
    return None if found is None else found.version


def installed_folder(*dists: str) -> Path | None:
    """The folder the first installed of ``dists`` is installed into (site-packages)."""
    found = _first_installed(dists)
    return None if found is None else Path(found.locate_file("")).resolve()


def version_tuple(text: str | None) -> tuple[int, ...]:
    """'12.9' or '0.19.2' -> (12, 9) / (0, 19): the release line, for comparisons; () when unreadable."""
    try:
        return tuple(int(x) for x in (text or "").split(".")[:2])
    except ValueError:
        return ()


def megatron_core_version() -> str | None:
    return installed_version("megatron-core", "megatron_core")


def experts_grouped_whenever_etp_differs() -> bool:
    """Whether megatron-core puts the experts in its expert process groups (their gradients reduced over expert data
    parallelism) whenever ETP differs from TP, as 0.19 does; 0.16 does only with EP > 1."""
    return version_tuple(megatron_core_version()) >= (0, 19)


def compile_problem(cuda: bool) -> str | None:
    """Why ``torch.compile`` cannot generate kernels here, or None. Inductor writes Triton on a GPU and C++
    on CPU, which it builds with the system's compiler against Python's headers."""
    if cuda:
        if importlib.util.find_spec("triton") is None:
            return "torch.compile on a GPU needs triton (pip install triton, the version your torch names)"
        return None
    if not any(c and shutil.which(c) for c in (os.environ.get("CXX"), "g++", "c++", "clang++")):
        return "torch.compile on CPU needs a C++ compiler (g++ or clang++, or CXX=...) to build its kernels"
    include = sysconfig.get_paths().get("include") or ""
    if not (Path(include) / "Python.h").is_file():
        return f"torch.compile on CPU needs Python's headers ({include}/Python.h: install python3-dev)"
    return None


def gpu_info() -> dict | None:
    """GPU 0's name, count, compute capability and memory, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "count": torch.cuda.device_count(), "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1)}


def transformer_engine_usable() -> bool:
    """Whether transformer-engine's PyTorch layers import here, with CUDA: what its layer spec needs. Package
    metadata alone is not enough: a partial install (the core library without the torch extension, which is
    built from source) has the metadata and fails at the first import. The launcher, ``mpatch info`` and
    the model builder all decide on this one test."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import means: not usable here
        return False
    return True


@functools.cache
def cpu_float8_rowwise() -> bool:
    """Whether torch's CPU float8 GEMM (``torch._scaled_mm``) takes row-wise scales, which torchao's rowwise recipes
    need. Asked of torch itself, one 16x32 GEMM: torch 2.11's CPU kernel takes per-tensor scales only (an internal
    assert), 2.13's and 2.15's take both."""
    import torch

    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, AttributeError, TypeError):
        return False
    return True


# the [fp8] extra's torchao (setup.py): older releases name float8's modules otherwise (float8_training_tensor was
# float8_tensor before 0.12), so their import fails on every rank
TORCHAO_MINIMUM = (0, 18)
# what to do where torchao_import_error says why it cannot run: the same advice from the launcher and from align
TORCHAO_REINSTALL = f"install torchao>={'.'.join(map(str, TORCHAO_MINIMUM))} for this torch (pip install -e \".[fp8]\")"


@functools.cache
def torchao_import_error() -> str | None:
    """Why torchao's float8 training cannot run although its distribution is installed (older than the [fp8] extra's
    minimum, or built for another torch so its float8 modules fail to import), or None. Tried once per process, and
    only for a PR=fp8 launch or dry run and align --dtype fp8 (the import takes about a second): otherwise the ranks
    would start and stop with an internal error."""
    version = installed_version("torchao")
    if version and version_tuple(version) and version_tuple(version) < TORCHAO_MINIMUM:
        return f"torchao {version} is older than {'.'.join(map(str, TORCHAO_MINIMUM))}"
    quiet_known_warnings()  # the notices torchao's import prints about CUDA extensions it cannot load
    try:
        # what models/blocks/float8.py imports
        import torchao.float8  # noqa: F401
        from torchao.float8 import float8_training_tensor, float8_utils  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import means: not usable here
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    return None


def features(gpu: dict | None) -> dict:
    """Which of transformer-engine, FP8 and FlashAttention are usable with ``gpu`` (``gpu_info()``)."""
    cuda = gpu is not None
    te_version = installed_version("transformer-engine", "transformer_engine")
    te = bool(cuda and te_version and transformer_engine_usable())
    fa2 = installed_version("flash-attn", "flash_attn")
    fa3 = installed_version("flash-attn-3", "flash_attn_3")
    torchao = installed_version("torchao")
    hopper = cuda and gpu["capability"].startswith("9.")
    return {
        "transformer_engine": te,
        "transformer_engine_version": te_version,
        "fp8": te and float(gpu["capability"]) >= 8.9,
        # PR=fp8 without transformer-engine (training/fp8_run.py): torchao's float8, on a GPU with FP8 or on CPU
        "fp8_torchao": torchao,
        "flash_attention_2": bool(fa2 and cuda),
        "flash_attention_3": bool(fa3 and hopper),
        "layer_spec": "transformer_engine" if te else "local",
        # models/blocks/core_attention.py: SDPA on a GPU without transformer-engine, unfused on CPU (FL=true: SDPA)
        "attention": "flash/fused (TE)" if te else ("sdpa (torch SDPA, local spec)" if cuda
                                                   else "local (unfused softmax; FL=true: torch SDPA)"),
    }


@dataclass(frozen=True)
class Capabilities:
    """What the launcher checks a configuration against."""

    cuda: bool
    transformer_engine: bool
    fp8: bool
    flash_attention_3: bool
    flash_attention_2: bool = False
    compute_capability: tuple[int, int] | None = None  # of GPU 0
    cuda_version: str | None = None  # torch's CUDA build
    compile_problem: str | None = None  # why torch.compile cannot build kernels here (None: it can)
    torchao: bool = False  # torchao's float8 training (PR=fp8 without transformer-engine)
    flash_attention_4: bool = False  # the flash-attn-4 package (torch SDPA's FA4 implementation)
    torch_version: str | None = None
    cpu_float8_rowwise: bool = True  # torch's CPU float8 GEMM takes row-wise scales (``cpu_float8_rowwise()``)
    torchao_import_error: str | None = None  # installed, but ``import torchao.float8`` fails (None: not asked)

    @classmethod
    def detect(cls, import_torchao: bool = False) -> "Capabilities":
        """This machine; ``import_torchao``: try torchao's import too (``torchao_import_error``)."""
        import torch

        gpu = gpu_info()
        f = features(gpu)
        torchao = installed_version("torchao") is not None
        return cls(cuda=gpu is not None, transformer_engine=f["transformer_engine"], fp8=f["fp8"],
                   flash_attention_3=f["flash_attention_3"], flash_attention_2=f["flash_attention_2"],
                   compute_capability=tuple(torch.cuda.get_device_capability(0)) if gpu else None,
                   cuda_version=torch.version.cuda, compile_problem=compile_problem(gpu is not None),
                   torchao=torchao, torchao_import_error=torchao_import_error() if torchao and import_torchao else None,
                   flash_attention_4=bool(gpu) and installed_version("flash-attn-4", "flash_attn_4") is not None,
                   torch_version=torch.__version__, cpu_float8_rowwise=cpu_float8_rowwise())

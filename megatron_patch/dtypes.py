"""The one table of dtypes: the project's precision names (and ``Precision``, the training precision with what it
implies), and each dtype's name in the formats it meets (config.json's ``torch_dtype``, safetensors headers, torch
pickles).

Every table is kept by dtype *name* (torch's attribute name: ``"bfloat16"``), which needs no torch;
the tables of ``torch.dtype`` objects (``PRECISIONS``, ``SAFETENSORS_TAGS``, ...) are built from
them on first use, so a command that never touches a tensor never imports torch.
"""

from __future__ import annotations

from enum import Enum

from megatron_patch.errors import UserError

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

# --dtype / PR / sidecar name -> dtype name.
PRECISION_DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
PRECISION_OF_DTYPE_NAME: dict[str, str] = {v: k for k, v in PRECISION_DTYPE_NAMES.items()}

# safetensors header tag -> dtype name.
SAFETENSORS_TAG_NAMES: dict[str, str] = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",  # power-of-two block scales (DeepSeek-V4's ue8m0)
}
SAFETENSORS_TAG_OF_NAME: dict[str, str] = {v: k for k, v in SAFETENSORS_TAG_NAMES.items()}

# Bytes per element.
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1,
}

# config.json's torch_dtype / dtype field is the dtype's name ("bfloat16").
HF_CONFIG_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def precision_dtype_name(name: str) -> str:
    """The dtype name of a precision name (fp32, bf16, fp16); fp8 training keeps bf16 parameters."""
    if name == "fp8":
        return "bfloat16"
    if name not in PRECISION_DTYPE_NAMES:
        raise UserError(f"unknown dtype {name!r}: choose one of {', '.join(PRECISION_DTYPE_NAMES)}")
    return PRECISION_DTYPE_NAMES[name]


def precision_dtype(name: str):
    """The torch dtype of a precision name (fp32, bf16, fp16); fp8 training keeps bf16 parameters."""
    import torch

    return getattr(torch, precision_dtype_name(name))


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


class Precision(str, Enum):
    """PR: the training precision. A ``str`` so that it prints, compares and serialises as PR's value. megatron-core's
    ``bf16`` and ``fp16`` flags are read from here alone (the builder's TransformerConfig, training's optimizer)."""

    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    FP32 = "fp32"

    def __str__(self) -> str:
        return self.value

    @property
    def fp8(self) -> bool:
        """transformer-engine's FP8 GEMMs (parameters stay bf16)."""
        return self is Precision.FP8

    @property
    def fp16(self) -> bool:
        """megatron-core's ``fp16`` flag, and with it the dynamic loss scale."""
        return self is Precision.FP16

    @property
    def mixed(self) -> bool:
        """16-bit parameters with fp32 master weights and fp32 gradient reduction."""
        return self is not Precision.FP32

    @property
    def bf16(self) -> bool:
        """megatron-core's ``bf16`` flag (FP8 keeps bf16 parameters)."""
        return self in (Precision.BF16, Precision.FP8)

    @property
    def dtype_name(self) -> str:
        """The parameters' dtype name ("bfloat16")."""
        return precision_dtype_name(self.value)

    @property
    def dtype(self):
        """The parameters' torch dtype."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype_name]

    @classmethod
    def of_dtype(cls, dtype) -> Precision:
        """The precision whose parameters are ``dtype`` (fp32, bf16 or fp16: FP8 keeps bf16 parameters)."""
        return cls(PRECISION_OF_DTYPE_NAME[dtype_name(dtype)])


_TORCH_TABLES = ("PRECISIONS", "PRECISION_NAMES", "HF_CONFIG_NAMES", "SAFETENSORS_TAGS", "SAFETENSORS_TAG_OF")


def __getattr__(attr: str):
    """The tables of torch.dtype objects, built (and torch imported) when first asked for."""
    if attr not in _TORCH_TABLES:  # e.g. the import system probing for ``__path__``: no torch for that
        raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
    import torch

    tables = {
        "PRECISIONS": lambda: {k: getattr(torch, v) for k, v in PRECISION_DTYPE_NAMES.items()},
        "PRECISION_NAMES": lambda: {getattr(torch, v): k for k, v in PRECISION_DTYPE_NAMES.items()},
        "HF_CONFIG_NAMES": lambda: {getattr(torch, n): n for n in HF_CONFIG_DTYPE_NAMES},
        "SAFETENSORS_TAGS": lambda: {k: getattr(torch, v) for k, v in SAFETENSORS_TAG_NAMES.items()},
        "SAFETENSORS_TAG_OF": lambda: {getattr(torch, v): k for k, v in SAFETENSORS_TAG_NAMES.items()},
    }
    value = tables[attr]()
    globals()[attr] = value
    return value

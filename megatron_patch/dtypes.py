"""The one table of dtypes: the project's precision names, and each dtype's name in the formats it
meets (config.json's ``torch_dtype``, safetensors headers).
"""

from __future__ import annotations

import torch

from megatron_patch.errors import UserError

# --dtype / PR / sidecar name -> torch dtype.
PRECISIONS: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISION_NAMES: dict[torch.dtype, str] = {v: k for k, v in PRECISIONS.items()}

# config.json's torch_dtype / dtype field.
HF_CONFIG_NAMES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# safetensors header tag -> torch dtype.
SAFETENSORS_TAGS: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_TAG_OF: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_TAGS.items()}


def precision_dtype(name: str) -> torch.dtype:
    """The torch dtype of a precision name (fp32, bf16, fp16); fp8 training keeps bf16 parameters."""
    if name == "fp8":
        return torch.bfloat16
    if name not in PRECISIONS:
        raise UserError(f"unknown dtype {name!r}: choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]

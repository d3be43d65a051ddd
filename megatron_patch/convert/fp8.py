"""Hub checkpoints stored in FP8 with block scales (DeepSeek-V3's): dequantized on the fly, tensor by tensor.

Such a checkpoint stores each quantized ``X.weight`` as float8_e4m3fn next to ``X.weight_scale_inv``, one
float32 scale per block of ``quantization_config.weight_block_size`` (128 x 128); the real weight is
the FP8 value times its block's scale. ``DequantizingReader`` wraps an ``HFCheckpointReader`` and shows
the converter plain weights: the scales disappear from its names, and reading ``X.weight`` returns
the product computed in float32, which the converter then casts to its ``--dtype``, exactly as
transformers' own dequantization does (``Fp8Dequantize``: float32 product, cast to the model's
dtype). DeepSeek-V4's hub files scale by powers of two (ue8m0, ``float8_e8m0fnu``) and store their routed
experts in FP4, two values a byte with a scale per 32 (``dequantize``). Memory holds one weight at a time.
Writing FP8 back is not done: ``mcore2hf`` writes the checkpoint's dtype (bf16).
"""

from __future__ import annotations

import functools
import math

from megatron_patch.convert.mxfp4 import Mxfp4Reader, fp4_byte_values
from megatron_patch.errors import UserError

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE_NAMES = ("float8_e4m3fn", "float8_e5m2")


def fp8_block_size(hf_config: dict) -> tuple[int, int] | None:
    """The (rows, cols) block of an FP8 checkpoint's scales, None if config.json declares no FP8 weights."""
    q = hf_config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size")
    if block is None:
        raise UserError("config.json's fp8 quantization_config has no weight_block_size: only block-scaled FP8 "
                        "checkpoints (DeepSeek-V3's) are dequantized")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise UserError(f"fp8 activation_scheme '{q['activation_scheme']}' is not supported: only dynamic "
                        "activation scales (nothing stored) convert")
    return int(block[0]), int(block[1])


# FP4 (e2m1) weights: two values a byte, the even one in the low nibble, packed as int8 beside one power-of-two
# (ue8m0) scale per row and 32 values (DeepSeek-V4's routed experts): transformers 5.24's ``Fp8Dequantize``
# (``_unpack_fp4``, ``_FP4_E2M1_LUT``: the E2M1 values of MXFP4's table, ``mxfp4.fp4_byte_values``) and its FP4 expert
# layout (``sf_gran_n=1, sf_gran_k=32``).
FP4_PACKED_DTYPE = "int8"
FP4_BLOCK = (1, 32)


def unpacked_shape(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """The shape of a stored quantized weight once dequantized: FP4's last dimension holds two values a byte."""
    return (*shape[:-1], 2 * shape[-1]) if dtype == FP4_PACKED_DTYPE else tuple(shape)


def dequantize(weight, scale, block: tuple[int, int]):
    """float32 weight of an FP8 ``weight`` [rows, cols] with per-block ``scale`` [ceil(rows/b0), ceil(cols/b1)]
    (float32, or ue8m0: a power of two a byte); the last block of a dimension may be partial. An int8 ``weight``
    is FP4, two values a byte ([rows, cols / 2]), with ``FP4_BLOCK`` scales whatever ``block``."""
    import torch

    if str(weight.dtype) == f"torch.{FP4_PACKED_DTYPE}":
        return _dequantize_fp4(weight, scale)
    rows, cols = weight.shape
    want = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale.shape) != want:
        raise UserError(f"a weight of shape {(rows, cols)} with {block[0]}x{block[1]} blocks needs scales of shape "
                        f"{want}, found {tuple(scale.shape)}: the checkpoint's scales do not belong to it")
    # An FP8 value has 256 codes: looking each up in a table of torch's own conversions of all of them
    # gives the same floats as ``weight.to(float32)`` at twice its speed on a CPU (most of DeepSeek-V3's
    # conversion time is this).
    codes = weight.contiguous().view(torch.uint8).numpy()
    out = torch.from_numpy(_fp8_to_float32(str(weight.dtype))[codes])
    col_scale = scale.to(torch.float32).repeat_interleave(block[1], dim=1)[:, :cols]
    for i in range(want[0]):  # in place, one row block at a time: no second weight-sized tensor
        out[i * block[0]:(i + 1) * block[0]].mul_(col_scale[i])
    return out


def _dequantize_fp4(weight, scale):
    import torch

    rows, cols = unpacked_shape(tuple(weight.shape), FP4_PACKED_DTYPE)
    want = (rows // FP4_BLOCK[0], math.ceil(cols / FP4_BLOCK[1]))
    if tuple(scale.shape) != want:
        raise UserError(f"an FP4 weight of shape {(rows, cols)} ({rows} x {cols // 2} bytes) needs one scale per row "
                        f"and {FP4_BLOCK[1]} values, {want}, found {tuple(scale.shape)}")
    codes = weight.contiguous().view(torch.uint8).numpy()
    out = torch.from_numpy(fp4_byte_values()[codes].reshape(rows, cols))
    return out.mul_(scale.to(torch.float32).repeat_interleave(FP4_BLOCK[1], dim=1)[:, :cols])


@functools.lru_cache(maxsize=None)
def _fp8_to_float32(dtype: str):
    """The float32 value of each of the 256 codes of FP8 ``dtype`` ("torch.float8_e4m3fn"), as torch converts it."""
    import torch

    fp8 = getattr(torch, dtype.removeprefix("torch."))
    return torch.arange(256, dtype=torch.uint8).view(fp8).to(torch.float32).numpy()


class DequantizingReader:
    """An HF reader over an FP8 block-scaled checkpoint that shows dequantized float32 weights.

    Dtypes are names, as ``HFCheckpointReader``'s. ``stored`` gives the place of a tensor kept as it is
    (norms, the embedding), and None for a dequantized weight: its bytes are not the weight's, so
    the converter computes it through torch instead of copying it."""

    def __init__(self, reader, block: tuple[int, int]):
        self.reader, self.block = reader, block
        names = set(reader.keys())
        self.scales = {n[: -len(SCALE_SUFFIX)]: n for n in names if n.endswith(SCALE_SUFFIX)}
        self.scale_names = set(self.scales.values())  # kept: DeepSeek-V3 has tens of thousands
        for weight in self.scales:
            if weight not in names:
                raise UserError(f"the checkpoint has {self.scales[weight]} but no {weight} it would scale")
        stray = sorted(n for n in names - self.scale_names
                       if reader.dtype(n) in FP8_DTYPE_NAMES and n not in self.scales)
        if stray:
            raise UserError(f"{stray[0]} is stored in FP8 without a {stray[0]}{SCALE_SUFFIX}: cannot dequantize it")
        self.folder = reader.folder
        fp4 = any(reader.dtype(n) == FP4_PACKED_DTYPE for n in self.scales)
        self.note = (f"weights dequantized from FP8 ({block[0]}x{block[1]} block scales)"
                     f"{f' and FP4 ({FP4_BLOCK[0]}x{FP4_BLOCK[1]} block scales)' if fp4 else ''}; "
                     "quantization_config removed from the config")

    def keys(self) -> list[str]:
        return sorted(n for n in self.reader.keys() if n not in self.scale_names)

    def __contains__(self, name: str) -> bool:
        return name in self.reader and name not in self.scale_names

    def stored(self, name: str):
        return None if name in self.scales else self.reader.stored(name)

    def get(self, name: str):
        if name not in self.scales:
            return self.reader.get(name)
        return dequantize(self.reader.get(name), self.reader.get(self.scales[name]), self.block)

    def dtype(self, name: str) -> str:
        return "float32" if name in self.scales else self.reader.dtype(name)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self.reader.shape(name)
        return unpacked_shape(shape, self.reader.dtype(name)) if name in self.scales else shape

    def nbytes(self, name: str) -> int:
        """Bytes read from disk for ``name`` (the FP8 weight and its scales)."""
        return self.reader.nbytes(name) + (self.reader.nbytes(self.scales[name]) if name in self.scales else 0)


def check_quantization(hf_config: dict) -> None:
    """Refuse hub weights quantized in a way the converter does not dequantize, before any is read."""
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    if method in (None, "fp8", "mxfp4"):
        return
    what = " (INT4 weights, as Kimi-K2-Thinking ships them)" if method == "compressed-tensors" else ""
    raise UserError(f"quantization_config quant_method '{method}'{what} is not supported: convert a bf16, "
                    "block-scaled FP8 or MXFP4 release of the model")


def open_weights(reader, hf_config: dict):
    """``reader`` itself, or a dequantizing view of it when config.json declares block-scaled FP8 weights or
    MXFP4 experts (``convert/mxfp4.py``); such a view has a ``note`` saying what it did."""
    check_quantization(hf_config)
    if (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        return Mxfp4Reader(reader)
    block = fp8_block_size(hf_config)
    return reader if block is None else DequantizingReader(reader, block)

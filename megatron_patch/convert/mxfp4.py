"""Hub checkpoints whose experts are stored in MXFP4 (gpt-oss's): dequantized on the fly, one expert at a
time, a band of rows at a time.

Such a checkpoint stores each quantized ``X`` (``mlp.experts.gate_up_proj``, ``down_proj``) as
``X_blocks`` [experts, rows, groups, 16] (two 4-bit E2M1 codes a byte, the low nibble first) and
``X_scales`` [experts, rows, groups] (one E8M0 exponent, biased by 127, per group of 32 values). The
value is the code's number times 2^(scale - 127); transformers' dequantization
(``integrations/mxfp4.py``) then lays each expert out transposed, [groups x 32, rows], which is how its
model (and its bf16 checkpoints) hold ``X``. ``Mxfp4Reader`` wraps an ``HFCheckpointReader`` and shows
the converter that ``X`` in float32: the same arithmetic (each code's value, from a table of all 256
code bytes, through an exact ``ldexp`` by ``scale - 127``), so the values, once the converter casts them
to its ``--dtype``, are transformers' bit for bit. Memory
holds one expert's float32 weight and a band of its codes. Writing MXFP4 back is not done: ``mcore2hf``
writes the checkpoint's dtype (bf16).
"""

from __future__ import annotations

import functools

from megatron_patch.checkpoint_files.byte_io import read_range
from megatron_patch.convert.stacked import member_place
from megatron_patch.errors import UserError

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

BLOCKS, SCALES = "_blocks", "_scales"
# The E2M1 codes 0..15 (OCP Microscaling): sign bit, 2 exponent bits, 1 mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
# Rows of one expert dequantized together: bounds the temporaries (8 bytes a value) to a few tens of MB.
BAND_ROWS = 1024


@functools.lru_cache(maxsize=1)
def fp4_byte_values():
    """The two values of each of the 256 bytes of codes, low nibble first [256, 2], float32."""
    # numpy (0.1 s) only once an MXFP4 tensor is read
    import numpy as np

    codes = np.array(FP4_VALUES, dtype=np.float32)
    return np.stack([codes[np.arange(256) & 0x0F], codes[np.arange(256) >> 4]], axis=1)


def dequantize(blocks, scales, band_rows: int = BAND_ROWS):
    """float32 [groups x 32, rows] (a transposed view) of one expert's ``blocks`` [rows, groups, 16] (uint8)
    and ``scales`` [rows, groups] (uint8): transformers' ``convert_moe_packed_tensors`` for one expert. Both
    scale each code's value by an exact ``ldexp`` (scale 255 included: 0.5 x 2^128 is finite, 0 x 2^128 zero)."""
    # numpy and torch only once an MXFP4 tensor is read
    import numpy as np
    import torch

    rows, groups, width = blocks.shape
    if width != 16 or tuple(scales.shape) != (rows, groups):
        raise UserError(f"MXFP4 blocks of shape {tuple(blocks.shape)} need scales of shape {(rows, groups)} and 16 "
                        f"bytes a group, found scales {tuple(scales.shape)}")
    pairs, codes, exps = fp4_byte_values(), blocks.numpy(), scales.numpy()
    out = np.empty((rows, groups, 32), dtype=np.float32)
    with np.errstate(over="ignore"):  # a value past float32's range is inf, as in transformers
        for r0 in range(0, rows, band_rows):  # a band of rows at a time: bounded temporaries
            r1 = min(r0 + band_rows, rows)
            band = pairs[codes[r0:r1]].reshape(r1 - r0, groups, 32)
            np.ldexp(band, exps[r0:r1, :, None].astype(np.int32) - SCALE_BIAS, out=out[r0:r1])
    return torch.from_numpy(out.reshape(rows, groups * 32)).t()


class Mxfp4Reader:
    """An HF reader over a checkpoint with MXFP4 experts that shows each quantized ``X`` as a float32
    [experts, groups x 32, rows] tensor (``get_member``: one expert of it). Names, dtypes and shapes as
    ``HFCheckpointReader``'s; ``stored`` is None for a dequantized tensor (computed, not copied)."""

    note = "expert weights dequantized from MXFP4; quantization_config removed from the config"

    def __init__(self, reader):
        self.reader, self.folder = reader, reader.folder
        names = set(reader.keys())
        self.quantized = {n[: -len(BLOCKS)]: (n, n[: -len(BLOCKS)] + SCALES) for n in names if n.endswith(BLOCKS)}
        self.hidden = set()
        for name, (blocks, scales) in self.quantized.items():
            if scales not in names:
                raise UserError(f"the checkpoint has {blocks} but no {scales} to dequantize it with")
            b, s = reader.shape(blocks), reader.shape(scales)
            if len(b) != 4 or b[-1] != 16 or tuple(b[:-1]) != tuple(s) or {reader.dtype(blocks), reader.dtype(scales)} != {"uint8"}:
                raise UserError(f"{blocks} {tuple(b)} and {scales} {tuple(s)} are not MXFP4 blocks and scales "
                                "(uint8 [experts, rows, groups, 16] and [experts, rows, groups])")
            self.hidden |= {blocks, scales}
        stray = sorted(n for n in names - self.hidden if n.endswith(SCALES))
        if stray:
            raise UserError(f"the checkpoint has {stray[0]} without the {stray[0][: -len(SCALES)]}{BLOCKS} it scales")

    def keys(self) -> list[str]:
        return sorted([n for n in self.reader.keys() if n not in self.hidden] + list(self.quantized))

    def __contains__(self, name: str) -> bool:
        return name in self.quantized or (name in self.reader and name not in self.hidden)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.quantized:
            return self.reader.shape(name)
        experts, rows, groups, _ = self.reader.shape(self.quantized[name][0])
        return experts, groups * 32, rows

    def dtype(self, name: str) -> str:
        return "float32" if name in self.quantized else self.reader.dtype(name)

    def stored(self, name: str):
        return None if name in self.quantized else self.reader.stored(name)

    def nbytes(self, name: str) -> int:
        """Bytes read from disk for ``name`` (its codes and scales)."""
        if name not in self.quantized:
            return self.reader.nbytes(name)
        return sum(self.reader.nbytes(n) for n in self.quantized[name])

    def get_member(self, name: str, index: int):
        """Expert ``index`` of ``name``, dequantized: only its own codes and scales are read."""
        import torch

        parts = []
        for stacked in self.quantized[name]:
            place = member_place(self.reader.stored(stacked), index)
            parts.append(torch.frombuffer(read_range(place.path, place.offset, place.nbytes), dtype=torch.uint8)
                         .reshape(place.shape))
        return dequantize(*parts)

    def get(self, name: str):
        if name not in self.quantized:
            return self.reader.get(name)
        import torch

        return torch.stack([self.get_member(name, i) for i in range(self.shape(name)[0])])

"""Sharded safetensors written one tensor at a time, with the index transformers reads.

Every tensor's name, shape and dtype is known before any is produced, so each shard's header is
written first and the tensors' bytes follow as they arrive: memory holds only the tensor in hand,
whatever ``max_shard_size`` is.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from megatron_patch.convert.torch_files import nbytes
from megatron_patch.dtypes import SAFETENSORS_TAG_OF
from megatron_patch.errors import UserError

INDEX_NAME = "model.safetensors.index.json"


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB', or a number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"cannot read size {text!r}: write it like 5GB, 500MB or 2GiB")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    scale = (1024 if binary else 1000) ** " KMGT".index(unit or " ")
    size = int(number * scale)
    if size <= 0:
        raise UserError(f"size {text!r} must be positive")
    return size


class SafetensorsShardWriter:
    """Writes ``entries`` (name, shape, dtype), in that order, into shards of at most ``max_shard_bytes``.

    A tensor larger than the limit gets a shard of its own, as transformers does.
    """

    def __init__(self, folder: str | Path, entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int):
        self.folder = Path(folder)
        self.entries = entries
        shards: list[list[int]] = [[]]
        size = 0
        for i, (_, shape, dtype) in enumerate(entries):
            nb = nbytes(shape, dtype)
            if shards[-1] and size + nb > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(i)
            size += nb
        n = len(shards)
        self.files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._shard_of = {i: s for s, members in enumerate(shards) for i in members}
        self._shards = shards
        self._next = 0
        self._handle = None
        self._open_shard = -1
        self.total_bytes = sum(nbytes(s, d) for _, s, d in entries)

    def _start_shard(self, shard: int) -> None:
        if self._handle is not None:
            self._handle.close()
        header, offset = {}, 0
        for i in self._shards[shard]:
            name, shape, dtype = self.entries[i]
            nb = nbytes(shape, dtype)
            header[name] = {"dtype": SAFETENSORS_TAG_OF[dtype], "shape": list(shape), "data_offsets": [offset, offset + nb]}
            offset += nb
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._handle = open(self.folder / self.files[shard], "wb")
        self._handle.write(len(raw).to_bytes(8, "little"))
        self._handle.write(raw)
        self._open_shard = shard

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.write_pieces(name, tuple(tensor.shape), [tensor])

    def write_pieces(self, name: str, shape: tuple[int, ...], pieces: list[torch.Tensor]) -> None:
        """Write tensor ``name`` of ``shape`` given as pieces whose concatenation on dim 0 is its bytes.

        Each piece's bytes go to the file as they are (views, no merged copy in memory).
        """
        if self._next >= len(self.entries):
            raise RuntimeError(f"unexpected extra tensor {name}")
        want, want_shape, dtype = self.entries[self._next]
        numel = sum(p.numel() for p in pieces)
        if name != want or tuple(shape) != tuple(want_shape) or any(p.dtype != dtype for p in pieces) \
                or numel != torch.Size(want_shape).numel():
            got = sorted({str(p.dtype) for p in pieces})
            raise RuntimeError(f"expected {want} {tuple(want_shape)} {dtype}, got {name} {tuple(shape)} "
                               f"({numel} elements) {', '.join(got)}")
        shard = self._shard_of[self._next]
        if shard != self._open_shard:
            self._start_shard(shard)
        for piece in pieces:
            data = piece.detach().cpu().contiguous()
            if data.numel():
                self._handle.write(memoryview(data.view(torch.uint8).reshape(-1).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.entries):
            raise RuntimeError(f"{len(self.entries) - self._next} tensor(s) were never written")
        if self._handle is not None:
            self._handle.close()
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {name: self.files[self._shard_of[i]] for i, (name, _, _) in enumerate(self.entries)}}
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")

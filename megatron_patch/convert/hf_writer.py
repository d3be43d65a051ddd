"""Sharded safetensors laid out before any tensor exists, with the index transformers reads.

Every tensor's name, shape and dtype is known up front, so ``plan_safetensors`` fixes each shard's
header and each tensor's byte range at once (a ``Stored``); the bytes are then copied into place in
any order. ``SafetensorsShardWriter`` writes tensors one after another into such a plan.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from megatron_patch.checkpoint_files.byte_io import Stored
from megatron_patch.checkpoint_files.byte_io import create_file
from megatron_patch.checkpoint_files.torch_files import nbytes
from megatron_patch.dtypes import SAFETENSORS_TAG_OF_NAME, dtype_name
from megatron_patch.errors import UserError

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

INDEX_NAME = "model.safetensors.index.json"


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB', or a number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]{1,15}(?:\.[0-9]{1,15})?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise UserError(f"cannot read size {text!r}: write it like 5GB, 500MB or 2GiB")
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    scale = (1024 if binary else 1000) ** " KMGT".index(unit or " ")
    size = int(number * scale)
    if size <= 0:
        raise UserError(f"size {text!r} must be positive")
    return size


@dataclass
class SafetensorsPlan:
    """Files (name -> total size and header bytes at offset 0), each tensor's place, the index."""

    folder: Path
    files: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    stored: dict[str, Stored] = field(default_factory=dict)
    index: dict | None = None
    total_bytes: int = 0

    def write_headers(self) -> None:
        """Create every file at its full size with its header; the index (if sharded) too."""
        for name, (size, header) in self.files.items():
            create_file(self.folder / name, size, [(0, header)])
        if self.index is not None:
            (self.folder / INDEX_NAME).write_text(json.dumps(self.index, indent=2) + "\n")


def plan_safetensors(folder: str | Path, entries: list[tuple[str, tuple[int, ...], str]], max_shard_bytes: int,
                     file_name: str = "model.safetensors") -> SafetensorsPlan:
    """``entries`` (name, shape, dtype name), in order, in shards of at most ``max_shard_bytes`` of tensor
    data (a tensor larger than the limit gets a shard of its own, as transformers does); ``file_name``: the
    file's name when there is one shard."""
    folder = Path(folder)
    names = [name for name, _, _ in entries]
    if len(set(names)) != len(names) or "__metadata__" in names:  # a header keeps one entry a name: a gap, unreadable
        raise ValueError(f"tensor names planned twice: {sorted({n for n in names if names.count(n) > 1})[:3]}")
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
    names = [file_name] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    plan = SafetensorsPlan(folder)
    for file, members in zip(names, shards):
        header, offset = {}, 0
        for i in members:
            name, shape, dtype = entries[i]
            nb = nbytes(shape, dtype)
            header[name] = {"dtype": SAFETENSORS_TAG_OF_NAME[dtype], "shape": list(shape), "data_offsets": [offset, offset + nb]}
            offset += nb
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        prefix = len(raw).to_bytes(8, "little") + raw
        for i in members:
            name, shape, dtype = entries[i]
            plan.stored[name] = Stored(str(folder / file), len(prefix) + header[name]["data_offsets"][0], tuple(shape), dtype)
        plan.files[file] = (len(prefix) + offset, prefix)
    plan.total_bytes = sum(nbytes(s, d) for _, s, d in entries)
    if n > 1:
        plan.index = {"metadata": {"total_size": plan.total_bytes},
                      "weight_map": {name: Path(plan.stored[name].path).name for name, _, _ in entries}}
    return plan


class SafetensorsShardWriter:
    """Writes ``entries`` (name, shape, dtype) one tensor at a time, in order (tests, benchmarks)."""

    def __init__(self, folder: str | Path, entries: list[tuple[str, tuple[int, ...], object]], max_shard_bytes: int):
        self.entries = [(n, tuple(s), dtype_name(d)) for n, s, d in entries]
        self.plan = plan_safetensors(folder, self.entries, max_shard_bytes)
        self.plan.write_headers()
        self.files = list(self.plan.files)
        self.total_bytes = self.plan.total_bytes
        self._next = 0

    def write(self, name: str, tensor) -> None:
        want, shape, dtype = self.entries[self._next]
        if name != want or tuple(tensor.shape) != shape or dtype_name(tensor.dtype) != dtype:
            raise RuntimeError(f"expected {want} {shape} {dtype}, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        place = self.plan.stored[name]
        data = tensor.detach().cpu().contiguous().reshape(-1)
        if data.numel():
            import torch

            with open(place.path, "r+b") as f:
                f.seek(place.offset)
                f.write(memoryview(data.view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.entries):
            raise RuntimeError(f"{len(self.entries) - self._next} tensor(s) were never written")

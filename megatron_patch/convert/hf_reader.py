"""Lazy reader of an HF model folder's safetensors (one file or sharded with an index)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from megatron_patch.dtypes import SAFETENSORS_TAGS
from megatron_patch.errors import UserError


class HFCheckpointReader:
    """Tensors by name, read from disk only when asked for.

    Bytes are read with ``pread`` rather than through safetensors' memory map: pages touched through
    a map stay in this process's resident set, so reading a whole checkpoint through it would make
    the converter's memory grow with the model even though each tensor is dropped after use.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise UserError(f"{index} is malformed ({exc}): re-download the checkpoint")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise UserError(f"no *.safetensors files in {self.folder}: convert .bin checkpoints to safetensors first")
            weight_map = None
        self._handles = {}
        self._headers: dict[str, tuple[int, dict]] = {}
        self._where: dict[str, str] = {}
        for name in files:
            handle = self._open(name)
            for key in handle.keys():
                if weight_map is not None and weight_map.get(key) != name:
                    raise UserError(f"{name} holds '{key}', which the index places elsewhere: the index is stale")
                self._where[key] = name
        if weight_map is not None:
            missing = set(weight_map) - set(self._where)
            if missing:
                raise UserError(f"the index lists {len(missing)} tensor(s) that no shard holds, e.g. {sorted(missing)[0]}")

    def _open(self, name: str):
        if name not in self._handles:
            path = self.folder / name
            if not path.exists():
                raise UserError(f"{path} is listed in the index but missing")
            try:
                self._handles[name] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as exc:
                raise UserError(f"{path} is not a readable safetensors file ({exc}): it may be truncated or corrupt")
        return self._handles[name]

    def keys(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def _header(self, file: str) -> tuple[int, dict]:
        """(offset of the data section, header) of a safetensors file, parsed once."""
        if file not in self._headers:
            with open(self.folder / file, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            self._headers[file] = (8 + length, header)
        return self._headers[file]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise UserError(f"tensor '{name}' is not in the checkpoint at {self.folder}")
        file = self._where[name]
        path = self.folder / file
        try:
            self._open(file)  # validated by safetensors before any byte is trusted
            base, header = self._header(file)
            info = header[name]
            begin, end = info["data_offsets"]
            dtype = SAFETENSORS_TAGS[info["dtype"]]
            fd = os.open(path, os.O_RDONLY)
            try:
                buf = bytearray(end - begin)
                view, got = memoryview(buf), 0
                while got < len(buf):
                    n = os.preadv(fd, [view[got:]], base + begin + got)
                    if n <= 0:
                        raise OSError(f"file ends {len(buf) - got} bytes early")
                    got += n
            finally:
                os.close(fd)
        except (SafetensorError, OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read '{name}' from {file} ({exc}): the file may be truncated or corrupt")
        if not buf:
            return torch.empty(info["shape"], dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])

    def dtype(self, name: str) -> torch.dtype:
        info = self._header(self._where[name])[1][name]
        if info["dtype"] not in SAFETENSORS_TAGS:
            raise UserError(f"tensor '{name}' has dtype {info['dtype']}, which the converter does not handle")
        return SAFETENSORS_TAGS[info["dtype"]]

    def nbytes(self, name: str) -> int:
        begin, end = self._header(self._where[name])[1][name]["data_offsets"]
        return end - begin

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._where[name]).get_slice(name).get_shape())

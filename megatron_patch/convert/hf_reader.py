"""Lazy reader of an HF model folder's safetensors (one file or sharded with an index)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from megatron_patch.errors import UserError


class HFCheckpointReader:
    """Tensors by name, read from disk only when asked for."""

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

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise UserError(f"tensor '{name}' is not in the checkpoint at {self.folder}")
        try:
            return self._open(self._where[name]).get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise UserError(f"cannot read '{name}' from {self._where[name]} ({exc}): the file may be truncated or corrupt")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._where[name]).get_slice(name).get_shape())

"""Lazy reader of an HF model folder's safetensors (one file or sharded with an index), without torch.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, data offsets) and
the tensors' bytes, back to back. Only the headers are read up front, and checked as strictly as the
safetensors library checks them (offsets contiguous from 0, sizes that match shapes, a data section
that ends exactly at the end of the file, so a truncated file fails here, before anything is written).
Each tensor is then a ``Stored`` place in its file: the converter copies bytes from there directly.
``get`` still returns a torch tensor for callers that want one (torch is imported then).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from megatron_patch.checkpoint_files.byte_io import Stored, read_range
from megatron_patch.dtypes import ITEMSIZE, SAFETENSORS_TAG_NAMES
from megatron_patch.errors import UserError
from megatron_patch.input_files import checked_input, contained, json_error, read_input_json
from megatron_patch.models.description.config_checks import check_weights_fit
from megatron_patch.models.description.registry import parse_arch
from megatron_patch.models.shape.skeleton import describe_model

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

# The safetensors library refuses headers above 100 MB.
MAX_HEADER_BYTES = 100_000_000


def read_safetensors_header(path: Path) -> dict[str, Stored]:
    """Every tensor of one safetensors file of a checkpoint folder as a ``Stored``; UserError if the file is damaged,
    or a link leading out of its folder (a carried_tensors.safetensors linked to a private file was copied into
    the export)."""

    def bad(why: str) -> UserError:
        return UserError(f"{path} is not a readable safetensors file ({why}): it may be truncated or corrupt")

    checked_input(path, limit=None, inside=path.parent)  # a FIFO would block the open below
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise bad(f"header length {length} does not fit a file of {size} bytes")
            raw = f.read(length)
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc})")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # ValueError: malformed, not UTF-8, or a number of 4300+ digits
        raise bad(f"header is not valid JSON: {json_error(exc)}")
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data_start, data_size = 8 + length, size - 8 - length
    out, spans = {}, []
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise bad("its __metadata__ is not a table of strings")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            tag, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)
                    and isinstance(begin, int) and isinstance(end, int)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise bad(f"malformed header entry for {name!r}")
        if tag not in SAFETENSORS_TAG_NAMES:
            raise UserError(f"tensor {name!r} in {path} has dtype {tag}, which the converter does not handle")
        dtype = SAFETENSORS_TAG_NAMES[tag]
        if end - begin != math.prod(shape) * ITEMSIZE[dtype] or begin < 0:
            raise bad(f"{name!r} has {end - begin} bytes for shape {shape} {tag}")
        spans.append((begin, end, name))
        out[name] = Stored(str(path), data_start + begin, tuple(shape), dtype)
    expected = 0
    for begin, end, name in sorted(spans):
        if begin != expected:
            raise bad(f"the bytes of {name!r} start at {begin}, not {expected}")
        expected = end
    if expected != data_size:
        raise bad(f"the header accounts for {expected} bytes of data, the file holds {data_size}")
    return out


def read_weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> file table, checked for shape."""
    data = read_input_json(index, inside=index.parent)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise UserError(f"{index} has no 'weight_map' table (found {type(weight_map).__name__}): re-download the "
                        "checkpoint")
    for key, value in weight_map.items():
        if not isinstance(value, str) or not value:
            raise UserError(f"{index} maps '{key}' to {value!r}, not a file name: re-download the checkpoint")
    return weight_map


class HFCheckpointReader:
    """Tensors by name: their places (``stored``), shapes and dtypes, read from disk only when asked for.

    Bytes are read with ``pread`` rather than through a memory map: pages touched through a map stay
    in this process's resident set, so reading a whole checkpoint through one would make the
    converter's memory grow with the model even though each tensor is dropped after use.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_weight_map(index)
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                raise UserError(f"no *.safetensors files in {self.folder}: convert .bin checkpoints to safetensors first")
            weight_map = None
        self._stored: dict[str, Stored] = {}
        held_by: dict[str, str] = {}
        for name in files:
            path = contained(self.folder, name, "the index names" if weight_map is not None else "found")
            if not path.exists():
                raise UserError(f"{path} is listed in the index but missing")
            for key, stored in read_safetensors_header(path).items():
                if weight_map is not None and weight_map.get(key) != name:
                    raise UserError(f"{name} holds '{key}', which the index places elsewhere: the index is stale")
                if key in held_by:  # without an index, two files with one name: which is meant is unknowable
                    raise UserError(f"tensor '{key}' is in both {held_by[key]} and {name} in {self.folder}: remove the "
                                    "stale copy (or add the model.safetensors.index.json that says which file holds it)")
                held_by[key] = name
                self._stored[key] = stored
        if weight_map is not None:
            missing = set(weight_map) - set(self._stored)
            if missing:
                raise UserError(f"the index lists {len(missing)} tensor(s) that no shard holds, e.g. {sorted(missing)[0]}")

    def keys(self) -> list[str]:
        return sorted(self._stored)

    def __contains__(self, name: str) -> bool:
        return name in self._stored

    def stored(self, name: str) -> Stored:
        if name not in self._stored:
            raise UserError(f"tensor '{name}' is not in the checkpoint at {self.folder}")
        return self._stored[name]

    def dtype(self, name: str) -> str:
        """The dtype's name ("bfloat16")."""
        return self.stored(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.stored(name).shape

    def nbytes(self, name: str) -> int:
        return self.stored(name).nbytes

    def read_bytes(self, name: str) -> bytearray:
        s = self.stored(name)
        return read_range(s.path, s.offset, s.nbytes)

    def get(self, name: str):
        """The tensor as a torch tensor (imports torch)."""
        import torch

        s = self.stored(name)
        dtype = getattr(torch, s.dtype)
        buf = self.read_bytes(name)
        if not buf:
            return torch.empty(s.shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(s.shape)


def checked_arch(hf_dir: str | Path, *, shapes: bool = False):
    """The model of an HF folder (``registry.parse_arch``: every config value checked), with its size checked
    against the safetensors headers before anything proportional to it is planned or allocated; with
    ``shapes``, every stored tensor's shape too, against what megatron-core builds for the config (the
    model's skeleton, cached: what hf2mcore checks), so a config that disagrees with its weights is one line."""
    arch = parse_arch(hf_dir)
    reader = HFCheckpointReader(hf_dir)
    check_weights_fit(arch, sum(reader.nbytes(n) for n in reader.keys()), f"the safetensors of {hf_dir}")
    if shapes:
        check_hf_shapes(reader, describe_model(arch).hf_shapes)
    return arch


def check_hf_shapes(reader: HFCheckpointReader, hf_shapes: dict) -> None:
    for name, shape in hf_shapes.items():
        if name in reader and tuple(reader.shape(name)) != tuple(shape):
            raise UserError(f"{name} has shape {tuple(reader.shape(name))} but config.json implies {tuple(shape)}: "
                            "the weights and config.json do not belong together")

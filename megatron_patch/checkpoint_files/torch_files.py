"""``torch.save`` files planned and read one tensor at a time, without torch.

``torch.save`` needs the whole object in memory; a Megatron legacy rank file is a dict of tensors
that together can be tens of gigabytes. ``plan_torch_save`` lays out the same zip ``torch.save``
writes (``data.pkl`` plus one ``data/<key>`` record per storage) from shapes and dtypes alone: the
pickle and every header are known before any tensor exists, and each tensor's bytes get a fixed
place (a ``Stored``) that the copier fills later. ``torch.load`` reads the result like any other file.

``LazyTorchFile`` is the reverse: it unpickles the structure of a ``torch.save`` file (ours or
Megatron-LM's) without reading any storage, into ``TensorRef`` leaves whose bytes it can locate
(``stored``) or, for the odd tensor that is not a dense view of its storage, load through torch.
Globals other than tensors and plain containers (``args``, RNG states, ...) come back as inert
records: nothing in the file is ever executed, and a global off the allow-list is refused. Opening a
file checks its zip structure and the CRC-32 of its pickle and small records; the tensor storages'
CRC-32s are checked by whoever reads them (``record_check``), or at once with ``verify``.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_patch.checkpoint_files.byte_io import Stored
from megatron_patch.checkpoint_files.byte_io import read_range
from megatron_patch.checkpoint_files.pickles import (
    STORAGE_CLASS_OF_DTYPE, Call, Global, PersistentId, StorageRef, TensorRef, dumps, lies_outside_its_storage, loads)
from megatron_patch.checkpoint_files.zipfmt import ALIGNMENT, ZipFormatError, ZipIndex, ZipLayout, check_crc, plan_zip, crc32
from megatron_patch.dtypes import ITEMSIZE
from megatron_patch.errors import UserError

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).


def nbytes(shape, dtype: str) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype`` (a dtype name), without making one."""
    return math.prod(shape) * ITEMSIZE[dtype]


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written later: what the pickle needs to know about it."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def plan_torch_save(path: str | os.PathLike, obj: Any, *, base: int = 0, archive: str = "archive",
                    force_zip64: bool = False) -> tuple[ZipLayout, dict[tuple, Stored]]:
    """Lay out ``torch.save(obj)`` where ``obj``'s tensor leaves are ``TensorSpec``s.

    Returns the zip layout (starting at byte ``base`` of ``path``) and where each leaf's bytes go,
    by the leaf's path (the tuple of keys leading to it).
    """
    leaves: dict[tuple, tuple[str, TensorSpec]] = {}

    def replace(value, where):
        if isinstance(value, TensorSpec):
            if value.dtype not in STORAGE_CLASS_OF_DTYPE:
                raise UserError(f"cannot write a {value.dtype} tensor into a torch checkpoint file")
            key = str(len(leaves))
            leaves[where] = (key, value)
            numel = math.prod(value.shape)
            storage = PersistentId(("storage", Global("torch", STORAGE_CLASS_OF_DTYPE[value.dtype]), key, "cpu", numel))
            return Call(Global("torch._utils", "_rebuild_tensor_v2"),
                        (storage, 0, tuple(value.shape), contiguous_stride(tuple(value.shape)), False,
                         collections.OrderedDict()))
        if isinstance(value, dict):
            return type(value)((k, replace(v, where + (k,))) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(replace(v, where + (i,)) for i, v in enumerate(value))
        return value

    pickled = dumps(replace(obj, ()))
    ident = str(int.from_bytes(hashlib.sha256(pickled).digest()[:16], "little")).zfill(40)[:40]
    records: list[tuple[str, bytes | int]] = [
        (f"{archive}/data.pkl", pickled), (f"{archive}/.format_version", b"1"),
        (f"{archive}/.storage_alignment", str(ALIGNMENT).encode()), (f"{archive}/byteorder", sys.byteorder.encode())]
    records += [(f"{archive}/data/{key}", spec.nbytes) for key, spec in leaves.values()]
    records += [(f"{archive}/version", b"3\n"), (f"{archive}/.data/serialization_id", ident.encode())]
    layout = plan_zip(records, base=base, force_zip64=force_zip64)
    path = os.fspath(path)
    stored = {where: Stored(path, layout.records[f"{archive}/data/{key}"][0], tuple(spec.shape), spec.dtype)
              for where, (key, spec) in leaves.items()}
    return layout, stored


def torch_save_bytes(obj: Any) -> bytes:
    """The bytes of a small ``torch.save(obj)`` file (``obj`` holds no tensors), made in memory."""
    layout, _ = plan_torch_save("", obj)
    out = bytearray(layout.size)
    for offset, data in layout.small:
        out[offset:offset + len(data)] = data
    return bytes(out)


# --- reading ---------------------------------------------------------------------------------------

class LazyTorchFile:
    """The structure of a torch.save file, with ``TensorRef`` leaves (no storage read)."""

    def __init__(self, path: str | Path, window: tuple[int, int] | None = None, verify: bool = False):
        """``window``: (offset, length) of a torch.save file stored inside ``path`` (as in a .distcp file);
        ``verify``: check every record's CRC-32 now (small files: common.pt, RNG and train-state files)."""
        self.path = Path(path)
        self.window = window
        try:
            self.zip = ZipIndex(self.path, *(window or (0, None)))
            pkl = next((n for n in self.zip.names() if n == "data.pkl"), None)
            if pkl is None:
                raise ZipFormatError("no data.pkl record")
            data = self.zip.read(pkl)
            if verify:
                for path_, offset, length, crc in self.zip.record_checks():
                    check_crc(path_, offset, length, crc, "a record")
        except (ZipFormatError, OSError) as exc:
            raise UserError(f"{self._where()} is not a readable torch checkpoint file ({exc}): "
                            "it is truncated or corrupt")
        try:
            self.obj = loads(data, where=str(self.path))
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - any other unpickling failure means a damaged file
            raise UserError(f"{self.path}: cannot unpickle its contents ({exc}): the file may be corrupt")

    def _where(self) -> str:
        return f"{self.path} (the archive at byte {self.window[0]})" if self.window else str(self.path)

    def record_check(self, t: TensorRef) -> tuple[str, int, int, int] | None:
        """(path, offset, length, CRC-32) of ``t``'s storage record, to check while reading it; None when
        opening the file checked it already or it carries no CRC."""
        self._record(t.storage)
        return self.zip.record_check(f"data/{t.storage.key}")

    def stored(self, t: TensorRef) -> Stored | None:
        """Where ``t``'s bytes are, when it is a dense C-contiguous run of its storage; else None."""
        if t.stride != contiguous_stride(t.shape) or t.storage.dtype not in ITEMSIZE:
            return None
        offset, length = self._record(t.storage)
        itemsize = ITEMSIZE[t.storage.dtype]
        if (t.offset + math.prod(t.shape)) * itemsize > length:
            raise UserError(f"{self.path}: tensor storage {t.storage.key} is shorter than its tensor: "
                            "the file may be corrupt")
        return Stored(str(self.path), offset + t.offset * itemsize, tuple(t.shape), t.storage.dtype)

    def _record(self, storage: StorageRef) -> tuple[int, int]:
        try:
            offset, length = self.zip.locate(f"data/{storage.key}")
        except (ZipFormatError, OSError) as exc:
            raise UserError(f"{self._where()}: cannot read tensor storage {storage.key} ({exc}): "
                            "the file may be truncated or corrupt")
        if length != storage.numel * ITEMSIZE.get(storage.dtype, 0):
            raise UserError(f"{self.path}: record data/{storage.key} holds {length} bytes, the pickle says "
                            f"{storage.numel} x {storage.dtype}: the file may be corrupt")
        return offset, length

    def load(self, t: TensorRef):
        """``t`` as a torch tensor (torch imported here): for the tensors ``stored`` cannot place."""
        import torch

        offset, length = self._record(t.storage)
        buf = read_range(self.path, offset, length)
        crc = self.zip.crc(f"data/{t.storage.key}")
        if crc and crc32(buf) != crc:
            raise UserError(f"{self._where()}: record data/{t.storage.key} fails its CRC-32 check: the file is corrupt")
        flat = torch.frombuffer(buf, dtype=getattr(torch, t.storage.dtype)) if length else \
            torch.empty(0, dtype=getattr(torch, t.storage.dtype))
        if lies_outside_its_storage(t, flat.numel()):  # a legacy rank file's tensor: as torch_dist's chunks are checked
            raise UserError(f"{self._where()}: a tensor of record data/{t.storage.key} lies outside its storage: the "
                            "file is damaged")
        return torch.as_strided(flat, t.shape, t.stride, t.offset).clone()

"""``torch.save`` files written and read one tensor at a time.

``torch.save`` needs the whole object in memory; a Megatron legacy rank file is a dict of tensors
that together can be tens of gigabytes. ``StreamingTorchSave`` writes the same zip layout
``torch.save`` writes (``data.pkl`` plus one ``data/<key>`` record per storage), but pickles the
structure first from shapes and dtypes alone and takes each tensor's bytes when it is ready, so
only the tensors in flight are in memory. ``torch.load`` reads the result like any other file.

``LazyTorchFile`` is the reverse: it unpickles the structure of a ``torch.save`` file (ours or
Megatron-LM's) without reading any storage, and reads a tensor's bytes only when asked for. Globals
other than tensors and plain containers (``args``, RNG states, ...) come back as inert placeholders:
nothing in the file is ever executed.
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_patch.errors import UserError

_STORAGE_TYPES = {
    torch.float32: "FloatStorage", torch.float16: "HalfStorage", torch.bfloat16: "BFloat16Storage",
    torch.float64: "DoubleStorage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage", torch.bool: "BoolStorage",
}

# Storage class name in the pickle -> element dtype (the classes themselves are deprecated).
_STORAGE_DTYPES = {name: dtype for dtype, name in _STORAGE_TYPES.items()}


def nbytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``, without making one."""
    return math.prod(shape) * dtype.itemsize


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written later: what the pickle needs to know about it."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


class _PendingStorage:
    def __init__(self, key: str, spec: TensorSpec):
        self.key, self.spec = key, spec


class _PendingTensor:
    """Pickles exactly as torch pickles a contiguous CPU tensor of ``spec`` (storage ``key``)."""

    def __init__(self, key: str, spec: TensorSpec):
        self.storage = _PendingStorage(key, spec)
        self.spec = spec

    def __reduce_ex__(self, protocol):
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, tuple(self.spec.shape), _contiguous_stride(self.spec.shape), False,
                 collections.OrderedDict()))


class StreamingTorchSave:
    """Write ``obj`` (nested containers whose tensor leaves are ``TensorSpec``) as a torch.save file.

    Call ``write(path_of_leaf, tensor)`` once per leaf, in any order, then ``close()``. A leaf's
    path is the tuple of keys leading to it. Nothing is readable as complete until ``close()``.
    """

    def __init__(self, path: str | Path, obj: Any):
        self.path = Path(path)
        self._specs: dict[tuple, tuple[str, TensorSpec]] = {}
        skeleton = self._replace(obj, ())
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=2)
        pickler.persistent_id = self._persistent_id
        pickler.dump(skeleton)
        # No zip CRC: computing it costs more than writing the bytes, and torch.load does not check it
        # (torch.save offers the same trade-off as torch.utils.serialization.config.save.compute_crc32).
        self._writer = torch._C.PyTorchFileWriter(str(self.path), False, torch.serialization._get_storage_alignment())
        data = buf.getvalue()
        self._writer.write_record("data.pkl", data, len(data))
        self._writer.write_record(".format_version", "1", 1)
        alignment = str(torch.serialization._get_storage_alignment())
        self._writer.write_record(".storage_alignment", alignment, len(alignment))
        self._writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._pending = set(self._specs)

    def _replace(self, obj, path):
        if isinstance(obj, TensorSpec):
            key = str(len(self._specs))
            self._specs[path] = (key, obj)
            return _PendingTensor(key, obj)
        if isinstance(obj, dict):
            return type(obj)((k, self._replace(v, path + (k,))) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._replace(v, path + (i,)) for i, v in enumerate(obj))
        return obj

    @staticmethod
    def _persistent_id(obj):
        if isinstance(obj, _PendingStorage):
            numel = 1
            for s in obj.spec.shape:
                numel *= s
            return ("storage", getattr(torch, _STORAGE_TYPES[obj.spec.dtype]), obj.key, "cpu", numel)
        return None

    def write(self, path: tuple, tensor: torch.Tensor) -> None:
        if path not in self._pending:
            raise RuntimeError(f"{self.path}: {path} is not a pending tensor (unknown or written twice)")
        key, spec = self._specs[path]
        if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
            raise RuntimeError(f"{self.path}: {path} planned as {spec.shape} {spec.dtype}, "
                               f"got {tuple(tensor.shape)} {tensor.dtype}")
        tensor = tensor.detach().cpu().contiguous()
        # From the tensor's own bytes: a shard is often a view into a larger tensor, no copy needed.
        self._writer.write_record(f"data/{key}", tensor.data_ptr(), tensor.nbytes)
        self._pending.discard(path)

    def close(self) -> None:
        if self._pending:
            raise RuntimeError(f"{self.path}: {len(self._pending)} tensor(s) never written, e.g. {sorted(self._pending)[0]}")
        self._writer.write_end_of_file()


# --- reading ---------------------------------------------------------------------------------

class Opaque:
    """Stands for any pickled object that is not a tensor or a plain container."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"<{getattr(self, 'qualname', 'object')} (not loaded)>"


def _opaque_class(module: str, name: str):
    return type(name, (Opaque,), {"qualname": f"{module}.{name}"})


@dataclass
class LazyTensor:
    """A tensor in a torch.save file, read on ``load()``."""

    file: "LazyTorchFile"
    key: str
    dtype: torch.dtype
    storage_numel: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def load(self) -> torch.Tensor:
        return self.file._read(self)

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def _rebuild_lazy(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return LazyTensor(storage[0], storage[1], storage[2], storage[3], storage_offset, tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    return data


_SAFE_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch.Size,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_lazy,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


class LazyTorchFile:
    """The structure of a torch.save file, with ``LazyTensor`` leaves."""

    def __init__(self, path: str | Path, window: tuple[int, int] | None = None):
        """``window``: (offset, length) of a torch.save file stored inside ``path`` (as in a .distcp file)."""
        self.path = Path(path)
        self._base = window[0] if window else 0
        self._file = None
        try:
            if window is None:
                self._reader = torch._C.PyTorchFileReader(str(self.path))
            else:
                self._file = _Window(self.path, *window)
                self._reader = torch._C.PyTorchFileReader(self._file)
            data = self._reader.get_record("data.pkl")
        except RuntimeError as exc:
            raise UserError(f"{self.path} is not a readable torch checkpoint file ({str(exc).splitlines()[0]}): "
                            "it may be truncated or corrupt")
        outer = self

        class _Unpickler(pickle.Unpickler):
            def find_class(self, module, name):
                if (module, name) in _SAFE_GLOBALS:
                    return _SAFE_GLOBALS[(module, name)]
                if module == "torch" and name in _STORAGE_DTYPES:
                    return _STORAGE_DTYPES[name]
                if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                    return getattr(torch, name)
                return _opaque_class(module, name)

            def persistent_load(self, pid):
                kind, storage_type, key, _location, numel = pid
                if kind != "storage":
                    raise UserError(f"{outer.path}: unsupported storage record {kind!r}")
                if not isinstance(storage_type, torch.dtype):
                    raise UserError(f"{outer.path}: unsupported storage type {storage_type!r}")
                return (outer, key, storage_type, numel)

        try:
            self.obj = _Unpickler(io.BytesIO(bytes(data))).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
            raise UserError(f"{self.path}: cannot unpickle its contents ({exc}): the file may be corrupt")

    def _read(self, t: LazyTensor) -> torch.Tensor:
        element = torch.empty((), dtype=t.dtype).element_size()
        nbytes = t.storage_numel * element
        record = f"data/{t.key}"
        try:
            # torch stores records uncompressed: read the bytes straight from the file into the tensor
            # (one copy, without the GIL), as torch.load(mmap=True) locates them.
            if self._reader.get_record_size(record) != nbytes:
                raise RuntimeError(f"record {record} holds {self._reader.get_record_size(record)} bytes, "
                                   f"the pickle says {nbytes}")
            offset = self._base + self._reader.get_record_offset(record)
        except RuntimeError as exc:
            raise UserError(f"{self.path}: cannot read tensor storage {t.key} ({str(exc).splitlines()[0]}): "
                            "the file may be truncated or corrupt")
        buf = torch.empty(nbytes, dtype=torch.uint8)
        self._pread(t, offset, buf)
        return torch.empty(0, dtype=t.dtype).set_(buf.untyped_storage(), t.offset, t.shape, t.stride)

    def _pread(self, t: LazyTensor, offset: int, buf: torch.Tensor) -> None:
        if buf.numel():
            try:
                _pread_into(self.path, offset, memoryview(buf.numpy()))
            except OSError as exc:
                raise UserError(f"{self.path}: cannot read tensor storage {t.key} ({exc}): "
                                "the file may be truncated or corrupt")

    def read_into(self, t: LazyTensor, target: torch.Tensor) -> bool:
        """Read ``t`` straight into ``target`` (no intermediate copy) when ``t`` is stored as exactly
        ``target``'s bytes: same dtype and shape, contiguous, the whole storage. False otherwise."""
        if (t.dtype != target.dtype or tuple(t.shape) != tuple(target.shape) or not target.is_contiguous()
                or t.offset != 0 or t.stride != _contiguous_stride(t.shape) or t.storage_numel != target.numel()):
            return False
        record = f"data/{t.key}"
        try:
            nbytes = self._reader.get_record_size(record)
            offset = self._base + self._reader.get_record_offset(record)
        except RuntimeError as exc:
            raise UserError(f"{self.path}: cannot read tensor storage {t.key} ({str(exc).splitlines()[0]}): "
                            "the file may be truncated or corrupt")
        if nbytes != target.numel() * target.element_size():
            return False
        self._pread(t, offset, target.reshape(-1).view(torch.uint8) if target.numel() else target)
        return True


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of a file, as a seekable file of their own."""

    def __init__(self, path: Path, offset: int, length: int):
        super().__init__()
        self._path, self._offset, self._length, self._pos = path, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        with open(self._path, "rb", buffering=0) as f:
            got = os.preadv(f.fileno(), [view[:n]], self._offset + self._pos)
        self._pos += got
        return got


def _pread_into(path: Path, offset: int, view: memoryview) -> None:
    """Fill ``view`` with the bytes of ``path`` from ``offset`` (the GIL is released while reading)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        got = 0
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                raise OSError(f"file ends {len(view) - got} bytes early")
            got += n
    finally:
        os.close(fd)

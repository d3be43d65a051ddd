"""The pickles inside torch checkpoint files, written and read without importing torch.

torch.save's ``data.pkl`` and torch's distributed-checkpoint ``.metadata`` are pickles that name
torch classes (``torch._utils._rebuild_tensor_v2``, ``torch.BFloat16Storage``,
``torch.distributed.checkpoint.metadata.Metadata``, ...). Python's pickler would import torch to
check that those names exist; ``dumps`` writes the opcodes itself for a small closed set of values
(the stand-ins ``Global``, ``Call``, ``New`` and ``PersistentId`` below), the way torch's own pickles
spell them. ``SafeUnpickler`` reads them back into inert records: nothing in a file is executed, and a
pickle that names anything outside the checkpoint allow-list (``checkpoint_files.allowlist``) is refused.
"""

from __future__ import annotations

import codecs
import collections
import io
import math
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

from megatron_patch.checkpoint_files.allowlist import ENUM_BY_NAME, canonical, check, enum_by_name


@dataclass(frozen=True)
class Global:
    """A module-level name, pickled as ``GLOBAL module name`` (a class, a function, a dtype)."""

    module: str
    name: str


@dataclass(frozen=True)
class Call:
    """``func(*args)`` at load time (pickle's REDUCE)."""

    func: Global
    args: tuple


@dataclass(frozen=True)
class New:
    """An instance of class ``cls`` rebuilt as ``cls.__new__(cls)`` then given ``state`` (NEWOBJ + BUILD:
    how dataclasses pickle)."""

    cls: Global
    state: Any


@dataclass(frozen=True)
class Items:
    """A dict given as (key, value) pairs: its keys may be unhashable here (``New`` records)."""

    pairs: list


@dataclass(frozen=True)
class PersistentId:
    """A reference resolved by the loader (torch.save's storages)."""

    value: Any


# --- writing ---------------------------------------------------------------------------------------

class _Emitter:
    def __init__(self):
        self.out: list[bytes] = [pickle.PROTO + bytes([2])]

    def emit(self, obj: Any) -> None:  # noqa: C901 - one branch per pickled type
        w = self.out.append
        if obj is None:
            w(pickle.NONE)
        elif obj is True:
            w(pickle.NEWTRUE)
        elif obj is False:
            w(pickle.NEWFALSE)
        elif isinstance(obj, int):
            if 0 <= obj < 256:
                w(pickle.BININT1 + bytes([obj]))
            elif 0 <= obj < 65536:
                w(pickle.BININT2 + struct.pack("<H", obj))
            elif -(2**31) <= obj < 2**31:
                w(pickle.BININT + struct.pack("<i", obj))
            else:
                raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
                w(pickle.LONG1 + bytes([len(raw)]) + raw)
        elif isinstance(obj, float):
            w(pickle.BINFLOAT + struct.pack(">d", obj))
        elif isinstance(obj, str):
            raw = obj.encode("utf-8", "surrogatepass")
            w(pickle.BINUNICODE + struct.pack("<I", len(raw)) + raw)
        elif isinstance(obj, tuple):
            if not obj:
                w(pickle.EMPTY_TUPLE)
                return
            if len(obj) > 3:
                w(pickle.MARK)
            for item in obj:
                self.emit(item)
            w({1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}.get(len(obj), pickle.TUPLE))
        elif isinstance(obj, list):
            w(pickle.EMPTY_LIST)
            if obj:
                w(pickle.MARK)
                for item in obj:
                    self.emit(item)
                w(pickle.APPENDS)
        elif isinstance(obj, (dict, Items)):
            if isinstance(obj, collections.OrderedDict):
                self.emit(Call(Global("collections", "OrderedDict"), ()))
            else:
                w(pickle.EMPTY_DICT)
            pairs = obj.pairs if isinstance(obj, Items) else list(obj.items())
            if pairs:
                w(pickle.MARK)
                for key, value in pairs:
                    self.emit(key)
                    self.emit(value)
                w(pickle.SETITEMS)
        elif isinstance(obj, Global):
            w(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        elif isinstance(obj, Call):
            self.emit(obj.func)
            self.emit(tuple(obj.args))
            w(pickle.REDUCE)
        elif isinstance(obj, New):
            self.emit(obj.cls)
            w(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
            self.emit(obj.state)
            w(pickle.BUILD)
        elif isinstance(obj, PersistentId):
            self.emit(obj.value)
            w(pickle.BINPERSID)
        else:
            raise TypeError(f"cannot pickle {type(obj).__name__} without torch")


def dumps(obj: Any) -> bytes:
    """Protocol-2 pickle of ``obj`` (plain values, dicts, lists, tuples and the stand-ins above)."""
    emitter = _Emitter()
    emitter.emit(obj)
    emitter.out.append(pickle.STOP)
    return b"".join(emitter.out)


def torch_size(shape) -> Call:
    return Call(Global("torch", "Size"), (tuple(int(s) for s in shape),))


def torch_dtype(name: str) -> Global:
    return Global("torch", name)


# --- reading ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DType:
    """A torch dtype, by name ("bfloat16")."""

    name: str


@dataclass(eq=False)  # hashed by identity: pickles use such objects as dict keys
class Record:
    """An instance of a class we do not import: its qualified name, constructor arguments and state."""

    qualname: str
    args: tuple = ()
    state: Any = None

    def get(self, key: str, default=None):
        return self.state.get(key, default) if isinstance(self.state, dict) else default


@dataclass(frozen=True)
class StorageRef:
    """A storage record of a torch.save file: ``key`` names ``data/<key>``; ``numel`` elements."""

    key: str
    dtype: str
    numel: int


@dataclass(frozen=True)
class TensorRef:
    storage: StorageRef
    offset: int                      # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    extra: dict = field(default_factory=dict, compare=False)


def lies_outside_its_storage(ref: TensorRef, numel: int) -> bool:
    """Whether a stored tensor's view (offset, shape, strides) reaches past the ``numel`` elements of its storage, or
    has a negative offset or stride: torch's as_strided then fails ("setStorage ... out of bounds"), or reads bytes
    beyond the record."""
    if len(ref.stride) != len(ref.shape) or ref.offset < 0 or any(st < 0 for st in ref.stride) \
            or any(n < 0 for n in ref.shape):
        return True
    return bool(math.prod(ref.shape)) and ref.offset + sum((n - 1) * st for n, st in zip(ref.shape, ref.stride)) >= numel


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *rest):
    return data


def record_class(module: str, name: str):
    qualname = f"{module}.{name}"

    class _Rec(Record):
        def __new__(cls, *args, **kwargs):
            return object.__new__(cls)

        def __init__(self, *args, **kwargs):
            Record.__init__(self, qualname, args, dict(kwargs) if kwargs else None)

        def __setstate__(self, state):
            if not hasattr(self, "qualname"):
                Record.__init__(self, qualname)
            if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) and state[0] is None:
                state = state[1]  # (None, slots) from classes with __slots__
            self.state = state

    _Rec.__name__ = _Rec.__qualname__ = name
    _Rec.qualname, _Rec.args, _Rec.state = qualname, (), None  # for NEWOBJ without BUILD
    return _Rec


_STORAGE_SUFFIX = "Storage"
_STORAGE_DTYPES = {
    "FloatStorage": "float32", "HalfStorage": "float16", "BFloat16Storage": "bfloat16", "DoubleStorage": "float64",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}
STORAGE_CLASS_OF_DTYPE = {v: k for k, v in _STORAGE_DTYPES.items()}


class SafeUnpickler(pickle.Unpickler):
    """Unpickles torch's pickles into ``TensorRef`` / ``StorageRef`` / ``DType`` / ``Record`` values.

    Only plain containers and the names below are built; any other allow-listed global becomes an
    inert ``Record`` (Megatron-LM puts ``argparse.Namespace``, RNG states and more in its checkpoints),
    and a global off the allow-list is refused (``UnsafePickle``, naming the file and the global).
    """

    _SAFE = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "slice"): slice,
        ("builtins", "bytes"): bytes,
        ("_codecs", "encode"): codecs.encode,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch", "Size"): lambda shape=(): tuple(shape),
        ("torch.serialization", "_get_layout"): lambda name: name,
    }

    def __init__(self, data: bytes, *, where: str = "the file"):
        super().__init__(io.BytesIO(data))
        self.where = where
        self._classes: dict = {}

    def find_class(self, module: str, name: str):
        if canonical(module, name) == ENUM_BY_NAME:
            return enum_by_name(self.where, Record)
        check(module, name, self.where)
        module, name = canonical(module, name)
        if (module, name) in self._SAFE:
            return self._SAFE[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch" and name in _TORCH_DTYPE_NAMES:
            return DType(name)
        key = (module, name)
        if key not in self._classes:
            self._classes[key] = record_class(module, name)
        return self._classes[key]

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent record {pid!r:.60}")
        _, storage_type, key, _location, numel = pid
        if isinstance(storage_type, DType):
            dtype = storage_type.name
        elif isinstance(storage_type, str):
            dtype = storage_type
        else:
            raise pickle.UnpicklingError(f"unsupported storage type {storage_type!r:.60}")
        return StorageRef(str(key), dtype, int(numel))


# torch's dtype attribute names (``torch.bfloat16``) that may appear as globals.
_TORCH_DTYPE_NAMES = {
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "complex64", "complex128", "uint16", "uint32", "uint64", "double", "float",
    "half", "long", "int", "short",
}


def loads(data: bytes, *, where: str = "the file") -> Any:
    return SafeUnpickler(data, where=where).load()

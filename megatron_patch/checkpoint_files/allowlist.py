"""The one allow-list for every pickle read from a checkpoint.

A checkpoint comes from a hub, a colleague or another tool, and a pickle can name any importable
callable (``posix.system``): every pickle this project reads (``.metadata``, ``common.pt``, legacy
``model_optim_rng.pt``, optimizer and RNG files, saved arguments, the byte entries inside ``.distcp``
files, other tools' train-state files) may name only the globals below. Anything else is refused in
one line naming the file and the global; nothing is recorded and let through.

Each entry is a class or function these files legitimately hold, and building it from pickled
arguments runs no code of the file's choosing: records (dataclasses, enums, namespaces), containers,
torch's tensor/storage rebuilders and dtypes, numpy's array reconstruction (RNG state).
"""

from __future__ import annotations

import _compat_pickle
import enum

from megatron_patch.errors import UserError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"

ALLOWED: frozenset[tuple[str, str]] = frozenset({
    # containers and plain values
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"), ("builtins", "bytearray"),
    ("builtins", "bytes"),
    ("_codecs", "encode"),  # how protocol-2 pickles spell bytes
    ("argparse", "Namespace"), ("types", "SimpleNamespace"), ("io", "BytesIO"), ("_io", "BytesIO"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    # torch.save's tensors, storages, dtypes and layouts
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"), ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"),
    ("torch.serialization", "_get_layout"),
    # torch.distributed.checkpoint's metadata (any torch version's fields; classes a newer torch added
    # that this one lacks are read as inert records)
    (_DCP_METADATA, "Metadata"), (_DCP_METADATA, "TensorStorageMetadata"), (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"), (_DCP_METADATA, "TensorProperties"), (_DCP_METADATA, "MetadataIndex"),
    (_DCP_METADATA, "StorageMeta"), (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    (_DCP_PLANNER, "SavePlan"), (_DCP_PLANNER, "WriteItem"), (_DCP_PLANNER, "WriteItemType"),
    (_DCP_PLANNER, "TensorWriteData"), (_DCP_PLANNER, "ReadItem"), (_DCP_PLANNER, "LoadItemType"),
    # numpy arrays and dtypes (numpy's RNG state in Megatron-LM's and our RNG files)
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    # megatron-core's records (the classes it registers with torch as safe, and its enums)
    ("megatron.core.enums", "ModelType"), ("megatron.core.transformer.enums", "AttnBackend"),
    ("megatron.core.transformer.enums", "AttnMaskType"), ("megatron.core.transformer.enums", "AttnType"),
    ("megatron.core.transformer.enums", "CudaGraphScope"), ("megatron.core.transformer.enums", "CudaGraphModule"),
    ("megatron.core.transformer.enums", "InferenceCudaGraphScope"), ("megatron.core.transformer.enums", "LayerType"),
    ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"),
    ("megatron.core.rerun_state_machine", "RerunDiagnostic"), ("megatron.core.rerun_state_machine", "RerunMode"),
    ("megatron.core.rerun_state_machine", "RerunState"), ("signal", "Signals"),
})

# torch's dtype and storage names, which torch.save spells as globals of the torch module.
TORCH_DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "complex64",
    "complex128", "uint16", "uint32", "uint64", "double", "float", "half", "long", "int", "short", "cfloat",
    "cdouble", "strided", "contiguous_format", "preserve_format", "channels_last",
})
TORCH_STORAGES = frozenset({
    "FloatStorage", "HalfStorage", "BFloat16Storage", "DoubleStorage", "LongStorage", "IntStorage",
    "ShortStorage", "CharStorage", "ByteStorage", "BoolStorage", "ComplexFloatStorage", "ComplexDoubleStorage",
})


class UnsafePickle(UserError):
    """A checkpoint pickle names a global outside the allow-list."""


# Some Python 3.11 releases (3.11.2 here; 3.11.7 does not) pickle an enum member as
# ``getattr(EnumClass, "NAME")`` (others call ``EnumClass(value)``), so torch's and megatron-core's files written
# there name ``builtins.getattr``. Only that use is read: the class must be an allow-listed Enum (or the inert
# record of one) and the name one of its members; any other getattr is refused.
ENUM_BY_NAME = ("builtins", "getattr")


def enum_by_name(where: str, record_type: type):
    """What a safe unpickler gives for ``builtins.getattr``: a member of an allow-listed enum by its name
    (``record_type``: the inert records an unpickler builds for classes it does not import)."""
    def member(cls, name):
        if isinstance(cls, type) and isinstance(name, str):
            if issubclass(cls, enum.Enum) and name in cls.__members__:
                return cls.__members__[name]
            if issubclass(cls, record_type) and name.isidentifier():
                record = cls()
                record.state = {"_name_": name}
                return record
        raise UnsafePickle(f"{where}: refused: its pickle calls getattr({cls!r:.60}, {name!r:.40}), which is not "
                           "an enum member by name and could run code on loading (docs/security.md); do not use "
                           "this file")
    return member


# Python 3.13 moved pathlib's classes into ``pathlib._local`` (``pathlib`` re-exports them), so a pickle written
# there names ``pathlib._local.PosixPath``: read under any Python as ``pathlib.PosixPath``, the same class.
_MOVED_MODULES = {"pathlib._local": "pathlib"}


def canonical(module: str, name: str) -> tuple[str, str]:
    """The one name of a global: the Python 3 name of one a protocol-2 pickle spells the Python 2 way
    (``__builtin__.set``, as pickle's own ``find_class`` maps it), and the public module of one a newer
    Python moved (``pathlib._local``)."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return _MOVED_MODULES.get(module, module), name


def is_allowed(module: str, name: str) -> bool:
    module, name = canonical(module, name)
    if (module, name) in ALLOWED:
        return True
    if module == "torch" and (name in TORCH_DTYPES or name in TORCH_STORAGES):
        return True
    # numpy's dtype classes (numpy.dtypes.UInt32DType, ...) are records of a dtype.
    return module == "numpy.dtypes" and name.endswith("DType") and name.isidentifier()


def refuse(module: str, name: str, where: str) -> UnsafePickle:
    return UnsafePickle(
        f"{where}: refused: its pickle names {module}.{name}, which no checkpoint needs and which could run code "
        "on loading (docs/security.md lists what a checkpoint may hold); do not use this file")


def check(module: str, name: str, where: str) -> None:
    if not is_allowed(module, name):
        raise refuse(module, name, where)

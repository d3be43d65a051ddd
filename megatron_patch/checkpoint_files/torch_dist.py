"""The torch_dist format (megatron-core ``dist_checkpointing``), laid out and read without torch.

A torch_dist checkpoint is a PyTorch distributed checkpoint: ``*.distcp`` files that hold one
``torch.save`` archive per tensor chunk (and raw bytes per object) back to back, and a ``.metadata``
pickle that says, for every global tensor, its shape, dtype and chunks, and where each chunk's
archive lies; plus megatron's ``metadata.json`` and its common (non-tensor) state: ``common.pt`` up to
megatron-core 0.16, the byte object ``common_state`` inside the ``.distcp`` files from 0.19 on.

``plan_torch_dist`` lays out all of it from the chunk list alone (shapes, offsets, dtypes): every
archive's headers and pickle, every chunk's byte range (a ``Stored`` the copier fills), and the
``.metadata`` pickle, spelled as torch's own ``FileSystemWriter`` spells it, so torch's reader and
megatron's ``dist_checkpointing.load`` read the result as their own.

``TorchDistReader`` reads ``.metadata`` with the safe unpickler (no torch, and no dependence on the
torch version that wrote it beyond the field names) and locates each stored chunk's bytes. A block
that is not exactly one plain stored chunk is read through torch's own reader (``load``).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from megatron_patch.checkpoint_files.byte_io import Stored
from megatron_patch.checkpoint_files.byte_io import create_file
from megatron_patch.checkpoint_files.pickles import (
    Call, DType, Global, Items, New, Record, TensorRef, dumps, loads, torch_dtype, torch_size)
from megatron_patch.checkpoint_files.torch_files import LazyTorchFile, TensorSpec, plan_torch_save
from megatron_patch.errors import UserError

# What megatron-core's dist_checkpointing.save writes next to the torch files.
MEGATRON_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}
# A new .distcp file is started after this many bytes, to keep files a manageable size.
FILE_BYTES = 2 * 2**30
_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
METADATA_VERSION = "1.0.0"
# megatron-core >= 0.19 stores the common state as this ShardedObject (one shard) instead of common.pt.
COMMON_STATE_OBJECT = "common_state/shard_0_1"


@dataclass(frozen=True)
class ChunkItem:
    """One stored block of global tensor ``key``: at ``offset`` (all dims), of ``local_shape``."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str


@dataclass
class TorchDistPlan:
    folder: Path
    files: dict[str, int] = field(default_factory=dict)                 # .distcp name -> size
    small: list[tuple[str, int, bytes]] = field(default_factory=list)   # (file name, offset, bytes)
    stored: dict[tuple[str, tuple[int, ...]], Stored] = field(default_factory=dict)
    metadata: bytes = b""

    def create_files(self) -> None:
        """Every .distcp file at its full size, with all headers and object bytes in place."""
        self.folder.mkdir(parents=True, exist_ok=True)
        by_file: dict[str, list[tuple[int, bytes]]] = {}
        for name, offset, data in self.small:
            by_file.setdefault(name, []).append((offset, data))
        for name, size in self.files.items():
            create_file(self.folder / name, size, by_file.get(name, ()))

    def finish(self) -> None:
        """``.metadata``, ``common.pt`` and ``metadata.json``: written once the data is in place."""
        (self.folder / ".metadata").write_bytes(self.metadata)
        write_torch_save(self.folder / "common.pt", {})
        (self.folder / "metadata.json").write_text(json.dumps(MEGATRON_CONFIG))


def write_torch_save(path: Path, obj) -> None:
    """A small torch.save file with no tensors."""
    layout, _ = plan_torch_save(path, obj)
    create_file(path, layout.size, layout.small)


def _properties(dtype: str) -> New:
    return New(Global(_MD, "TensorProperties"),
               (torch_dtype(dtype), Call(Global("torch.serialization", "_get_layout"), ("torch.strided",)), False,
                Call(Global(_MD, "_MEM_FORMAT_ENCODING"), (0,)), False))


def plan_torch_dist(folder: str | Path, chunks: list[ChunkItem], objects: list[tuple[str, bytes]],
                    file_bytes: int = FILE_BYTES) -> TorchDistPlan:
    """Lay out a torch_dist checkpoint holding ``chunks`` (then ``objects``: key, raw bytes) in this order."""
    plan = TorchDistPlan(Path(folder))
    tensors: dict[str, dict] = {}
    storage = []
    file_index, pos, name = -1, file_bytes, ""

    def place() -> tuple[str, int]:
        nonlocal file_index, pos, name
        if pos >= file_bytes:
            file_index += 1
            name = f"__0_{file_index}.distcp"
            pos = 0
        return name, pos

    for ch in chunks:
        fname, start = place()
        layout, stored = plan_torch_save(plan.folder / fname, TensorSpec(tuple(ch.local_shape), ch.dtype), base=start)
        plan.small += [(fname, off, data) for off, data in layout.small]
        plan.stored[(ch.key, tuple(ch.offset))] = stored[()]
        entry = tensors.setdefault(ch.key, {"dtype": ch.dtype, "size": tuple(ch.global_shape), "chunks": []})
        if entry["dtype"] != ch.dtype or entry["size"] != tuple(ch.global_shape):
            raise ValueError(f"chunks of {ch.key} disagree on dtype or global shape")
        index = len(entry["chunks"])
        entry["chunks"].append(New(Global(_MD, "ChunkStorageMetadata"),
                                   {"offsets": torch_size(ch.offset), "sizes": torch_size(ch.local_shape)}))
        storage.append((New(Global(_MD, "MetadataIndex"), {"fqn": ch.key, "index": index, "offset": torch_size(ch.offset)}),
                        New(Global(_FS, "_StorageInfo"), {"relative_path": fname, "offset": start, "length": layout.size})))
        pos = layout.end
        plan.files[fname] = pos
    sd_metadata = {key: New(Global(_MD, "TensorStorageMetadata"),
                            {"properties": _properties(e["dtype"]), "size": torch_size(e["size"]), "chunks": e["chunks"]})
                   for key, e in tensors.items()}
    for key, payload in objects:
        fname, start = place()
        plan.small.append((fname, start, payload))
        sd_metadata[key] = New(Global(_MD, "BytesStorageMetadata"), {})
        storage.append((New(Global(_MD, "MetadataIndex"), {"fqn": key, "index": None, "offset": None}),
                        New(Global(_FS, "_StorageInfo"), {"relative_path": fname, "offset": start, "length": len(payload)})))
        pos = start + len(payload)
        plan.files[fname] = pos
    plan.metadata = dumps(New(Global(_MD, "Metadata"), {
        "state_dict_metadata": sd_metadata, "planner_data": None, "storage_data": Items(storage),
        "storage_meta": None, "version": METADATA_VERSION}))
    return plan


# --- reading ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    global_shape: tuple[int, ...]
    dtype: str
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]   # (offsets, sizes)


def _state(rec, name: str):
    """Field ``name`` of an unpickled dataclass (None when absent: torch leaves out some None fields)."""
    return rec.get(name) if isinstance(rec, Record) else getattr(rec, name, None)


@dataclass
class DistMetadata:
    """What a ``.metadata`` pickle says: every tensor, the byte objects' keys, and where each stored
    item lies ((key, offset or None) -> (file, start, length, transform descriptors))."""

    tensors: dict[str, TensorInfo]
    objects: set[str]
    storage: dict[tuple[str, tuple | None], tuple[str, int, int, object]]


def read_metadata(path: Path) -> DistMetadata:
    """``.metadata`` read with the safe unpickler; raises whatever a damaged file makes unpickling or
    the structure raise."""
    md = loads(path.read_bytes(), where=str(path))
    tensors: dict[str, TensorInfo] = {}
    objects: set[str] = set()
    for key, entry in _state(md, "state_dict_metadata").items():
        if entry.qualname.endswith("BytesStorageMetadata"):
            objects.add(key)
            continue
        props = _state(entry, "properties")
        pstate = props.state
        dtype = pstate[0] if isinstance(pstate, tuple) else pstate["dtype"]
        chunks = tuple((tuple(_state(c, "offsets")), tuple(_state(c, "sizes"))) for c in _state(entry, "chunks"))
        tensors[key] = TensorInfo(tuple(_state(entry, "size")), dtype.name if isinstance(dtype, DType) else str(dtype),
                                  chunks)
    storage = {}
    for index, info in (_state(md, "storage_data") or {}).items():
        offset = _state(index, "offset")
        storage[(_state(index, "fqn"), None if offset is None else tuple(offset))] = (
            _state(info, "relative_path"), int(_state(info, "offset")), int(_state(info, "length")),
            info.get("transform_descriptors") if isinstance(info, Record) else None)
    return DistMetadata(tensors, objects, storage)


class TorchDistReader:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not (self.folder / ".metadata").exists():
            raise UserError(f"{self.folder} has no .metadata: it is not a complete torch_dist checkpoint")
        try:
            md = read_metadata(self.folder / ".metadata")
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unpickling or structure failure means a damaged file
            raise UserError(f"{self.folder / '.metadata'} is unreadable ({type(exc).__name__}: {exc}): "
                            "the checkpoint is damaged")
        self.tensors, self.objects, self.storage = md.tensors, md.objects, md.storage

    def keys(self) -> set[str]:
        return set(self.tensors) | self.objects

    def tensor_keys(self) -> set[str]:
        return set(self.tensors)

    def common_state(self):
        """megatron's common state (args, iteration, ...) as the safe unpickler reads it: ``common.pt``
        when present (megatron-core <= 0.16, and this project's writer), else the ``common_state`` object
        (megatron-core >= 0.19, a one-element list around the dict); None when neither is there."""
        if (self.folder / "common.pt").exists():
            return LazyTorchFile(self.folder / "common.pt").obj
        where = self.storage.get((COMMON_STATE_OBJECT, None))
        if where is None:
            return None
        relative, start, length, _ = where
        obj = LazyTorchFile(self.folder / relative, window=(start, length)).obj
        return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj

    def global_shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key].global_shape

    def dtype(self, key: str) -> str:
        return self.tensors[key].dtype

    def stored_chunk(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> Stored | None:
        """Where the bytes of the block of ``key`` at ``offset`` of ``shape`` are, when exactly one plain
        stored chunk holds it (always for checkpoints written here or by a TP=1 training run); else None."""
        info = self.tensors.get(key)
        if info is None or (tuple(offset), tuple(shape)) not in info.chunks:
            return None
        where = self.storage.get((key, tuple(offset)))
        if where is None or where[3]:
            return None
        relative, start, length, _ = where
        blob = LazyTorchFile(self.folder / relative, window=(start, length))
        if not isinstance(blob.obj, TensorRef):
            return None
        stored = blob.stored(blob.obj)
        if stored is None or stored.dtype != info.dtype or tuple(stored.shape) != tuple(shape):
            return None
        return stored

    def read_all(self) -> dict:
        """Every tensor whole, in its stored dtype (torch imported here): for tests and benchmarks."""
        import torch

        out = {k: torch.empty(self.global_shape(k), dtype=getattr(torch, self.dtype(k))) for k in self.tensor_keys()}
        self.load([(k, (0,) * t.dim(), t) for k, t in out.items()])
        return out

    def load(self, requests: Iterable[tuple[str, tuple[int, ...], object]]) -> None:
        """Fill each target tensor with the block of ``key`` that starts at ``offset``, through torch's
        reader (torch imported here): for blocks ``stored_chunk`` cannot place."""
        requests = list(requests)
        if not requests:
            return
        from torch.distributed.checkpoint.api import CheckpointException

        from megatron_patch.checkpoint_files.safe_torch import SafeFileSystemReader, load_refusing

        for key, offset, target in requests:
            info = self.tensors.get(key)
            if info is None:
                raise UserError(f"the torch_dist checkpoint has no tensor '{key}': it was not written for this model")
            end = [o + s for o, s in zip(offset, target.shape)]
            if len(info.global_shape) != len(offset) or any(e > s for e, s in zip(end, info.global_shape)):
                raise UserError(f"torch_dist tensor '{key}' has shape {info.global_shape}, which does not fit the model "
                                f"(needs a block at {offset} of {tuple(target.shape)})")
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to")
                load_refusing({}, SafeFileSystemReader(self.folder), _chunk_load_planner(requests))
        except UserError:
            raise
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - torch reports damaged files in many ways
            raise UserError(f"cannot read {requests[0][0]} from {self.folder} ({_cause(exc)}): "
                            "the checkpoint may be truncated or corrupt")


def _cause(exc: BaseException) -> str:
    """The innermost error's message, first sentence only (torch's messages run to paragraphs)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else type(exc).__name__
    return last.split(". ")[0]


def _chunk_load_planner(requests):
    """torch's load planner, asked for the given blocks of global tensors, filling the given targets."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class _ChunkLoad(DefaultLoadPlanner):
        def __init__(self):
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
            self._targets: dict = {}

        def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
            super().set_up_planner({}, metadata, is_coordinator)

        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, offset, target in requests:
                md = self.metadata.state_dict_metadata[key]
                self._targets[(key, tuple(offset))] = target
                items += create_read_items_for_chunk_list(key, md, [ChunkStorageMetadata(torch.Size(offset), target.size())])
            return LoadPlan(items)

        def resolve_tensor(self, read_item):
            target = self._targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                target = target.narrow(dim, start, length)
            return target

        def commit_tensor(self, read_item, tensor) -> None:
            pass

    return _ChunkLoad()

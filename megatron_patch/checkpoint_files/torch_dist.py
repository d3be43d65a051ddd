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
torch version that wrote it beyond the field names), locates each stored chunk's bytes, and assembles
any block of any tensor from whatever chunks were stored: torch's own reader is never used, so no
checkpoint pickle reaches an unguarded unpickler on this path.
"""

from __future__ import annotations

import itertools
import json
import io
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from megatron_patch.checkpoint_files.byte_io import Stored, create_file, read_range
from megatron_patch.checkpoint_files.pickles import (
    Call,
    DType,
    Global,
    Items,
    New,
    Record,
    TensorRef,
    dumps,
    lies_outside_its_storage,
    loads,
    torch_dtype,
    torch_size,
)
from megatron_patch.checkpoint_files.torch_files import LazyTorchFile, TensorSpec, plan_torch_save
from megatron_patch.checkpoint_files.zipfmt import ZipLayout
from megatron_patch.dtypes import ITEMSIZE
from megatron_patch.errors import UserError
from megatron_patch.input_files import file_problem, read_input

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

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
    archives: list[tuple[str, ZipLayout]] = field(default_factory=list)   # (file name, a chunk's archive)

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
        plan.archives.append((fname, layout))
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

# Transform descriptors (torch >= 2.7's StreamTransformExtension) this reader decodes: the registry name
# and the major version it knows.
ZSTD = "stream.zstd"
# The most bytes a stored byte object (megatron's common state, an optimizer's step) decompresses to: such objects
# hold kilobytes; a tensor chunk's bound is its own size (``chunk_bytes``).
OBJECT_BYTES = 1 << 30
# what a chunk's torch.save archive holds beside its data: the pickle, the zip's headers, the records' alignment
ARCHIVE_OVERHEAD = 1 << 20


@dataclass(frozen=True)
class TensorInfo:
    global_shape: tuple[int, ...]
    dtype: str
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]   # (offsets, sizes)


@dataclass(frozen=True)
class Piece:
    """The part of a requested block that one stored chunk holds: the box of ``size`` at ``src_start`` of
    ``src`` (the whole stored chunk, dense, in its stored shape) is the box at ``dst_start`` of the block."""

    src: Stored
    src_start: tuple[int, ...]
    dst_start: tuple[int, ...]
    size: tuple[int, ...]


def _state(rec, name: str):
    """Field ``name`` of an unpickled dataclass (None when absent: torch leaves out some None fields)."""
    return rec.get(name) if isinstance(rec, Record) else getattr(rec, name, None)


@dataclass
class DistMetadata:
    """What a ``.metadata`` pickle says: every tensor, the byte objects' keys, and where each stored
    item lies ((key, offset or None) -> (file, start, length, transform descriptors))."""

    tensors: dict[str, TensorInfo]
    objects: set[str]
    storage: dict[tuple[str, tuple | None], tuple[str, int, int, tuple[str, ...]]]


# More dimensions than any tensor a model stores (megatron's stacked expert weights have 4).
MAX_TENSOR_DIMS = 32


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def metadata_problem(md: DistMetadata) -> str | None:
    """What in a ``.metadata`` no checkpoint can hold, or None. Every reader of ``.metadata`` applies it (the
    torch-free ``read_metadata``: mcore2hf, inspect, the resume's choice of checkpoint; and
    ``safe_torch.read_dcp_metadata``: resume, PRETRAIN_CHECKPOINT_PATH, align), so each refuses the same
    shapes in the same words, before any size taken from the file is used:

    - a tensor shape of negative, non-integer or too many dimensions;
    - a chunk of another rank than its tensor, or lying outside it;
    - chunks that hold fewer elements than the tensor claims (it could never be read whole);
    - a chunk stored plainly in fewer bytes than its elements take;
    - chunks of one tensor that overlap (an exact duplicate among them): torch never saves them, and a reader
      would take the overlapped elements from either;
    - a chunk or byte object listed without a storage entry;
    - a storage entry with a negative place or length, or a file name that is not a plain name in the folder;
    - two storage entries that share bytes of a file (torch writes every item to bytes of its own): one
      tensor's chunk pointed at another's record.

    What only the stored records say (their dtype and shape, against the chunk's) is checked as each is read:
    ``check_chunk_record``, by the torch-free reader and by ``safe_torch.SafeFileSystemReader``.
    """
    for (key, _), (name, start, length, _) in md.storage.items():
        if not isinstance(name, str) or not name or "/" in name or name in (".", "..") or "\0" in name:
            return f"the record of {key} is stored in {str(name)[:80]!r}, which is not a file of the checkpoint's folder"
        if not (_whole(start) and _whole(length)):
            return f"the record of {key} is stored at byte {start} for {length} bytes, which no file has"
    shared = _shared_bytes(md.storage)
    if shared:
        return shared
    for key in sorted(md.objects):
        if (key, None) not in md.storage:
            return f"it lists the object {key} but not where it is stored"
    for key, info in md.tensors.items():
        shape = info.global_shape
        if len(shape) > MAX_TENSOR_DIMS or not all(_whole(d) for d in shape):
            return f"tensor {key} claims the shape {list(shape)[:MAX_TENSOR_DIMS]}, which no tensor has"
        covered = 0
        for offsets, sizes in info.chunks:
            if len(offsets) != len(shape) or len(sizes) != len(shape) or \
                    not all(_whole(x) for x in (*offsets, *sizes)):
                return f"a chunk of {key} at {list(offsets)[:8]} of {list(sizes)[:8]} does not fit its shape {list(shape)}"
            if any(o + n > d for o, n, d in zip(offsets, sizes, shape)):
                return f"a chunk of {key} at {list(offsets)} of {list(sizes)} lies outside its shape {list(shape)}"
            elements = math.prod(sizes)
            covered += elements
            where = md.storage.get((key, tuple(offsets)))
            if where is None:
                return f"it lists a chunk of {key} at {list(offsets)} but not where it is stored"
            itemsize = ITEMSIZE.get(info.dtype)
            if where is not None and not where[3] and itemsize and where[2] < elements * itemsize:
                return (f"a chunk of {key} at {list(offsets)} of {list(sizes)} takes {elements * itemsize} bytes of "
                        f"{info.dtype}, but its record holds {where[2]}")
        pair = _overlapping_pair(info.chunks)
        if pair is not None:
            (ao, asz), (bo, bsz) = pair
            return (f"it stores overlapping chunks of {key} (at {list(ao)} of {list(asz)} and at {list(bo)} of "
                    f"{list(bsz)})")
        if covered < math.prod(shape):
            return f"tensor {key} claims the shape {list(shape)}, but its chunks hold {covered} of its {math.prod(shape)} elements"
    return None


def _item_name(key: tuple) -> str:
    fqn, offset = key
    return str(fqn) if offset is None else f"{fqn} at {list(offset)}"


def _shared_bytes(storage: dict) -> str | None:
    """Two storage entries whose bytes overlap in one file (or that name the same empty range), or None."""
    by_file: dict = {}
    for key, (name, start, length, _) in storage.items():
        by_file.setdefault(name, []).append((start, length, key))
    for name, items in by_file.items():
        items.sort(key=lambda x: (x[0], x[1]))
        end, last = -1, None
        for start, length, key in items:
            if last is not None and (start < end or (start, length) == last[:2]):
                return (f"the records of {_item_name(last[2])} and {_item_name(key)} share bytes of {name} "
                        f"(at byte {start})")
            if last is None or start + length >= end:
                end, last = start + length, (start, length, key)
    return None


def _overlapping_pair(chunks) -> tuple | None:
    """Two chunks (offsets, sizes) that hold a common element, or None. Chunks that differ on an axis where
    every chunk has size 1 (megatron's layer and expert axes) never overlap, so only chunks that agree there are
    compared, by a sweep along the axis on which they are most spread."""
    chunks = [c for c in chunks if all(n > 0 for n in c[1])]
    if len(chunks) < 2:
        return None
    ndim = len(chunks[0][0])
    if ndim == 0:
        return chunks[0], chunks[1]
    unit = [d for d in range(ndim) if all(s[d] == 1 for _, s in chunks)]
    groups: dict = {}
    for c in chunks:
        groups.setdefault(tuple(c[0][d] for d in unit), []).append(c)
    for group in groups.values():
        if len(group) < 2:
            continue
        axis = max(range(ndim), key=lambda d: len({o[d] for o, _ in group}))
        active: list = []
        for c in sorted(group, key=lambda c: c[0][axis]):
            active = [a for a in active if a[0][axis] + a[1][axis] > c[0][axis]]
            for a in active:
                if _overlap(a, c):
                    return a, c
            active.append(c)
    return None


def check_transforms(path, transforms, what: str) -> None:
    """Refuse a transform descriptor no reader here decodes (the torch-free reader decodes ``stream.zstd/1``,
    as torch's own reader does)."""
    for desc in transforms:
        name, _, version = str(desc).partition("/")
        if name != ZSTD or version.partition(".")[0] != "1":
            raise UserError(f"{path}: {what} is stored with the transform '{str(desc)[:60]}', which this reader "
                            f"does not decode (it decodes {ZSTD}/1): the checkpoint cannot be read")


def check_chunk_record(ref, dtype: str, sizes: tuple, what: str) -> None:
    """The stored record of a chunk holds the tensor ``.metadata`` declares for it: a tensor (not another
    object), of the chunk's dtype and shape, whose elements lie within its storage."""
    if not isinstance(ref, TensorRef):
        raise UserError(f"{what} holds no tensor: the checkpoint is damaged")
    if ref.storage.dtype != dtype or tuple(ref.shape) != tuple(sizes):
        raise UserError(f"{what} holds a {ref.storage.dtype} tensor of shape {list(ref.shape)} where .metadata "
                        f"says {dtype} of {list(sizes)}: the checkpoint is damaged")
    if lies_outside_its_storage(ref, ref.storage.numel):
        raise UserError(f"{what} holds a tensor that lies outside its storage: the checkpoint is damaged")


def check_metadata(md: DistMetadata, path: str | Path) -> DistMetadata:
    """``md``, or one line naming ``path`` and what no checkpoint can hold (``metadata_problem``)."""
    why = metadata_problem(md)
    if why:
        raise UserError(f"{path}: {why}: the checkpoint is damaged")
    return md


def metadata_files(folder: Path) -> list[Path]:
    """The metadata of a torch_dist folder: ``.metadata``, or, written by ``dcp.save(use_collectives=False)``
    (torch >= 2.6), one ``__<rank>.metadata`` per rank and no global file; [] when there is none."""
    if (folder / ".metadata").is_file():
        return [folder / ".metadata"]
    return sorted(folder.glob("__*.metadata"), key=lambda p: p.name)


def read_metadata(path: Path) -> DistMetadata:
    """``.metadata`` (or, where only rank-local files exist, all of them merged) read with the safe
    unpickler; raises whatever a damaged file makes unpickling or the structure raise.

    Reads any torch version's records by field name: torch 2.14-2.15 add ``strides`` to the tensor
    properties and megatron-core adds ``all_local_plans`` and ``mcore_data`` to the metadata, which
    nothing here needs."""
    path = Path(path)
    files = [path] if path.exists() else metadata_files(path.parent)
    if not files:
        raise FileNotFoundError(f"{path} is missing")
    out = DistMetadata({}, set(), {})
    for file in files:
        _merge(out, _parse_metadata(file), file)
    return check_metadata(out, path)


def _parse_metadata(path: Path) -> DistMetadata:
    # inside its folder: a rank-local __N.metadata linked to a file elsewhere was read as the checkpoint's own
    md = loads(read_input(path, limit=None, inside=path.parent), where=str(path))
    tensors: dict[str, TensorInfo] = {}
    objects: set[str] = set()
    for key, entry in _state(md, "state_dict_metadata").items():
        if entry.qualname.endswith("BytesStorageMetadata"):
            objects.add(key)
            continue
        pstate = _state(entry, "properties").state
        dtype = pstate[0] if isinstance(pstate, tuple) else pstate["dtype"]
        chunks = tuple((tuple(_state(c, "offsets")), tuple(_state(c, "sizes"))) for c in _state(entry, "chunks"))
        tensors[key] = TensorInfo(tuple(_state(entry, "size")), dtype.name if isinstance(dtype, DType) else str(dtype),
                                  chunks)
    storage = {}
    for index, info in (_state(md, "storage_data") or {}).items():
        offset = _state(index, "offset")
        storage[(_state(index, "fqn"), None if offset is None else tuple(offset))] = (
            _state(info, "relative_path"), int(_state(info, "offset")), int(_state(info, "length")),
            tuple(_state(info, "transform_descriptors") or ()))
    return DistMetadata(tensors, objects, storage)


def _merge(out: DistMetadata, md: DistMetadata, where: Path) -> None:
    for key, info in md.tensors.items():
        have = out.tensors.get(key)
        if have is not None and (have.global_shape, have.dtype) != (info.global_shape, info.dtype):
            raise ValueError(f"{where.name} gives {key} another shape or dtype than an earlier rank's metadata")
        out.tensors[key] = info if have is None else TensorInfo(
            have.global_shape, have.dtype, have.chunks + tuple(c for c in info.chunks if c not in have.chunks))
    out.objects |= md.objects
    out.storage.update(md.storage)


def _overlap(a: tuple, b: tuple) -> bool:
    (ao, asz), (bo, bsz) = a, b
    return all(x < y + ys and y < x + xs for x, xs, y, ys in zip(ao, asz, bo, bsz))


# What NeMo (``model.``) and Megatron-Bridge's wrapped modules (``module.``) put before megatron-core's own names.
WRAPPER_PREFIXES = ("model.", "module.")
_MODEL_ROOTS = ("embedding.", "decoder.", "output_layer.", "mtp.")


def wrapper_prefix_dropped(tensors: dict) -> dict[str, str]:
    """stored name -> the name read, where every model tensor carries a wrapper's prefix (NeMo's ``model.``,
    ``module.``) and none is named as megatron-core names it: the prefix is dropped."""
    if any(key.startswith(_MODEL_ROOTS) for key in tensors):
        return {}
    for prefix in WRAPPER_PREFIXES:
        named = {key: key[len(prefix):] for key in tensors if key.startswith(prefix)}
        if any(name.startswith(_MODEL_ROOTS) for name in named.values()):
            return {key: name for key, name in named.items() if name not in tensors}
    return {}


def _moe_norms_under_local_names(tensors: dict) -> dict[str, str]:
    """stored name -> the name read, for the pre-MLP norms of MoE layers that megatron-core's local spec stores
    under a dense layer's fused name (``mlp.linear_fc1.layer_norm_weight``: it maps that norm so for every layer,
    where transformer-engine's spec keeps ``pre_mlp_layernorm.weight`` in an MoE layer, as this project writes it).
    Only where nothing else can be meant: the same layers hold a router and no first linear of their own."""
    suffix = ".mlp.linear_fc1.layer_norm_weight"
    out = {}
    for key in tensors:
        prefix = key[:-len(suffix)] if key.endswith(suffix) else None
        if (prefix is not None and f"{prefix}.mlp.router.weight" in tensors
                and f"{prefix}.mlp.linear_fc1.weight" not in tensors
                and f"{prefix}.pre_mlp_layernorm.weight" not in tensors):
            out[key] = f"{prefix}.pre_mlp_layernorm.weight"
    return out


class TorchDistReader:
    """A torch_dist checkpoint read without torch's reader: ``.metadata`` through the allow-list, each stored
    chunk located in its ``.distcp`` file (``chunk``), and any block of any tensor assembled from whatever
    chunks hold it (``block``): a block spread over several chunks, part of one, chunks of another TP/PP/EP
    layout or of the distributed optimizer's flattened buckets.

    A chunk stored with a transform (zstd, torch >= 2.7) or as a strided view is decoded into an anonymous
    scratch file (``close`` drops them); any other transform is refused. ``integrity`` collects the CRC-32
    of every stored record handed out, for the caller to check while it reads the bytes."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if os.path.lexists(self.folder / ".metadata") and (problem := file_problem(self.folder / ".metadata")):
            raise UserError(f"{self.folder}: {problem}: it is not a readable torch_dist checkpoint")
        if not metadata_files(self.folder):
            raise UserError(f"{self.folder} has no .metadata: it is not a complete torch_dist checkpoint")
        try:
            md = read_metadata(self.folder / ".metadata")
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - any unpickling or structure failure means a damaged file
            raise UserError(f"{self.folder / '.metadata'} is unreadable ({type(exc).__name__}: {exc}): "
                            "the checkpoint is damaged")
        self.tensors, self.objects, self.storage = md.tensors, md.objects, md.storage
        # other tools' spellings of megatron-core's names, read as this project reads its own
        self._read_as(wrapper_prefix_dropped(self.tensors))
        self._read_as(_moe_norms_under_local_names(self.tensors))
        self.integrity: dict[tuple[str, int, int], tuple[int, str]] = {}   # (path, offset, length) -> (crc, what)
        self._chunks: dict[tuple[str, tuple], Stored] = {}
        self._index: dict[str, tuple[int, dict]] = {}
        self._scratch: list = []

    def _read_as(self, names: dict[str, str]) -> None:
        """Each stored tensor of ``names`` read under the name it maps to."""
        if not names:
            return
        self.tensors = {names.get(key, key): info for key, info in self.tensors.items()}
        self.storage = {(names.get(key, key), offset): where for (key, offset), where in self.storage.items()}

    def keys(self) -> set[str]:
        return set(self.tensors) | self.objects

    def tensor_keys(self) -> set[str]:
        return set(self.tensors)

    def global_shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key].global_shape

    def dtype(self, key: str) -> str:
        return self.tensors[key].dtype

    def close(self) -> None:
        for f in self._scratch:
            f.close()
        self._scratch.clear()
        self._chunks = {k: v for k, v in self._chunks.items() if not v.path.startswith("/proc/self/fd/")}

    # --- byte objects ---------------------------------------------------------------------------

    def object_range(self, key: str) -> tuple[Path, int, int]:
        """(file, offset, length) of byte object ``key``'s stored bytes, decoded if it was stored with a transform."""
        where = self.storage.get((key, None))
        if where is None:
            raise UserError(f"{self.folder / '.metadata'} lists the object {key} but not where it is stored: "
                            "the checkpoint is damaged")
        relative, start, length, transforms = where
        return self._decoded(self.folder / relative, start, length, transforms, key)

    def common_state(self):
        """megatron's common state (args, iteration, ...) as the safe unpickler reads it: ``common.pt``
        when present (megatron-core <= 0.16, and this project's writer), else the ``common_state`` object
        (megatron-core >= 0.19, a one-element list around the dict); None when neither is there."""
        if (self.folder / "common.pt").exists():
            return LazyTorchFile(self.folder / "common.pt", verify=True).obj
        if (COMMON_STATE_OBJECT, None) not in self.storage:
            return None
        path, start, length = self.object_range(COMMON_STATE_OBJECT)
        obj = LazyTorchFile(path, window=(start, length), verify=True).obj
        return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj

    # --- tensor chunks ----------------------------------------------------------------------------

    def chunk(self, key: str, offset: tuple[int, ...]) -> Stored:
        """Where the stored chunk of ``key`` at ``offset`` is: a dense tensor of the chunk's shape."""
        offset = tuple(offset)
        found = self._chunks.get((key, offset))
        if found is not None:
            return found
        info = self.tensors[key]
        sizes = next((s for o, s in info.chunks if o == offset), None)
        where = self.storage.get((key, offset))
        if sizes is None or where is None:
            raise UserError(f"{self.folder / '.metadata'} lists a chunk of {key} at {offset} but not where it is "
                            "stored: the checkpoint is damaged")
        relative, start, length, transforms = where
        path, start, length = self._decoded(self.folder / relative, start, length, transforms, f"{key} at {offset}",
                                            chunk_bytes(sizes, info.dtype))
        blob = LazyTorchFile(path, window=(start, length))
        ref = blob.obj
        what = f"{Path(relative).name}: chunk of {key} at {list(offset)}"
        check_chunk_record(ref, info.dtype, sizes, what)
        stored = blob.stored(ref)
        record = blob.record_check(ref)
        if record is not None:
            self.integrity[record[:3]] = (record[3], what)
        if stored is None:  # a strided view of its storage: made dense once
            import torch

            tensor = blob.load(ref).contiguous()
            stored = self._scratch_file(tensor.reshape(-1).view(torch.uint8).numpy(), tuple(sizes), info.dtype)
        self._chunks[(key, offset)] = stored
        return stored

    def _scratch_file(self, data, shape: tuple[int, ...], dtype: str) -> Stored:
        f = tempfile.TemporaryFile(prefix="mpatch-chunk-")
        f.write(memoryview(data).cast("B"))
        f.flush()
        self._scratch.append(f)
        return Stored(f"/proc/self/fd/{f.fileno()}", 0, shape, dtype)

    def _decoded(self, path: Path, start: int, length: int, transforms: tuple[str, ...], what: str,
                 limit: int = OBJECT_BYTES):
        """(file, start, length) of an item's bytes once its transforms are undone (they are applied in
        order when saving, so undone in reverse), at most ``limit`` bytes."""
        if not transforms:
            return path, start, length
        check_transforms(path, transforms, what)
        data = undo_transforms(bytes(read_range(path, start, length)), transforms, path, what, limit)
        stored = self._scratch_file(data, (len(data),), "uint8")
        return Path(stored.path), 0, len(data)

    def _candidates(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]):
        """The stored chunks of ``key`` that may intersect the block: chunks are indexed by their offsets on
        the leading axes on which every chunk has size 1 (megatron's layer and expert axes)."""
        if key not in self._index:
            chunks = self.tensors[key].chunks
            ndim = len(self.tensors[key].global_shape)
            lead = next((d for d in range(ndim) if any(s[d] != 1 for _, s in chunks)), ndim)
            buckets: dict = {}
            for o, s in chunks:
                buckets.setdefault(o[:lead], []).append((o, s))
            self._index[key] = (lead, buckets)
        lead, buckets = self._index[key]
        if lead == 0:
            return buckets.get((), [])

        ranges = [range(o, o + s) for o, s in zip(offset[:lead], shape[:lead])]
        return [c for prefix in itertools.product(*ranges) for c in buckets.get(prefix, ())]

    def block(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> list[Piece]:
        """The pieces that make up the block of ``key`` at ``offset`` of ``shape``: every element of it
        held by exactly one stored chunk, or one line saying what is wrong."""
        info = self.tensors.get(key)
        if info is None:
            raise UserError(f"the torch_dist checkpoint has no tensor '{key}': it was not written for this model")
        offset, shape = tuple(offset), tuple(shape)
        if len(offset) != len(info.global_shape) or len(shape) != len(offset) or \
                any(o < 0 or o + s > g for o, s, g in zip(offset, shape, info.global_shape)):
            raise UserError(f"torch_dist tensor '{key}' has shape {info.global_shape}, which does not fit the model "
                            f"(needs a block at {offset} of {shape})")
        pieces, boxes = [], []
        for co, cs in self._candidates(key, offset, shape):
            lo = tuple(max(a, b) for a, b in zip(offset, co))
            hi = tuple(min(a + s, b + t) for a, s, b, t in zip(offset, shape, co, cs))
            if any(x >= y for x, y in zip(lo, hi)):
                continue
            size = tuple(y - x for x, y in zip(lo, hi))
            boxes.append((lo, size))
            pieces.append(Piece(self.chunk(key, co), tuple(x - c for x, c in zip(lo, co)),
                                tuple(x - o for x, o in zip(lo, offset)), size))
        _check_cover(key, offset, shape, boxes)
        return pieces

    def read_block(self, key: str, offset: tuple[int, ...] | None = None, shape: tuple[int, ...] | None = None):
        """The block as a torch tensor (torch imported here), assembled by this reader: for tests, the
        in-memory merges of the converter and benchmarks."""
        # numpy and torch only for this read into memory
        import numpy as np
        import torch

        info = self.tensors[key]
        shape = tuple(info.global_shape if shape is None else shape)
        offset = tuple((0,) * len(shape) if offset is None else offset)
        itemsize = torch.empty((), dtype=getattr(torch, info.dtype)).element_size()
        out = np.zeros(shape[:-1] + (shape[-1] * itemsize,) if shape else (itemsize,), dtype=np.uint8)
        for p in self.block(key, offset, shape):
            src = np.fromfile(p.src.path, dtype=np.uint8, count=p.src.nbytes, offset=p.src.offset)
            src = src.reshape(p.src.shape[:-1] + (p.src.shape[-1] * itemsize,) if p.src.shape else (itemsize,))
            box = tuple(slice(a, a + s) for a, s in zip(p.src_start, p.size))
            dst = tuple(slice(a, a + s) for a, s in zip(p.dst_start, p.size))
            if shape:
                box = box[:-1] + (slice(box[-1].start * itemsize, box[-1].stop * itemsize),)
                dst = dst[:-1] + (slice(dst[-1].start * itemsize, dst[-1].stop * itemsize),)
            out[dst] = src[box]
        return torch.from_numpy(out.reshape(-1)).view(getattr(torch, info.dtype)).reshape(shape).clone()

    def read_all(self) -> dict:
        """Every tensor whole, in its stored dtype: for tests and benchmarks."""
        return {k: self.read_block(k) for k in self.tensor_keys()}


def chunk_bytes(sizes: tuple[int, ...], dtype: str) -> int:
    """The most bytes a chunk of ``sizes`` stored as a torch.save archive takes once decompressed."""
    return math.prod(sizes) * ITEMSIZE.get(dtype, 8) + ARCHIVE_OVERHEAD


def undo_transforms(data: bytes, transforms, path, what: str, limit: int = OBJECT_BYTES) -> bytes:
    """An item's stored bytes with its (``check_transforms``-ed) zstd transforms undone, in reverse order, each to at
    most ``limit`` bytes: a 128 KiB frame of a 256-byte norm inflated to 4 GiB and ended mcore2hf in a MemoryError."""
    try:
        import zstandard
    except ImportError:
        raise UserError(f"{path}: {what} is zstd-compressed (torch's {ZSTD} extension): pip install zstandard "
                        "to read it") from None
    try:
        for _ in transforms:
            reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data))  # one frame, as torch writes it
            parts, size = [], 0
            while size <= limit and (part := reader.read(min(1 << 24, limit + 1 - size))):
                parts.append(part)
                size += len(part)
            if size > limit:
                raise UserError(f"{path}: {what} decompresses to more than {limit:,} bytes, more than it holds: the "
                                "checkpoint is damaged")
            data = b"".join(parts)
    except zstandard.ZstdError as exc:
        raise UserError(f"{path}: {what} does not decompress ({exc}): the checkpoint is damaged") from None
    return data


def _check_cover(key: str, offset: tuple, shape: tuple, boxes: list) -> None:
    """The boxes cover the block exactly once (torch refuses overlapping chunks when it saves, so
    overlaps or holes mean a damaged or forged .metadata)."""
    volume = math.prod(shape)
    got = sum(math.prod(s) for _, s in boxes)
    if len(shape) == 1:
        ordered = sorted(boxes)
        overlapping = any(a[0][0] + a[1][0] > b[0][0] for a, b in zip(ordered, ordered[1:]))
    else:
        overlapping = got > volume or any(_overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    if overlapping:
        raise UserError(f"the torch_dist checkpoint stores overlapping chunks of {key} (in the block at "
                        f"{list(offset)} of {list(shape)}): its .metadata is damaged")
    if got != volume:
        raise UserError(f"the torch_dist checkpoint stores only {got} of the {volume} elements of {key} in the block "
                        f"at {list(offset)} of {list(shape)}: it is incomplete or was not written for this model")

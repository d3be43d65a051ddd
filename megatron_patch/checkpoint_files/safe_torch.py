"""torch's and megatron-core's checkpoint loaders, fed only what the allow-list has read.

torch's ``FileSystemReader`` unpickles ``.metadata`` with plain ``pickle.load``, and its default load
planner reads every byte entry of a ``.distcp`` file (megatron's ``_extra_state``, other tools'
``common_state``) with ``torch.load(weights_only=False)``: a ``__reduce__`` payload in either runs.
Here every such pickle is read once into memory and parsed with the allow-list
(``checkpoint_files.allowlist``), and torch is handed the parsed object (the metadata) or bytes that
have passed it (a byte entry, loaded with ``weights_only=True``), never the file to read again.

``safe_dist_load`` is megatron-core's ``dist_checkpointing.load`` (0.16 or 0.19) with that reader and a
common-state loader that does the same for ``common.pt`` (and accepts its absence, as other tools and
megatron-core 0.19 write it).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import serialization as mcore_serialization
from megatron.core.dist_checkpointing.strategies import common as mcore_common
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta, TensorProperties

from megatron_patch.checkpoint_files.allowlist import ALLOWED, ENUM_BY_NAME, UnsafePickle, canonical, check, enum_by_name, refuse
from megatron_patch.checkpoint_files.pickles import loads as parse_inert
from megatron_patch.checkpoint_files.pickles import Record, record_class
from megatron_patch.checkpoint_files.torch_dist import (
    COMMON_STATE_OBJECT, DistMetadata, TensorInfo, check_chunk_record, check_metadata, check_transforms, chunk_bytes,
    metadata_files, undo_transforms)
from megatron_patch.dtypes import ITEMSIZE
from megatron_patch.checkpoint_files.zipfmt import ZipFormatError, ZipIndex
from megatron_patch.errors import UserError
from megatron_patch.input_files import read_input


class _AllowListUnpickler(pickle.Unpickler):
    """A pickle of real objects whose every global is on the allow-list. An allowed class this torch
    does not have (a newer torch's metadata record) is read as an inert record."""

    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str):
        if canonical(module, name) == ENUM_BY_NAME:
            return enum_by_name(self.where, Record)
        check(module, name, self.where)
        module, name = canonical(module, name)
        if (module, name) == ("torch.distributed.checkpoint.metadata", "TensorProperties"):
            return _TensorProperties
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return record_class(module, name)

    def persistent_load(self, pid):
        raise pickle.UnpicklingError(f"unexpected persistent record {pid!r:.60}")


class _TensorProperties(TensorProperties):
    """torch's TensorProperties, also from a newer torch's pickle: torch 2.14+ adds the tensor's strides as
    a sixth field, which older torch's ``__setstate__`` cannot unpack (the chunks' own archives carry
    their strides; the planner does not need them)."""

    def __setstate__(self, state):
        super().__setstate__(tuple(state)[:5] if isinstance(state, tuple) else state)
        self.__class__ = TensorProperties  # torch's own class from here on (pickled again, compared)


def read_dcp_metadata(path: str | Path):
    """A torch.distributed.checkpoint ``.metadata`` file as torch's ``Metadata``, read with the allow-list and
    held to the shapes a checkpoint can have (``torch_dist.check_metadata``, the torch-free reader's check)."""
    return _read_dcp_metadata(path)[0]


def _read_dcp_metadata(path: str | Path):
    """``read_dcp_metadata``, and the checked description of it (``torch_dist.DistMetadata``). Where the folder has
    no ``.metadata`` but rank-local ``__<rank>.metadata`` files (``dcp.save(use_collectives=False)``), all of them
    merged, as the torch-free reader merges them: torch's own reader would take one rank's alone."""
    path = Path(path)
    files = [path] if os.path.lexists(path) else metadata_files(path.parent)
    if not files:
        raise UserError(f"{path.parent} has no .metadata: it is not a complete torch_dist checkpoint")
    metadata = None
    for file in files:
        part = _unpickled_metadata(file)
        metadata = part if metadata is None else _merged(metadata, part, file)
    described = _described(metadata)
    check_metadata(described, path)
    return metadata, described


def _unpickled_metadata(path: Path):
    # a regular file inside its folder: a FIFO or a device at its name would stall or flood, a link out is not its own
    data = read_input(path, limit=None, inside=path.parent)
    try:
        return _AllowListUnpickler(data, str(path)).load()
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise UserError(f"{path} is unreadable ({type(exc).__name__}: {exc}): the checkpoint is damaged") from None


def _merged(metadata, part, where: Path):
    """``metadata`` with one more rank's ``part``: each tensor's chunks joined, its shape and dtype the same."""
    for key, entry in part.state_dict_metadata.items():
        have = metadata.state_dict_metadata.setdefault(key, entry)
        if have is entry:
            continue
        if isinstance(have, BytesStorageMetadata) and isinstance(entry, BytesStorageMetadata):
            continue
        if (isinstance(have, BytesStorageMetadata) or isinstance(entry, BytesStorageMetadata)
                or (tuple(have.size), have.properties.dtype) != (tuple(entry.size), entry.properties.dtype)):
            raise UserError(f"{where} gives {key} another shape or dtype than an earlier rank's metadata: "
                            "the checkpoint is damaged")
        known = {(tuple(c.offsets), tuple(c.sizes)) for c in have.chunks}
        have.chunks = list(have.chunks) + [c for c in entry.chunks if (tuple(c.offsets), tuple(c.sizes)) not in known]
    metadata.storage_data.update(part.storage_data or {})
    if isinstance(metadata.planner_data, dict) and isinstance(part.planner_data, dict):
        metadata.planner_data.update(part.planner_data)
    return metadata


def _described(metadata) -> DistMetadata:
    """torch's ``Metadata`` as the torch-free reader describes a ``.metadata`` (tensors, objects, storage)."""
    tensors, objects, storage = {}, set(), {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            objects.add(key)
            continue
        dtype = str(entry.properties.dtype).removeprefix("torch.")
        tensors[key] = TensorInfo(tuple(entry.size), dtype,
                                  tuple((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks))
    for index, info in (metadata.storage_data or {}).items():
        offset = None if index.offset is None else tuple(index.offset)
        storage[(index.fqn, offset)] = (info.relative_path, info.offset, info.length,
                                        tuple(getattr(info, "transform_descriptors", None) or ()))
    return DistMetadata(tensors, objects, storage)


def check_torch_save(data: bytes, where: str) -> None:
    """Check a torch.save archive held in memory: its zip structure and every record's CRC-32
    (``zipfmt.ZipIndex``), then its pickle with the allow-list (nothing built but inert records)."""
    try:
        index = ZipIndex(where, data=data)
        index.verify()
        if "data.pkl" not in index:
            raise UserError(f"{where}: no data.pkl record: not a torch.save archive, or a damaged one")
        pkl = index.read("data.pkl")
    except ZipFormatError as exc:
        raise UserError(f"{where} is not a readable torch.save archive ({exc}): it is truncated or corrupt "
                        "(torch's pre-1.6 format is not read)") from None
    try:
        parse_inert(pkl, where=where)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise UserError(f"{where}: cannot unpickle its contents ({exc}): the file may be corrupt") from None


def _torch_safe_globals() -> list:
    """The allow-list's entries this environment can import, for torch's weights_only unpickler."""
    found = []
    for module, name in sorted(ALLOWED):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


_SAFE_GLOBALS: list | None = None
_UNSUPPORTED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)\.(\w+)")


def load_torch_bytes(data: bytes, where: str) -> Any:
    """A torch.save archive held in memory: checked with the allow-list, then loaded by torch with
    ``weights_only=True`` (torch's own restricted unpickler, given the same allow-list)."""
    global _SAFE_GLOBALS
    check_torch_save(data, where)
    if _SAFE_GLOBALS is None:
        _SAFE_GLOBALS = _torch_safe_globals()
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _UNSUPPORTED_GLOBAL.search(str(exc))
        if found:
            raise refuse(found.group(1), found.group(2), where) from None
        raise UnsafePickle(f"{where}: refused by torch's restricted loader ({str(exc).splitlines()[0]})") from None


def load_torch_file(path: str | Path, inside: str | Path | None = None) -> Any:
    """A torch.save file (RNG state, common.pt, another tool's train state), read once, allow-listed; only a
    regular file is read (a FIFO or a device planted at its name would stall or flood the reader), inside the
    checkpoint folder ``inside`` (default: its own folder; a link out of it is refused, not read)."""
    path = Path(path)
    return load_torch_bytes(read_input(path, limit=None, inside=path.parent if inside is None else inside), str(path))


class _SafeBytesPlanner:
    """A load planner whose byte entries are allow-listed before the real planner sees them."""

    def __init__(self, planner, where: str):
        self._planner = planner
        self._where = where

    def __getattr__(self, name):
        return getattr(self._planner, name)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = load_torch_bytes(value.read(), f"{self._where} ({read_item.dest_index.fqn})")
        # The planner torch.loads what it is given: give it a fresh archive of the vetted object.
        vetted = io.BytesIO()
        torch.save(obj, vetted)
        vetted.seek(0)
        self._planner.load_bytes(read_item, vetted)


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` with ``.metadata`` and the byte entries read through the allow-list.
    Tensor entries are torch.load-ed by torch itself with ``weights_only=True``."""

    def __init__(self, path: str | Path, *args, **kwargs):
        super().__init__(str(path), *args, **kwargs)
        # Read now, not inside torch's load steps, which would bury a refusal in a CheckpointException;
        # held to the torch-free reader's checks (torch_dist.metadata_problem, check_transforms).
        where = Path(self.path) / ".metadata"
        self._safe_metadata, described = _read_dcp_metadata(where)
        if getattr(self._safe_metadata, "storage_meta", None) is None:
            self._safe_metadata.storage_meta = StorageMeta()
        self._safe_metadata.storage_meta.load_id = self.load_id
        # What each tensor chunk's record must hold, by where it is stored (no two entries share bytes:
        # metadata_problem refuses that, so the place names one chunk).
        self._declared: dict[tuple, tuple[str, str, tuple]] = {}
        for index, info in (self._safe_metadata.storage_data or {}).items():
            transforms = tuple(getattr(info, "transform_descriptors", None) or ())
            offset = None if index.offset is None else tuple(index.offset)
            what = f"{index.fqn}" if offset is None else f"{index.fqn} at {offset}"
            check_transforms(Path(self.path) / str(info.relative_path), transforms, what)
            tensor = described.tensors.get(index.fqn)
            if tensor is not None and offset is not None:
                sizes = dict(tensor.chunks).get(offset)
                if sizes is not None:
                    place = (str(info.relative_path), info.offset, info.length)
                    self._declared[place] = (f"chunk of {index.fqn} at {list(offset)}", tensor.dtype, sizes)

    def read_metadata(self, *args, **kwargs):
        return self._safe_metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, _SafeBytesPlanner(planner, str(self.path)))

    def _slice_file(self, file, sinfo):
        """Each stored item read once into memory; a tensor chunk's archive is checked (zip structure and
        CRC-32s, and its record against the chunk's declared dtype and shape: ``torch_dist.check_chunk_record``,
        the torch-free reader's check) before torch loads it from those bytes."""
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        transforms = tuple(getattr(sinfo, "transform_descriptors", None) or ())
        declared = self._declared.get((str(sinfo.relative_path), sinfo.offset, sinfo.length))
        where = f"{Path(self.path) / sinfo.relative_path} (the archive at byte {sinfo.offset})"
        if declared is not None:  # a tensor chunk: its record holds what .metadata declares, as mcore2hf checks
            what, dtype, sizes = declared
            if len(data) < sinfo.length:
                raise UserError(f"{where} ends {sinfo.length - len(data)} bytes early: the checkpoint is truncated")
            archive = undo_transforms(data, transforms, Path(self.path) / sinfo.relative_path, what,
                                      chunk_bytes(sizes, dtype)) if transforms else data
            try:
                index = ZipIndex(where, data=archive)
                index.verify()
                if "data.pkl" not in index:
                    raise ZipFormatError("no data.pkl record")
                pkl = index.read("data.pkl")
            except ZipFormatError as exc:
                raise UserError(f"{where} is corrupt ({exc})") from None
            try:
                ref = parse_inert(pkl, where=where)
            except UserError:
                raise
            except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
                raise UserError(f"{where}: cannot unpickle its contents ({exc}): the checkpoint is damaged") from None
            check_chunk_record(ref, dtype, sizes, f"{Path(str(sinfo.relative_path)).name}: {what}")
            try:
                _, length = index.locate(f"data/{ref.storage.key}")
            except ZipFormatError as exc:
                raise UserError(f"{where}: cannot read tensor storage {ref.storage.key} ({exc}): "
                                "the checkpoint is damaged") from None
            if length != ref.storage.numel * ITEMSIZE.get(ref.storage.dtype, 0):
                raise UserError(f"{where}: record data/{ref.storage.key} holds {length} bytes, the pickle says "
                                f"{ref.storage.numel} x {ref.storage.dtype}: the checkpoint is damaged")
        elif not transforms and data[:4] == b"PK\x03\x04":
            try:
                ZipIndex(where, data=data).verify()
            except ZipFormatError as exc:
                raise UserError(f"{where} is corrupt ({exc})") from None
        return io.BytesIO(data)


# How torch's and megatron-core's load planners say that the model asks for what the checkpoint lacks.
_MISSING = (re.compile(r"^(?P<key>\S+) from model not in state dict:"),             # megatron-core
            re.compile(r"^Missing key in checkpoint state_dict: (?P<key>.+)\.$"))   # torch's default planner
_SHAPE = re.compile(r"^Global shape mismatch for loaded \((?P<loaded>.*)\) and expected \((?P<expected>.*)\) "
                    r"tensor for key (?P<key>\S+)$")


def _raise_refusal(exc: CheckpointException, folder=None) -> None:
    """torch reports a rank's failure inside a CheckpointException: a refusal is raised as itself, and a
    tensor the model asks for that the checkpoint lacks (or holds at another shape) in one line naming it."""
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, UserError):  # a refused pickle, a corrupt archive
            raise inner from None
    where = f" in {folder}" if folder is not None else ""
    for failure in exc.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        text = str(inner.args[0]) if isinstance(inner, Exception) and inner.args else ""
        for pattern in _MISSING:
            found = pattern.match(text)
            if found:
                raise UserError(f"the torch_dist checkpoint{where} has no tensor '{found['key'][:200]}': "
                                "it was not written for this model") from None
        found = _SHAPE.match(text)
        if found:
            loaded, expected = (tuple(int(n) for n in re.findall(r"\d+", found[g])[:40]) for g in ("loaded", "expected"))
            raise UserError(f"torch_dist tensor '{found['key'][:200]}'{where} has shape {loaded}, "
                            f"which does not fit the model (it needs {expected})") from None


def load_refusing(state_dict: dict, reader: SafeFileSystemReader, planner=None) -> None:
    """torch's ``dcp.load`` (no process group) through the safe reader; a refusal is raised as itself."""
    try:
        dcp.load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as exc:
        _raise_refusal(exc, reader.path)
        raise


def _safe_reader(checkpoint_dir, *args, **kwargs) -> SafeFileSystemReader:
    return SafeFileSystemReader(checkpoint_dir)


def load_common_state(checkpoint_dir) -> dict:
    """megatron's common state, wherever its writer kept it: ``common.pt`` (megatron-core 0.16, this
    project's converter), the ``common_state`` object inside the .distcp data (0.19, Megatron-Bridge),
    or nowhere (an empty state), each read through the allow-list."""
    if (Path(checkpoint_dir) / "common.pt").is_file():
        return load_torch_file(Path(checkpoint_dir) / "common.pt")
    reader = SafeFileSystemReader(checkpoint_dir)
    key = COMMON_STATE_OBJECT
    if key not in reader.read_metadata().state_dict_metadata:
        return {}
    state = {key: io.BytesIO()}
    load_refusing(state, reader)
    loaded = state[key]
    if isinstance(loaded, io.BytesIO):
        loaded = load_torch_bytes(loaded.getvalue(), f"{checkpoint_dir} ({key})")
    return loaded[0] if isinstance(loaded, (list, tuple)) else loaded


# Where megatron-core makes its readers and reads its common state: module-level names its load paths
# call, with no hook. 0.16 takes a common-state strategy as an argument instead (below).
_PATCHES = ((mcore_torch, "_get_filesystem_reader", _safe_reader),
            (mcore_serialization, "_get_filesystem_reader", _safe_reader),
            (mcore_serialization, "load_common_state_dict", load_common_state))


@contextlib.contextmanager
def _megatron_reads_safely():
    """Point megatron-core's readers at the safe ones for the duration of a load."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in _PATCHES if hasattr(module, name)]
    for module, name, safe in _PATCHES:
        if hasattr(module, name):
            setattr(module, name, safe)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _common_strategy_argument() -> dict:
    """megatron-core 0.16's load takes the common-state loader as an argument."""
    base = getattr(mcore_common, "TorchCommonLoadStrategy", None)
    if base is None:
        return {}

    class SafeCommonLoadStrategy(base):
        def load_common(self, checkpoint_dir):  # a 0.19 checkpoint's common_state object too
            return load_common_state(checkpoint_dir)

    return {"common_strategy": SafeCommonLoadStrategy()}


def safe_dist_load(sharded_state_dict: dict, folder: str | Path, **kwargs) -> dict:
    """megatron-core's ``dist_checkpointing.load``, reading every pickle through the allow-list."""
    try:
        with _megatron_reads_safely():
            return dist_checkpointing.load(sharded_state_dict, str(folder), **_common_strategy_argument(), **kwargs)
    except CheckpointException as exc:
        _raise_refusal(exc, folder)
        raise
    except ValueError as exc:  # megatron-core's merge of the saved common state into the one asked for
        if not str(exc).startswith(_MERGE_FAILURES):
            raise
        raise UserError(f"{folder} holds a state of another structure than the one this launch's model and optimizer "
                        f"read ({' '.join(str(exc).split())[:200]}): the checkpoint is damaged") from None


_MERGE_FAILURES = ("Cannot merge two lists with different lengths", "Duplicate non-dict and non-list values")

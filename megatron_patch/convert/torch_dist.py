"""The torch_dist format (megatron-core ``dist_checkpointing``) written and read one chunk at a time.

A torch_dist checkpoint is a PyTorch distributed checkpoint (``.metadata`` + ``*.distcp`` files)
of global tensors, plus megatron's ``metadata.json`` and ``common.pt``. The write path goes through
torch's own save planner, so ``.metadata`` is exactly what ``torch.distributed.checkpoint`` builds,
but with a storage writer that asks for each chunk only when it is about to be written and drops it
right after (torch's own writer keeps every tensor of a file alive until the file is finished).
The read path asks for blocks of global tensors (one layer of one parameter at a time).
"""

from __future__ import annotations

import io
import json
import warnings
from torch.futures import Future
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import (
    LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from megatron_patch.convert.torch_files import LazyTensor, LazyTorchFile
from megatron_patch.errors import UserError

# What megatron-core's dist_checkpointing.save writes next to the torch files.
MEGATRON_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}
# A new .distcp file is started after this many bytes, to keep files a manageable size.
FILE_BYTES = 2 * 2**30


def tensor_item(key: str, global_shape, offset, local_shape, dtype: torch.dtype) -> WriteItem:
    return WriteItem(index=MetadataIndex(key, torch.Size(offset)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offset), torch.Size(local_shape)),
                                                 properties=TensorProperties(dtype=dtype), size=torch.Size(global_shape)))


def bytes_item(key: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)


class _PlannedSave(DefaultSavePlanner):
    """A save planner whose plan is given (no state dict) and whose data is produced on demand."""

    def __init__(self, items: list[WriteItem], resolve: Callable[[WriteItem], torch.Tensor | io.BytesIO]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items, self._resolve = items, resolve

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        super().set_up_planner({}, storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(list(self._items))
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return self._resolve(write_item)


class _StreamingWriter(dcp.FileSystemWriter):
    """Writes items in plan order, one at a time, never holding more than the item in hand."""

    def __init__(self, path, order: dict, on_item: Callable[[WriteItem, int], None] | None = None):
        super().__init__(path, single_file_per_rank=True, sync_files=False, thread_count=1)
        self._order, self._on_item = order, on_item

    def write_data(self, plan: SavePlan, planner) -> Future:
        prefix = plan.storage_data.prefix
        items = sorted(plan.items, key=lambda it: self._order[(it.index.fqn, tuple(it.index.offset or ()))])
        results, file_index, stream, written = [], -1, None, FILE_BYTES
        try:
            for item in items:
                if written >= FILE_BYTES:
                    if stream is not None:
                        stream.close()
                    file_index += 1
                    name = f"{prefix}{file_index}.distcp"
                    stream = open(Path(self.path) / name, "wb")
                    written = 0
                offset = stream.tell()
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    stream.write(data.getbuffer())
                else:
                    data = data.detach().cpu().contiguous()
                    if data.storage_offset() or data.untyped_storage().nbytes() != data.nbytes:
                        data = data.clone()  # torch.save writes whole storages
                    torch.save(data, stream)
                length = stream.tell() - offset
                written += length
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
                if self._on_item is not None:
                    self._on_item(item, length)
                del data
        finally:
            if stream is not None:
                stream.close()
        future: Future = Future()
        future.set_result(results)
        return future


def write_torch_dist(folder: str | Path, items: list[WriteItem],
                     resolve: Callable[[WriteItem], torch.Tensor | io.BytesIO],
                     on_item: Callable[[WriteItem, int], None] | None = None) -> None:
    """Write a megatron torch_dist checkpoint holding ``items`` (in this order) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    order = {(it.index.fqn, tuple(it.index.offset or ())): i for i, it in enumerate(items)}
    from torch.utils.serialization import config

    crc, config.save.compute_crc32 = config.save.compute_crc32, False  # as in StreamingTorchSave
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to")
            dcp.save({}, storage_writer=_StreamingWriter(folder, order, on_item), planner=_PlannedSave(items, resolve),
                     no_dist=True)
    except CheckpointException as exc:
        # torch wraps whatever the writer raised; a UserError from reading the HF side passes through.
        inner = [v[0] if isinstance(v, tuple) else v for v in getattr(exc, "failures", {}).values()]
        if inner and isinstance(inner[0], UserError):
            raise inner[0]
        raise UserError(f"cannot write the torch_dist checkpoint in {folder} ({_cause(exc)})")
    finally:
        config.save.compute_crc32 = crc
    torch.save({}, folder / "common.pt")
    (folder / "metadata.json").write_text(json.dumps(MEGATRON_CONFIG))


def _same(a, b) -> bool:
    return tuple(a) == tuple(b)


def _cause(exc: BaseException) -> str:
    """The innermost error's message, first sentence only (torch's messages run to paragraphs)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else type(exc).__name__
    return last.split(". ")[0]


class _ChunkLoad(DefaultLoadPlanner):
    """Loads the given blocks of global tensors into the given target tensors."""

    def __init__(self, requests: list[tuple[str, tuple[int, ...], torch.Tensor]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._requests = requests
        self._targets: dict = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        super().set_up_planner({}, metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, offset, target in self._requests:
            md = self.metadata.state_dict_metadata.get(key)
            if md is None or isinstance(md, BytesStorageMetadata):
                raise UserError(f"the torch_dist checkpoint has no tensor '{key}': it was not written for this model")
            end = [o + s for o, s in zip(offset, target.shape)]
            if len(md.size) != len(offset) or any(e > s for e, s in zip(end, md.size)):
                raise UserError(f"torch_dist tensor '{key}' has shape {tuple(md.size)}, which does not fit the model "
                                f"(needs a block at {offset} of {tuple(target.shape)})")
            self._targets[(key, tuple(offset))] = target
            items += create_read_items_for_chunk_list(
                key, md, [ChunkStorageMetadata(torch.Size(offset), target.size())])
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        target = self._targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item, tensor) -> None:
        pass


class _CachedReader(dcp.FileSystemReader):
    """Reads ``.metadata`` once for the many small loads of a conversion."""

    _metadata = None

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class TorchDistReader:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not (self.folder / ".metadata").exists():
            raise UserError(f"{self.folder} has no .metadata: it is not a complete torch_dist checkpoint")
        try:
            self._reader = _CachedReader(self.folder)
            self.metadata = self._reader.read_metadata()
        except Exception as exc:  # noqa: BLE001 - any unpickling failure means a damaged file
            raise UserError(f"{self.folder / '.metadata'} is unreadable ({exc}): the checkpoint is damaged")

    def keys(self) -> set[str]:
        return set(self.metadata.state_dict_metadata)

    def tensor_keys(self) -> set[str]:
        return {k for k, v in self.metadata.state_dict_metadata.items() if not isinstance(v, BytesStorageMetadata)}

    def global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.metadata.state_dict_metadata[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.metadata.state_dict_metadata[key].properties.dtype

    def _read_stored_chunk(self, key: str, offset: tuple[int, ...], target: torch.Tensor) -> bool:
        """Fast path: the block asked for is exactly one stored chunk, kept as a plain torch.save record.

        Its bytes are read straight into ``target`` (one copy, GIL released), where torch's reader
        reads the record into a buffer, unpickles a tensor from it and then copies that into the
        target. Anything else (other chunking, transforms, another dtype) goes through torch's reader.
        """
        md = self.metadata.state_dict_metadata.get(key)
        if md is None or isinstance(md, BytesStorageMetadata) or md.properties.dtype != target.dtype:
            return False
        if not any(_same(c.offsets, offset) and _same(c.sizes, target.shape) for c in md.chunks):
            return False
        info = (self.metadata.storage_data or {}).get(MetadataIndex(key, torch.Size(offset)))
        if info is None or getattr(info, "transform_descriptors", None):
            return False
        blob = LazyTorchFile(self.folder / info.relative_path, window=(info.offset, info.length))
        return isinstance(blob.obj, LazyTensor) and blob.read_into(blob.obj, target)

    def load(self, requests: Iterable[tuple[str, tuple[int, ...], torch.Tensor]]) -> None:
        """Fill each target tensor with the block of ``key`` that starts at ``offset``."""
        requests = [r for r in requests if not self._read_stored_chunk(*r)]
        if not requests:
            return
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*assuming the intent is to")
                dcp.load({}, storage_reader=self._reader, planner=_ChunkLoad(requests), no_dist=True)
        except UserError:
            raise
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - torch reports damaged files in many ways
            raise UserError(f"cannot read {requests[0][0]} from {self.folder} ({_cause(exc)}): "
                            "the checkpoint may be truncated or corrupt")

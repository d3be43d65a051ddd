"""The torch_dist reader assembles any block from whatever was stored (newer writers included), and
checkpoint files carry and are checked against their zip CRC-32s: a flipped byte in data or headers is
refused in one line naming the file, with exit status 2."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import pickle
import re
import shutil
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from megatron_patch.checkpoint_files import zipfmt
from megatron_patch.checkpoint_files.byte_io import Stored
from megatron_patch.checkpoint_files.byte_io import create_file
from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME
from megatron_patch.checkpoint_files.safe_torch import (
    SafeFileSystemReader, load_refusing, load_torch_bytes, read_dcp_metadata)
from megatron_patch.checkpoint_files.torch_dist import ChunkItem, TorchDistReader, plan_torch_dist
from megatron_patch.checkpoint_files.torch_files import LazyTorchFile, TensorSpec, plan_torch_save
from megatron_patch.cli import main
from megatron_patch.convert.bytemap import box_tiles
from megatron_patch.errors import UserError
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from tests.convert_helpers import write_torch_dist_chunks

FIXTURE = Path(__file__).parent / "fixtures" / "torch215_tp2pp2"


def _one_line_exit_2(capsys, argv: list[str], *words: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(w in err for w in words), err
    return err


def _same_bytes(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return sorted(x) == sorted(y) and all(torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8)) for k in x)


def _export(capsys, src: Path, out: Path, *extra: str) -> None:
    assert main(["convert", "mcore2hf", "--load-dir", str(src), "--save-dir", str(out), "--quiet", *extra]) == 0, \
        capsys.readouterr().err


# --- a newer writer: torch 2.15's dcp.save at TP=2 PP=2 ------------------------------------------

def test_torch215_fixture_is_what_the_script_says():
    versions = json.loads((FIXTURE / "VERSIONS.json").read_text())
    assert versions["written_by"]["torch"].startswith("2.15") and versions["written_by"]["writer"].endswith("save")
    reader = TorchDistReader(FIXTURE / "iter_0000001")
    qkv = reader.tensors["decoder.layers.self_attention.linear_qkv.weight"]
    assert len(qkv.chunks) == 4 and len({f for f, *_ in reader.storage.values()}) == 4  # 2 layers x TP=2, 4 ranks
    assert not (FIXTURE / "iter_0000001" / "common.pt").exists() and reader.common_state()["iteration"] == 1
    raw = read_dcp_metadata(FIXTURE / "iter_0000001" / ".metadata")  # torch 2.15's records, read by this torch
    assert hasattr(raw, "all_local_plans") and len(raw.all_local_plans) == 4


def test_torch215_fixture_exports_bit_exactly_without_torchs_reader(tmp_path, capsys, monkeypatch):
    def refuse(*_a, **_k):
        raise AssertionError("torch's checkpoint reader was used")

    monkeypatch.setattr(dcp.FileSystemReader, "read_metadata", refuse)
    monkeypatch.setattr(dcp.FileSystemReader, "read_data", refuse)
    _export(capsys, FIXTURE, tmp_path / "hf", "--hf-config", str(FIXTURE / "hf" / "config.json"))
    assert _same_bytes(tmp_path / "hf", FIXTURE / "hf")


def test_torch215_fixtures_distributed_optimizer_buckets_assemble():
    """dp_reshardable: each rank's parameters flattened into one 1-D bucket per moment, a chunk per
    parameter; exp_avg = w / 2 and exp_avg_sq = w^2, so exp_avg_sq = 4 exp_avg^2 element for element,
    and the buckets together hold every weight element once."""
    reader = TorchDistReader(FIXTURE / "iter_0000001")
    weights = sum(reader.read_block(k).double().sum().item() for k in reader.tensor_keys() if not k.startswith("optimizer."))
    total = 0.0
    for key in sorted(k for k in reader.tensor_keys() if k.endswith(".exp_avg")):
        avg, sq = reader.read_block(key), reader.read_block(key + "_sq")
        assert len(reader.tensors[key].chunks) > 5 and avg.dim() == 1
        assert torch.equal(sq, 4 * avg * avg)
        total += avg.double().sum().item()
    assert math.isclose(total, weights / 2, rel_tol=1e-9)


@pytest.mark.slow
def test_torch215_fixture_aligns(tmp_path, capsys):
    rc = main(["align", "--hf-dir", str(FIXTURE / "hf"), "--mcore-dir", str(FIXTURE), "--report-dir", str(tmp_path / "r")])
    out = capsys.readouterr().out
    assert rc == 0 and "ALIGNED" in out, out[-2000:]


def _split_into_rank_local_metadata(folder: Path) -> None:
    """The fixture's iteration as dcp.save(use_collectives=False) writes it: one __<rank>.metadata per rank."""
    md = read_dcp_metadata(folder / ".metadata")
    (folder / ".metadata").unlink()
    for rank in range(4):
        part = type(md)(state_dict_metadata={}, storage_data={}, planner_data=None, storage_meta=md.storage_meta)
        for index, info in md.storage_data.items():
            if info.relative_path == f"__{rank}_0.distcp":
                part.storage_data[index] = info
                entry = md.state_dict_metadata[index.fqn]
                if hasattr(entry, "chunks"):
                    have = part.state_dict_metadata.setdefault(
                        index.fqn, type(entry)(properties=entry.properties, size=entry.size, chunks=[]))
                    have.chunks += [c for c in entry.chunks if tuple(c.offsets) == tuple(index.offset)]
                else:
                    part.state_dict_metadata[index.fqn] = entry
        (folder / f"__{rank}.metadata").write_bytes(pickle.dumps(part))


def test_rank_local_metadata_without_a_global_file(tmp_path, capsys):
    """dcp.save(use_collectives=False) writes __<rank>.metadata files and no .metadata: read merged."""
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    _split_into_rank_local_metadata(tmp_path / "ckpt" / "iter_0000001")
    _export(capsys, tmp_path / "ckpt", tmp_path / "hf", "--hf-config", str(FIXTURE / "hf" / "config.json"))
    assert _same_bytes(tmp_path / "hf", FIXTURE / "hf")


def test_torchs_loader_is_given_every_ranks_metadata_merged(tmp_path):
    """The reader megatron-core's load runs (training's resume, align, parity) read ".metadata" alone: a checkpoint
    with only rank-local files was "iter_0000001/.metadata not found" in mpatch align. It is given all of them merged,
    as the torch-free reader merges them, and ranks that disagree on a tensor's shape are refused in one line."""
    def described(md):
        return md.storage_data, {key: (tuple(entry.size), entry.properties.dtype,
                                       {(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks})
                                 if hasattr(entry, "chunks") else "bytes"
                                 for key, entry in md.state_dict_metadata.items()}

    whole = described(read_dcp_metadata(FIXTURE / "iter_0000001" / ".metadata"))
    folder = tmp_path / "ckpt" / "iter_0000001"
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    _split_into_rank_local_metadata(folder)
    assert described(SafeFileSystemReader(folder).read_metadata()) == whole

    part = pickle.loads((folder / "__1.metadata").read_bytes())
    key, entry = next((k, e) for k, e in part.state_dict_metadata.items() if hasattr(e, "chunks"))
    entry.size = torch.Size([n + 1 for n in entry.size])
    (folder / "__1.metadata").write_bytes(pickle.dumps(part))
    with pytest.raises(UserError, match=f"__1.metadata gives {re.escape(key)} another shape or dtype"):
        SafeFileSystemReader(folder)


# --- transforms: zstd decoded, anything else refused ----------------------------------------------

def test_zstd_chunks_are_decoded_and_unknown_transforms_refused(tmp_path, capsys):
    from torch.distributed.checkpoint._extension import ZStandard

    tensors = {"a": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.randn(3, 5).to(torch.bfloat16)}
    writer = dcp.FileSystemWriter(str(tmp_path / "z"), _extensions=[ZStandard()])
    dcp.save(tensors, storage_writer=writer, no_dist=True)
    reader = TorchDistReader(tmp_path / "z")
    assert all(d for *_, d in reader.storage.values())
    for key, t in tensors.items():
        assert torch.equal(reader.read_block(key), t)
        assert torch.equal(reader.read_block(key, (1, 2), (2, 3)), t[1:3, 2:5])
    md = pickle.loads((tmp_path / "z" / ".metadata").read_bytes())  # written just now: trusted here
    for info in md.storage_data.values():
        info.transform_descriptors = ["stream.evil/1"]
    (tmp_path / "z" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UserError, match=r"transform 'stream.evil/1', which this reader does not decode"):
        TorchDistReader(tmp_path / "z").read_block("a")


def test_a_zstd_frame_is_decompressed_only_to_what_its_chunk_can_hold(tmp_path):
    """A 128 KiB zstd frame stored for a 256-byte norm inflated to 4 GiB, and mcore2hf ended in a MemoryError (the
    sec audit): an item is decompressed to at most what its chunk holds (its elements and an archive's overhead;
    a byte object to OBJECT_BYTES), and refused past it."""
    import zstandard

    from megatron_patch.checkpoint_files.torch_dist import ARCHIVE_OVERHEAD, chunk_bytes, undo_transforms

    bomb = zstandard.ZstdCompressor().compress(bytes(8 << 20))  # 8 MiB of zeros in a few hundred bytes
    assert len(bomb) < 4096
    limit = chunk_bytes((64,), "float32")
    assert limit == 256 + ARCHIVE_OVERHEAD
    with pytest.raises(UserError, match=f"decompresses to more than {limit:,} bytes, more than it holds"):
        undo_transforms(bomb, ["stream.zstd/1"], tmp_path / "__0_0.distcp", "a norm", limit)
    assert undo_transforms(bomb, ["stream.zstd/1"], tmp_path / "__0_0.distcp", "a big chunk", 8 << 20) == bytes(8 << 20)


# --- blocks from odd chunkings -----------------------------------------------------------------

def _write_chunked(folder: Path, tensors: dict[str, torch.Tensor], cuts: dict[str, list[list[int]]]) -> None:
    """A torch_dist checkpoint (this project's writer) storing each tensor as the grid of boxes its cut
    points give per dim."""
    items, values = [], {}
    for key, t in tensors.items():
        import itertools

        edges = [[0, *c, n] for c, n in zip(cuts[key], t.shape)]
        for box in itertools.product(*(list(zip(e, e[1:])) for e in edges)):
            offset, size = tuple(a for a, _ in box), tuple(b - a for a, b in box)
            items.append(ChunkItem(key, tuple(t.shape), offset, size, str(t.dtype)[6:]))
            values[(key, offset)] = t[tuple(slice(a, b) for a, b in box)]
    write_torch_dist_chunks(folder, items, [], values)


@st.composite
def _chunked(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    cuts = [sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1))) if n > 1 else [] for n in shape]
    start = tuple(draw(st.integers(0, n - 1)) for n in shape)
    size = tuple(draw(st.integers(1, n - s)) for n, s in zip(shape, start))
    return shape, cuts, start, size


@settings(max_examples=40, deadline=None, derandomize=True)
@given(_chunked())
def test_any_block_from_any_chunking(tmp_path_factory, case):
    shape, cuts, start, size = case
    folder = tmp_path_factory.mktemp("chunked")
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    _write_chunked(folder, {"t": t}, {"t": cuts})
    got = TorchDistReader(folder).read_block("t", start, size)
    assert torch.equal(got, t[tuple(slice(a, a + b) for a, b in zip(start, size))])


@settings(max_examples=80, deadline=None, derandomize=True)
@given(st.data())
def test_box_tiles_address_the_same_elements(data):
    """The tiles of a box, read through their 2-D views, are exactly the box of the tensor: whatever the
    chunk around it (leading layer axes, larger in every dim)."""
    ndim = data.draw(st.integers(0, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    start = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    size = tuple(data.draw(st.integers(1, n - s)) for n, s in zip(shape, start))
    lead = data.draw(st.integers(0, 2))
    before = tuple(data.draw(st.integers(0, 2)) for _ in range(ndim))
    chunk = tuple(data.draw(st.integers(1, 3)) for _ in range(lead)) + \
        tuple(b + s + data.draw(st.integers(0, 2)) for b, s in zip(before, size))
    lead_at = tuple(data.draw(st.integers(0, c - 1)) for c in chunk[:lead])
    src_mem = np.arange(math.prod(chunk), dtype=np.int64).reshape(chunk) if chunk else np.array(7)
    box = src_mem[lead_at + tuple(slice(b, b + s) for b, s in zip(before, size))]
    want = np.full(shape, -1, dtype=np.int64)
    want[tuple(slice(a, a + s) for a, s in zip(start, size))] = box
    src = Stored("src", 0, chunk, "int64")
    tiles = box_tiles(shape, start, (1,) * lead + size, src, lead_at + before)
    got = np.full(shape, -1, dtype=np.int64).reshape(shape[0] if shape else 1, -1)
    flat = src_mem.reshape(-1)
    for r0, r1, c0, c1, where, wr, wc in tiles:
        base = where.offset // 8
        view = flat[base:base + where.rows * where.cols].reshape(where.rows, where.cols)
        got[r0:r1, c0:c1] = view[wr:wr + r1 - r0, wc:wc + c1 - c0]
    assert np.array_equal(got.reshape(shape), want)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return make_tiny_hf_checkpoint("llama3_1", tmp_path_factory.mktemp("hf") / "hf", seed=3)


def test_mcore2hf_from_whole_stacked_chunks_and_odd_cuts(hf, tmp_path, capsys):
    """Every tensor stored as one chunk holding all layers (part of one chunk per layer), or cut at odd
    places in every dim (a layer spread over several chunks): the export is bit-exact, through byte moves."""
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "td"), "--format", "torch_dist",
                 "--quiet"]) == 0
    # Rewritten below as another tool would write it, so without this project's manifest.
    (tmp_path / "td" / MANIFEST_NAME).unlink()
    release = tmp_path / "td" / "release"
    reader = TorchDistReader(release)
    full = reader.read_all()
    objects = [(k, open(release / reader.storage[(k, None)][0], "rb").read()[
        reader.storage[(k, None)][1]:reader.storage[(k, None)][1] + reader.storage[(k, None)][2]]) for k in sorted(reader.objects)]
    for name, cut in (("whole", lambda t: [[] for _ in t.shape]),
                      ("odd", lambda t: [[1] if n > 1 else [] for n in t.shape[:1]] + [[n // 3] if n > 2 else [] for n in t.shape[1:]])):
        shutil.rmtree(release)
        _write_chunked(release, full, {k: cut(t) for k, t in full.items()})
        if objects:
            md = TorchDistReader(release)
            assert md.tensor_keys() == set(full)
        from megatron_patch.convert.checkpoint import mcore_to_hf
        from megatron_patch.convert.copier import Copier

        copier = Copier(2)
        mcore_to_hf(tmp_path / "td", tmp_path / f"hf-{name}", progress=False, copier=copier)
        assert copier.stats.called_bytes == 0
        assert _same_bytes(tmp_path / f"hf-{name}", hf), name


def test_overlapping_or_missing_chunks_are_refused(tmp_path):
    items = [ChunkItem("t", (3, 4), (0, 0), (2, 4), "float32"), ChunkItem("t", (3, 4), (1, 0), (2, 4), "float32")]
    plan = plan_torch_dist(tmp_path / "o", items, [])
    plan.create_files()
    plan.finish()
    with pytest.raises(UserError, match="overlapping chunks of t"):
        TorchDistReader(tmp_path / "o").read_block("t")
    plan = plan_torch_dist(tmp_path / "m", items[:1], [])
    plan.create_files()
    plan.finish()
    # A hole is refused as soon as .metadata is read, by every reader (torch's own load would leave it unfilled).
    with pytest.raises(UserError, match="tensor t claims the shape \\[3, 4\\], but its chunks hold 8 of its 12 elements"):
        TorchDistReader(tmp_path / "m")



def _two_chunk_checkpoint(folder: Path, edit) -> Path:
    """``t`` [4, 4] float32 as two [2, 4] chunks (written here), ``.metadata`` then edited by ``edit(metadata)`` as a
    forger would (with torch's own classes)."""
    items = [ChunkItem("t", (4, 4), (0, 0), (2, 4), "float32"), ChunkItem("t", (4, 4), (2, 0), (2, 4), "float32")]
    plan = plan_torch_dist(folder, items, [])
    plan.create_files()
    plan.finish()
    md = pickle.loads((folder / ".metadata").read_bytes())
    edit(md)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    return folder


def _index(md, offset):
    return next(k for k in md.storage_data if k.fqn == "t" and list(k.offset) == offset)


def _overlap_own_bytes(md):
    """A third chunk over both, with a storage entry of its own (bytes no other entry names)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md.state_dict_metadata["t"].chunks.append(ChunkStorageMetadata(offsets=torch.Size([1, 0]), sizes=torch.Size([2, 4])))
    first = md.storage_data[_index(md, [0, 0])]
    md.storage_data[MetadataIndex("t", torch.Size([1, 0]), 2)] = dataclasses.replace(first, offset=first.offset + 10**6)


def _duplicate(md):
    md.state_dict_metadata["t"].chunks.append(md.state_dict_metadata["t"].chunks[0])


def _pointed_at_another_record(md):
    md.storage_data[_index(md, [2, 0])] = md.storage_data[_index(md, [0, 0])]


def _without_storage(md):
    del md.storage_data[_index(md, [2, 0])]


def _declared_float16(md):
    md.state_dict_metadata["t"].properties.dtype = torch.float16


def _unknown_transform(md):
    index = _index(md, [2, 0])
    md.storage_data[index] = dataclasses.replace(md.storage_data[index], transform_descriptors=["evil/1"])


@pytest.mark.parametrize("edit, words", [
    (_overlap_own_bytes, "stores overlapping chunks of t (at [0, 0] of [2, 4] and at [1, 0] of [2, 4])"),
    (_duplicate, "stores overlapping chunks of t (at [0, 0] of [2, 4] and at [0, 0] of [2, 4])"),
    (_pointed_at_another_record, "the records of t at [0, 0] and t at [2, 0] share bytes of __0_0.distcp"),
    (_without_storage, "lists a chunk of t at [2, 0] but not where it is stored"),
    (_declared_float16, "chunk of t at [0, 0] holds a float32 tensor of shape [2, 4] where .metadata says float16"),
    (_unknown_transform, "is stored with the transform 'evil/1', which this reader does not decode"),
], ids=["overlap", "duplicate", "alias", "no storage entry", "dtype", "transform"])
def test_every_reader_refuses_a_forged_metadata_alike(tmp_path, edit, words):
    """The torch-free reader (mcore2hf, inspect) and SafeFileSystemReader (align --mcore-dir,
    PRETRAIN_CHECKPOINT_PATH, resume) refuse the same forged .metadata in the same words, before torch reads a
    byte; the torch-based path loaded the overlap, the alias and the dtype edit and trained on them."""
    folder = _two_chunk_checkpoint(tmp_path / "ck", edit)
    with pytest.raises(UserError) as torch_free:
        TorchDistReader(folder).read_block("t")
    with pytest.raises(UserError) as safe:
        load_refusing({"t": torch.zeros(4, 4)}, SafeFileSystemReader(folder))
    for err in (torch_free.value, safe.value):
        assert words in str(err) and "\n" not in str(err), str(err)


def test_a_tensor_the_checkpoint_lacks_is_named_in_one_line(tmp_path):
    """torch's planner raised its CheckpointException (an 'internal error'); the model's tensor is named."""
    folder = _two_chunk_checkpoint(tmp_path / "ck", lambda md: None)
    with pytest.raises(UserError, match=r"^the torch_dist checkpoint in .*ck has no tensor 'absent': it was not "
                                        r"written for this model$"):
        load_refusing({"absent": torch.zeros(4, 4)}, SafeFileSystemReader(folder))
    target = {"t": torch.full((4, 4), -1.0)}
    load_refusing(target, SafeFileSystemReader(folder))  # the sound checkpoint loads


# --- CRC-32: written, and checked -------------------------------------------------------------

@pytest.fixture(scope="module")
def written(hf, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("written")
    out = {}
    for fmt in ("legacy", "torch_dist"):
        out[fmt] = root / fmt
        assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(out[fmt]), "--format", fmt,
                     "--tp", "2", "--pp", "2", "--quiet"]) == 0
    return out


def test_every_zip_record_written_here_carries_its_crc(written):
    files = list(written["legacy"].rglob("model_optim_rng.pt")) + list(written["torch_dist"].rglob("common.pt"))
    for path in files:  # python's zipfile checks every record's CRC-32
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None and all(i.CRC for i in z.infolist() if i.file_size), path
    reader = TorchDistReader(written["torch_dist"] / "release")
    for (key, offset), (name, start, length, _) in reader.storage.items():
        if offset is not None:
            archive = zipfile.ZipFile(io.BytesIO(open(reader.folder / name, "rb").read()[start:start + length]))
            assert archive.testzip() is None and all(i.CRC for i in archive.infolist() if i.file_size), key


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _record_offsets(path: Path) -> dict[str, tuple[int, int]]:
    with zipfile.ZipFile(path) as z:
        out = {}
        for i in z.infolist():
            name_len, extra_len = struct.unpack("<HH", path.read_bytes()[i.header_offset + 26:i.header_offset + 30])
            out[i.filename.split("/", 1)[1]] = (i.header_offset, i.header_offset + 30 + name_len + extra_len)
        return out


@pytest.mark.parametrize("where", ["tensor data", "pickle", "local header", "directory"])
@pytest.mark.parametrize("deferred", [False, True], ids=["checked-on-open", "checked-beside-the-copy"])
def test_a_flipped_byte_in_a_legacy_rank_file_is_refused(written, tmp_path, capsys, monkeypatch, where, deferred):
    if deferred:  # every record counts as large: its CRC-32 is checked by the copier's workers
        monkeypatch.setattr(zipfmt, "SMALL_RECORD", 0)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(written["legacy"], ckpt)
    (ckpt / MANIFEST_NAME).unlink()  # the zip's own CRC-32s, as for another tool's files
    path = sorted(ckpt.rglob("model_optim_rng.pt"))[1]
    records = _record_offsets(path)
    with zipfile.ZipFile(path) as z:  # the largest tensor: not a replica that a comparison would catch first
        largest = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    header, data = records[largest.filename.split("/", 1)[1]]
    at = {"tensor data": data + 5, "pickle": records["data.pkl"][1] + 40, "local header": header + 31,
          "directory": path.read_bytes().rfind(b"PK\x01\x02") + 16}[where]
    _flip(path, at)
    _one_line_exit_2(capsys, ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "out"),
                              "--quiet"], str(path))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_a_checkpoint_with_a_manifest_is_read_whole_once(written, tmp_path, capsys, monkeypatch, fmt):
    """The manifest's check reads every byte of the files it lists, so the records' CRC-32s in them are not
    checked a second time (they are with --no-verify, or without a manifest); a flipped tensor byte is
    refused either way, naming the file."""
    from megatron_patch.convert import checkpoint

    checked = []
    real = checkpoint.check_crc
    monkeypatch.setattr(checkpoint, "check_crc", lambda *a: checked.append(a[0]) or real(*a))
    monkeypatch.setattr(zipfmt, "SMALL_RECORD", 0)   # every record's CRC-32 is left to the copier's workers
    export = ["convert", "mcore2hf", "--load-dir", str(written[fmt]), "--quiet", "--save-dir"]
    assert main(export + [str(tmp_path / "verified")]) == 0 and not checked
    assert main(export + [str(tmp_path / "unverified"), "--no-verify"]) == 0 and checked
    ckpt = tmp_path / "ckpt"
    shutil.copytree(written[fmt], ckpt)
    path = max((p for p in (ckpt / "release").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    _flip(path, path.stat().st_size // 2)
    _one_line_exit_2(capsys, ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "out"),
                              "--quiet"], str(path))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("at", [10, 0.5], ids=["pickle-name", "middle"])
def test_a_flipped_byte_in_the_metadata_is_named_by_the_manifest(written, tmp_path, capsys, at):
    """A flipped byte in .metadata breaks its pickle in any way at all (a UnicodeDecodeError, an AttributeError, a
    refused class): where a manifest covers the folder, the file it says changed is named, not the reader's error,
    with --no-verify too (no switch reads a file that cannot be read), by every reader."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(written["torch_dist"], ckpt)
    path = ckpt / "release" / ".metadata"
    _flip(path, at if isinstance(at, int) else int(path.stat().st_size * at))
    named = f"{path} does not match its digest in {MANIFEST_NAME}"
    export = ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "out"), "--quiet"]
    for argv in (export, export + ["--no-verify"], ["inspect", str(ckpt)]):
        assert "--no-verify reads it" not in _one_line_exit_2(capsys, argv, named, "restore it from a good copy")
    (ckpt / MANIFEST_NAME).unlink()  # another tool's checkpoint: the reader's own diagnosis
    _one_line_exit_2(capsys, export, "is not a complete checkpoint")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt,name", [("torch_dist", "mpatch_checkpoint.json"), ("torch_dist", "release/common.pt"),
                                      ("torch_dist", "release/__0_0.distcp"), ("torch_dist", "release/.metadata"),
                                      ("legacy", "release/mp_rank_00_000/model_optim_rng.pt")])
def test_a_checkpoint_file_that_is_no_file_is_named_as_what_it_is(written, tmp_path, capsys, fmt, name):
    """A FIFO (or a dangling link) where a checkpoint file belongs was read as a missing file: a sidecar as none
    at all ("give --hf-config"), a common.pt or data file as "missing". Each is named as what it is, and nothing
    opens it (a FIFO would block its reader)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(written[fmt], ckpt)
    path = ckpt / name
    path.unlink()
    os.mkfifo(path)
    export = ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "out"), "--quiet"]
    err = _one_line_exit_2(capsys, export, f"{path.name} is a FIFO, not a regular file")
    assert "missing" not in err and "--hf-config" not in err
    _one_line_exit_2(capsys, ["inspect", str(ckpt)], f"{path.name} is a FIFO, not a regular file")
    path.unlink()
    path.symlink_to(tmp_path / "nowhere")
    (ckpt / MANIFEST_NAME).unlink()  # which would name the link first, as leading outside
    _one_line_exit_2(capsys, export, f"{path.name} is a dangling link")
    assert not (tmp_path / "out").exists()


def test_a_metadata_linked_to_a_device_is_named_as_one(written, tmp_path, capsys):
    """release/.metadata -> /dev/zero was reported as ".metadata is missing" (the audit's D4)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(written["torch_dist"], ckpt)
    (ckpt / MANIFEST_NAME).unlink()  # another tool's checkpoint: the reader's own diagnosis
    (ckpt / "release" / ".metadata").unlink()
    (ckpt / "release" / ".metadata").symlink_to("/dev/zero")
    for argv in (["inspect", str(ckpt)],
                 ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "out"), "--quiet"]):
        err = _one_line_exit_2(capsys, argv, ".metadata is a character device, not a regular file")
        assert "missing" not in err, err
    with pytest.raises(UserError, match="is a character device, not a regular file"):
        TorchDistReader(ckpt / "release")
    with pytest.raises(UserError, match=r"leads outside the folder \(to /dev/zero\)"):
        SafeFileSystemReader(ckpt / "release")


def test_a_flipped_byte_in_a_distcp_chunk_is_refused(written, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(written["torch_dist"], ckpt)
    # The format's own check, as for another tool's checkpoint: this project's manifest would name the
    # file first (tests/test_outputs.py).
    (ckpt / MANIFEST_NAME).unlink()
    reader = TorchDistReader(ckpt / "release")
    (piece,) = reader.block("decoder.layers.self_attention.linear_qkv.weight", (1, 0, 0),
                            reader.tensors["decoder.layers.self_attention.linear_qkv.weight"].chunks[1][1])
    _flip(Path(piece.src.path), piece.src.offset + 7)  # inside the chunk's tensor bytes
    _one_line_exit_2(capsys, ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "out"),
                              "--quiet"], Path(piece.src.path).name, "CRC-32")


def test_every_single_byte_flip_of_a_small_file_is_refused_or_harmless(tmp_path):
    """Exhaustively, for a torch.save file this project wrote: flipping any byte either makes the reader
    refuse the file in one line, or leaves everything it reads unchanged (a byte no reader uses)."""
    path = tmp_path / "f.pt"
    layout, stored = plan_torch_save(path, {"w": TensorSpec((3, 5), "float32"), "n": 7})
    create_file(path, layout.size, layout.small)
    fd = __import__("os").open(path, __import__("os").O_RDWR)
    __import__("os").pwrite(fd, torch.arange(15.0).numpy().tobytes(), stored[("w",)].offset)
    zipfmt.seal(fd, layout)
    __import__("os").close(fd)
    original = path.read_bytes()

    def read() -> tuple:
        lazy = LazyTorchFile(path, verify=True)
        return lazy.obj["n"], lazy.load(lazy.obj["w"]).tolist(), torch.load(path, weights_only=True)["w"].tolist()

    want = read()
    refused = harmless = 0
    for at in range(len(original)):
        data = bytearray(original)
        data[at] ^= 0x01
        path.write_bytes(bytes(data))
        try:
            got = read()
        except UserError as exc:
            assert "\n" not in str(exc) and str(path) in str(exc)
            refused += 1
            continue
        assert got == want, at
        harmless += 1
    assert refused > 0.85 * len(original), (refused, harmless)  # harmless: version, time and attribute fields


def test_other_tools_torch_save_files_are_checked(tmp_path):
    """torch.save writes real CRC-32s (in data descriptors): a flipped data byte is refused."""
    buf = io.BytesIO()
    torch.save({"w": torch.arange(64.0)}, buf)
    data = bytearray(buf.getvalue())
    assert load_torch_bytes(bytes(data), "common.pt")["w"].sum() == torch.arange(64.0).sum()
    at = bytes(data).index(torch.arange(64.0).numpy().tobytes()) + 9
    data[at] ^= 1
    with pytest.raises(UserError, match=r"^common\.pt is not a readable torch\.save archive .*CRC-32"):
        load_torch_bytes(bytes(data), "common.pt")
    path = tmp_path / "m.pt"
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match="CRC-32"):
        LazyTorchFile(path, verify=True)


def test_training_loads_check_the_distcp_chunks(written, tmp_path):
    """SafeFileSystemReader (resume, PRETRAIN_CHECKPOINT_PATH, align) checks each chunk's archive."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(written["torch_dist"] / "release", ckpt)
    key = "decoder.layers.self_attention.linear_qkv.weight"
    reader = TorchDistReader(ckpt)
    name, start, length, _ = reader.storage[(key, (0, 0, 0))]
    (piece,) = reader.block(key, (0, 0, 0), reader.tensors[key].chunks[0][1])
    _flip(ckpt / name, piece.src.offset + 3)
    target = {key: torch.empty(reader.global_shape(key), dtype=getattr(torch, reader.dtype(key)))}
    with pytest.raises(UserError, match=rf"{name} \(the archive at byte {start}\) is corrupt"):
        load_refusing(target, SafeFileSystemReader(ckpt))


# --- a run's checkpoint folder whose newest iteration is damaged ------------------------------------------------

def _run_checkpoints(converted: Path, root: Path, iterations=(1, 2)) -> Path:
    """A run's checkpoint folder as its saves leave it: iteration folders of the converted weights, each with the
    sidecar and a manifest of its own, and the tracker at the newest."""
    from megatron_patch.checkpoint_files.layout import iteration_dir, write_tracker
    from megatron_patch.checkpoint_files.manifest import write_manifest

    for iteration in iterations:
        folder = iteration_dir(root, iteration)
        shutil.copytree(converted / "release", folder)
        for side in converted.iterdir():  # the sidecar and the files it carries
            if side.is_file() and side.name not in (MANIFEST_NAME, "latest_checkpointed_iteration.txt"):
                shutil.copy(side, folder)
        write_manifest(folder, "mpatch train", sync=False)
    write_tracker(root, iterations[-1])
    return root


@pytest.mark.parametrize("found_by", ["the look", "the conversion"])
def test_mcore2hf_of_a_runs_checkpoints_takes_the_newest_sound_iteration(written, tmp_path, capsys, monkeypatch,
                                                                         found_by):
    """docs/training.md: mcore2hf of OUTPUT_BASEPATH/checkpoint takes the newest complete iteration with a resume's
    checks. A flipped byte in the newest iteration's .distcp was refused ('--no-verify reads it as it is': the
    damaged bytes) while the launcher resumed the previous one. The look that chooses hashes files up to 64 MiB; a
    bigger file's damage is found by the conversion, which then converts the previous iteration."""
    import megatron_patch.checkpoint.foreign as foreign

    if found_by == "the conversion":  # as for files past the look's digest limit
        monkeypatch.setattr(foreign, "LOOK_DIGEST_LIMIT", 0)
    root = _run_checkpoints(written["torch_dist"], tmp_path / "checkpoint")
    newest = root / "iter_0000002"
    _flip(next(newest.glob("*.distcp")), 200)
    assert main(["convert", "mcore2hf", "--load-dir", str(root), "--iteration", "1", "--save-dir",
                 str(tmp_path / "one"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["convert", "mcore2hf", "--load-dir", str(root), "--save-dir", str(tmp_path / "out"), "--quiet"]) == 0
    err = capsys.readouterr().err
    said = {"the look": f"warning: {newest} is incomplete or damaged: {next(newest.glob('*.distcp'))} does not match "
                        "its digest",
            "the conversion": f"warning: {newest} is damaged ("}[found_by]
    assert said in err and "iteration 1" in err, err
    assert _same_bytes(tmp_path / "out", tmp_path / "one")
    # an iteration named is converted or refused as it is, never another
    _one_line_exit_2(capsys, ["convert", "mcore2hf", "--load-dir", str(newest), "--save-dir", str(tmp_path / "o2"),
                              "--quiet"], "does not match its digest", "--no-verify")


def test_evals_refusal_of_a_damaged_newest_iteration_names_the_previous_one(written, tmp_path, monkeypatch):
    import megatron_patch.checkpoint.foreign as foreign
    from megatron_patch.checkpoint_files.manifest import IntegrityError
    from megatron_patch.cli.eval import _with_the_previous_iteration

    monkeypatch.setattr(foreign, "LOOK_DIGEST_LIMIT", 0)
    root = _run_checkpoints(written["torch_dist"], tmp_path / "checkpoint", iterations=(1, 2, 3))
    _flip(next((root / "iter_0000003").glob("*.distcp")), 200)
    _flip(next((root / "iter_0000002").glob("*.distcp")), 20)  # cut short too: the look skips it
    (root / "iter_0000002" / "metadata.json").write_text("{}" * 10)
    said = str(_with_the_previous_iteration(IntegrityError("x does not match its digest"), str(root)))
    assert said == f"x does not match its digest; --load-dir {root / 'iter_0000001'} evaluates the newest complete " \
                   "iteration before it"
    assert str(_with_the_previous_iteration(IntegrityError("x"), str(root / "iter_0000003"))) == "x"

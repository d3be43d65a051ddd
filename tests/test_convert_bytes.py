"""The converter's byte-level machinery: split blocks, the torch-free file formats, the copier.

Each piece is checked against torch's own implementation of the same thing (``Split.shards`` /
``merge``, ``torch.load``, torch's distributed-checkpoint reader), and the zero-copy path against the
path through memory, bit for bit.
"""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.models.mapping import plan_transfers
from megatron_patch.models.shape import derived_skeleton as ds
from megatron_patch.runtime import ParallelLayout
from tests.convert_helpers import read_torch_dist_release, write_torch_dist_chunks

FAMILIES = sorted(families())


def _apply_blocks(blocks, parts):
    """A shard made of ``blocks`` of ``parts``, the slow and obvious way."""
    out = []
    for shard in blocks:
        pieces = []
        for b in shard:
            if b.part is None:
                pieces.append(parts[0].new_zeros((b.num_rows,) + tuple(parts[0].shape[1:])))
                continue
            t = parts[b.part][b.rows[0]:b.rows[1]]
            pieces.append(t if b.cols is None else t[:, b.cols[0]:b.cols[1]])
        out.append(torch.cat(pieces, 0))
    return out


def _layouts(arch):
    out = [ParallelLayout(tp=tp) for tp in (1, 2, 4) if arch.num_kv_heads % tp == 0]
    if arch.is_moe:
        out.append(ParallelLayout(tp=2, ep=2, etp=1))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_describe_exactly_what_shards_and_merge_do(family, hf_shapes):
    """For every rule of every family's table and several layouts, the shards built from the blocks
    equal ``Split.shards`` bit for bit, and the HF tensors put back from them equal ``Split.merge``. A split
    that is not rows and columns (gpt-oss's transposed experts) runs through torch: its merge undoes its
    shards exactly."""
    from megatron_patch.models.mapping.stacks import member_index

    fam = families()[family]
    arch = parse_arch(fam.tiny_config)
    gen = torch.Generator().manual_seed(0)
    members = member_index(fam.hf_stacked(arch))
    stored = {**hf_shapes[family], **{m: hf_shapes[family][s][1:] for m, (s, _) in members.items()}}
    checked = 0
    for layout in _layouts(arch):
        for t in plan_transfers(fam.weight_rules(arch), arch, layout):
            shapes = [stored[n] for n in t.hf_names]
            parts = [torch.randn(s, generator=gen) for s in shapes]
            blocks = t.split.blocks(shapes, t.num_shards, t.context)
            want = t.split.shards(parts, t.num_shards, t.context)
            if blocks is None:
                assert all(torch.equal(b, p) for b, p in zip(t.split.merge(want, t.context), parts)), t.split
                checked += 1
                continue
            got = _apply_blocks(blocks, parts)
            assert len(got) == len(want)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), (t.placements[0].mcore_name, layout)
            # Back: every HF tensor rebuilt from the blocks' boxes of the shards equals merge().
            back = [torch.full(s, float("nan")) for s in shapes]
            for shard, shard_blocks in zip(want, blocks):
                row = 0
                for b in shard_blocks:
                    if b.part is not None:
                        box = back[b.part][b.rows[0]:b.rows[1]]
                        box = box if b.cols is None else box[:, b.cols[0]:b.cols[1]]
                        box.copy_(shard[row:row + b.num_rows])
                    row += b.num_rows
            merged = t.split.merge(want, t.context)
            assert all(torch.equal(b, m) for b, m in zip(back, merged)), t.placements[0].mcore_name
            if layout == ParallelLayout():  # the shapes alone say the same
                assert t.split.merged_shapes(tuple(want[0].shape), t.context) == [tuple(m.shape) for m in merged]
            checked += 1
    assert checked > 20


@pytest.fixture(scope="module")
def tiny_hf_dirs(tmp_path_factory) -> dict:
    """Every family's tiny HF checkpoint (fp32)."""
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {family: make_tiny_hf_checkpoint(family, root / family) for family in FAMILIES}


@pytest.fixture(scope="module")
def hf_shapes(tiny_hf_dirs) -> dict:
    """Every family's tiny checkpoint's tensor shapes, as its safetensors store them."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    out = {}
    for family, folder in tiny_hf_dirs.items():
        reader = HFCheckpointReader(folder)
        out[family] = {n: reader.shape(n) for n in reader.keys()}
    return out


# --- the copier: zero copy, its fallbacks, workers -----------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    # Four KV heads so TP=4 splits them; bf16 so same-dtype moves go file to file.
    d = make_tiny_hf_checkpoint("qwen2_moe", tmp_path_factory.mktemp("moe") / "hf", seed=5, num_key_value_heads=4)
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.convert.hf_writer import SafetensorsShardWriter

    reader = HFCheckpointReader(d)
    tensors = {n: reader.get(n).to(torch.bfloat16) for n in reader.keys()}
    (d / "model.safetensors").unlink()
    writer = SafetensorsShardWriter(d, [(n, t.shape, t.dtype) for n, t in tensors.items()], 40_000)
    for n, t in tensors.items():
        writer.write(n, t)
    writer.close()
    return d


def _folder_bytes(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and p.name != "mpatch_checkpoint.json"}


def _convert_both_ways(hf, out, fmt, copier_factory, layout=ParallelLayout(tp=2, pp=2, ep=2), **kw):
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf

    there, back = copier_factory(), copier_factory()
    out.mkdir(parents=True)
    hf_to_mcore(hf, out / "mcore", layout, fmt=fmt, progress=False, copier=there, **kw)
    mcore_to_hf(out / "mcore", out / "hf", max_shard_size="50KB", progress=False, copier=back)
    return _folder_bytes(out / "mcore"), _folder_bytes(out / "hf"), there.stats, back.stats


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_zero_copy_output_is_byte_identical_to_copying_through_memory(hf_dir, tmp_path, fmt):
    from megatron_patch.convert.copier import Copier

    fast = _convert_both_ways(hf_dir, tmp_path / "fast", fmt, lambda: Copier(3))
    slow = _convert_both_ways(hf_dir, tmp_path / "slow", fmt, lambda: Copier(1, zero_copy=False))
    assert fast[0] == slow[0] and fast[1] == slow[1]
    for f, s in zip(fast[2:], slow[2:]):
        assert f.zero_copy_bytes > 0 and f.buffered_bytes == 0 and f.fallback_reason is None
        assert f.called_bytes == 0  # nothing needed torch: every tensor was placed by byte ranges
        assert s.zero_copy_bytes == 0 and s.buffered_bytes == f.zero_copy_bytes and s.gathered_bytes == f.gathered_bytes
    # torch_dist holds whole (TP=1) tensors: every byte goes file to file; legacy at TP=2 gathers the
    # dim-1 slices of the row-parallel weights through memory.
    assert (fast[2].gathered_bytes > 0) == (fast[3].gathered_bytes > 0) == (fmt == "legacy")
    # And the round trip is exact.
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    a, b = HFCheckpointReader(hf_dir), HFCheckpointReader(tmp_path / "fast" / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a.get(n), b.get(n)) for n in a.keys())


@pytest.mark.parametrize("failure, slices", [("exdev", "mapped"), ("enosys", "mapped"), ("missing", "mapped"),
                                             ("short", "mapped"), ("exdev", "copied"), ("short", "copied")])
def test_copy_file_range_refused_falls_back_with_the_same_bytes(hf_dir, tmp_path, monkeypatch, failure, slices):
    """Another file system (EXDEV), no kernel support (ENOSYS), no os.copy_file_range at all, or a
    kernel that copies a little at a time: the output is the same, also where the gathers copy their
    row slices file to file."""
    from megatron_patch.convert import copier as copier_mod
    from megatron_patch.convert.copier import Copier

    want = _convert_both_ways(hf_dir, tmp_path / "want", "legacy", lambda: Copier(2))
    if slices == "copied":
        monkeypatch.setattr(copier_mod, "GATHER_COPY_MIN", 0)
    real = os.copy_file_range
    calls = []

    def fake(src, dst, count, offset_src=None, offset_dst=None):
        calls.append(count)
        if failure == "short":
            return real(src, dst, min(count, 4097), offset_src, offset_dst)
        raise OSError(errno.EXDEV if failure == "exdev" else errno.ENOSYS, os.strerror(errno.EXDEV if failure == "exdev" else errno.ENOSYS))

    if failure == "missing":
        monkeypatch.delattr(os, "copy_file_range")
    else:
        monkeypatch.setattr(os, "copy_file_range", fake)
    got = _convert_both_ways(hf_dir, tmp_path / "got", "legacy", lambda: Copier(2))
    assert got[0] == want[0] and got[1] == want[1]
    for stats in got[2:]:
        if failure == "short":
            assert stats.zero_copy_bytes > 0 and stats.fallback_reason is None
        else:
            assert stats.zero_copy_bytes == 0 and stats.buffered_bytes > 0 and stats.fallback_reason
    if failure == "short":
        assert len(calls) > 50  # many partial copies, stitched together
    elif failure != "missing":
        assert 2 <= len(calls) <= 4  # per conversion, tried at most once by each of its two workers, then not again


def test_gathers_copy_long_row_slices_file_to_file(hf_dir, tmp_path, monkeypatch):
    """Row slices of at least GATHER_COPY_MIN bytes (row-parallel weights) are copied file to file, each
    with copy_file_range, not written from a mapping; the bytes are the same either way."""
    from megatron_patch.convert import copier as copier_mod
    from megatron_patch.convert.copier import Copier

    maps = []
    real_map = Copier._map
    monkeypatch.setattr(Copier, "_map", lambda self, *a: maps.append(a[1]) or real_map(self, *a))
    want = _convert_both_ways(hf_dir, tmp_path / "want", "legacy", lambda: Copier(2))
    assert maps and want[2].gathered_bytes > 0   # this model's slices are short: mapped
    maps.clear()
    monkeypatch.setattr(copier_mod, "GATHER_COPY_MIN", 0)
    got = _convert_both_ways(hf_dir, tmp_path / "got", "legacy", lambda: Copier(2))
    assert not maps and got[2].gathered_bytes == want[2].gathered_bytes and got[3].gathered_bytes == want[3].gathered_bytes
    assert got[0] == want[0] and got[1] == want[1]


def test_dtype_change_and_splits_without_blocks_go_through_torch(hf_dir, tmp_path, monkeypatch):
    """A split that cannot describe itself as blocks runs on tensors, with the same result; a dtype
    change is converted as torch converts."""
    from megatron_patch.convert.copier import Copier
    from megatron_patch.models.mapping.splits import GateUp, Row

    for fmt in ("legacy", "torch_dist"):
        want = _convert_both_ways(hf_dir, tmp_path / f"want-{fmt}", fmt, lambda: Copier(2), dtype="fp32")
        with monkeypatch.context() as m:
            m.setattr(GateUp, "blocks", lambda self, *a: None)
            m.setattr(Row, "blocks", lambda self, *a: None)
            got = _convert_both_ways(hf_dir, tmp_path / f"got-{fmt}", fmt, lambda: Copier(2), dtype="fp32")
        assert got[0] == want[0] and got[1] == want[1]
        assert got[2].called_bytes > 0 and got[3].called_bytes > 0 and want[2].called_bytes == want[3].called_bytes == 0
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    a, b = HFCheckpointReader(hf_dir), HFCheckpointReader(tmp_path / "want-legacy" / "hf")
    assert all(b.dtype(n) == "float32" and torch.equal(b.get(n), a.get(n).float()) for n in a.keys())


@pytest.mark.parametrize("map_reads", [True, False], ids=["mapped", "read"])
def test_every_move_gathered_in_small_bands_with_short_writes_gives_the_same_bytes(hf_dir, tmp_path, monkeypatch,
                                                                                   map_reads):
    """The gather path (band reads, pwritev of slices, zero rows for vocabulary padding) on every
    tensor, with bands of a few rows and a kernel that writes at most 1000 bytes per call; the source
    rows mapped from the page cache (the default) or read into memory (where mmap fails)."""
    from megatron_patch.convert import copier as copier_mod
    from megatron_patch.convert.bytemap import Move
    from megatron_patch.convert.copier import Copier

    maps = []
    real_map = Copier._map
    monkeypatch.setattr(Copier, "_map", lambda self, *a: maps.append(a[1]) or real_map(self, *a))
    for fmt in ("legacy", "torch_dist"):
        want = _convert_both_ways(hf_dir, tmp_path / f"want-{fmt}", fmt, lambda: Copier(2))
        real = os.pwritev
        with monkeypatch.context() as m:
            m.setattr(Move, "contiguous", property(lambda self: False))
            m.setattr(copier_mod.os, "pwritev", lambda fd, bufs, offset: real(fd, bufs, offset) if sum(map(len, bufs)) < 1000
                      else real(fd, [memoryview(bytes().join(bytes(b) for b in bufs))[:999]], offset))
            maps.clear()
            got = _convert_both_ways(hf_dir, tmp_path / f"got-{fmt}", fmt,
                                     lambda: Copier(3, band_bytes=2048, map_reads=map_reads))
        assert got[0] == want[0] and got[1] == want[1]
        assert got[2].zero_copy_bytes == got[3].zero_copy_bytes == 0 and got[2].gathered_bytes > 0
        assert (len(maps) > 100) == map_reads


def test_gather_from_a_source_that_ends_early_is_an_error_not_a_crash(tmp_path):
    """A mapped page past the end of a file would kill the process (SIGBUS): the length is checked
    first, and the error names the file. With mmap refused, the read path says the same."""
    from megatron_patch.checkpoint_files.byte_io import Stored, create_file
    from megatron_patch.convert.bytemap import Move
    from megatron_patch.convert.copier import Copier

    src, dst = tmp_path / "src.bin", tmp_path / "dst.bin"
    src.write_bytes(bytes(range(256)) * 60)            # 15360 bytes: 60 of the 64 rows of 256 bytes
    create_file(dst, 64 * 128, [])
    a, b = Stored(str(src), 0, (64, 128), "bfloat16"), Stored(str(dst), 0, (64, 64), "bfloat16")
    for map_reads in (True, False):
        copier = Copier(1, map_reads=map_reads)
        with pytest.raises(UserError, match=r"cannot read .*src\.bin .*truncated or corrupt"):
            copier.run(copier.gather_tasks([Move(a, 0, 0, b, 0, 0, 64, 64)]))
        copier.close()


_CONVERT_MAPPED_ROWS = """
import sys, torch
from megatron_patch.checkpoint_files.byte_io import Stored, create_file
from megatron_patch.convert.bytemap import Move
from megatron_patch.convert.copier import Copier
src, dst = sys.argv[1:]
values = torch.randn(64, 32)
open(src, "wb").write(values.numpy().tobytes())
create_file(dst, values.numel() * 2, [])
copier = Copier(1)
copier.run(copier.gather_tasks([Move(Stored(src, 0, (64, 32), "float32"), 0, 0, Stored(dst, 0, (64, 32), "bfloat16"),
                                     0, 0, 64, 32)]))
copier.close()
got = torch.frombuffer(bytearray(open(dst, "rb").read()), dtype=torch.bfloat16).reshape(64, 32)
assert torch.equal(got, values.to(torch.bfloat16))
"""


def test_a_dtype_change_from_mapped_rows_warns_nothing(tmp_path):
    """The rows a dtype change converts are read-only views of the mapped input, which torch only reads: torch's
    warning about such views (shown even with --quiet) is not printed. In a fresh process: torch warns once."""
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-c", _CONVERT_MAPPED_ROWS, str(tmp_path / "src"), str(tmp_path / "dst")],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Warning" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("workers", [1, 4])
def test_output_does_not_depend_on_the_number_of_workers(hf_dir, tmp_path, workers):
    from megatron_patch.convert.copier import Copier

    one = _convert_both_ways(hf_dir, tmp_path / "one", "torch_dist", lambda: Copier(1), layout=ParallelLayout(tp=4))
    many = _convert_both_ways(hf_dir, tmp_path / "many", "torch_dist", lambda: Copier(workers, band_bytes=4096),
                              layout=ParallelLayout(tp=4))
    assert one[0] == many[0] and one[1] == many[1]


def test_manifest_digests_of_the_data_files_are_taken_beside_the_copies(hf_dir, tmp_path, monkeypatch):
    """The converters' data files (rank files, .distcp, safetensors) are hashed by the copier's workers as
    soon as each is complete, CRC-32s sealed, not in a pass after the copies; the manifests check out."""
    from megatron_patch.checkpoint_files import manifest
    from megatron_patch.convert.copier import Copier

    late = []   # what the manifests' writer hashes itself (a check of the input hashes without syncing)
    real = manifest.digests
    monkeypatch.setattr(manifest, "digests", lambda folder, names, sync=True: (late.extend(names) if sync else None)
                        or real(folder, names, sync=sync))
    for fmt in ("legacy", "torch_dist"):
        late.clear()
        out = tmp_path / fmt
        _convert_both_ways(hf_dir, out, fmt, lambda: Copier(2))
        assert late and not [n for n in late if n.endswith(("model_optim_rng.pt", ".distcp", ".safetensors"))], late
        for folder in (out / "mcore", out / "hf"):
            data = json.loads((folder / manifest.MANIFEST_NAME).read_text())["files"]
            assert any(n.endswith((".pt", ".distcp", ".safetensors")) for n in data)
            assert manifest.verify_manifest(folder / manifest.MANIFEST_NAME) == sum(e["size"] for e in data.values())


def test_schedule_gives_each_file_one_writer_and_starts_a_task_after_the_bytes_it_waits_for():
    """Tasks go in read order, except that a task writing a busy file yields to the next one writing
    another file (or none), and a task waiting for a byte range starts once every writer of bytes in it
    is done: an overlapping range, a task that may write anywhere in that file, or anywhere at all."""
    import threading

    from megatron_patch.convert.schedule import ANY_FILE, WHOLE_FILE, Schedule, Work

    works = [Work(frozenset({"F"}), (("F", 0, 100),)),      # 0
             Work(frozenset({"F"}), (("F", 100, 200),)),    # 1
             Work(after=(("F", 0, 100),)),                  # 2: waits for 0 only
             Work(frozenset({"G"}), (("G", 0, 50),)),       # 3
             Work(),                                        # 4: writes nothing
             Work(after=(("F", 150, 160),))]                # 5: waits for 1
    plan = Schedule(works)
    assert [plan.take(), plan.take(), plan.take()] == [0, 3, 4]   # F busy: 1 yields to G, then to nothing
    plan.done(0)
    assert [plan.take(), plan.take()] == [1, 2]
    for i in (1, 2, 3, 4):
        plan.done(i)
    assert plan.take() == 5 and (plan.done(5) or plan.take()) is None
    anywhere = [Work(frozenset({"F"}), (("F", 0, WHOLE_FILE),)), Work(ranges=((ANY_FILE, 0, WHOLE_FILE),)),
                Work(frozenset({"G"}), (("G", 0, 10),)), Work(after=(("F", 5, 6),))]
    plan = Schedule(anywhere)
    assert [plan.take(), plan.take(), plan.take()] == [0, 1, 2]
    plan.done(0)
    plan.done(2)
    got = []
    taker = threading.Thread(target=lambda: got.append(plan.take()), daemon=True)
    taker.start()
    taker.join(0.5)
    assert taker.is_alive() and not got      # 3 still waits for 1 (it may write anywhere)
    plan.done(1)
    taker.join(5)
    assert got == [3]


def test_copier_runs_one_writer_per_file_beside_other_work(tmp_path):
    """With four workers and tasks that write two files, never two tasks write one file at once, the
    tasks that write nothing run beside them, and a task that waits for a file's bytes starts after
    every task writing them has finished."""
    import threading
    import time
    from collections import Counter

    from megatron_patch.convert.copier import CallTask, Copier

    lock, active, peak, log = threading.Lock(), Counter(), Counter(), []

    def task(name: str, files: tuple[str, ...]):
        def run(_copier) -> int:
            with lock:
                active.update(files)
                peak.update({f: max(0, active[f] - peak[f]) for f in files})
                log.append(("start", name))
            time.sleep(0.02)
            with lock:
                active.subtract(files)
                log.append(("end", name))
            return 0
        return run

    tasks = [CallTask(task(f"a{i}", ("A",)), writes=("A",), reads=("src", i)) for i in range(6)]
    tasks += [CallTask(task(f"b{i}", ("B",)), writes=("B",), reads=("src", 10 + i)) for i in range(3)]
    tasks += [CallTask(task(f"c{i}", ()), writes=(), reads=("src", 20 + i)) for i in range(3)]
    tasks += [CallTask(task("seal", ()), writes=(), reads=("src", 0), after=(("A", 0, 10),))]
    copier = Copier(4)
    copier.run(tasks)
    copier.close()
    assert peak["A"] == 1 and peak["B"] == 1
    when = {(kind, name): k for k, (kind, name) in enumerate(log)}
    assert when[("start", "seal")] > max(when[("end", f"a{i}")] for i in range(6))
    assert when[("start", "b0")] < when[("end", "a5")] and when[("start", "c0")] < when[("end", "a5")]


# --- the file formats, against torch's own readers ------------------------------------------------



def test_torch_save_layout_loads_in_torch_also_past_4_gib(tmp_path):
    """Our torch.save files load with torch.load (plain and zip64 form); a record that starts past 4 GiB
    is where torch's own reader says it is. The big file is sparse: it takes no disk space."""
    import zipfile

    from megatron_patch.checkpoint_files.torch_files import LazyTorchFile, TensorSpec, plan_torch_save

    values = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, 0)}
    obj = {"model": {k: TensorSpec(tuple(v.shape), str(v.dtype)[6:]) for k, v in values.items()},
           "checkpoint_version": 3.0, "iteration": 0, "args": None, "big": 2**40, "neg": -3, "name": "x"}
    for zip64 in (False, True):
        path = tmp_path / f"small-{zip64}.pt"
        layout, places = plan_torch_save(path, obj, force_zip64=zip64)
        with open(path, "wb") as f:
            f.truncate(layout.size)
            for offset, data in layout.small:
                f.seek(offset)
                f.write(data)
            for k, v in values.items():
                f.seek(places[("model", k)].offset)
                f.write(v.contiguous().view(torch.uint8).numpy().tobytes())
        loaded = torch.load(path, weights_only=True)
        assert {k: v for k, v in loaded.items() if k != "model"} == {k: v for k, v in obj.items() if k != "model"}
        assert all(torch.equal(loaded["model"][k], v) for k, v in values.items())
        lazy = LazyTorchFile(path)
        assert {k: lazy.stored(r) for k, r in lazy.obj["model"].items()} == {k: places[("model", k)] for k in values}
        assert all(torch.equal(lazy.load(lazy.obj["model"][k]), v) for k, v in values.items())

    big = tmp_path / "big.pt"
    obj = {"model": {"huge": TensorSpec((2**32 + 64,), "uint8"), "after": TensorSpec((4,), "float32")}}
    layout, places = plan_torch_save(big, obj)
    with open(big, "wb") as f:
        f.truncate(layout.size)
        for offset, data in layout.small:
            f.seek(offset)
            f.write(data)
    assert places[("model", "after")].offset > 2**32
    reader = torch._C.PyTorchFileReader(str(big))
    assert reader.get_record_offset("data/0") == places[("model", "huge")].offset
    assert reader.get_record_offset("data/1") == places[("model", "after")].offset
    assert reader.get_record_size("data/0") == 2**32 + 64
    info = {i.filename.split("/", 1)[1]: i for i in zipfile.ZipFile(big).infolist()}
    assert info["data/0"].file_size == 2**32 + 64 and info["data/1"].header_offset > 2**32
    lazy = LazyTorchFile(big)
    assert lazy.stored(lazy.obj["model"]["after"]) == places[("model", "after")]


def test_torch_dist_metadata_reads_as_torch_writes_it(hf_dir, tmp_path):
    """Our .metadata, unpickled by torch, equals what torch's own planner and writer make for the same
    tensors, and torch's reader loads every chunk; our reader reads a torch-written .metadata."""
    import torch.distributed.checkpoint as dcp

    from megatron_patch.checkpoint_files.torch_dist import TorchDistReader
    from megatron_patch.convert.checkpoint import hf_to_mcore

    hf_to_mcore(hf_dir, tmp_path / "ours", ParallelLayout(), fmt="torch_dist", progress=False)
    ours = dcp.FileSystemReader(str(tmp_path / "ours" / "release")).read_metadata()
    tensors = {}
    for key, md in ours.state_dict_metadata.items():
        if hasattr(md, "size"):
            tensors[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(tmp_path / "ours" / "release")), no_dist=True)
    assert all(t.abs().sum() > 0 for t in tensors.values())  # every chunk was found and read
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp_path / "torch")), no_dist=True)
    theirs = dcp.FileSystemReader(str(tmp_path / "torch")).read_metadata()
    # torch saves whole tensors; compare each key's properties and size, and that our chunks tile it. torch 2.15
    # adds the saved tensor's strides, a sixth field that older torch cannot unpickle and no reader uses: ours
    # are the five fields every torch reads, so a checkpoint converted here loads under any torch.
    for key, md in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata[key]
        assert getattr(mine.properties, "strides", None) is None, key
        fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
        assert [getattr(mine.properties, f) for f in fields] == [getattr(md.properties, f) for f in fields], key
        assert mine.size == md.size, key
        assert sum(torch.Size(c.sizes).numel() for c in mine.chunks) == md.size.numel(), key
    assert {(i.fqn, tuple(i.offset) if i.offset is not None else None) for i in ours.storage_data} == \
        {(k, tuple(c.offsets)) for k, md in ours.state_dict_metadata.items() if hasattr(md, "size") for c in md.chunks} | \
        {(k, None) for k, md in ours.state_dict_metadata.items() if not hasattr(md, "size")}
    back = TorchDistReader(tmp_path / "torch")
    assert back.tensor_keys() == set(tensors)
    assert {k: (back.global_shape(k), back.dtype(k)) for k in tensors} == \
        {k: (tuple(t.shape), str(t.dtype)[6:]) for k, t in tensors.items()}
    for key, t in tensors.items():  # torch's own files: each whole tensor is one plain stored chunk
        (piece,) = back.block(key, (0,) * t.dim(), tuple(t.shape))
        stored = piece.src
        assert piece.src_start == piece.dst_start == (0,) * t.dim() and piece.size == tuple(t.shape)
        with open(stored.path, "rb") as f:
            f.seek(stored.offset)
            raw = f.read(stored.nbytes)
        assert raw == t.contiguous().view(torch.uint8).numpy().tobytes(), key


def test_mcore2hf_reads_what_it_cannot_copy_file_to_file(hf_dir, tmp_path):
    """Checkpoints written by other tools: tensors stored as strided views of their storage (legacy) are
    read into memory by the project's reader; parameters cut into several chunks (torch_dist written at
    TP > 1) are gathered from the chunks' bytes, never through torch's reader; the same result."""
    import shutil

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME
    from megatron_patch.checkpoint_files.torch_dist import ChunkItem, TorchDistReader
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf
    from megatron_patch.convert.copier import Copier

    want = HFCheckpointReader(hf_dir)
    # legacy: every matrix saved column-major (a transposed view of a contiguous storage)
    legacy = tmp_path / "legacy"
    hf_to_mcore(hf_dir, legacy, ParallelLayout(tp=2, ep=2), fmt="legacy", progress=False)
    for path in (legacy / "release").rglob("model_optim_rng.pt"):
        state = torch.load(path, weights_only=True)
        state["model"] = {k: v.t().contiguous().t() if v.dim() == 2 else v for k, v in state["model"].items()}
        torch.save(state, path)
    (legacy / MANIFEST_NAME).unlink()  # rewritten as another tool would: no manifest of ours
    # torch_dist: every chunk cut in two along its last dimension
    td = tmp_path / "td"
    hf_to_mcore(hf_dir, td, ParallelLayout(), fmt="torch_dist", progress=False)
    release = td / "release"
    reader, full, objects = read_torch_dist_release(release)
    chunks, values = [], {}
    for key, info in reader.tensors.items():
        for offset, sizes in info.chunks:
            half = sizes[-1] // 2
            for start, size in ((0, half), (half, sizes[-1] - half)):
                o = offset[:-1] + (offset[-1] + start,)
                s = sizes[:-1] + (size,)
                chunks.append(ChunkItem(key, info.global_shape, o, s, info.dtype))
                values[(key, o)] = full[key][tuple(slice(a, a + b) for a, b in zip(o, s))]
    shutil.rmtree(release)
    (td / MANIFEST_NAME).unlink()
    write_torch_dist_chunks(release, chunks, objects, values)
    assert len(TorchDistReader(release).tensors["decoder.layers.self_attention.linear_qkv.weight"].chunks) == 8

    for ckpt in (legacy, td):
        copier = Copier(2)
        mcore_to_hf(ckpt, tmp_path / f"{ckpt.name}-hf", progress=False, copier=copier)
        got = HFCheckpointReader(tmp_path / f"{ckpt.name}-hf")
        assert got.keys() == want.keys() and all(torch.equal(got.get(n), want.get(n)) for n in want.keys()), ckpt.name
        if ckpt is legacy:
            assert copier.stats.called_bytes > 0  # strided: read into memory
        else:
            assert copier.stats.called_bytes == 0 and copier.stats.gathered_bytes > 0  # half chunks: byte moves


# --- the model skeleton: derived without megatron-core, megatron-core's own where not, cached --------

def describe_all_worker(archs: list) -> list:
    """In a helper process: megatron-core's skeleton of each arch (one megatron import for all)."""
    from megatron_patch.models.shape.skeleton import describe_model_here

    return [describe_model_here(a) for a in archs]


def skeleton_variants() -> dict:
    """Every family's tiny model, and a variant of some for each branch of the derivation's rules: tied
    embeddings, linear biases, a head_dim apart from hidden/heads, another vocabulary padding, MoE
    without a shared expert, dense layers between MoE ones (per-layer keys), multi-latent attention
    without a query LoRA and without the router's expert bias, multi-token-prediction layers."""
    import dataclasses

    tiny = {name: fam.tiny_config for name, fam in families().items()}
    archs = {name: parse_arch(config) for name, config in tiny.items()}
    configs = {
        "llama3_1/tied": {**tiny["llama3_1"], "tie_word_embeddings": True},
        "llama3_1/biases": {**tiny["llama3_1"], "attention_bias": True, "mlp_bias": True},
        "llama3_1/head_dim": {**tiny["llama3_1"], "head_dim": 32},
        "qwen2_moe/no_shared_expert": {**tiny["qwen2_moe"], "shared_expert_intermediate_size": 0},
        "qwen2_moe/dense_layers": {**tiny["qwen2_moe"], "decoder_sparse_step": 2},
        "deepseek_v3/v2_lite": {**tiny["deepseek_v3"], "model_type": "deepseek_v2", "q_lora_rank": None,
                                "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
                                "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0},
    }
    archs.update({name: parse_arch(config) for name, config in configs.items()})
    archs["deepseek_v3/mtp"] = dataclasses.replace(archs["deepseek_v3"], mtp_layers=1)
    archs["llama3_1/vocab_padded"] = dataclasses.replace(archs["llama3_1"], vocab_padded_to=archs["llama3_1"].padded_vocab_size() + 128)
    return archs


@pytest.fixture(scope="module")
def megatron_skeletons():
    """Each variant's arch and megatron-core's skeleton of it, from one helper process."""
    from megatron_patch.runtime.launch import run_local

    archs = skeleton_variants()
    return archs, dict(zip(archs, run_local(describe_all_worker, 1, list(archs.values()))[0]))


def _extra_states(skeleton) -> list:
    import io

    return [(o.unique_key, torch.load(io.BytesIO(o.payload), weights_only=True)) for o in skeleton.objects]


@pytest.mark.slow
def test_derived_skeleton_is_what_megatron_builds(megatron_skeletons):
    """For every family and variant, the skeleton derived from the weight table and config equals the one
    megatron-core computes: every parameter's shape, every torch_dist chunk in order, which are buffers,
    the HF shapes, and every _extra_state object's key in order, holding what torch reads as megatron's
    ([None]; the bytes are this project's torch.save writer's). A torch_dist checkpoint holds global
    tensors, so this single-rank description is the one every layout loads from (the round trips at each
    family's layouts and the training runs from converted torch_dist checkpoints use it)."""
    archs, megatron = megatron_skeletons
    compared = 0
    for name, arch in archs.items():
        try:
            derived = ds.derive_skeleton(arch)
        except ds.NotDerivable:  # only a family with layers of its own goes beyond the rules
            assert families()[arch.family].layer_spec is not None, name
            continue
        want = megatron[name]
        assert (derived.shapes, derived.buffers, derived.hf_shapes) == (want.shapes, want.buffers, want.hf_shapes), name
        assert derived.chunks == want.chunks, name
        assert _extra_states(derived) == _extra_states(want) and all(v == [None] for _, v in _extra_states(want)), name
        compared += 1
    own_layers = sum(f.layer_spec is not None for f in families().values())
    assert compared >= len(families()) - own_layers + 8


@pytest.mark.slow
def test_cached_skeleton_is_what_megatron_computed(megatron_skeletons, tmp_path, monkeypatch):
    """Where the derivation does not describe a model, the skeleton read back from the disk cache equals
    the one megatron-core computes (shapes, every sharded-state-dict chunk, every object's bytes, the HF
    shapes); a miss is computed once and stored, a damaged entry is computed again; the key changes with
    config.json, the MTP layers, the vocabulary padding and the code."""
    import json

    from megatron_patch.models.shape import skeleton as sk

    archs, megatron = megatron_skeletons
    by_key = {sk._key(arch, None): name for name, arch in archs.items()}
    monkeypatch.setenv("MPATCH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sk, "derive_skeleton", _not_derivable)  # as for a family the rules do not describe
    computed = []

    def compute(keys):  # stands for the helper process (megatron's answer)
        computed.extend(keys)
        return [megatron[by_key[k]] for k in keys]

    monkeypatch.setattr(sk, "_compute", compute)
    sk._describe_cached.cache_clear()
    sk._derived.cache_clear()
    try:
        for name, arch in archs.items():
            assert sk.describe_model(arch) is megatron[name]           # a miss: computed, then stored
            path = sk.cache_path(*sk._key(arch, None))
            assert path.is_file() and path.parent == tmp_path / "cache" / "skeletons"
            sk._describe_cached.cache_clear()
            cached = sk.describe_model(arch)                          # read back from disk
            assert cached == megatron[name] and cached is not megatron[name]
            assert len(cached.chunks) > 10 and cached.hf_shapes and cached.objects
        assert len(computed) == len(archs)
        assert megatron["deepseek_v3/mtp"] != megatron["deepseek_v3"]
        arch = archs["llama3_1"]
        config = json.dumps(arch.hf_config, sort_keys=True)
        assert sk.cache_path(json.dumps({**arch.hf_config, "num_hidden_layers": 2}, sort_keys=True), 0) != \
            sk.cache_path(config, 0)
        assert sk.cache_path(config, 1) != sk.cache_path(config, 0)
        assert sk.cache_path(config, 0, vocab_padded_to=arch.padded_vocab_size() + 128) != sk.cache_path(config, 0)
        assert sk.cache_path(config, 0, layers=(0,)) != sk.cache_path(config, 0)
        with monkeypatch.context() as m:
            m.setattr(sk, "_code_digest", lambda: "another version of the code")
            changed = sk.cache_path(config, 0)
        assert changed != sk.cache_path(config, 0)
        path = sk.cache_path(config, 0)
        path.write_text('{"format": 1, "shapes": ')     # damaged (a full disk, say)
        sk._describe_cached.cache_clear()
        assert sk.describe_model(arch) == megatron["llama3_1"] and len(computed) == len(archs) + 1
        assert sk.ModelSkeleton.from_json(json.loads(path.read_text())) == megatron["llama3_1"]
    finally:
        sk._describe_cached.cache_clear()
        sk._derived.cache_clear()


def _not_derivable(arch):
    from megatron_patch.models.shape.derived_skeleton import NotDerivable

    raise NotDerivable("a test's stand-in for a family the rules do not describe")


def _with_family(monkeypatch, **changes):
    """The derivation sees the Llama family changed as given (a stand-in for a family added later)."""
    import dataclasses

    from megatron_patch.models.shape import derived_skeleton

    family = dataclasses.replace(families()["llama3_1"], **changes)
    monkeypatch.setattr(derived_skeleton, "get_family", lambda name: family)


def test_derivation_refuses_what_its_rules_do_not_model(monkeypatch):
    """A family setting megatron-core's rules here do not model, an Arch field they do not read set away
    from its default, linear biases with experts, or a weight table that writes a module they do not
    know (or leaves out one megatron-core builds): ``NotDerivable`` saying why, never a guess; and
    ``describe_model`` then asks megatron-core (the cached path above)."""
    import dataclasses

    from megatron_patch.models.mapping import REPLICATED, Rule
    from megatron_patch.models.shape import skeleton as sk

    llama = families()["llama3_1"]
    arch = parse_arch(llama.tiny_config)
    assert ds.derive_skeleton(arch).chunks
    with monkeypatch.context() as m:
        _with_family(m, transformer_config_kwargs=lambda a: {"window_size": (128, 0)})
        with pytest.raises(ds.NotDerivable, match="sets window_size"):
            ds.derive_skeleton(arch)
    sink = Rule("decoder.layers.{layer}.self_attention.core_attention.softmax_offset",
                "model.layers.{layer}.self_attn.sinks", REPLICATED)
    with monkeypatch.context() as m:
        _with_family(m, weight_rules=lambda a: llama.weight_rules(a) + [sink])
        with pytest.raises(ds.NotDerivable, match="disagree on 4 parameter.*core_attention.softmax_offset"):
            ds.derive_skeleton(arch)
    with monkeypatch.context() as m:
        _with_family(m, weight_rules=lambda a: [r for r in llama.weight_rules(a) if "linear_proj" not in r.mcore])
        with pytest.raises(ds.NotDerivable, match="linear_proj.weight"):
            ds.derive_skeleton(arch)
    with monkeypatch.context() as m:
        m.setattr(ds, "_ARCH_FIELDS", ds._ARCH_FIELDS - {"dense_layers"})
        assert ds.derive_skeleton(arch).chunks                                  # at its default: nothing new
        with pytest.raises(ds.NotDerivable, match="Arch.dense_layers"):
            ds.derive_skeleton(dataclasses.replace(arch, dense_layers=(1,)))
    moe = parse_arch(families()["mixtral"].tiny_config)
    with pytest.raises(ds.NotDerivable, match="linear biases"):
        ds.derive_skeleton(dataclasses.replace(moe, linear_bias=True))
    # describe_model: derived when it can, megatron-core's (through the cache) when not
    asked = []
    monkeypatch.setattr(sk, "_describe_cached", lambda *key: asked.append(key) or "megatron's")
    sk._derived.cache_clear()
    try:
        assert sk.describe_model(arch).chunks and not asked
        assert sk.describe_model(arch, layers=(0,)) == "megatron's"          # models/shape/model_shape.py's question
        monkeypatch.setattr(sk, "derive_skeleton", _not_derivable)
        sk._derived.cache_clear()
        assert sk.describe_model(arch) == "megatron's" and len(asked) == 2
    finally:
        sk._derived.cache_clear()


def test_first_conversion_imports_neither_megatron_nor_torch(tiny_hf_dirs, tmp_path):
    """Every family built from megatron-core's standard layers converts the first time (an empty skeleton
    cache), both ways and in both formats, without importing megatron-core or torch and without starting
    the skeleton's helper process. Families with layers of their own are asked of megatron-core."""
    import subprocess
    import sys

    derivable = {}
    for name, folder in tiny_hf_dirs.items():
        try:
            ds.derive_skeleton(parse_arch(folder))
            derivable[name] = str(folder)
        except ds.NotDerivable:
            assert families()[name].layer_spec is not None, name  # only own modules go beyond the rules
    dirs = derivable
    code = f"""
import sys
from pathlib import Path
from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf
from megatron_patch.runtime.distributed import ParallelLayout
for name, hf in {dirs!r}.items():
    root = Path({str(tmp_path)!r}) / name
    root.mkdir()
    for fmt in ("legacy", "torch_dist"):
        hf_to_mcore(hf, root / fmt, ParallelLayout(tp=2), fmt, progress=False)
        mcore_to_hf(root / fmt, root / f"back-{{fmt}}", progress=False)
print(sorted(m for m in ("torch", "megatron") if m in sys.modules))
"""
    env = {**os.environ, "MPATCH_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert not (tmp_path / "cache").exists()   # no helper process asked megatron-core
    assert all((tmp_path / name / f"back-{fmt}" / "config.json").is_file() for name in dirs
               for fmt in ("legacy", "torch_dist"))


def test_a_first_conversion_asking_megatron_core_for_its_skeleton_imports_torch_only_in_the_helper(
        tiny_hf_dirs, tmp_path):
    """Gemma 3's skeleton comes from megatron-core, in a helper process; the converter's own process still imports
    neither torch nor megatron-core (it imported torch only to ask whether the machine has a GPU, to start the
    helper: 1.1 s of every such first conversion)."""
    import subprocess
    import sys

    code = f"""
import sys
from megatron_patch.convert.checkpoint import hf_to_mcore
from megatron_patch.runtime.distributed import ParallelLayout
hf_to_mcore({str(tiny_hf_dirs["gemma3"])!r}, {str(tmp_path / "mc")!r}, ParallelLayout(), "torch_dist", progress=False)
print(sorted(m for m in ("torch", "megatron") if m in sys.modules))
"""
    env = {**os.environ, "MPATCH_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert any((tmp_path / "cache").rglob("*")), "the helper process was not asked"


def test_a_legacy_export_of_many_small_experts_streams(tmp_path):
    """mcore2hf of a legacy MoE checkpoint whose experts are small zip records (<= 1 MiB each) streams: the zip
    index kept every small record's bytes after checking them, so memory grew with the experts (the resource audit:
    409 MiB for a 0.52 GiB checkpoint; here 40 MiB for 37)."""
    import tracemalloc

    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    hf = make_tiny_hf_checkpoint("qwen3_moe", tmp_path / "hf", seed=1, num_experts=128, moe_intermediate_size=128)
    hf_to_mcore(hf, tmp_path / "legacy", ParallelLayout(), fmt="legacy", progress=False)
    size = sum(p.stat().st_size for p in (tmp_path / "legacy").rglob("*") if p.is_file())
    tracemalloc.start()
    try:
        mcore_to_hf(tmp_path / "legacy", tmp_path / "out", progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size > 30 * 2**20 and peak < size / 4, (peak, size)

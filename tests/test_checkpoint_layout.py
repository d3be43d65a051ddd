"""The checkpoint layout shared by the converter and the trainer: tracker, iteration folders, atomic and
durable folders, and which checkpoint is complete."""

from __future__ import annotations

import json
import os
import subprocess
import warnings

import pytest
import torch

from megatron_patch.checkpoint_files.layout import (
    RELEASE, TRACKER_NAME, atomic_dir, is_iteration_dir, iteration_dir, latest_complete_iteration, partial_dir,
    read_tracker, remove_stale_partials, torch_dist_problem, write_tracker)
from megatron_patch.errors import UserError
from megatron_patch.outputs import renames


def test_tracker_is_written_as_megatron_writes_it_and_read_back(tmp_path):
    assert read_tracker(tmp_path) is None
    write_tracker(tmp_path, RELEASE)
    assert (tmp_path / TRACKER_NAME).read_text() == "release"
    assert read_tracker(tmp_path) == RELEASE
    write_tracker(tmp_path, 20)
    assert (tmp_path / TRACKER_NAME).read_text() == "20"
    assert read_tracker(tmp_path) == 20
    (tmp_path / TRACKER_NAME).write_text("20\n")  # Megatron-LM strips what it reads; so do we
    assert read_tracker(tmp_path) == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == [TRACKER_NAME]  # no temporary file left
    with pytest.raises(ValueError):
        write_tracker(tmp_path, "latest")


def test_a_damaged_tracker_is_named(tmp_path):
    (tmp_path / TRACKER_NAME).write_text("garbage")
    with pytest.raises(UserError, match="neither 'release' nor an iteration number"):
        read_tracker(tmp_path)


def test_iteration_folders(tmp_path):
    assert iteration_dir(tmp_path, 10) == tmp_path / "iter_0000010"
    assert is_iteration_dir(tmp_path / "iter_0000010") and not is_iteration_dir(tmp_path / "iter_10")


def test_iterations_past_seven_digits_are_found(tmp_path):
    """Megatron-LM names iteration 12345678's folder iter_12345678 (iter_{:07d}), as iteration_dir() does: a
    pattern of exactly 7 digits called it missing, and a resume past iteration 10**7 never found its checkpoint."""
    assert iteration_dir(tmp_path, 12345678) == tmp_path / "iter_12345678"
    assert is_iteration_dir(tmp_path / "iter_12345678") and is_iteration_dir(tmp_path / "iter_999999999999")
    for name in ("iter_00000010", "iter_1000000000000", "iter_+0000010", "iter_000001"):
        assert not is_iteration_dir(tmp_path / name), name  # one name per iteration, no sign, no fewer digits
    root = _run_root(tmp_path, iterations=(9999999, 12345678), tracker=12345678)
    assert latest_complete_iteration(root) == (12345678, [])


def test_atomic_dir_appears_complete_or_not_at_all(tmp_path):
    target = tmp_path / "out"
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
        assert not target.exists() and tmp.name.startswith(".out.mpatch-partial.")
    assert (target / "a").read_text() == "1"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("disk full")
    assert (target / "a").read_text() == "1"  # the old folder is untouched
    with atomic_dir(target) as tmp:
        (tmp / "b").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["b"]  # replaced only when the new one is complete
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_stale_partials_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    target = tmp_path / "iter_0000015"
    stale, live = partial_dir(target, pid=dead.pid), partial_dir(target)
    stale.mkdir()
    live.mkdir()
    remove_stale_partials(target)
    assert not stale.exists() and live.exists()


# --- durability: everything on disk before a name (or the tracker) points at it ---------------------------

@pytest.fixture
def disk_log(monkeypatch):
    """Records, in order, each fsync (the path of the fsynced descriptor) and each rename."""
    events = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst, *a, **k):
        events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
        real_rename(src, dst, *a, **k)

    def replace(src, dst, *a, **k):
        events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
        real_replace(src, dst, *a, **k)

    real_renameat2 = renames.renameat2

    def renameat2(src, dst, flags):
        events.append(("rename", os.path.realpath(src), os.path.realpath(dst)))
        real_renameat2(src, dst, flags)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(renames, "renameat2", renameat2)
    return events


def test_atomic_dir_fsyncs_every_file_and_folder_before_the_rename(tmp_path, disk_log):
    """What the converter's outputs and training checkpoints go through (publish): a power loss after the
    rename cannot leave the folder's name pointing at files still only in the page cache."""
    target = tmp_path / "out"
    with atomic_dir(target) as tmp:
        (tmp / "release").mkdir()
        (tmp / "release" / "w.bin").write_bytes(b"x" * 100)
        (tmp / "sidecar.json").write_text("{}")
        staged = {os.path.realpath(p) for p in [tmp, tmp / "release", tmp / "release" / "w.bin", tmp / "sidecar.json"]}
    renames = [i for i, e in enumerate(disk_log) if e[0] == "rename" and e[2] == os.path.realpath(target)]
    assert len(renames) == 1
    before = {e[1] for e in disk_log[:renames[0]] if e[0] == "fsync"}
    assert staged <= before, staged - before
    # and the parent folder after the rename, which makes the new name itself durable
    assert ("fsync", os.path.realpath(tmp_path)) in disk_log[renames[0]:]
    # a folder is fsynced after the files in it (its entries name them)
    order = [e[1] for e in disk_log if e[0] == "fsync"]
    assert order.index(os.path.realpath(tmp / "release" / "w.bin")) < order.index(os.path.realpath(tmp / "release"))


def test_tracker_reaches_the_disk_before_and_after_its_rename(tmp_path, disk_log):
    write_tracker(tmp_path, 20)
    tracker = os.path.realpath(tmp_path / TRACKER_NAME)
    (i,) = [i for i, e in enumerate(disk_log) if e[0] == "rename" and e[2] == tracker]
    assert disk_log[i - 1][0] == "fsync" and disk_log[i - 1][1] == disk_log[i][1]  # the new content, then the rename
    assert ("fsync", os.path.realpath(tmp_path)) in disk_log[i:]
    assert read_tracker(tmp_path) == 20


# --- which checkpoint is complete --------------------------------------------------------------------------

def _torch_dist(folder, seed=0):
    """A small torch_dist checkpoint as megatron-core writes it: torch DCP files, metadata.json, common.pt."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}, checkpoint_id=str(folder),
                 no_dist=True)
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                      "common_backend": "torch", "common_backend_version": 1}))
    torch.save({"iteration": seed, "scheduler": {"num_steps": seed}}, folder / "common.pt")
    return folder


def _damage(folder, how):
    distcp = sorted(folder.glob("*.distcp"))[0]
    if how == "truncated .distcp":
        distcp.write_bytes(distcp.read_bytes()[:-100])
        return f"{distcp.name} is truncated ({distcp.stat().st_size} bytes; its records end at byte"
    if how == "missing .distcp":
        distcp.unlink()
        return f"{distcp.name} is missing"
    if how == "missing .metadata":
        (folder / ".metadata").unlink()
        return ".metadata is missing"
    if how == "garbage .metadata":
        (folder / ".metadata").write_bytes(b"not a pickle")
        return ".metadata is unreadable (UnpicklingError"
    if how == "missing common.pt":
        (folder / "common.pt").unlink()
        return "common.pt is missing"
    if how == "flipped byte in common.pt":
        import struct
        import zipfile

        data = bytearray((folder / "common.pt").read_bytes())
        with zipfile.ZipFile(folder / "common.pt") as archive:
            info = next(i for i in archive.infolist() if i.filename.endswith("data.pkl"))
        name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
        start = info.header_offset + 30 + name_len + extra_len  # the member's first byte, past its local header
        data[start + info.file_size // 2] ^= 0xFF
        (folder / "common.pt").write_bytes(bytes(data))
        return "common.pt is damaged (its member"
    if how == "truncated common.pt":
        (folder / "common.pt").write_bytes((folder / "common.pt").read_bytes()[:100])
        return "common.pt is unreadable"
    if how == "missing metadata.json":
        (folder / "metadata.json").unlink()
        return "metadata.json is missing"
    raise ValueError(how)


DAMAGE = ["truncated .distcp", "missing .distcp", "missing .metadata", "garbage .metadata", "missing common.pt",
          "flipped byte in common.pt", "truncated common.pt", "missing metadata.json"]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_torch_dist_checkpoint_is_named(tmp_path, how):
    folder = _torch_dist(tmp_path / "ckpt")
    assert torch_dist_problem(folder) is None
    expected = _damage(folder, how)
    problem = torch_dist_problem(folder)
    assert problem is not None and problem.startswith(expected), problem


def _torch_dist_019(folder, seed=0):
    """As megatron-core >= 0.19 writes it: the common state is the byte object ``common_state`` (torch DCP's
    torch.save of a one-element list) inside the .distcp files, and there is no common.pt."""
    import torch.distributed.checkpoint as dcp

    common = [{"iteration": seed, "args": {"num_layers": 2}}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        # megatron's planner keeps the list whole (the default one would flatten it into "....0").
        dcp.save({"w": torch.randn(256, 64), "common_state/shard_0_1": common}, checkpoint_id=str(folder), no_dist=True,
                 planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    return folder


def test_the_common_state_of_megatron_core_019_is_found_inside_the_distcp(tmp_path):
    from megatron_patch.checkpoint_files.torch_dist import COMMON_STATE_OBJECT, TorchDistReader, read_metadata

    folder = _torch_dist_019(tmp_path / "ckpt", seed=7)
    assert torch_dist_problem(folder) is None
    assert TorchDistReader(folder).common_state() == {"iteration": 7, "args": {"num_layers": 2}}
    # The object's record is checked like a tensor's: cut the file inside it and the checkpoint is incomplete.
    name, start, length, _ = read_metadata(folder / ".metadata").storage[(COMMON_STATE_OBJECT, None)]
    distcp = folder / name
    distcp.write_bytes(distcp.read_bytes()[:start + length - 1])
    assert torch_dist_problem(folder).startswith(f"{name} is truncated")


def test_a_torch_dist_checkpoint_without_any_common_state_is_named(tmp_path):
    folder = _torch_dist(tmp_path / "ckpt")
    (folder / "common.pt").unlink()
    assert torch_dist_problem(folder) == "common.pt is missing"
    assert torch_dist_problem(folder, common=False) is None


def _run_root(tmp_path, iterations=(2, 4, 6), tracker=6):
    for i in iterations:
        _torch_dist(iteration_dir(tmp_path, i), seed=i)
    if tracker is not None:
        write_tracker(tmp_path, tracker)
    return tmp_path


def test_the_newest_complete_checkpoint_is_taken_with_a_warning_for_each_skipped(tmp_path):
    root = _run_root(tmp_path)
    assert latest_complete_iteration(root) == (6, [])
    why6 = _damage(iteration_dir(root, 6), "truncated .distcp")
    why4 = _damage(iteration_dir(root, 4), "missing common.pt")
    latest, notes = latest_complete_iteration(root)
    assert latest == 2 and len(notes) == 3
    assert notes[0].startswith(f"{iteration_dir(root, 6)} is incomplete or damaged: {why6}")
    assert notes[1] == f"{iteration_dir(root, 4)} is incomplete or damaged: {why4}"
    # what reads it says which iteration it holds (an export of iteration 2 said nothing of it)
    assert notes[2] == "iteration 2 (iter_0000002) is read instead"


def test_the_tracker_bounds_the_choice_and_a_bad_tracker_is_skipped(tmp_path):
    root = _run_root(tmp_path, tracker=4)
    # a tracker moved back by hand is respected, and said
    assert latest_complete_iteration(root) == (4, [f"{root / TRACKER_NAME} names iteration 4, and 1 newer iteration "
                                                   "folder(s) (iter_0000006) are left as they are"])
    write_tracker(root, 8)
    latest, notes = latest_complete_iteration(root)
    assert latest == 6 and notes == [f"{root / TRACKER_NAME} names iteration 8, but iter_0000008 is missing"]
    (root / TRACKER_NAME).write_bytes(b"\xff\xfe")
    latest, notes = latest_complete_iteration(root)
    assert latest == 6 and "is unreadable" in notes[0] and "looking for the newest complete iteration folder" in notes[0]
    (root / TRACKER_NAME).unlink()
    latest, notes = latest_complete_iteration(root)
    assert latest == 6 and notes == [f"{root / TRACKER_NAME} is missing; looking for the newest complete iteration "
                                     "folder instead"]


def test_nothing_saved_yet_and_nothing_complete(tmp_path):
    assert latest_complete_iteration(tmp_path / "absent") == (None, [])
    assert latest_complete_iteration(tmp_path) == (None, [])
    (tmp_path / ".iter_0000002.mpatch-partial.1").mkdir()  # a partial folder is not a checkpoint
    assert latest_complete_iteration(tmp_path) == (None, [])
    root = _run_root(tmp_path, iterations=(2, 4), tracker=4)
    _damage(iteration_dir(root, 4), "missing .metadata")
    _damage(iteration_dir(root, 2), "truncated .distcp")
    with pytest.raises(UserError) as err:
        latest_complete_iteration(root)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"no complete checkpoint in {root} (")
    assert "iter_0000004 is incomplete or damaged: .metadata is missing" in message
    assert "iter_0000002 is incomplete or damaged: __0_0.distcp is truncated" in message
    write_tracker(root, RELEASE)
    with pytest.raises(UserError, match="holds converted weights"):
        latest_complete_iteration(root)

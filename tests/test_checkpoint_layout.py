"""The checkpoint layout shared by the converter and the trainer: tracker, iteration folders, atomic folders."""

from __future__ import annotations

import subprocess

import pytest

from megatron_patch.checkpoint_layout import (
    RELEASE, TRACKER_NAME, atomic_dir, is_iteration_dir, iteration_dir, partial_dir, read_tracker,
    remove_stale_partials, write_tracker)
from megatron_patch.errors import UserError


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

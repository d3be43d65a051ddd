"""Nothing lost, nothing half-done (issue 19): one writer per output, publishing that cannot clobber, what
killed runs left recovered through the lock, --force only onto an earlier output, no output overlapping an
input, and the manifest every output carries (mpatch verify, mcore2hf's check)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME, read_manifest
from megatron_patch.convert.checkpoint import hf_to_mcore
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.outputs import renames
from megatron_patch.outputs.folders import atomic_dir, partial_dir, replaced_dir
from megatron_patch.outputs.lock import OutputLock, live_ranks, lock_path, register_rank
from megatron_patch.runtime.distributed import ParallelLayout
from tests.convert_helpers import leftovers, run_cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    folder = make_tiny_hf_checkpoint("llama3_1", tmp_path_factory.mktemp("hf") / "llama", seed=1)
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def ckpt(hf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ck") / "ck"
    hf_to_mcore(hf, out, ParallelLayout(), progress=False)
    return out


def _env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _one_line_error(rc: int, err: str, *words: str, code: int = 2) -> None:
    assert rc == code and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


# --- one writer per output ------------------------------------------------------------------------------

def test_second_writer_is_refused_naming_the_first_and_the_lock_goes_on_exit(hf, tmp_path, capsys):
    target = tmp_path / "out"
    with OutputLock(target, "--save-dir"):
        rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(target), "--quiet")
        _one_line_error(rc, err, "is being written by", f"pid {os.getpid()}", "mpatch")
        assert not target.exists()
    assert not lock_path(target).exists()
    rc, _ = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(target), "--quiet")
    assert rc == 0 and not leftovers(target)  # the lock file is removed on a clean exit


def test_an_output_inside_a_folder_being_written_is_refused(hf, tmp_path, capsys):
    """hf2mcore --save-dir RUN/final while a run trained into RUN took only its own lock: the run's export then
    replaced the conversion without a word (the outputs audit). An output inside a folder whose writer is alive is
    refused, nothing made there; a lock file left by a writer that is gone says nothing."""
    run = tmp_path / "RUN"
    run.mkdir()
    argv = ["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(run / "final"), "--quiet"]
    with OutputLock(run, "OUTPUT_BASEPATH"):
        _one_line_error(*run_cli(capsys, *argv), f"lies inside {run}, which is being written by", f"pid {os.getpid()}")
        assert list(run.iterdir()) == []
    lock_path(run).write_text('{"pid": 1}')  # stale: nobody holds it
    assert run_cli(capsys, *argv)[0] == 0 and (run / "final").is_dir()


def test_a_stale_lock_is_taken_over_saying_so(tmp_path, capsys):
    dead = subprocess.Popen(["true"])
    dead.wait()
    target = tmp_path / "out"
    lock_path(target).write_text(json.dumps({"pid": dead.pid, "host": "h", "command": "mpatch convert", "started": 0}))
    with atomic_dir(target) as tmp:
        (tmp / "a").write_text("1")
    err = capsys.readouterr().err
    assert f"took over the lock of {target} left by pid {dead.pid}" in err and err.count("\n") == 1
    assert (target / "a").read_text() == "1" and not lock_path(target).exists()


def test_a_lock_whose_record_meets_a_full_disk_is_removed(tmp_path, monkeypatch):
    """The lock file is made, then its owner's record written: on a full disk that write failed and the empty lock
    file stayed beside the output (align's and eval's on a full --output-dir, every writer's; the s64 audit)."""
    from megatron_patch.outputs import lock as lock_module

    def no_space(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lock_module.os, "pwrite", no_space)
    target = tmp_path / "out"
    with pytest.raises(OSError, match="No space left"):
        with atomic_dir(target):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _not_a_plain_file(kind: str, lock: Path, victim: Path) -> None:
    """Put something that is not a plain file of its own at ``lock`` (``victim``: what a link leads to)."""
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "dangling symlink":  # O_CREAT through it would create the file it names
        lock.symlink_to(victim.with_name("created-through-the-link"))
    elif kind == "hard link":
        os.link(victim, lock)
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "folder":
        lock.mkdir()
    elif kind == "device":  # /dev/null's numbers: opening it writes nowhere, but it is no lock
        try:
            os.mknod(lock, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod needs root (CAP_MKNOD), which this run lacks")


@pytest.mark.parametrize("kind,said", [("symlink", "is a symlink (to"), ("dangling symlink", "is a symlink (to"),
                                       ("hard link", "is a file with 2 names (hard links)"), ("fifo", "is a FIFO"),
                                       ("folder", "is a folder"), ("device", "is a device")])
def test_a_lock_that_is_not_a_plain_file_is_refused_and_nothing_is_written_through_it(kind, said, tmp_path):
    """N2: the lock was opened without O_NOFOLLOW, and truncated and rewritten: a symlink at its name made every
    writer overwrite the link's target with the lock's JSON."""
    from megatron_patch.errors import UserError

    target = tmp_path / "out"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    _not_a_plain_file(kind, lock_path(target), victim)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(UserError, match="not a plain file: mpatch's lock is always a plain file") as refused:
        with atomic_dir(target, what="--save-dir") as tmp:
            (tmp / "a").write_text("1")
    assert str(refused.value).startswith(f"{lock_path(target)} {said}")
    assert victim.read_text() == "precious" and sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_ranks_folder_that_is_not_a_folder_is_refused(tmp_path):
    """Through a symlinked ``.NAME.mpatch-lock.ranks``, the launcher's clean-up of ranks that are gone removed
    every file no process held from wherever the link led, and the ranks marked themselves there."""
    from megatron_patch.errors import UserError

    out = tmp_path / "run"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("keep me")
    ranks = tmp_path / ".run.mpatch-lock.ranks"
    ranks.symlink_to(elsewhere)
    for check in (live_ranks, register_rank):
        with pytest.raises(UserError, match="is a symlink .*nothing was written through it"):
            check(out)
    assert [p.name for p in elsewhere.iterdir()] == ["notes.txt"] and (elsewhere / "notes.txt").read_text() == "keep me"
    ranks.unlink()
    ranks.mkdir()
    os.mkfifo(ranks / "host.1")  # a mark that is not a plain file: no open of it, no removal
    with pytest.raises(UserError, match="is a FIFO, not a plain file"):
        live_ranks(out)
    assert (ranks / "host.1").exists()


def _live_rank(out: Path) -> subprocess.Popen:
    """A process marked as a rank writing ``out`` (as ``mpatch train``'s ranks mark themselves), once it is."""
    rank = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from megatron_patch.outputs.lock import register_rank
        register_rank({str(out)!r})
        print("ready", flush=True)
        time.sleep(120)
    """)], env=_env(), stdout=subprocess.PIPE, text=True)
    assert rank.stdout.readline().strip() == "ready"
    return rank


def test_ranks_of_an_earlier_run_are_named_until_they_end(tmp_path):
    out = tmp_path / "run"
    rank = _live_rank(out)
    try:
        assert live_ranks(out) == [f"pid {rank.pid} on {os.uname().nodename}"]
    finally:
        rank.kill()
        rank.wait()
    assert live_ranks(out) == [] and not any(p.name.endswith(".ranks") for p in tmp_path.iterdir())
    fd = register_rank(out)  # this process: not "earlier"
    os.close(fd)


@pytest.mark.parametrize("goes", ["before its look", "after its look"])
def test_a_rank_marks_itself_though_the_empty_ranks_folder_goes_meanwhile(tmp_path, monkeypatch, goes):
    """Another rank's end, or a launcher's live_ranks, removes the ranks' folder once it is empty: a rank that found
    the folder there and had not yet made its mark in it failed with an internal error (a CI run's forked ranks), or
    called it "not a folder"."""
    from megatron_patch.outputs import lock

    out = tmp_path / "run"
    folder = tmp_path / ".run.mpatch-lock.ranks"
    folder.mkdir()  # left by a rank that is ending
    checked = lock._check_ranks_dir

    def look_losing_it(path):
        if goes == "after its look":
            checked(path)
        if path.is_dir() and not any(path.iterdir()):
            path.rmdir()  # that rank's release_rank, between this rank's mkdir and its mark
        if goes == "before its look":
            checked(path)

    monkeypatch.setattr(lock, "_check_ranks_dir", look_losing_it)
    fd = register_rank(out)
    try:
        assert [p.name for p in folder.iterdir()] == [f"{os.uname().nodename}.{os.getpid()}"]
    finally:
        os.close(fd)
    assert live_ranks(out) == [] and not folder.exists()


# --- publishing that cannot clobber, and what killed runs left ----------------------------------------------

def test_a_name_taken_meanwhile_is_never_replaced(tmp_path):
    from megatron_patch.errors import UserError

    target = tmp_path / "out"
    with pytest.raises(UserError, match="nothing was replaced"):
        with atomic_dir(target, replace=False) as tmp:
            (tmp / "new").write_text("new")
            target.mkdir()
            (target / "theirs").write_text("theirs")  # something that does not take the lock
    assert [p.name for p in target.iterdir()] == ["theirs"] and not leftovers(target)


_KILL_DURING_REPLACE = """
import os, signal, sys
from megatron_patch.outputs import folders, renames
mode = sys.argv[1]
if mode == "exchange":     # killed right after the one-step swap, before the old folder is removed
    real = folders.exchange
    def exchange(a, b):
        real(a, b)
        os.kill(os.getpid(), signal.SIGKILL)
    folders.exchange = exchange
else:                      # a filesystem without renameat2 flags, killed between the fallback's two renames
    def exchange(a, b):
        raise renames.FlagsUnsupported(22, "Invalid argument")
    folders.exchange = exchange
    real_rename = os.rename
    def rename(src, dst):
        real_rename(src, dst)
        if ".mpatch-replaced." in str(dst):
            os.kill(os.getpid(), signal.SIGKILL)
    os.rename = rename
from megatron_patch.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_sigkill_during_a_forced_replace_leaves_the_previous_output_whole(hf, ckpt, tmp_path, capsys, mode):
    target = tmp_path / "ck"
    shutil.copytree(ckpt, target)
    before = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
    proc = subprocess.Popen([sys.executable, "-c", _KILL_DURING_REPLACE, mode, "convert", "hf2mcore", "--hf-dir",
                             str(hf), "--save-dir", str(target), "--format", "legacy", "--force", "--quiet"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, stderr
    if mode == "exchange":  # the new output is in place, whole; the old one waits under the partial name
        assert json.loads((target / "mpatch_checkpoint.json").read_text())["checkpoint_format"] == "legacy"
        assert run_cli(capsys, "verify", str(target))[0] == 0
        assert any(".mpatch-partial." in n for n in leftovers(target))
    else:  # nothing at the name for now: the previous output is parked, and the next holder of the lock restores it
        assert not target.exists() and any(".mpatch-replaced." in n for n in leftovers(target))
    with atomic_dir(target) as tmp:  # any next writer of this output
        if mode == "fallback":
            restored = {p.relative_to(target): p.read_bytes() for p in target.rglob("*") if p.is_file()}
            assert restored == before
        shutil.copytree(target, tmp, dirs_exist_ok=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"note: took over the lock of {target} left by pid {proc.pid}"), err
    assert err[1] == f"note: removed .ck.mpatch-partial.{proc.pid}, the unfinished output of an earlier run", err
    if mode == "fallback":
        assert err[2] == f"note: restored {target} from .ck.mpatch-replaced.{proc.pid}: an earlier replace of it was " \
                         "interrupted", err
    assert len(err) == (3 if mode == "fallback" else 2) and not leftovers(target)


def test_replaced_folder_is_removed_when_the_replace_completed(tmp_path, capsys):
    target = tmp_path / "out"
    target.mkdir()
    (target / "new").write_text("new")
    replaced_dir(target, pid=1).mkdir()
    (replaced_dir(target, pid=1) / "old").write_text("old")
    with atomic_dir(target) as tmp:
        (tmp / "newer").write_text("newer")
    assert [p.name for p in target.iterdir()] == ["newer"] and not leftovers(target)
    assert "the previous out an earlier replace left behind" in capsys.readouterr().err


def test_a_symlink_at_a_parked_name_is_removed_never_put_back(tmp_path, capsys):
    """Only a folder parked by an interrupted replace is put back: a symlink at that name would have become the
    output, leading wherever it pointed."""
    from megatron_patch.outputs.folders import recover

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("keep me")
    target = tmp_path / "out"
    replaced_dir(target, pid=1).symlink_to(elsewhere)
    recover(target)
    assert not os.path.lexists(target) and not os.path.lexists(replaced_dir(target, pid=1))
    assert (elsewhere / "notes.txt").read_text() == "keep me"


def test_without_renameat2_flags_the_fallback_still_publishes(monkeypatch, tmp_path):
    def unsupported(src, dst, flags):
        raise renames.FlagsUnsupported(22, "Invalid argument")

    monkeypatch.setattr(renames, "renameat2", unsupported)
    target = tmp_path / "out"
    for value in ("1", "2"):
        with atomic_dir(target) as tmp:
            (tmp / "v").write_text(value)
        assert (target / "v").read_text() == value and not leftovers(target)


# --- --force replaces only an earlier output; no output overlaps an input --------------------------------------

def test_force_replaces_only_what_mpatch_wrote(hf, ckpt, tmp_path, capsys):
    def hf2mcore(target, *extra):
        return run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(target), "--quiet",
                       "--force", *extra)

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "precious.txt").write_text("keep me")
    rc, err = hf2mcore(notes)
    _one_line_error(rc, err, f"has no {MANIFEST_NAME}, so mpatch did not write it", "precious.txt")
    assert (notes / "precious.txt").read_text() == "keep me"
    # an earlier output with a file added after it was written
    added = tmp_path / "added"
    shutil.copytree(ckpt, added)
    (added / "notes.md").write_text("mine")
    rc, err = hf2mcore(added)
    _one_line_error(rc, err, "notes.md", "does not list")
    # a folder without a manifest, whatever it holds: an HF model folder (which passed as an export of mpatch
    # from before manifests, and was replaced by another model's export), another tool's checkpoint
    user_hf = tmp_path / "user_hf"
    shutil.copytree(hf, user_hf)
    before = _tree_bytes(user_hf)
    for argv in (["hf2mcore", "--hf-dir", str(hf)], ["mcore2hf", "--load-dir", str(ckpt)]):
        rc, err = run_cli(capsys, "convert", *argv, "--save-dir", str(user_hf), "--force", "--quiet")
        _one_line_error(rc, err, f"has no {MANIFEST_NAME}, so mpatch did not write it", "config.json")
    assert _tree_bytes(user_hf) == before
    pre_manifest = tmp_path / "pre_manifest"
    shutil.copytree(ckpt, pre_manifest)
    (pre_manifest / MANIFEST_NAME).unlink()
    rc, err = hf2mcore(pre_manifest, "--format", "legacy")
    _one_line_error(rc, err, f"has no {MANIFEST_NAME}, so mpatch did not write it")
    # what the manifest does not list and --force would delete: links (to a folder outside too), an empty folder
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep me")
    for name, plant in (("link_to_a_folder", lambda p: p.symlink_to(outside)),
                        ("link_to_a_file", lambda p: p.symlink_to(outside / "keep.txt")),
                        ("empty_folder/", lambda p: p.mkdir())):
        work = tmp_path / f"planted_{name.strip('/')}"
        shutil.copytree(ckpt, work)
        plant(work / name.strip("/"))
        rc, err = hf2mcore(work)
        _one_line_error(rc, err, name, "does not list")
        assert os.path.lexists(work / name.strip("/")) and (outside / "keep.txt").read_text() == "keep me"
    # recognised: this project's outputs
    assert hf2mcore(added.parent / "planted_again")[0] == 0
    assert hf2mcore(added.parent / "planted_again", "--format", "legacy")[0] == 0
    assert not leftovers(added.parent / "planted_again")


def _tree_bytes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_force_never_replaces_a_training_runs_checkpoints_or_export(hf, ckpt, tmp_path, capsys):
    """A run's checkpoint/ (a tracker beside iter_* folders) and its final/ (a manifest listing every file) both
    passed as an earlier converter output, so one mistyped --save-dir with --force (which every Pai converter line
    adds) deleted the run's checkpoints. Made here as a run lays them out: an iteration holds train_state.json
    (checkpointing.py), final/'s manifest names 'mpatch train' (as checkpointing.py writes it)."""
    run = tmp_path / "run"
    iteration = run / "checkpoint" / "iter_0000004"
    shutil.copytree(ckpt / "release", iteration)
    (iteration / "train_state.json").write_text(json.dumps({"iteration": 4}))
    (run / "checkpoint" / "latest_checkpointed_iteration.txt").write_text("4")
    shutil.copytree(ckpt, run / "final")
    manifest = json.loads((run / "final" / MANIFEST_NAME).read_text())
    (run / "final" / MANIFEST_NAME).write_text(json.dumps({**manifest, "tool": "mpatch train, final export of iteration 4"}))
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    for target, words in ((run / "checkpoint", "iter_0000004 holds its training state"),
                          (run / "final", "is a training run's export (mpatch train, final export of iteration 4)")):
        for argv in (["hf2mcore", "--hf-dir", str(hf)], ["mcore2hf", "--load-dir", str(ckpt)]):
            rc, err = run_cli(capsys, "convert", *argv, "--save-dir", str(target), "--force", "--quiet")
            _one_line_error(rc, err, words, "--force never replaces a training run's files")
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    # a conversion's own output is still replaced
    assert run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "again"),
                   "--quiet")[0] == 0
    assert run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "again"),
                   "--quiet", "--force")[0] == 0


def test_force_replaces_only_an_earlier_output_of_the_same_command(hf, ckpt, tmp_path, capsys):
    """align --report-dir X --force (and eval --output-dir) replaced any output of mpatch, a converted checkpoint
    included: one mistyped path deleted a conversion. Each command's --force now replaces its own outputs only;
    the converters' outputs stay interchangeable (checkpoints and exports are both mpatch convert's)."""
    from megatron_patch.checkpoint.outputs import check_target
    from megatron_patch.errors import UserError

    work = tmp_path / "ck"
    shutil.copytree(ckpt, work)
    rc, err = run_cli(capsys, "align", "--hf-dir", str(hf), "--dtype", "fp32", "--seq-len", "16", "--quiet",
                      "--report-dir", str(work), "--force")
    _one_line_error(rc, err, "--force replaces only an earlier output of mpatch align",
                    "was written by mpatch convert hf2mcore, not by mpatch align")
    assert sorted(p.name for p in work.iterdir()) == sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(UserError, match="not by mpatch eval"):
        check_target(work, True, what="--output-dir", writer="mpatch eval")
    report = tmp_path / "report"
    assert run_cli(capsys, "align", "--hf-dir", str(hf), "--dtype", "fp32", "--seq-len", "16", "--quiet",
                   "--report-dir", str(report))[0] in (0, 1)
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(report), "--force",
                      "--quiet")
    _one_line_error(rc, err, "was written by mpatch align, not by mpatch convert")
    # without its manifest, a report is no longer known as mpatch's, to any command
    (report / MANIFEST_NAME).unlink()
    for writer in ("mpatch convert", "mpatch align"):
        with pytest.raises(UserError, match=f"has no {MANIFEST_NAME}, so mpatch did not write it"):
            check_target(report, True, writer=writer)
    # one converter's output is another's to replace
    export = tmp_path / "export"
    assert run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(work), "--save-dir", str(export), "--quiet")[0] == 0
    assert run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(export), "--force",
                   "--quiet")[0] == 0


def test_no_output_overlaps_an_input(hf, ckpt, tmp_path, capsys):
    work = tmp_path / "ck"
    shutil.copytree(ckpt, work)
    # An HF folder written here: a folder added inside it would contradict its manifest (one written elsewhere may
    # hold a conversion's output, as Pai's READMEs lay them out: tests/test_pai_converters.py).
    export = tmp_path / "export"
    assert run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(work), "--save-dir", str(export), "--quiet")[0] == 0
    cases = [
        ["convert", "mcore2hf", "--load-dir", str(work), "--save-dir", str(work / "release"), "--force"],
        ["convert", "mcore2hf", "--load-dir", str(work / "release"), "--save-dir", str(work), "--force"],
        ["convert", "hf2mcore", "--hf-dir", str(export), "--save-dir", str(export / "sub"), "--force"],
        ["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(hf.parent), "--force"],
    ]
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    shutil.copy(hf / "config.json", cfg / "config.json")
    foreign = tmp_path / "foreign"
    shutil.copytree(ckpt, foreign)
    (foreign / "mpatch_checkpoint.json").unlink()
    cases.append(["convert", "mcore2hf", "--load-dir", str(foreign), "--hf-config", str(cfg / "config.json"),
                  "--save-dir", str(cfg), "--force"])
    for argv in cases:
        rc, err = run_cli(capsys, *argv, "--quiet")
        _one_line_error(rc, err, "overlaps the input")
    assert (cfg / "config.json").exists() and (work / "release").is_dir()
    # an output under a regular file
    (tmp_path / "file").write_text("")
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "file" / "x"))
    _one_line_error(rc, err, "which is a file")


def test_force_onto_an_immutable_folder_is_one_line(hf, ckpt, tmp_path, capsys):
    target = tmp_path / "ck"
    shutil.copytree(ckpt, target)
    if subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (not root, or a filesystem without the flag)")
    try:
        rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(target), "--force",
                          "--quiet")
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)
    _one_line_error(rc, err, "cannot replace", "left as it was")
    assert run_cli(capsys, "verify", str(target))[0] == 0 and not leftovers(target)


def test_an_empty_folder_that_cannot_be_replaced_is_refused_before_the_work(hf, tmp_path, capsys, monkeypatch):
    """An empty folder is a valid output, which the finished output takes the place of; an empty mount point (a
    container's volume) or an immutable folder cannot be removed, and the conversion ended in an internal error after
    all its work. Refused under the lock before the work now; an empty folder that can go is put back where the
    run fails."""
    from megatron_patch.outputs import folders

    busy = tmp_path / "volume"
    busy.mkdir()
    removable = Path.rmdir

    def rmdir(self):
        if self == busy:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(self))
        removable(self)

    monkeypatch.setattr(Path, "rmdir", rmdir)
    worked = []
    monkeypatch.setattr(folders, "partial_dir", lambda target, pid=None: worked.append(target) or
                        target.parent / f".{target.name}.partial")
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(busy), "--quiet")
    _one_line_error(rc, err, f"{busy} is an empty folder that cannot be replaced (Device or resource busy",
                    f"give a --save-dir inside it, such as {busy / 'out'}")
    assert worked == [] and busy.is_dir() and not any(busy.iterdir())
    fixed = tmp_path / "immutable"  # chattr +i: nothing can be created inside it either
    fixed.mkdir()
    monkeypatch.setattr(Path, "rmdir", lambda self: (_ for _ in ()).throw(
        OSError(errno.EPERM, os.strerror(errno.EPERM), str(self))) if self == fixed else removable(self))
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(fixed), "--quiet")
    _one_line_error(rc, err, f"{fixed} is an empty folder that cannot be replaced (Operation not permitted",
                    "choose another --save-dir")
    monkeypatch.setattr(Path, "rmdir", removable)

    empty = tmp_path / "empty"
    empty.mkdir(mode=0o750)
    os.chmod(empty, 0o750)
    with pytest.raises(RuntimeError, match="the work failed"):
        with atomic_dir(empty):
            assert not empty.exists()  # taken at the start: the finished output takes its place
            raise RuntimeError("the work failed")
    assert empty.is_dir() and oct(empty.stat().st_mode & 0o777) == oct(0o750) and not any(empty.iterdir())


def test_a_file_size_limit_while_converting_is_one_line_naming_it(hf, tmp_path):
    """A job's `ulimit -f` (or a filesystem's largest file) stops a write with EFBIG: an internal error before,
    now the full disk's one line, saying what limits and that the output is as it was."""
    import resource

    target = tmp_path / "ck"
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_patch", "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir",
         str(target), "--quiet"], env=_env(), capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000)))
    _one_line_error(proc.returncode, proc.stderr, "File too large", "a file reached the largest size allowed "
                    "(`ulimit -f`, or the filesystem's limit)", f"{target} is as it was before this run")
    assert not target.exists() and not leftovers(target)


def test_a_full_disk_anywhere_is_bad_input_in_one_line(monkeypatch, capsys):
    """align's report and eval's task data met a file-size limit as an internal error (exit 3 and 1): a full disk,
    quota or file-size limit is bad input in whatever command meets it, a writer's wrapping of it too."""
    from megatron_patch.cli import families, main

    for code, words in ((errno.EFBIG, "a file reached the largest size allowed"), (errno.ENOSPC, "MiB free there")):
        def full(args, code=code):
            try:
                raise OSError(code, os.strerror(code), "/tmp/report/plot.png")
            except OSError as exc:
                raise RuntimeError("the writer failed") from exc

        monkeypatch.setattr(families, "run", full)
        assert main(["families"]) == 2
        _one_line_error(2, capsys.readouterr().err, f"mpatch families: error: writing failed: [Errno {code}]",
                        "(/tmp/report/plot.png)", words)


def test_a_full_disk_without_a_file_name_names_the_fullest_place_the_command_writes(monkeypatch, tmp_path):
    """A file's write() fails without a file name: align's and eval's line gave the working directory's room
    ("47961.6 MiB free there" beside a full --output-dir; the env audit). It names the fullest of the command's
    output folder and TMPDIR, where its working files go, and that one's room."""
    import collections
    import tempfile

    from megatron_patch.outputs.full_disk import unwritten_line

    output, tmp = tmp_path / "results" / "ev", tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    usage = collections.namedtuple("usage", "total used free")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    for fullest, want in ((output, f"(in --output-dir {output}), 0.1 MiB free there"),
                          (tmp, f"(in TMPDIR {tmp}), 0.1 MiB free there; what it was writing is left out (an output "
                                "appears only complete): free space (or choose another TMPDIR)")):
        monkeypatch.setattr(shutil, "disk_usage",
                            lambda p, fullest=fullest: usage(2**40, 0, 2**17 if Path(p) == fullest else 2**35))
        line = unwritten_line(full, {"--output-dir": str(output)})
        assert want in line, line


# --- the manifest ------------------------------------------------------------------------------------------------

def test_every_conversion_carries_a_manifest_that_finds_a_flipped_byte(ckpt, tmp_path, capsys):
    work = tmp_path / "ck"
    shutil.copytree(ckpt, work)
    manifest = json.loads((work / MANIFEST_NAME).read_text())
    assert manifest["tool"] == "mpatch convert hf2mcore" and manifest["digest"] == "xxh3_128"
    assert set(manifest["files"]) == {p.relative_to(work).as_posix() for p in work.rglob("*")
                                      if p.is_file() and p.name != MANIFEST_NAME}
    hf_out = tmp_path / "hf_out"
    assert run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(work), "--save-dir", str(hf_out), "--quiet")[0] == 0
    assert run_cli(capsys, "verify", str(hf_out))[0] == 0
    assert json.loads((hf_out / MANIFEST_NAME).read_text())["tool"] == "mpatch convert mcore2hf"
    victim = sorted((work / "release").glob("*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    rc, err = run_cli(capsys, "verify", str(work))
    _one_line_error(rc, err, victim.name, "does not match its digest")
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(work), "--save-dir", str(tmp_path / "x"), "--quiet")
    _one_line_error(rc, err, victim.name, "does not match its digest")
    assert not (tmp_path / "x").exists() and not leftovers(tmp_path / "x")
    # truncated, and missing
    victim.write_bytes(bytes(data[:-8]))
    _one_line_error(*run_cli(capsys, "verify", str(work)), victim.name, "bytes, but")
    victim.unlink()
    _one_line_error(*run_cli(capsys, "verify", str(work)), victim.name, "is missing")
    (tmp_path / "empty").mkdir()
    _one_line_error(*run_cli(capsys, "verify", str(tmp_path / "empty")), "has no mpatch_manifest.json")


def test_preprocess_takes_the_lock_and_leaves_a_manifest(tmp_path, capsys):
    from tests.training_helpers import make_tiktoken_file

    tok = make_tiktoken_file(tmp_path / "tok.tiktoken", [])
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    prefix = tmp_path / "p"
    stale = partial_dir(f"{prefix}_text_document", pid=1)  # a killed run's
    stale.mkdir()
    (stale / "p_text_document.bin").write_bytes(b"x")
    argv = ["preprocess", "--input", str(data), "--output-prefix", str(prefix), "--tokenizer", str(tok), "--quiet"]
    with OutputLock(f"{prefix}_text_document", "--output-prefix"):
        _one_line_error(*run_cli(capsys, *argv), "is being written by")
    assert run_cli(capsys, *argv)[0] == 0 and not stale.exists()
    manifest = tmp_path / f"p_text_document.{MANIFEST_NAME}"
    assert set(json.loads(manifest.read_text())["files"]) == {"p_text_document.bin", "p_text_document.idx"}
    assert run_cli(capsys, "verify", str(manifest))[0] == 0
    # either file of the pair names its manifest (before: read as a manifest, "is not valid JSON")
    for suffix in (".bin", ".idx"):
        assert run_cli(capsys, "verify", f"{prefix}_text_document{suffix}")[0] == 0
    _one_line_error(*run_cli(capsys, "verify", str(data)), "is neither a folder nor a manifest")
    Path(f"{prefix}_text_document.idx").write_bytes(b"\0" * 10)
    _one_line_error(*run_cli(capsys, "verify", str(tmp_path)), "p_text_document.idx")
    _one_line_error(*run_cli(capsys, "verify", f"{prefix}_text_document.bin"), "p_text_document.idx")


def test_the_working_directory_is_never_an_output(hf, ckpt, tmp_path, capsys, monkeypatch):
    """`cd ck && mpatch convert hf2mcore --save-dir .` published by putting a new folder in the place of the empty
    one the shell stood in: "wrote .", the shell left in a deleted folder, and its next command an internal error.
    align --report-dir . ran the whole alignment first. Refused in one line now, before any work, and so is a
    --force onto an output that holds the working directory; a deleted working directory is one line, exit 2."""
    import megatron_patch.align.alignment as alignment

    monkeypatch.setattr(alignment, "run_alignment", lambda *a, **k: pytest.fail("the alignment ran"))
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for argv in (["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", "."],
                 ["align", "--hf-dir", str(hf), "--report-dir", "."],
                 ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(here)]):
        rc, err = run_cli(capsys, *argv, "--quiet")
        _one_line_error(rc, err, f"{here} is the working directory", f"such as {here / 'out'}")
        assert os.path.samefile(".", here) and not any(here.iterdir()) and not leftovers(here)
    earlier = tmp_path / "earlier"
    shutil.copytree(ckpt, earlier)
    monkeypatch.chdir(earlier / "release")
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(earlier), "--force",
                      "--quiet")
    _one_line_error(rc, err, f"{earlier} is the working directory or holds it")
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", "", "--quiet")
    _one_line_error(rc, err, "--save-dir is an empty path")
    monkeypatch.chdir(here)
    here.rmdir()
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", "sub", "--quiet")
    _one_line_error(rc, err, "the working directory no longer exists")


def test_align_report_dir_has_one_writer(hf, tmp_path, capsys):
    report = tmp_path / "report"
    with OutputLock(report, "--report-dir"):
        rc, err = run_cli(capsys, "align", "--hf-dir", str(hf), "--report-dir", str(report), "--quiet")
    assert rc == 2 and "is being written by" in err and err.count("\n") == 1, err


def test_the_report_dir_is_checked_before_the_run_and_never_written_into(hf, tmp_path, capsys, monkeypatch):
    """N4: align wrote its report into a folder the user had, over their report.md. N15: a --report-dir naming
    a file was refused only after the whole run, as an internal error (exit 3). Both are refused now before
    anything runs, --force or not."""
    import megatron_patch.align.alignment as alignment

    def no_run(*args, **kwargs):
        raise AssertionError("the alignment ran before the report folder was checked")

    monkeypatch.setattr(alignment, "run_alignment", no_run)
    file = tmp_path / "report"
    file.write_text("a file")
    rc, err = run_cli(capsys, "align", "--hf-dir", str(hf), "--report-dir", str(file), "--quiet")
    _one_line_error(rc, err, "exists and is not a folder", "--report-dir")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my notes")
    for force in ([], ["--force"]):
        rc, err = run_cli(capsys, "align", "--hf-dir", str(hf), "--report-dir", str(mine), "--quiet", *force)
        _one_line_error(rc, err, str(mine), "--report-dir")
    assert file.read_text() == "a file" and [p.name for p in mine.iterdir()] == ["report.md"]
    assert (mine / "report.md").read_text() == "my notes" and sorted(p.name for p in tmp_path.iterdir()) == ["mine", "report"]


def test_a_refused_report_dir_leaves_nothing_inside_its_input(hf, ckpt, tmp_path, capsys, monkeypatch):
    """align made --report-dir's parent folders before its overlap check: a refused ck/reports/r1 left ck/reports/
    in the checkpoint, which then failed mpatch verify (the outputs audit). A literal "~/r1" (quoted, unexpanded) made
    a folder named ~ here and said "report: ~/r1/report.md"."""
    work = tmp_path / "ck"
    shutil.copytree(ckpt, work)
    rc, err = run_cli(capsys, "align", "--hf-dir", str(hf), "--mcore-dir", str(work), "--report-dir",
                      str(work / "reports" / "r1"), "--quiet")
    _one_line_error(rc, err, "overlaps the input")
    assert not (work / "reports").exists()
    assert run_cli(capsys, "verify", str(work))[0] == 0
    monkeypatch.chdir(tmp_path)
    rc, err = run_cli(capsys, "align", "--hf-dir", str(hf), "--report-dir", "~/reports/r1", "--quiet")
    _one_line_error(rc, err, "begins with a literal ~", "--report-dir")
    assert not (tmp_path / "~").exists()


def test_preprocess_replaces_only_a_pair_its_manifest_lists(tmp_path, capsys):
    """N3: a .bin/.idx pair mpatch never wrote was overwritten, and preprocess had no --force."""
    from tests.training_helpers import make_tiktoken_file

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    tok = make_tiktoken_file(tmp_path / "tok.tiktoken", [])
    prefix = tmp_path / "p"
    argv = ["preprocess", "--input", str(data), "--tokenizer", str(tok), "--output-prefix", str(prefix), "--quiet"]
    idx = tmp_path / "p_text_document.idx"
    idx.write_bytes(b"someone's index")  # one file alone is not mpatch's either
    _one_line_error(*run_cli(capsys, *argv, "--force"), "p_text_document.idx", "mpatch did not write it",
                      "even with --force")
    assert idx.read_bytes() == b"someone's index" and not (tmp_path / "p_text_document.bin").exists()
    idx.unlink()
    assert run_cli(capsys, *argv)[0] == 0
    _one_line_error(*run_cli(capsys, *argv), "an earlier output of mpatch preprocess", "pass --force")
    manifest = tmp_path / f"p_text_document.{MANIFEST_NAME}"
    listed = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**listed, "files": {"p_text_document.bin": listed["files"]["p_text_document.bin"]}}))
    _one_line_error(*run_cli(capsys, *argv, "--force"), "not the two files", "even with --force")
    manifest.write_text(json.dumps(listed))
    assert run_cli(capsys, *argv, "--force")[0] == 0 and run_cli(capsys, "verify", str(manifest))[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir() if "p_text_document" in p.name) == [
        "p_text_document.bin", "p_text_document.idx", f"p_text_document.{MANIFEST_NAME}"]


@pytest.mark.parametrize("renames_done", [1, 2])
def test_a_first_preprocess_stopped_between_its_renames_is_redone_with_force(tmp_path, capsys, monkeypatch,
                                                                             renames_done):
    """A first run killed after its .bin was renamed into place, before its manifest, left a .bin no manifest listed:
    every rerun, --force too, refused it as not mpatch's (the outputs audit). A first pair's manifest goes first."""
    import megatron_patch.training.preprocess as preprocess_module
    from tests.training_helpers import make_tiktoken_file

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    tok = make_tiktoken_file(tmp_path / "tok.tiktoken", [])
    argv = ["preprocess", "--input", str(data), "--tokenizer", str(tok), "--output-prefix", str(tmp_path / "p"),
            "--quiet"]
    real, calls = os.replace, []

    def stopped(src, dst):  # the process killed right after this many renames
        if len(calls) == renames_done:
            raise KeyboardInterrupt
        calls.append(dst)
        real(src, dst)

    monkeypatch.setattr(preprocess_module.os, "replace", stopped)
    rc, _ = run_cli(capsys, *argv)
    monkeypatch.setattr(preprocess_module.os, "replace", real)
    assert rc == 130 and len(calls) == renames_done
    _one_line_error(*run_cli(capsys, *argv), "an earlier output of mpatch preprocess", "pass --force")
    assert run_cli(capsys, *argv, "--force")[0] == 0
    assert run_cli(capsys, "verify", str(tmp_path / f"p_text_document.{MANIFEST_NAME}"))[0] == 0


def test_preprocess_never_writes_into_its_input_folder(tmp_path, capsys):
    """`--input data/ --output-prefix data/corpus` wrote the pair and its manifest among the shards, and the same
    command again was refused (the .bin is not JSONL); moving the pair away, the manifest was read as corpus, 18
    bad lines skipped. Refused first now, in one line, and nothing is written; a file input beside its output is
    fine."""
    from tests.training_helpers import make_tiktoken_file  # as the tests above take it

    data = tmp_path / "data"
    data.mkdir()
    (data / "00.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    tok = make_tiktoken_file(tmp_path / "tok.tiktoken", [])
    for force in ([], ["--force"]):
        _one_line_error(*run_cli(capsys, "preprocess", "--input", str(data), "--tokenizer", str(tok), "--output-prefix",
                                 str(data / "corpus"), "--quiet", *force),
                        f"--output-prefix {data / 'corpus'} is inside the input folder", f"such as {tmp_path / 'corpus'}")
    assert sorted(p.name for p in data.iterdir()) == ["00.jsonl"]
    # a folder under the input is refused too (as a folder in the input, before the output is looked at)
    (data / "sub").mkdir()
    _one_line_error(*run_cli(capsys, "preprocess", "--input", str(data), "--tokenizer", str(tok), "--output-prefix",
                             str(data / "sub" / "corpus"), "--quiet"), "is not a .jsonl or .json file")
    assert sorted(p.name for p in data.rglob("*")) == ["00.jsonl", "sub"]
    argv = ["preprocess", "--input", str(data / "00.jsonl"), "--tokenizer", str(tok), "--output-prefix",
            str(data / "sub" / "corpus"), "--quiet"]
    assert run_cli(capsys, *argv)[0] == 0


# --- a training run's OUTPUT_BASEPATH ----------------------------------------------------------------------------

@pytest.mark.slow
def test_training_run_outputs_one_run_per_folder_and_ranks_die_with_their_launcher(corpus, tmp_path, capsys):
    """One short run, several checks on its folder: every iteration and final/ carry a manifest (mpatch verify
    passes); rerunning the finished run says so and exits 0 (it died in export_model before); a rank of an
    earlier run that is still alive blocks a restart, named by PID; and ranks end when their launcher is
    SIGKILLed (torch elastic gives them sessions of their own); a second launch reaching the running run's
    folder through a symlink is refused as the same folder would be; a finished run leaves no marks beside it; and
    a Ctrl-C ends the job in one line."""
    import time

    from tests.training_helpers import GBS, SEQ, launch, pretrain_args

    out = tmp_path / "out"
    args = pretrain_args(corpus, out, DO="true", TRAIN_TOKENS_OR_ITERS=str(4 * GBS * SEQ), SAVE_INTERVAL="2",
                         WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ))
    first = launch(args)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert not (tmp_path / ".out.mpatch-lock.ranks").exists()  # the ranks' marks go with the run
    for folder in (out / "checkpoint" / "iter_0000002", out / "checkpoint" / "iter_0000004", out / "final"):
        assert (folder / MANIFEST_NAME).is_file(), folder
    rc, err = run_cli(capsys, "verify", str(out))
    assert rc == 0, err
    again = launch(args)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "is complete (iteration 4 of 4)" in again.stdout and str(out / "final") in again.stdout
    assert "Traceback" not in again.stderr and not lock_path(out).exists()

    # Extended to 6 iterations, then stopped in its export (here: the earlier export put back): final/ holds
    # iteration 4, and the rerun said the run was complete with its model there. It exports iteration 6 now.
    shutil.copytree(out / "final", tmp_path / "final-4")
    extended = pretrain_args(corpus, out, DO="true", TRAIN_TOKENS_OR_ITERS=str(6 * GBS * SEQ), SAVE_INTERVAL="2",
                             WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ))
    assert launch(extended).returncode == 0
    shutil.rmtree(out / "final")
    shutil.copytree(tmp_path / "final-4", out / "final")
    rerun = launch(extended)
    assert rerun.returncode == 0 and "is complete" not in rerun.stdout, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert "nothing left to train: iteration 6 of 6" in rerun.stdout
    assert read_manifest(out / "final" / MANIFEST_NAME)["tool"] == "mpatch train, final export of iteration 6"

    longer = pretrain_args(corpus, out, DO="true", TRAIN_TOKENS_OR_ITERS=str(400 * GBS * SEQ), SAVE_INTERVAL="1000",
                           WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ))
    rank = _live_rank(out)
    try:
        blocked = launch(longer)
        assert blocked.returncode == 2 and f"pid {rank.pid}" in blocked.stderr, blocked.stderr[-2000:]
        assert "ranks of an earlier run still write" in blocked.stderr
    finally:
        rank.kill()
        rank.wait()

    script = REPO / "examples" / "llama3_1" / "run_mcore_llama3_1.sh"
    # Ctrl-C: the job ends with one line, the launcher's (the agent's log line and each rank's own were printed too)
    launcher = subprocess.Popen(["bash", str(script), *longer], env={**_env(), "PYTHON": sys.executable},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 240
    while len(live_ranks(out)) < 1:
        assert launcher.poll() is None and time.time() < deadline
        time.sleep(0.5)
    os.killpg(launcher.pid, signal.SIGINT)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 130 and err == "mpatch train: error: the launcher got SIGINT: every rank was " \
        "stopped\n", err[-2000:]
    assert not live_ranks(out)

    launcher = subprocess.Popen(["bash", str(script), *longer], env={**_env(), "PYTHON": sys.executable},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while len(live_ranks(out)) < 1:  # the rank has started and marked itself
        assert launcher.poll() is None and time.time() < deadline
        time.sleep(0.5)
    alive = live_ranks(out)
    link = tmp_path / "link"  # the same folder by another name is the same run folder: one writer
    link.symlink_to(out)
    beside = launch(pretrain_args(corpus, link, DO="true", TRAIN_TOKENS_OR_ITERS=str(400 * GBS * SEQ)))
    assert beside.returncode == 2 and f"{out} is being written by pid" in beside.stderr, beside.stderr[-2000:]
    os.killpg(launcher.pid, signal.SIGKILL)  # bash and the launcher; the rank is in a session of its own
    launcher.wait()
    deadline = time.time() + 60
    while live_ranks(out):
        assert time.time() < deadline, f"ranks outlived their launcher: {alive}"
        time.sleep(0.5)

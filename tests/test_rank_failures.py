"""A training run's failures are one line on the terminal, and no process outlives its run (issue 34):

- an OUTPUT_BASEPATH that is a file, or a run folder that cannot be written (a read-only checkpoint/), is
  bad input: refused in one line before any rank starts, exit 2;
- a rank's failure is one line from the launcher: what a rank cannot write in OUTPUT_BASEPATH is bad input
  (exit 2), anything else an internal error (exit 1) whose traceback is in OUTPUT_BASEPATH/log/, not on the
  terminal;
- after a SIGKILL to the launcher's process group, the ranks die (PR_SET_PDEATHSIG), and so does the helper
  process megatron-core's checkpoint writer keeps for each rank.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import psutil
import pytest

from megatron_patch.cli.train import _interrupted
from tests.convert_helpers import run_cli
from tests.training_helpers import REPO, pretrain_args


def _one_line(rc: int, err: str, *words: str, code: int = 2) -> None:
    assert rc == code and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def _read_only(folder: Path) -> None:
    """``folder`` made read-only for this process: by its mode, or (as root, whom modes do not stop) by a
    read-only tmpfs mounted on it."""
    folder.mkdir(parents=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"root, and no read-only tmpfs can be mounted here: {proc.stderr.decode().strip()}")


# --- refused before any rank starts -------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["base-is-a-file", "parent-is-a-file", "checkpoint-is-a-file",
                                  "checkpoint-read-only"])
def test_an_output_basepath_the_run_cannot_write_is_refused_before_any_rank_starts(corpus, tmp_path, capsys, case):
    """Before, each rank failed at its first write with a traceback (megatron-core's data cache: "Failed to
    write dataset materials", or the save's PermissionError) and the launcher called it a bug, exit 1."""
    out = tmp_path / "out"
    expected = {"base-is-a-file": f"OUTPUT_BASEPATH {out} exists and is not a folder",
                "parent-is-a-file": f"OUTPUT_BASEPATH {out}/run cannot be made: {out} is a file",
                "checkpoint-is-a-file": f"OUTPUT_BASEPATH {out}: checkpoint is a file",
                "checkpoint-read-only": f"OUTPUT_BASEPATH {out}: {out}/checkpoint is "}[case]
    target = out / "run" if case == "parent-is-a-file" else out
    if case.startswith("checkpoint"):
        out.mkdir()
    if case == "checkpoint-read-only":
        _read_only(out / "checkpoint")
    else:
        (out / "checkpoint" if case == "checkpoint-is-a-file" else out).write_text("not a folder")
    try:
        rc, err = run_cli(capsys, "train", "llama3_1", *pretrain_args(corpus, target))
    finally:
        if case == "checkpoint-read-only" and os.geteuid() == 0:
            subprocess.run(["umount", str(out / "checkpoint")], check=False)
    _one_line(rc, err, "mpatch train: error: " + expected, "OUTPUT_BASEPATH")
    assert not (tmp_path / "out" / "log").exists()  # no rank started


# --- a rank's failure, told in one line ---------------------------------------------------------------------

def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # noqa: BLE001 - a real traceback for the log
        return caught


def test_what_a_rank_cannot_write_in_the_run_folder_is_bad_input(tmp_path):
    from megatron_patch.cli.train import _rank_failure

    out = tmp_path / "out"
    # megatron-core's data cache wraps the OSError in a bare Exception
    try:
        try:
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(out / "data_cache"))
        except OSError as err:
            raise Exception("Failed to write dataset materials to the data cache directory") from err
    except Exception as exc:  # noqa: BLE001
        kind, line = _rank_failure(exc, 3, 10.0, out)
    assert kind == "user" and line.startswith(f"rank 3 cannot write {out}/data_cache in OUTPUT_BASEPATH ([Errno 20] "
                                              "Not a directory): make "), line
    kind, line = _rank_failure(_raised(OSError(errno.EROFS, "Read-only file system", str(out / "checkpoint" / "x"))),
                               0, 10.0, out)
    assert kind == "user" and "[Errno 30] Read-only file system" in line
    assert not (out / "log").exists()
    # the same error outside the run folder is not the run folder's: a bug, with its traceback in the log
    kind, line = _rank_failure(_raised(PermissionError(errno.EACCES, "Permission denied", "/elsewhere")), 0, 10.0, out)
    assert kind == "internal" and line.startswith("internal error: PermissionError:")


def test_a_ranks_internal_error_keeps_its_traceback_in_the_log(tmp_path, capsys, monkeypatch):
    from megatron_patch.cli.train import _rank_failure

    out = tmp_path / "out"
    monkeypatch.delenv("MPATCH_DEBUG", raising=False)
    kind, line = _rank_failure(_raised(ValueError("a bug")), 2, 10.0, out)
    log = out / "log" / "rank2-error.log"
    assert kind == "internal" and line == (
        f"internal error: ValueError: a bug at test_rank_failures.py:{_raised.__code__.co_firstlineno + 2} on rank 2 "
        f"(a bug: please report it; the traceback is in {log})")
    text = log.read_text()
    assert text.startswith("--- ") and "rank 2, pid" in text and "Traceback (most recent call last)" in text
    assert "ValueError: a bug" in text and capsys.readouterr().err == ""
    _rank_failure(_raised(KeyError("again")), 2, 10.0, out)  # a restart's failure is appended
    assert log.read_text().startswith(text) and "KeyError: 'again'" in log.read_text()
    # never written through a symlink: the traceback then goes to the terminal
    (out / "log" / "rank5-error.log").symlink_to(tmp_path / "elsewhere")
    kind, line = _rank_failure(_raised(ValueError("x")), 5, 10.0, out)
    assert line.endswith("(a bug: please report it; the traceback is above)") and not (tmp_path / "elsewhere").exists()
    assert "Traceback" in capsys.readouterr().err


def _launch(args: list[str], env: dict, **popen) -> subprocess.Popen:
    script = os.path.join(REPO, "examples", "llama3_1", "run_mcore_llama3_1.sh")
    return subprocess.Popen(["bash", script, *args], env={**os.environ, "PYTHON": sys.executable, **env}, **popen)


@pytest.mark.slow
def test_a_ranks_bug_is_one_line_on_the_terminal_and_its_traceback_in_the_log(corpus, tmp_path):
    """Before, each rank's traceback reached the terminal, then torchrun's log lines, then the launcher's
    'rank 0 (pid N) exited with status 1: its traceback is above'."""
    out = tmp_path / "out"
    proc = _launch(pretrain_args(corpus, out), {"MP_INJECT_FAULT": "error@2", "MP_NPROC": "2"},
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=480)
    assert proc.returncode == 1, stdout[-3000:] + stderr[-3000:]
    ours = [line for line in stderr.splitlines() if "mpatch" in line or "Error" in line or "rank" in line]
    assert len(ours) == 1 and "Traceback" not in stderr and "exitcode" not in stderr, stderr[-3000:]
    assert ours[0].startswith("mpatch train: internal error: InjectedError: MP_INJECT_FAULT=error@2 at loop.py:")
    named = re.search(r"on rank (\d) \(a bug: please report it; the traceback is in (\S+)\)$", ours[0])
    assert named and named[2] == f"{out}/log/rank{named[1]}-error.log", ours[0]
    # The rank the line names wrote its log. The other rank raises too, but the launcher stops the job at the
    # first failure: on a loaded machine it can be stopped before it gets there, so its log may be missing.
    logs = sorted((out / "log").glob("rank*-error.log"))
    assert Path(named[2]) in logs and {p.name for p in logs} <= {"rank0-error.log", "rank1-error.log"}, logs
    assert all("Traceback (most recent call last)" in p.read_text() and "InjectedError" in p.read_text() for p in logs)


# --- no process outlives its run ----------------------------------------------------------------------------

def _processes_of(launcher_pid: int) -> list[psutil.Process]:
    """Every process of the run the launcher started: each carries the launcher's pid in its environment."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != launcher_pid and p.environ().get("MP_LAUNCHER_PID") == str(launcher_pid):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _forked_writer(rank: psutil.Process) -> bool:
    """Whether ``rank`` has a child forked from it (no new program: the rank's own command line) just now."""
    try:
        return any(child.cmdline() == rank.cmdline() for child in rank.children())
    except psutil.Error:
        return False


@pytest.mark.slow
def test_a_sigkill_to_the_launchers_group_leaves_no_process_of_the_run(corpus, tmp_path):
    """The launcher in a session of its own (a terminal's job), SIGKILLed with its process group during a run
    that saves every 2 iterations. megatron-core's checkpoint writer would serve its results queue from a spawned
    multiprocessing Manager (about 270 MB), which used to live on for good: the rank keeps that queue in-process,
    so no such helper is there at all. megatron-core 0.16 forks a writer per file during each save; the kill is
    sent while one is alive where that happens within a minute (one waiting on a lock its dead rank held lived on,
    1 run in 6)."""
    out = tmp_path / "out"
    args = pretrain_args(corpus, out, SAVE_INTERVAL="2", TRAIN_TOKENS_OR_ITERS=str(10**6 * 8 * 64))
    with open(tmp_path / "launcher.log", "w") as log:
        proc = _launch(args, {}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    left: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoint" / "iter_0000002").is_dir():
            assert proc.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 300 s"
            time.sleep(0.5)
        run = _processes_of(proc.pid)
        ranks = [p for p in run if p.name() == "mpatch-rank0" and p.parent().name() != "mpatch-rank0"]
        spawned = [p for p in run if ranks and p.ppid() == ranks[0].pid and "multiprocessing.spawn" in " ".join(p.cmdline())]
        assert len(ranks) == 1 and not spawned, [(p.pid, p.ppid(), p.cmdline()[:4]) for p in run]
        deadline = time.monotonic() + 60  # saves come every few seconds; 0.19 writes with threads and forks none
        while not _forked_writer(ranks[0]) and time.monotonic() < deadline:
            time.sleep(0.01)

        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60  # a process dies of its parent's death within moments; this is the limit
        while _processes_of(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = _processes_of(proc.pid)
        assert not left, [(p.pid, p.ppid(), " ".join(p.cmdline())[:120]) for p in left]
    finally:
        for p in [*_processes_of(proc.pid), *left]:  # never leave this test's processes behind
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_ctrl_c_during_a_checkpoint_s_save_or_load_is_an_interruption():
    """torch's checkpointing reports a rank's KeyboardInterrupt during a save or load as a CheckpointException, a
    BaseException: the rank takes it as the Ctrl-C it is (status 130, the launcher's one line), where it once
    escaped with a traceback; a checkpoint failure of another cause stays a failure."""
    from torch.distributed.checkpoint.api import CheckpointException

    def failure(exc: BaseException):
        return exc, traceback.StackSummary()

    assert _interrupted(CheckpointException("load", {0: failure(KeyboardInterrupt()), 1: failure(ValueError())}))
    assert not _interrupted(CheckpointException("load", {0: failure(ValueError("bad shard"))}))
    assert not _interrupted(KeyboardInterrupt()) and not _interrupted(ValueError())

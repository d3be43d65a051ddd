"""How a failed job is told in one line: which collective timed out and which rank went silent
(runtime.watchdog), and which of torchrun's failed ranks is the root cause (runtime.launch).

Fast: no job is started here. tests/test_training.py runs the real thing (a SIGSTOPped rank, a
SIGKILLed one, a full disk) through the launchers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_patch.runtime import watchdog
from megatron_patch.runtime.launch import explain_failures, reports_beside


def _timed_out_in_all_reduce() -> RuntimeError:
    """gloo's timeout, raised from inside torch.distributed.all_reduce (a real traceback through it)."""
    try:
        dist.all_reduce(torch.ones(1))  # no process group here: raises from within all_reduce
    except Exception as exc:  # noqa: BLE001
        tb = exc.__traceback__
    return RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 12000ms for recv operation "
                        "to complete").with_traceback(tb)


def _beat(age: float, phase: str, now: float, pid: int) -> dict:
    return {"time": now - age, "phase": phase, "host": "node1", "pid": pid}


def test_a_timeout_names_the_collective_the_phase_and_the_silent_rank(monkeypatch):
    exc = _timed_out_in_all_reduce()
    assert watchdog.failure_kind(exc) == "timeout"
    assert watchdog.operation(exc).startswith("all_reduce (called from test_launch_failures.py, ")
    watchdog.set_phase("iteration 7")
    monkeypatch.setitem(watchdog._state, "beat", watchdog.Heartbeat(0, 3, 12.0))  # not started: judging only
    now = 1000.0
    beats = {0: _beat(0.5, "iteration 7", now, 10), 1: _beat(0.9, "iteration 7", now, 11),
             2: _beat(14.0, "saving iter_0000006", now, 12)}
    line = watchdog.explain(exc, 0, 0.2, now=now, beats=beats)
    assert line == ("rank 0 waited 0.2 min (MP_DIST_TIMEOUT_MIN) in all_reduce (called from test_launch_failures.py, "
                    "_timed_out_in_all_reduce) during iteration 7 and gave up; rank 2 stopped answering (rank 2: last "
                    "heartbeat 14 s ago, during saving iter_0000006 (host node1, pid 12))")


def test_a_timeout_with_every_rank_alive_says_they_wait_in_different_collectives(monkeypatch):
    monkeypatch.setitem(watchdog._state, "beat", watchdog.Heartbeat(0, 2, 12.0))
    now = 50.0
    line = watchdog.explain(_timed_out_in_all_reduce(), 1, 0.2, now=now,
                            beats={0: _beat(1, "saving iter_0000006", now, 1), 1: _beat(1, "iteration 7", now, 2)})
    assert line.endswith("every rank's heartbeat is recent, so none is frozen: the ranks are waiting in different "
                         "collectives (rank 0: saving iter_0000006; rank 1: iteration 7)")
    unreachable = watchdog.explain(_timed_out_in_all_reduce(), 1, 0.2, now=now, beats=None)
    assert unreachable.endswith("the job's store did not answer either, so which rank stopped is not known (its host, "
                                "MASTER_ADDR, may be the one that is frozen)")



def _lost_connection() -> RuntimeError:
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as exc:  # noqa: BLE001
        tb = exc.__traceback__
    return RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234").with_traceback(tb)


def test_a_lost_connection_names_the_rank_that_exited_or_its_node(monkeypatch):
    """A rank of another node that died left this node's line pointing to "the launcher's report of which rank
    exited", which only that node's launcher prints (the multi-node audit): the heartbeats name it, by a pid of
    this host that is gone, else by the other node's host."""
    import socket
    import subprocess
    import sys

    monkeypatch.setitem(watchdog._state, "beat", watchdog.Heartbeat(0, 2, 12.0))
    watchdog.set_phase("iteration 7")
    exc = _lost_connection()
    assert watchdog.failure_kind(exc) == "lost"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    here, now = socket.gethostname(), 100.0
    beats = {0: {"time": now, "phase": "iteration 7", "host": here, "pid": os.getpid()},
             1: {"time": now - 1, "phase": "iteration 7", "host": here, "pid": int(gone.stdout)}}
    line = watchdog.explain(exc, 0, 0.2, now=now, beats=beats)
    assert line.endswith(f"that rank died or its node went away; rank 1 exited (pid {gone.stdout.strip()} on {here}; its "
                         "last heartbeat 1 s ago, during iteration 7)"), line
    beats[1].update(host="node1", pid=os.getpid())
    assert watchdog.explain(exc, 0, 0.2, now=now, beats=beats).endswith(
        "; a rank of another node exited (ranks 1 run on node1): that node's launcher names it")

def test_before_the_heartbeats_start_the_line_says_the_job_was_still_forming(monkeypatch):
    monkeypatch.setitem(watchdog._state, "beat", None)
    watchdog.set_phase("joining the job")
    line = watchdog.explain(_timed_out_in_all_reduce(), 3, 10, now=0.0)
    assert "during joining the job and gave up; the ranks had not started their heartbeats yet" in line


def test_a_new_phase_reaches_the_store_before_the_next_interval(monkeypatch):
    """A rank killed 20 s into training was named "during joining the job": its first beat went out before the
    phase moved on, and the next one 30 s later (the mn audit). A phase change beats within the gap (1 s here),
    well before the interval (6 s)."""
    from datetime import timedelta

    from megatron_patch.runtime.distributed import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setitem(watchdog._state, "beat", None)
    watchdog.set_phase("building the model, optimizer and data")
    beat = watchdog.start(0, 2, 1.0)
    try:
        assert (beat.interval, beat.gap) == (6.0, 1.0)
        assert beat.read()[0]["phase"] == "building the model, optimizer and data"  # the first beat, at once
        watchdog.set_phase("iteration 6")
        deadline = time.time() + 4
        while beat.read()[0]["phase"] != "iteration 6" and time.time() < deadline:
            time.sleep(0.1)
        assert beat.read()[0]["phase"] == "iteration 6"
    finally:
        watchdog.stop()
        del server


def test_other_errors_are_left_to_their_traceback():
    assert watchdog.explain(ValueError("a bug"), 0, 10) is None
    assert watchdog.failure_kind(RuntimeError("CUDA out of memory")) is None
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer")
    assert watchdog.failure_kind(lost) == "lost"


def test_report_failure_writes_torchruns_error_file(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / "attempt_0" / "1" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    assert watchdog.report_failure("DATASET_PATH x not found", "user")
    failure = ProcessFailure(local_rank=1, pid=42, exitcode=2, error_file=str(path))  # torchrun reads it back
    assert failure.error_file_data["message"]["message"] == "DATASET_PATH x not found"
    assert failure.error_file_data["message"]["extraInfo"]["mpatch_kind"] == "user"
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    assert not watchdog.report_failure("x", "user")  # not under torchrun: the caller prints it


# --- the launcher's one line from torchrun's failures ------------------------------------------------------

def _failure(tmp_path, rank: int, exitcode: int, message: str | None = None, kind: str | None = None, at: int = 0):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error_{rank}.json"
    if message is not None:
        path.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": "", "timestamp": str(1000 + at), **({"mpatch_kind": kind} if kind else {})}}}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_the_root_cause_is_chosen_in_order(tmp_path):
    sigkill, sigterm = -int(signal.SIGKILL), -int(signal.SIGTERM)
    hang = _failure(tmp_path, 0, 1, "rank 0 waited ... rank 1 stopped answering", "hang", at=5)
    killed_by_agent = _failure(tmp_path, 1, sigkill)  # the stopped rank, SIGKILLed by torchrun after its grace
    # A hang explained by a rank beats the SIGKILL torchrun gave the silent rank afterwards.
    assert explain_failures({0: hang, 1: killed_by_agent}) == ("rank 0 waited ... rank 1 stopped answering", 1, "hang")
    # Bad input (or a full disk) on any rank beats everything, with exit status 2.
    user = _failure(tmp_path, 3, 2, "saving iter_0000012 failed on rank 0: [Errno 28] ...", "user", at=9)
    assert explain_failures({0: hang, 3: user}) == ("saving iter_0000012 failed on rank 0: [Errno 28] ...", 2, "user")
    # A rank killed by someone else's signal beats the lost connections it caused and the agent's SIGTERMs.
    lost = _failure(tmp_path, 0, 1, "rank 0 lost its connection to another rank ...", "lost")
    terminated = _failure(tmp_path, 2, sigterm)
    line, code, _ = explain_failures({0: lost, 1: _failure(tmp_path, 1, sigkill), 2: terminated})
    assert code == 1 and line.startswith("rank 1 (pid 101) was killed by SIGKILL (by hand, by the scheduler, or by "
                                         "the kernel for want of memory)"), line
    # a crash is not the OOM killer's
    line, code, _ = explain_failures({0: lost, 1: _failure(tmp_path, 1, -int(signal.SIGSEGV))})
    assert line.startswith("rank 1 (pid 101) was killed by SIGSEGV (a crash in native code: torch, a library it "
                           "loads, or the hardware); the other ranks were stopped"), line
    assert explain_failures({0: lost, 2: terminated}) == ("rank 0 lost its connection to another rank ...", 1, "lost")
    # A rank's internal error (a bug, its traceback in the run's log) beats the lost connections it caused.
    bug = _failure(tmp_path, 5, 1, "internal error: ValueError: x at loop.py:1 on rank 5 (...)", "internal", at=7)
    assert explain_failures({0: lost, 5: bug, 2: terminated}) == (
        "internal error: ValueError: x at loop.py:1 on rank 5 (...)", 1, "internal")
    # Nothing explained: the earliest failure, pointing at what it printed.
    plain = _failure(tmp_path, 4, 1, "ValueError: a bug", at=-1)
    assert explain_failures({4: plain, 2: terminated}) == ("rank 4 (pid 104) exited with status 1: its output is "
                                                           "above", 1, None)


def _rank_that_fails_after(marks: str, rank: int) -> None:
    """Local rank 1: its own error; local rank 0: the lost connection that rank 1's exit gives it, written after."""
    marks = Path(marks)
    if rank == 1:
        watchdog.report_failure("internal error: ValueError: x at loop.py:1 on rank 1 (...)", "internal")
        (marks / "1").touch()
        os._exit(1)
    while not (marks / "1").exists():
        time.sleep(0.01)
    time.sleep(0.2)  # rank 1 is gone
    watchdog.report_failure("rank 0 lost its connection to another rank ...", "lost")
    (marks / "0").touch()
    os._exit(1)


def test_the_rank_whose_error_ended_the_job_is_named_when_torch_lists_only_another(tmp_path):
    """torch's agent for forked ranks (a function entrypoint) lists one failed rank, the first in local-rank order
    among those that had exited: rank 0's lost connection, not rank 1's error that caused it. The other ranks'
    error files of the attempt say it (a 4-rank pipeline job whose last stage failed printed only rank 0's line)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    marks = tmp_path / "marks"
    marks.mkdir()
    context = start_processes("ranks", _rank_that_fails_after, args={r: (str(marks), r) for r in (0, 1)},
                              envs={0: {}, 1: {}}, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
                              start_method="fork")
    try:
        deadline = time.time() + 60
        while not (marks / "0").exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # both have exited before the agent looks, as when the lost connection comes within its poll
        result = context.wait(timeout=30, period=0.1)
    finally:
        context.close()
    assert result is not None and list(result.failures) == [0]  # torch's own report: rank 0 alone
    assert explain_failures(result.failures)[2] == "lost"
    assert explain_failures(result.failures, reports_beside(result.failures)) == (
        "internal error: ValueError: x at loop.py:1 on rank 1 (...)", 1, "internal")


def test_reports_beside_skip_a_cut_short_file_and_files_outside_torchs_layout(tmp_path):
    attempt = tmp_path / "attempt_0"
    for local in (0, 1, 2):
        (attempt / str(local)).mkdir(parents=True)
    own = _failure(tmp_path, 0, 1, "rank 4 lost its connection to another rank ...", "lost")
    (attempt / "0" / "error.json").write_text(Path(own.error_file).read_text())
    (attempt / "1" / "error.json").write_text('{"message": {"mess')  # the agent's SIGTERM came mid-write
    user = _failure(tmp_path, 2, 1, "bad input", "user")
    (attempt / "2" / "error.json").write_text(Path(user.error_file).read_text())
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    lost = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(attempt / "0" / "error.json"))
    beside = reports_beside({4: lost})  # rank 4 is its node's local rank 0: the others there are 5 and 6
    assert list(beside) == [6] and _text_of(beside[6]) == "bad input"
    assert explain_failures({4: lost}, beside) == ("bad input", 2, "user")
    assert reports_beside({0: own}) == {}  # not torch's <attempt>/<local rank>/error.json: nothing guessed


def _text_of(failure) -> str:
    return failure.error_file_data["message"]["message"]


def test_a_stopped_rank_is_woken_to_take_the_agents_sigterm():
    """A rank stopped by SIGSTOP (or a debugger's pause) takes the SIGTERM torch's process context sends the others
    once one failed only when continued: torch waited out its 30 s grace, then sent SIGKILL, so such a job ended 30 s
    after its timeout (tests/test_training.py::test_stopped_rank_fails_the_job_naming_it prints how long). Within
    the launch's monitor, the SIGTERM is followed by SIGCONT, and the rank ends by it."""
    import multiprocessing

    from megatron_patch.runtime.launch import _agent_monitor

    rank = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))
    rank.start()
    try:
        os.kill(rank.pid, signal.SIGSTOP)
        with _agent_monitor():
            rank.terminate()
        rank.join(20)  # at once where woken; a rank left stopped would still be there after it
        assert rank.exitcode == -signal.SIGTERM, rank.exitcode
    finally:
        if rank.is_alive():
            os.kill(rank.pid, signal.SIGCONT)
            rank.kill()
            rank.join()


def test_a_ctrl_c_inside_a_fork_hook_is_not_printed_by_a_rank():
    """Ctrl-C during a checkpoint's save: megatron-core's writer forks, and a SIGINT landing in logging's at-fork hook
    was printed as "Exception ignored in: <function _releaseLock>" with its traceback above the launcher's one line.
    A rank drops it silently (``quiet_interrupts_in_finalizers``; torchrun's agent ends the rank), and takes a later
    Ctrl-C as before."""
    code = """
import os, signal, sys, time
from megatron_patch.cli.common import quiet_interrupts_in_finalizers

quiet_interrupts_in_finalizers()

def hook():
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100000):  # the handler runs here, inside the hook
        pass

os.register_at_fork(after_in_parent=hook)
child = os.fork()
if child == 0:
    os._exit(0)
os.waitpid(child, 0)
print("went on", file=sys.stderr)
try:
    os.kill(os.getpid(), signal.SIGINT)
    end = time.time() + 30
    while time.time() < end:  # the rank's work goes on
        pass
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
"""
    repo = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c", code], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": repo})
    assert done.returncode == 130 and done.stderr.split() == ["went", "on", "interrupted"], (done.returncode,
                                                                                          done.stderr[-2000:])


def test_torchs_agent_says_nothing_after_a_successful_run():
    """On several nodes, node 0's agent serves the store and may end before another node's agent has read the exit
    barrier's last key: that agent logged a traceback under a run that succeeded on every node (the fail audit).
    Without MPATCH_DEBUG=1 the record is left out, as the agent's "death signal" line is; its other records stay."""
    import logging

    from megatron_patch.runtime.launch import agent_record_shown

    def record(message: str, *args) -> logging.LogRecord:
        return logging.LogRecord("torch.distributed.elastic.agent.server.api", logging.ERROR, "api.py", 1008,
                                 message, args, None)

    assert not agent_record_shown(record("Error waiting on exit barrier. Elapsed: %s seconds", 3.2))
    assert not agent_record_shown(record("Received %s death signal, shutting down workers", 2))
    assert agent_record_shown(record("[%s] Worker group FAILED.", "default"))

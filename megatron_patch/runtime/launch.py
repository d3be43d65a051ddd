"""Starting the ranks of a job.

``run_torchrun``: training's one launch path, on a laptop (ENV=cpu) as on a cluster (dsw, dlc):
torch's own torchrun, run in this process, and its failures turned into one line. Its ranks are fresh
interpreters (``python -u ROOT/mpatch.py train ...``), or, for a one-node CPU job, processes forked from the
fork server below with torch and megatron-core already imported (``forked_ranks``: about 4 s of CPU less per rank).

``run_local``: a function in N local processes that form one torch.distributed job (gloo on CPU),
for commands that need ranks for themselves (a parity check or an alignment at TP=2 from a single
CLI process) and for the tests. ``fn`` must be importable (a module-level function), since the
workers are started by a fork server (``rank_preload`` says why), or with "spawn" where
``MP_LOCAL_START=spawn`` asks for a fresh interpreter per rank and on a machine with a CUDA device.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import io
import json
import logging
import multiprocessing as mp
import os
import pickle
import queue
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from multiprocessing import forkserver, process, reduction
from multiprocessing import util as mp_util
from pathlib import Path
from typing import Any, Callable

from megatron_patch.errors import UserError
from megatron_patch.runtime import scratch
from megatron_patch.runtime.distributed import destroy, free_port
from megatron_patch.runtime.known_warnings import quiet_known_warnings

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch` and the launcher's checks start without them, its dry run
# with torch alone (to see the machine).


class WorkerError(RuntimeError):
    """A worker raised: its message is the worker's exception and where the worker raised it, on one line (the
    mpatch line of an internal error quoted the start of the worker's traceback); ``worker_traceback`` is the whole
    of it, which MPATCH_DEBUG=1 prints."""

    def __init__(self, message: str, worker_traceback: str = ""):
        super().__init__(message)
        self.worker_traceback = worker_traceback

    @classmethod
    def of_rank(cls, rank: int, report: str) -> "WorkerError":
        said, _, worker_traceback = report.partition("\n")
        frames = re.findall(r'File "([^"]+)", line (\d+)', worker_traceback)
        where = f" (at {Path(frames[-1][0]).name}:{frames[-1][1]} on the rank)" if frames else ""
        return cls(f"rank {rank} failed: {said}{where}", worker_traceback)


def quiet_cpu_warnings() -> None:
    """On CPU, each rank would print megatron's "Apex/TE not installed, falling back" notices and
    deprecation chatter: expected there, and noise times N ranks (MP_SHOW_WARNINGS=1 keeps them)."""
    import torch

    quiet_known_warnings()
    if not torch.cuda.is_available() and os.environ.get("MP_SHOW_WARNINGS") != "1":
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, env: dict) -> None:
    try:
        _work(rank, world_size, port, fn, args, results, env)
    except KeyboardInterrupt:
        # Ctrl-C reaches the whole process group, and the caller says "interrupted": multiprocessing printed this
        # process's traceback around that line
        sys.exit(130)


def _work(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, env: dict) -> None:
    # A rank forked from the fork server has the server's environment, taken when it started: the
    # caller's current one is what the rank must see, as a spawned rank would.
    os.environ.clear()
    # A local job started inside a torchrun rank (the memory plan's model shape, say) is a world of its own:
    # with the agent's variables it would wait for torchrun's store at its own address (30 minutes, then fail).
    os.environ.update({k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")})
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    # Several ranks on two cores: one intra-op thread each keeps them from fighting.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    quiet_cpu_warnings()
    _thread_lock_for_tqdm()
    try:
        # Plain pickle, not the queue's own: torch registers shared-memory reductions with
        # multiprocessing, and a tensor sent that way is gone once this worker exits, before the
        # parent has read it ("FileNotFoundError" in the parent).
        out = pickle.dumps(fn(*args))
        results.put((rank, True, out))
    except UserError as exc:
        # Bad input found on a rank: the parent raises it again as itself (one line, exit 2).
        results.put((rank, False, _pickled_user_error(exc)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent verbatim
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            destroy()
        except Exception:
            pass


def _thread_lock_for_tqdm() -> None:
    """tqdm makes its write lock on a process's first bar, by default a multiprocessing RLock of the process's start
    method, here the fork server's: a named semaphore that the caller's resource tracker must unlink when the rank
    is killed (one still blocked in a collective 5 s after Ctrl-C is), and then reports under the command's one
    line ("There appear to be 1 leaked semaphore objects"). A rank's bars are its own: a thread lock leaves nothing
    behind."""
    from tqdm import tqdm  # imported by torch already (torch.hub); lm-eval and transformers draw with it

    tqdm.set_lock(threading.RLock())


def _pickled_user_error(exc: UserError) -> bytes:
    try:
        return pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an unpicklable subclass still travels as a plain UserError
        return pickle.dumps(UserError(str(exc)))


# Attempts at a job whose rendezvous port another process took between ``free_port`` and the bind.
PORT_ATTEMPTS = 3


def run_local(fn: Callable, world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    """Run ``fn(*args)`` on ranks 0..world_size-1; return the per-rank results in rank order.

    A ``UserError`` raised on a rank is raised here as itself; any other failure as ``WorkerError``
    carrying the rank's traceback. A job that lost its free port to another process before it could
    bind it (EADDRINUSE) starts again on another one.
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _run_once(fn, world_size, args, timeout)
        except WorkerError as exc:
            if "EADDRINUSE" not in f"{exc}\n{exc.worker_traceback}" or attempt == PORT_ATTEMPTS:
                raise


@contextlib.contextmanager
def _sigint_deferred():
    """Ctrl-C while the ranks start is taken once they have: a rank whose start it cut short was forked but not
    known here, so nothing waited for it, and it printed multiprocessing's traceback failing to read what this
    process had left behind (its queue's semaphore)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed = []
    earlier = signal.signal(signal.SIGINT, lambda *_: pressed.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, earlier)
    if pressed:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _main_importable():
    """Spawned children re-run the parent's main script by its path; a script read from stdin or given with
    -c has none to re-run ("<stdin>"), and the children died at start. Without a path they skip it."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.exists(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _cuda_present() -> bool:
    """Whether this machine has a CUDA device, asked without initialising CUDA here: torch's count (NVML's) where
    this process has torch, else the device files CUDA needs, so that a process without torch (a conversion asking
    for its model's skeleton) does not import it for this (1.1 s). A device file CUDA cannot use errs on the safe
    side: fresh interpreters, only slower."""
    if "torch" in sys.modules:
        import torch

        return torch.cuda.device_count() > 0
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return any(name[len("nvidia"):].isdigit() for name in os.listdir("/dev") if name.startswith("nvidia"))


LOCAL_JOB_PRELOAD = ["megatron_patch.runtime.fork_server_guard", "megatron_patch.runtime.local_job_preload",
                     "megatron_patch.runtime.fork_server_ready"]
TRAINING_RANK_PRELOAD = ["megatron_patch.runtime.fork_server_guard", "megatron_patch.runtime.rank_preload",
                         "megatron_patch.runtime.fork_server_ready"]


# sockaddr_un.sun_path on Linux: 108 bytes with the closing NUL
_SOCKET_PATH_MAX = 107
# what multiprocessing's folder adds to its parent (ours: scratch.make_owned_folder's), then the fork server's socket
_SOCKET_PATH_TAIL = len(f"/{scratch.PREFIX}pymp-XXXXXXXX/listener-XXXXXXXX")


def _socket_folder_fits() -> bool:
    """Whether the fork server's socket path fits a Unix socket's. multiprocessing's folder (not yet made) is made
    here, as a scratch folder a killed launch's successor removes (multiprocessing's own pymp-* stayed behind
    each killed launch), and in the system's own temporary folder where TMPDIR is too deep for the socket, as
    CPython 3.14 does itself: a deep TMPDIR (a job's scratch folder) failed every evaluation and local training
    start with "internal error: OSError: AF_UNIX path too long". False (spawn instead) where no folder fits."""
    made = process.current_process()._config.get("tempdir")
    if made is not None:
        return len(os.fsencode(made)) + len("/listener-XXXXXXXX") <= _SOCKET_PATH_MAX
    for base in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/usr/tmp"):
        if len(os.fsencode(base)) + _SOCKET_PATH_TAIL <= _SOCKET_PATH_MAX and os.access(base, os.W_OK | os.X_OK):
            scratch.sweep_abandoned(base)
            folder = scratch.make_owned_folder("pymp", base)
            # as multiprocessing.util.get_temp_dir does for the folder it makes: removed at this process's exit
            mp_util.Finalize(None, scratch.remove, args=(folder,), exitpriority=-100)
            process.current_process()._config["tempdir"] = folder
            return True
    return False


def _start_context(preload: list[str] = LOCAL_JOB_PRELOAD):
    """The fork server (started on first use, kept for this process's life, ranks forked from it with the
    ``preload`` of the first use imported), or "spawn" where asked for, where there is no fork server, or where a
    CUDA device is. On the lent H100 every rank forked from the fork server failed at ``torch.cuda.set_device``
    ("Cannot re-initialize CUDA in forked subprocess"): the server's preload touched CUDA (most likely
    ``cpu_compat``'s ``torch.cuda.is_available()``, whose device count arms torch's fork guard), and a child
    forked after that cannot use CUDA. A spawned rank starts clean."""
    if (os.environ.get("MP_LOCAL_START") == "spawn" or "forkserver" not in mp.get_all_start_methods()
            or _cuda_present() or not _socket_folder_fits()):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    return ctx


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any]:
    ctx = _start_context()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, env), daemon=False)
             for r in range(world_size)]
    outputs: dict[int, Any] = {}
    errors: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    interrupted = False
    try:
        with _main_importable(), _sigint_deferred():
            for p in procs:
                p.start()
        while len(outputs) + len(errors) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                # A rank that died before it could report (a crash, or a failure while starting, such as
                # an import error) would otherwise leave us waiting for the whole timeout.
                gone = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in outputs and r not in errors]
                if gone and results.empty():
                    time.sleep(0.5)  # its last words may still be in the queue's pipe
                    if results.empty():
                        rank = gone[0]
                        errors[rank] = f"exited with code {procs[rank].exitcode} before reporting a result"
                        break
                if time.monotonic() > deadline:
                    raise WorkerError(f"local job timed out after {timeout}s; finished ranks: {sorted(outputs)}")
                continue
            if ok:
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            if errors:
                # One failed rank usually leaves the others blocked in a collective.
                break
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            p.join(timeout=5 if errors or interrupted else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        # the other ranks' reports too: the root cause is not always the first to arrive (rank 0's port taken,
        # EADDRINUSE, came after rank 1's lost connection to it under load, and the job was not started again)
        while True:
            try:
                rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                break
            if not ok:
                errors.setdefault(rank, payload)
        port_taken = [r for r in sorted(errors) if isinstance(errors[r], str) and "EADDRINUSE" in errors[r]]
        rank = port_taken[0] if port_taken else min(errors)
        if isinstance(errors[rank], bytes):
            raise pickle.loads(errors[rank])
        raise WorkerError.of_rank(rank, errors[rank])
    return [outputs[r] for r in range(world_size)]


# --- torchrun -------------------------------------------------------------------------------------

class JobFailed(Exception):
    """A job started by torchrun failed; the message is one line, ``code`` the exit status to give, ``kind`` the
    failing rank's own ('user', 'internal', 'hang', 'lost') where it told one."""

    def __init__(self, message: str, code: int = 1, kind: str | None = None):
        super().__init__(message)
        self.code = code
        self.kind = kind


def run_torchrun(torchrun_args: list[str], forked: tuple[Callable, tuple] | None = None) -> None:
    """``torchrun torchrun_args...`` in this process: torch.distributed.run's own parser and agent,
    so it behaves exactly as the command does (rendezvous, --max-restarts, signals). With ``forked``
    (``(entry, args)``, a module-level function and its arguments: the rank's own command as a call), each rank
    is forked from the fork server and runs ``entry(*args)`` (``forked_ranks``). Raises ``JobFailed`` with one
    line saying why the job failed."""

    from torch.distributed.run import parse_args

    if os.environ.get("MPATCH_DEBUG") != "1":
        # The agent logs each failed rank and each rank it stops ("failed (exitcode: 1) local_rank: 0 ..."):
        # the one line below says it, from the ranks' own reports.
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
        # forked ranks: the others stopped after one failed ("Terminating process N via signal SIGTERM")
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.CRITICAL)
        # and the signal it got ("Received 2 death signal, shutting down workers"): said below too; and, after every
        # rank succeeded, a failed wait at the exit barrier: node 0's agent, which serves the store, may leave it and
        # end before another node's agent has read the barrier's last key, a traceback after a successful run (the
        # fail audit)
        logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(agent_record_shown)
    with agent_log_folder() as log_dir:
        _run_agent(parse_args(["--log-dir", log_dir, *torchrun_args]), forked)


def agent_record_shown(record: logging.LogRecord) -> bool:
    """Whether a record of torch's agent reaches the terminal (``run_torchrun``, without MPATCH_DEBUG=1)."""
    return not any(said in record.getMessage() for said in ("death signal", "exit barrier"))


@contextlib.contextmanager
def agent_log_folder():
    """A folder for torchrun's agent (its ranks' error files, ``explain_failures`` reads them), removed after the job,
    or by the next launch where this one was killed: without ``--log-dir`` the agent made one in TMPDIR per launch
    and left it there (the env audit: thousands of torchelastic_* in /tmp)."""
    scratch.sweep_abandoned()
    folder = scratch.make_owned_folder("torchelastic")
    try:
        yield folder
    finally:
        scratch.remove(folder)


def _run_agent(parsed, forked: tuple[Callable, tuple] | None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.run import run

    try:
        with _agent_monitor():
            if forked is None:
                run(parsed)
            else:
                _run_forked(parsed, *forked)
    except (DistStoreError, DistNetworkError) as exc:
        # the nodes' rendezvous, before any rank started: a node that never came (or node 0 never reached)
        said = " ".join(str(exc).split())[:300]
        raise JobFailed(f"the nodes did not all join the rendezvous at {parsed.master_addr}:{parsed.master_port} "
                        f"within MP_DIST_TIMEOUT_MIN ({said}): start the same launcher line on every node, RANK 0 "
                        f"to {int(parsed.nnodes.split(':')[-1]) - 1}, or raise MP_DIST_TIMEOUT_MIN", 1) from None
    except ChildFailedError as exc:
        raise JobFailed(*explain_failures(exc.failures, reports_beside(exc.failures))) from None
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        raise JobFailed(f"the launcher got {name}: every rank was stopped", 128 + int(exc.sigval)) from None


@contextlib.contextmanager
def _agent_monitor():
    """While the launch runs, the agent's monitor of a failed group:

    - reports every forked rank that had died before the agent stopped the others. torch's agent for a function
      entrypoint (forked ranks) reports one failed process, the first in local-rank order: a rank 1 killed by
      SIGKILL (the OOM killer) was reported as rank 0's lost connection (the dlc audit), where a fresh rank's
      agent reports each, and the one line names the signal;
    - wakes a stopped rank (SIGSTOP, a debugger's pause) before the agent's SIGTERM, which a stopped process takes
      only once continued: torch waited out its 30 s grace for it, then sent SIGKILL;
    - ends torchrun's restarts (MP_MAX_RESTARTS) at bad input. A rank that refused its input (its one line of kind
      "user", exit 2) refuses it again at every restart, and a node that restarts after a refusal all nodes made
      waits out the rendezvous for nodes that did not restart (the mn audit: another MP_MAX_RESTARTS on one node);
      a reader of the output gone is gone for the restart too.

    With a torch whose agent or process context is laid out otherwise, each is left as torch does it."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, SubprocessContext

    monitor = LocalElasticAgent.__dict__.get("_monitor_workers")
    close = MultiprocessContext.__dict__.get("_close")
    close_spawned = SubprocessContext.__dict__.get("_close")
    if monitor is None or close is None or close_spawned is None:
        yield
        return
    # the ranks torch's process context stops (SIGTERM, and SIGKILL 30 s later) as it finds a failed one: not dead
    # of themselves, whatever their status says
    stopped, terminate, kill = set(), process.BaseProcess.terminate, process.BaseProcess.kill

    def terminate_noting(stopping):  # torch's process context stopping the others once one failed
        stopped.add(stopping.pid)
        terminate(stopping)
        _continue([stopping.pid])

    def kill_noting(stopping):
        stopped.add(stopping.pid)
        kill(stopping)

    def close_noting_the_dead(context, *args, **kwargs):
        processes = getattr(getattr(context, "_pc", None), "processes", None) or []
        context.mpatch_dead = {rank: (p.pid, p.exitcode) for rank, p in enumerate(processes)
                               if p.pid not in stopped and p.exitcode not in (None, 0)}
        _continue(p.pid for p in processes if p.exitcode is None)
        return close(context, *args, **kwargs)

    def close_spawned_continuing(context, *args, **kwargs):
        handlers = getattr(context, "subprocess_handlers", None) or {}
        # each spawned rank leads its own process group, which the agent's signals go to (os.killpg)
        _continue((h.proc.pid for h in handlers.values() if h.proc.poll() is None), group=True)
        return close_spawned(context, *args, **kwargs)

    def monitor_reporting_each_failure(agent, worker_group):
        result = monitor(agent, worker_group)
        if not result.is_failed():
            return result
        _add_dead_forked_ranks(result.failures, getattr(agent._pcontext, "mpatch_dead", {}), agent._pcontext,
                               worker_group)
        if getattr(agent, "_remaining_restarts", 0) > 0:
            if explain_failures(result.failures, reports_beside(result.failures))[2] in ("user", "pipe"):
                agent._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitor_reporting_each_failure
    MultiprocessContext._close = close_noting_the_dead
    SubprocessContext._close = close_spawned_continuing
    process.BaseProcess.terminate, process.BaseProcess.kill = terminate_noting, kill_noting
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = monitor
        MultiprocessContext._close = close
        SubprocessContext._close = close_spawned
        process.BaseProcess.terminate, process.BaseProcess.kill = terminate, kill


def _continue(pids, group: bool = False) -> None:
    """SIGCONT to each of ``pids`` (``group``: to the process group each leads), gone ones skipped: a running process
    ignores it."""
    for pid in pids:
        try:
            (os.killpg if group else os.kill)(pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass


def _add_dead_forked_ranks(failures: dict, dead: dict, context, worker_group) -> None:
    """``failures`` ({global rank: ProcessFailure}) with each forked rank that ``dead`` ({local rank: (pid, exit
    status)}) found exited before the agent stopped the group."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    for local, (pid, status) in dead.items():
        rank = worker_group.workers[local].global_rank
        if rank not in failures:
            failures[rank] = ProcessFailure(local_rank=local, pid=pid, exitcode=status,
                                            error_file=context.error_files[local])


# --- forked ranks ---------------------------------------------------------------------------------

def forked_ranks() -> bool:
    """Whether torchrun's ranks on this machine are forked from the fork server: yes unless ``_start_context``
    starts fresh interpreters (MP_LOCAL_START=spawn, no fork server, or a CUDA device: CUDA does not survive a
    fork). Starts the server now: its imports run while the agent sets up the rendezvous."""
    if _start_context(TRAINING_RANK_PRELOAD).get_start_method() != "forkserver":
        return False
    _quiet_resource_tracker()
    forkserver.ensure_running()
    return True


# The resource tracker this process starts with the fork server outlives a launcher killed alone (the OOM killer's
# pick): it unlinks the semaphores of torch's process context, as it should, and warned of them under the job's
# output ("There appear to be 9 leaked semaphore objects", the dlc audit). It takes this process's -W options.
QUIET_RESOURCE_TRACKER = "ignore::UserWarning:multiprocessing.resource_tracker"


def _quiet_resource_tracker() -> None:
    if QUIET_RESOURCE_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(QUIET_RESOURCE_TRACKER)


def _run_forked(args, entry: Callable, entry_args: tuple) -> None:
    """torch.distributed.run.run, with ``entry`` as the agent's function entrypoint and the fork server as its start
    method: the same agent, rendezvous (a node of a multi-node job joins the others as torchrun's own would),
    restarts and failure reports."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if args.standalone:  # what torch.distributed.run.run sets for it: a c10d rendezvous on a free local port
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = config_from_args(args)
    config.start_method = "forkserver"
    with _main_importable():
        elastic_launch(config, entrypoint=_forked_rank)(entry, entry_args, dict(os.environ),
                                                        _InheritedFd(1), _InheritedFd(2))


class _InheritedFd:
    """A descriptor of this process that a child started by the fork server receives as its own (multiprocessing
    passes it over the server's socket when the child's arguments are pickled); an int there."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


# What the agent sets for each rank (torch's LocalElasticAgent): kept over the launcher's environment. OMP_NUM_THREADS
# is not among them: the agent copies the launcher's, which the launcher's environment already holds.
_AGENT_VARIABLES = frozenset({"RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                              "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                              "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
_FORK_SERVER: list[int] = []  # in a forked rank: the pid of the fork server it came from, its parent
_REPLACED_STREAMS: list = []  # the fork server's stdout/stderr objects: kept, never flushed into the launcher's


def _forked_rank(entry: Callable, entry_args: tuple, env: dict, stdout: int, stderr: int) -> None:
    """A forked rank made what the agent's fresh ``python -u`` rank is, then ``entry(*entry_args)``, whose non-zero
    status becomes the process's exit status. The fork server's state is not the launcher's: the rank takes a
    session of its own (a terminal's Ctrl-C reaches the launcher, which stops the ranks), the launcher's
    output unbuffered, and the launcher's environment with the agent's variables over it."""
    _FORK_SERVER.append(os.getppid())
    os.setsid()
    for fd, target in ((stdout, 1), (stderr, 2)):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    _REPLACED_STREAMS.extend((sys.stdout, sys.stderr))
    sys.stdout, sys.stderr = _unbuffered_text(1, sys.stdout), _unbuffered_text(2, sys.stderr)
    agent = {k: v for k, v in os.environ.items() if k in _AGENT_VARIABLES or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(agent)
    _signals_as_a_fresh_rank()
    # torch's agent runs a forked rank under its error handler, which turns faulthandler on: a fresh rank has it only
    # where PYTHONFAULTHANDLER asks (a SIGSEGV printed 40 lines of thread dumps above the launcher's one line naming
    # it; the s65 audit)
    faulthandler.disable()
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(all_threads=True)  # on the rank's own stderr, as a fresh one
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # torch read the fork server's at its import
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    code = entry(*entry_args)
    if code:
        sys.exit(code)


def _signals_as_a_fresh_rank() -> None:
    """The signals torch's agent handles in the launcher (TORCHELASTIC_SIGNALS_TO_HANDLE) as a fresh rank has them:
    exec gives a handled signal its default, and Python makes SIGINT's a KeyboardInterrupt. A forked rank had the
    fork server's: SIGINT ignored where the launcher had started with it ignored (a script's `cmd &`), and it
    trained on through the agent's SIGINT until torch's SIGKILL 30 s later (the dlc audit)."""
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    for name in names.split(","):
        number = getattr(signal, name.strip(), None)
        if isinstance(number, signal.Signals):
            signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)


def _unbuffered_text(fd: int, like):
    """A text stream on ``fd`` as ``python -u`` makes it: each write goes straight to the descriptor."""
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding=like.encoding, errors=like.errors, write_through=True)


def _kind(failure) -> str | None:
    data = failure.error_file_data or {}
    message = data.get("message")
    return message.get("extraInfo", {}).get("mpatch_kind") if isinstance(message, dict) else None


def _text(failure) -> str:
    message = (failure.error_file_data or {}).get("message")
    return message.get("message", "") if isinstance(message, dict) else str(message or "")


def explain_failures(failures: dict, beside: dict | None = None) -> tuple[str, int, str | None]:
    """(one line, exit status, the rank's kind) for torchrun's failed ranks ({global rank: ProcessFailure}) and the
    reports other ranks of the attempt wrote (``beside``, ``reports_beside``'s: their one line counts, their exit
    is not known).

    The root cause, in this order: a rank's own one-line error (bad input: exit 2; the reader of the output gone,
    `| head`: 141; a collective that timed out, naming the rank that stopped answering), a rank killed by a signal
    the agent did not send (SIGKILL from the OOM killer or a person, SIGSEGV...), a rank's internal error (its
    traceback in the run's log), a lost connection, the first rank that exited non-zero."""
    order = sorted(failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    reported = sorted({**(beside or {}), **failures}.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    for kind, code in (("user", 2), ("pipe", 141), ("hang", 1)):
        for rank, f in reported:
            if _kind(f) == kind:
                return _text(f), code, kind
    for rank, f in order:
        if f.exitcode < 0 and f.signal_name() not in ("SIGTERM", "SIGINT"):
            return (f"rank {rank} (pid {f.pid}) was killed by {f.signal_name()} ({_why_killed(f.signal_name())}); "
                    "the other ranks were stopped"), 1, None
    for kind in ("internal", "lost"):
        for rank, f in reported:
            if _kind(f) == kind:
                return _text(f), 1, kind
    rank, f = order[0]
    how = f"was stopped by {f.signal_name()}" if f.exitcode < 0 else f"exited with status {f.exitcode}"
    return f"rank {rank} (pid {f.pid}) {how}: its output is above", 1, None


def refusal_reported(log_dir: str | Path) -> str | None:
    """The one line a rank refused its line with (bad input), from the error files torchrun's agent keeps under
    ``log_dir`` (``<run>/attempt_<n>/<local rank>/error.json``), or None."""
    for error_file in sorted(Path(log_dir).glob("**/error.json")):
        try:
            message = json.loads(error_file.read_text()).get("message")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(message, dict) and message.get("extraInfo", {}).get("mpatch_kind") == "user":
            return str(message.get("message", ""))
    return None


def _why_killed(signal_name: str) -> str:
    if signal_name in ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"):
        return "a crash in native code: torch, a library it loads, or the hardware"
    if signal_name == "SIGKILL":
        return "by hand, by the scheduler, or by the kernel for want of memory"
    return "by hand or by the scheduler"


def reports_beside(failures: dict) -> dict:
    """{global rank: ProcessFailure} of the error files that the other local ranks of a failed attempt wrote before
    the agent stopped them. torch's agent for a function entrypoint (forked ranks) names one failed rank, the first
    in local-rank order among those that had exited: a rank 0 that lost its connection to the rank whose own error
    ended the job came before that rank. torch keeps each local rank's file at ``<attempt>/<local rank>/error.json``."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    beside = {}
    for rank, failure in failures.items():
        own = Path(failure.error_file or "")
        if own.name != "error.json" or own.parent.name != str(failure.local_rank):
            continue
        for folder in own.parent.parent.iterdir():
            error_file = folder / "error.json"
            if not folder.name.isdigit() or folder == own.parent or not error_file.is_file():
                continue
            try:  # a file the agent's SIGTERM cut short is no report (torch would log its traceback)
                json.loads(error_file.read_text())
            except (OSError, ValueError):
                continue
            local = int(folder.name)
            beside[rank - failure.local_rank + local] = ProcessFailure(local_rank=local, pid=0, exitcode=1,
                                                                       error_file=str(error_file))
    return {rank: f for rank, f in beside.items() if rank not in failures}


# --- ranks end with their launcher ----------------------------------------------------------------

PR_SET_PDEATHSIG = 1
LAUNCHER_PID = "MP_LAUNCHER_PID"  # set by the launcher for its ranks
# the warnings the launcher printed of the checkpoints it skipped (JSON), which its ranks then leave out
LAUNCHER_WARNED = "MP_LAUNCHER_WARNED"
LAUNCHER_REFUSED = "MP_LAUNCHER_REFUSED"  # the launcher refused its node's line: its ranks only say so (cli.train)
# the launcher found the run complete: its ranks only compare the node's line with the other nodes' (cli.train)
LAUNCHER_COMPLETE = "MP_LAUNCHER_COMPLETE"


def die_with_launcher(log=print) -> str:
    """Make this rank end when the process that started it ends, however it ends (a SIGKILL to the launcher's
    process group, a closed terminal, a scheduler without cgroups): torch elastic starts each rank in a
    session of its own, so nothing else would stop it, and it would go on writing the run's checkpoints.
    Returns how, in words."""
    if _FORK_SERVER:  # forked: the fork server is the parent, and it ends when the launcher does
        return die_with_parent(_FORK_SERVER[0], "its launcher's fork server", log)
    return die_with_parent(int(os.environ.get(LAUNCHER_PID) or os.getppid()), "its launcher", log)


PR_SET_NAME = 15


def name_this_process(name: str) -> None:
    """The name ps, top and /proc/PID/comm show for this process (Linux; at most 15 bytes): a forked rank would
    otherwise show the fork server's command line, and a fresh one ``python``."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def die_with_parent(expected: int, who: str = "its parent", log=print) -> str:
    """This process ends when its parent (pid ``expected``) ends. Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``,
    then a check that the parent is still ``expected`` (it may have died before the call, and then no signal
    comes). Elsewhere: a thread that watches the parent. Returns how, in words."""
    how = "prctl(PR_SET_PDEATHSIG)"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl failed")
    except (OSError, AttributeError):
        how = "a thread watching the parent"

        def watch():
            while os.getppid() == expected:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="mpatch-parent-watch", daemon=True).start()
    if os.getppid() != expected:  # the parent was gone before the signal was armed
        log(f"rank {os.environ.get('RANK', '?')}: {who} (pid {expected}) is gone; exiting")
        os._exit(1)
    return how


_FORKED_BY: dict = {}  # who forked: read by the child, in its copy of this process's memory


def helpers_die_with_rank() -> None:
    """The processes a rank starts end with it, as the rank ends with its launcher: the parent-death signal is not
    inherited, and megatron-core's checkpoint writer left processes of a killed run alive for good (issue 34):

    - megatron-core serves the queue its write results come back on from a spawned multiprocessing Manager, a
      process of about 270 MB kept from the rank's first save on, which outlived a killed rank. The project saves
      synchronously (the writer runs in the rank, and the queue is put to and read from there alone), so the queue
      is a plain in-process one and there is no such process: nothing to outlive the rank, and no 2-4 s first save
      while a fresh interpreter imports torch to unpickle the results. megatron-core 0.16 and 0.19 both keep it in
      ``filesystem_async._results_queue`` behind a getter (``_get_write_results_queue``; 0.19:
      ``get_write_results_queue``) that the writer looks up when it saves;
    - megatron-core 0.16 forks a writer per file during each save; one forked while the rank was killed could
      wait forever on a lock the dead rank held. Every child forked from the rank's main thread is armed
      (``os.register_at_fork``); a child forked from another thread is not, since the signal follows the
      thread that forked, not the process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as writer

    def results_queue(*args, **kwargs):
        if writer._results_queue is None:
            writer._results_queue = queue.Queue()
        return writer._results_queue

    for name in ("get_write_results_queue", "_get_write_results_queue"):
        if hasattr(writer, name):
            setattr(writer, name, results_queue)
    if not _FORKED_BY:
        _FORKED_BY["pid"] = None
        os.register_at_fork(before=_note_fork, after_in_child=_arm_forked_child)


def _note_fork() -> None:
    _FORKED_BY["pid"] = os.getpid() if threading.current_thread() is threading.main_thread() else None


def _arm_forked_child() -> None:
    if _FORKED_BY.get("pid") is not None:
        die_with_parent(_FORKED_BY["pid"], "the rank that forked it")

"""Which rank stopped answering, when a collective times out; and how a rank reports why it failed.

Every collective waits at most MP_DIST_TIMEOUT_MIN minutes (the process groups' timeout), then raises
on the ranks that are still alive. That alone says neither which rank is missing nor what the job was
doing, so each rank of a multi-process job also publishes a heartbeat every few seconds in the job's
key-value store: the time, its host and pid, and its phase ("iteration 7", "saving iter_0000010").
Under torchrun that store is served by the launcher's agent, not by a rank, so it still answers when
a rank is frozen. When a collective times out, the ranks read every heartbeat: a rank whose last one
is far older than the others' is the one that stopped answering (a stopped or frozen process, or one
stuck outside the job); if all are recent, the ranks are alive but waiting in different collectives.

A rank that fails in a way it can explain (bad input, a full disk, such a timeout) writes the one-line
reason into torchrun's error file (TORCHELASTIC_ERROR_FILE, the format of torch's ``ErrorHandler``),
tagged with its kind, so that the launcher prints that line once instead of N tracebacks.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.

_state: dict = {"beat": None, "phase": "starting"}

# What a timed-out or broken collective says, by backend (gloo, the TCP store, NCCL's watchdog).
_TIMEOUT_WORDS = ("timed out", "timeout")
_LOST_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed")


def set_phase(text: str) -> None:
    """What this rank is doing now; the heartbeat sends it soon (cheap: no I/O here)."""
    _state["phase"] = text
    if _state["beat"] is not None:
        _state["beat"].phase_changed()


def phase() -> str:
    return _state["phase"]


class Heartbeat:
    """A daemon thread that writes this rank's heartbeat into the job's store every ``interval`` seconds."""

    def __init__(self, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.store_timeout_s = max(5.0, min(60.0, timeout_s / 4))  # one store call's limit
        # Ten beats per timeout, between 1 and 30 seconds apart: a rank silent for half the
        # timeout has missed at least five.
        self.interval = min(30.0, max(1.0, timeout_s / 10))
        # A new phase is sent at its next beat, sooner than the interval but at most one beat per gap: a rank
        # that dies 20 s into training is not reported as still joining the job (the mn audit), and a job of
        # thousands of ranks stepping in a second each does not beat the store every iteration.
        self.gap = max(1.0, self.interval / 10)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "local")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"mpatch/heartbeat/{run}/{attempt}/"
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._changed = threading.Event()
        self._store = None
        self._thread = None

    def start(self) -> "Heartbeat":
        import torch.distributed as dist

        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            return self
        try:
            # A connection of its own: a blocking wait on the job's store elsewhere cannot delay a beat.
            self._store = dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                                        timeout=timedelta(seconds=self.store_timeout_s))
            self._beat()
        except Exception as exc:  # noqa: BLE001 - without heartbeats a timeout still fires, less explained
            print(f"note: rank {self.rank}: no heartbeat ({type(exc).__name__}: {exc}); a timeout will not name "
                  "the rank that stopped", flush=True)
            self._store = None
            return self
        self._thread = threading.Thread(target=self._run, name="mpatch-heartbeat", daemon=True)
        self._thread.start()
        return self

    def phase_changed(self) -> None:
        self._changed.set()

    def _run(self) -> None:
        while not self._stop.wait(self.gap):
            self._changed.wait(self.interval - self.gap)
            self._changed.clear()
            if self._stop.is_set():
                return
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store goes away when the job ends; the next beat retries
                pass

    def _beat(self) -> None:
        value = json.dumps({"time": time.time(), "phase": _state["phase"], "host": self.host, "pid": self.pid})
        with self._lock:
            self._store.set(self.prefix + str(self.rank), value)

    def read(self) -> dict[int, dict] | None:
        """Every rank's last heartbeat (ranks that never beat are left out); None if the store is unreachable."""
        if self._store is None:
            return None
        out = {}
        try:
            with self._lock:
                for r in range(self.world):
                    key = self.prefix + str(r)
                    if self._store.check([key]):
                        out[r] = json.loads(self._store.get(key))
        except Exception:  # noqa: BLE001 - the store's host may be the thing that is frozen
            return None
        return out

    def stop(self) -> None:
        """Stop beating and wait for a beat in flight: a daemon thread still inside the store's C++ client when
        the interpreter exits can abort the process ("terminate called without an active exception")."""
        self._stop.set()
        self._changed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.store_timeout_s + 1)


def start(rank: int, world: int, timeout_minutes: float) -> Heartbeat | None:
    """Start this rank's heartbeat (nothing to watch in a job of one)."""
    stop()
    if world < 2:
        return None
    _state["beat"] = Heartbeat(rank, world, timeout_minutes * 60).start()
    return _state["beat"]


def stop() -> None:
    if _state["beat"] is not None:
        _state["beat"].stop()
        _state["beat"] = None


# --- explaining a failed collective -----------------------------------------------------------------

def failure_kind(exc: BaseException) -> str | None:
    """'timeout' for a collective (or store wait) that timed out, 'lost' for a connection to another
    rank that broke (that rank died), None for anything else."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()
        if isinstance(exc, (RuntimeError, TimeoutError, ConnectionError)):
            if any(w in text for w in _LOST_WORDS):
                return "lost"
            if any(w in text for w in _TIMEOUT_WORDS):
                return "timeout"
        exc = exc.__cause__ or exc.__context__
    return None


def operation(exc: BaseException) -> str:
    """The collective that failed and who called it, from the traceback: "all_reduce (called from
    loop.py, _run_schedule)". The collective is the torch.distributed function the caller entered
    ("wait": the wait for an asynchronous one, e.g. DDP's gradient reduction)."""
    frames = traceback.extract_tb(exc.__traceback__)
    paths = [f.filename.replace(os.sep, "/") for f in frames]
    entered = next((i for i, p in enumerate(paths) if "/torch/distributed/" in p), None)
    if entered is None:
        return frames[-1].name if frames else type(exc).__name__
    name = next((f.name for f, p in zip(frames[entered:], paths[entered:]) if p.endswith("distributed_c10d.py")),
                frames[entered].name)
    what = "the wait for an asynchronous collective" if name == "wait" else name
    if entered == 0:
        return what
    caller = frames[entered - 1]
    return f"{what} (called from {Path(caller.filename).name}, {caller.name})"


def explain(exc: BaseException, rank: int, timeout_minutes: float, now: float | None = None,
            beats: dict[int, dict] | None | bool = False) -> str | None:
    """One line for a timed-out or broken collective on ``rank``: the operation, the phase, and which
    rank(s) stopped answering by their heartbeats. None when ``exc`` is something else.

    ``beats``: the heartbeats to judge by (default: read them now from the job's store)."""
    kind = failure_kind(exc)
    if kind is None:
        return None
    where = f"in {operation(exc)} during {phase()}"
    if beats is False and _state["beat"] is None:
        # Before the heartbeats start: the job was still forming (a rank or node that never arrived).
        head = (f"rank {rank} waited {timeout_minutes:g} min (MP_DIST_TIMEOUT_MIN) {where} and gave up"
                if kind == "timeout" else f"rank {rank} lost its connection to another rank {where}")
        return head + "; the ranks had not started their heartbeats yet, so which one is missing is not known " \
                      "(check that every node's launcher started and can reach MASTER_ADDR)"
    if beats is False:
        beats = _state["beat"].read()
    now = time.time() if now is None else now
    if kind == "lost":
        head = f"rank {rank} lost its connection to another rank {where}: that rank died or its node went away"
        return head + "; " + _judge(beats, now, timeout_minutes * 60 / 2, lost=True)
    head = f"rank {rank} waited {timeout_minutes:g} min (MP_DIST_TIMEOUT_MIN) {where} and gave up"
    return head + "; " + _judge(beats, now, timeout_minutes * 60 / 2)


def _who_exited(beats: dict[int, dict], now: float) -> str:
    """The rank a lost connection lost, by its heartbeat: a process of this host that is gone, else the other
    hosts' ranks, whose own launchers say which exited (a multi-node job: this node's launcher never hears of it)."""
    here = socket.gethostname()
    gone = {r: b for r, b in beats.items() if b["host"] == here and not _alive(b["pid"])}
    if gone:
        return "; ".join(f"rank {r} exited (pid {b['pid']} on {here}; its last heartbeat {now - b['time']:.0f} s ago, "
                         f"during {b['phase']})" for r, b in sorted(gone.items()))
    away = {r: b["host"] for r, b in beats.items() if b["host"] != here}
    if away:
        hosts = ", ".join(sorted(set(away.values())))
        return (f"a rank of another node exited (ranks {', '.join(str(r) for r in sorted(away))} run on {hosts}): "
                "that node's launcher names it")
    return "see the launcher's report of which rank exited"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a killed rank stays a zombie until its launcher reaps it, which the lost connection
    can come before."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _judge(beats: dict[int, dict] | None, now: float, stale_after: float, lost: bool = False) -> str:
    if beats is None:
        return ("the job's store did not answer either, so which rank stopped is not known (its host, MASTER_ADDR, "
                "may be the one that is frozen)")
    interval = _state["beat"].interval if _state["beat"] is not None else 1.0
    stale_after = max(stale_after, 3 * interval)
    silent = {r: b for r, b in beats.items() if now - b["time"] > stale_after}
    if silent:
        names = ", ".join(str(r) for r in sorted(silent))
        detail = "; ".join(f"rank {r}: last heartbeat {now - b['time']:.0f} s ago, during {b['phase']} "
                           f"(host {b['host']}, pid {b['pid']})" for r, b in sorted(silent.items()))
        verb = "stopped answering" if not lost else "went silent"
        return f"rank{'s' if len(silent) > 1 else ''} {names} {verb} ({detail})"
    if lost:
        return _who_exited(beats, now)
    phases = "; ".join(f"rank {r}: {b['phase']}" for r, b in sorted(beats.items()))
    return (f"every rank's heartbeat is recent, so none is frozen: the ranks are waiting in different "
            f"collectives ({phases})")


# --- telling the launcher why this rank failed ------------------------------------------------------

def report_failure(message: str, kind: str) -> bool:
    """Write ``message`` into torchrun's error file for this rank (torch ``ErrorHandler``'s format,
    plus ``mpatch_kind``: 'user' for bad input, 'pipe' for a reader of the output gone, 'hang', 'lost'). False
    when not under torchrun."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time())),
                                      "mpatch_kind": kind}}}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data))
    except OSError:
        return False
    return True

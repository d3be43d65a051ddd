"""Run a function in N local processes that form one torch.distributed job (gloo on CPU).

Used by the tests and by commands that need more ranks than the caller has (for example a
parity check at TP=2 from a single CLI process). ``fn`` must be importable (a module-level
function), since the workers are started with the "spawn" method.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from typing import Any, Callable

from megatron_patch.errors import UserError
from megatron_patch.runtime.distributed import free_port


class WorkerError(RuntimeError):
    """A worker raised; carries the worker's own traceback."""


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    # Several ranks on two cores: one intra-op thread each keeps them from fighting.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if not torch.cuda.is_available() and os.environ.get("MP_SHOW_WARNINGS") != "1":
        # Each rank would print megatron's "Apex/TE not installed, falling back" notices and
        # deprecation chatter: expected on CPU, and noise times N ranks.
        import warnings

        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
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
            from megatron_patch.runtime.distributed import destroy

            destroy()
        except Exception:
            pass


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
            if "EADDRINUSE" not in str(exc) or attempt == PORT_ATTEMPTS:
                raise


def _run_once(fn: Callable, world_size: int, args: tuple, timeout: float) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
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
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors)
        if isinstance(errors[rank], bytes):
            raise pickle.loads(errors[rank])
        raise WorkerError(f"rank {rank} failed: {errors[rank]}")
    return [outputs[r] for r in range(world_size)]

"""Injected faults (``MP_INJECT_FAULT``), to exercise the recovery paths a user relies on.

A loss scaler that never sees an overflow and a resume that never follows a crash are untested.
``MP_INJECT_FAULT`` takes a comma-separated list of ``KIND@ITERATION``:

- ``overflow@N``: after iteration N's backward pass, every gradient buffer is filled with inf, as
  an fp16 overflow would leave it. The optimizer must find it, skip the step and (fp16) lower the
  loss scale; with bf16/fp32 the step is skipped as well (megatron's check for non-finite grads).
- ``kill@N``: every rank sends itself SIGKILL as iteration N starts, as a lost node would. No
  checkpoint, log line or exit handler runs; the next launch must resume from the last checkpoint.
- ``error@N``: every rank raises a Python exception as iteration N starts, as a bug would: the launcher
  must say so in one line, naming the log that holds the first failing rank's traceback (each rank that
  gets there before the launcher stops the job writes its own).

A group torchrun restarts (``MP_MAX_RESTARTS``) is not killed or failed again: the restart is what those test, and
it would reach N again and again until the restarts ran out. ``overflow@N`` fires again, as the uninterrupted run's.

Nothing else in a run changes: with the variable unset no code path differs.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import psutil

from megatron_patch.checkpoint_files.layout import WHOLE_NUMBER
from megatron_patch.errors import UserError

KINDS = ("overflow", "kill", "error")


@dataclass(frozen=True)
class Fault:
    kind: str
    iteration: int


def parse_faults(raw: str | None) -> list[Fault]:
    """'overflow@7,kill@12' -> [Fault('overflow', 7), Fault('kill', 12)]."""
    faults = []
    for item in (raw or "").split(","):
        item = item.strip()
        if not item:
            continue
        kind, _, when = item.partition("@")
        if kind not in KINDS or not WHOLE_NUMBER.fullmatch(when) or int(when) < 1:
            raise UserError(f"MP_INJECT_FAULT item '{item}' must be KIND@ITERATION with KIND one of "
                            f"{' | '.join(KINDS)} and ITERATION >= 1, e.g. overflow@7,kill@12")
        faults.append(Fault(kind, int(when)))
    return faults


def of_attempt(faults: list[Fault], restart: int) -> list[Fault]:
    """The faults a group started ``restart`` times before fires: a restarted group no kill or error."""
    return faults if not restart else [f for f in faults if f.kind == "overflow"]


def due(faults: list[Fault], kind: str, iteration: int) -> bool:
    return any(f.kind == kind and f.iteration == iteration for f in faults)


def fill_gradients_with_inf(models: list) -> None:
    """What an overflowing fp16 backward leaves behind, in every DDP gradient buffer of this rank."""
    for model in models:
        for buffer in [*model.buffers, *model.expert_parallel_buffers]:
            buffer.grad_data.fill_(float("inf"))


class InjectedError(RuntimeError):
    """What ``error@N`` raises: a failure no check foresaw."""


def kill_this_process() -> None:
    """SIGKILL to this rank and the helper processes it started (the torch_dist writer's), as when a
    node is lost: a helper left alive would keep the launcher's output pipes open."""

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    os.kill(os.getpid(), signal.SIGKILL)

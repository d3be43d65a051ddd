"""Arguments several subcommands share."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading

from megatron_patch.errors import UserError
from megatron_patch.runtime.distributed import ParallelLayout

# Every command's --seed: numpy takes 0..2^32-1 only (lm-eval seeds it with eval's), torch's generator up to 2^64-1
# and wraps a negative one; a value beyond them failed deep inside as an internal error. One range for all.
SEED_RANGE = f"0..{2 ** 32 - 1}"


def check_seed(seed: int) -> None:
    if not 0 <= seed < 2 ** 32:
        raise UserError(f"--seed must be in {SEED_RANGE}, got {seed}")


def check_not_empty(path: str | None, flag: str) -> None:
    """An output folder given as '' (an unset shell variable) is said, not taken as none given (no report written)."""
    if path == "":
        raise UserError(f"{flag} is an empty path: give the output folder")


def sigterm_as_interrupt(run):
    """``run`` with SIGTERM (a scheduler cancelling the job) unwinding like Ctrl-C, so its partial output and lock
    go; the caller's own handler is back afterwards (tests run the commands in process)."""
    @functools.wraps(run)
    def wrapped(*args, **kwargs):
        earlier, earlier_hook = signal.signal(signal.SIGTERM, _interrupt), sys.unraisablehook
        sys.unraisablehook = functools.partial(_terminated_again, earlier_hook)
        try:
            return run(*args, **kwargs)
        finally:
            signal.signal(signal.SIGTERM, earlier)
            sys.unraisablehook = earlier_hook
    return wrapped


def quiet_interrupts_in_finalizers() -> None:
    """For the rest of this process (a training rank): a Ctrl-C's KeyboardInterrupt raised inside a finalizer or a
    fork hook is dropped, not printed. megatron-core's checkpoint writer forks during a save, and a SIGINT landing in
    logging's at-fork hook printed "Exception ignored in: <function _releaseLock>" with its traceback above the
    launcher's one line. The rank is stopped all the same: torchrun's agent, which took the Ctrl-C too, ends every
    rank. (Sent again instead, as ``sigterm_as_interrupt`` does, the interrupt escaped the rank's handlers on
    CPython 3.13 when it followed a fork.)"""
    earlier_hook = sys.unraisablehook

    def hook(unraisable) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            earlier_hook(unraisable)

    sys.unraisablehook = hook


def _terminated_again(earlier_hook, unraisable) -> None:
    """A Terminated raised inside a finalizer (``__del__``, a weakref callback), where Python prints it as ignored
    and goes on: the run went on to the end and exited 0 after the scheduler's SIGTERM. The signal is sent again,
    so that it unwinds the run from where the finalizer returns to."""
    if isinstance(unraisable.exc_value, Terminated):
        # from another thread, a moment later: a signal made pending here is taken at once, inside the hook again
        again = threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGTERM))
        again.daemon = True
        again.start()
        return
    earlier_hook(unraisable)


class Terminated(KeyboardInterrupt):
    """SIGTERM's KeyboardInterrupt, a class of its own because CPython remembers a KeyboardInterrupt itself that
    passes through code run from a string (``exec``/``eval``: a dataclass or namedtuple made by a late import) and,
    under ``python -m``, ends the process by SIGINT at exit though the CLI caught it and returned 130. It checks
    for that exact class, so a subclass unwinds as Ctrl-C does and the 130 stands."""


def _interrupt(signum, frame):
    raise Terminated


def add_layout_args(parser, *, etp: bool = True) -> None:
    g = parser.add_argument_group("parallel layout")
    g.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    g.add_argument("--ep", type=int, default=1, help="expert parallel size, MoE only (default 1)")
    if etp:
        g.add_argument("--etp", type=int, default=None,
                       help="expert tensor parallel size, MoE only (default: TP; 1 for experts with biases, as gpt_oss's)")


def layout_from_args(args) -> ParallelLayout:
    return ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep, etp=getattr(args, "etp", None))


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))

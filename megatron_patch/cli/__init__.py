"""`mpatch`: one entry point, one module per subcommand (each exposes ``register(subparsers)``).

The subcommand modules import the library inside their ``run`` functions, not at the top: ``mpatch convert``
starts without torch or megatron-core (0.3-0.6 s with the model's shape cached, docs/performance.md), and
``--help`` of any subcommand should not pay for the others' imports. Library modules import at the top.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
import traceback
from pathlib import Path

from megatron_patch import __version__
from megatron_patch.errors import UserError
from megatron_patch.outputs.full_disk import full_disk_error, unwritten_line
from megatron_patch.runtime.deferred_compile import defer_megatron_compile
from megatron_patch.runtime.known_warnings import quiet_known_warnings

SUBCOMMANDS = ["info", "families", "demo", "parity", "convert", "inspect", "verify", "preprocess", "train", "align",
               "eval"]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of ``only`` that one (its module's imports are all that run:
    some subcommands import torch at import time, which ``mpatch convert`` does not need)."""
    parser = argparse.ArgumentParser(
        prog="mpatch", description="Llama-3.1, Qwen2 and MoE models on Megatron-Core: conversion, alignment, training.")
    parser.add_argument("--version", action="version", version=f"megatron_patch {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS if only not in SUBCOMMANDS else [only]:
        importlib.import_module(f"megatron_patch.cli.{name}").register(subparsers)
    return parser


# Exit codes (docs/outputs.md). align and parity give a verdict, so their internal error is 3, not 1.
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = {"align": 3, "parity": 3}
EXIT_BROKEN_PIPE = 141  # as a shell reports a process ended by SIGPIPE (`mpatch families | head -1`)
DEBUG_VARIABLE = "MPATCH_DEBUG"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def reader_gone() -> int:
    """The reader went away (a pager quit, `| head`): nothing is wrong and nothing more can be said. stdout
    is pointed at /dev/null so that the interpreter's final flush does not complain either."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def went_to_a_gone_reader(exc: BaseException) -> bool:
    """Whether ``exc`` is (or was caused by) a write to stdout or stderr whose reader went away: a BrokenPipeError
    while the pipe's write end reports the error (poll's POLLERR), not a broken socket of the job's."""
    seen = set()
    while exc is not None and id(exc) not in seen and not isinstance(exc, BrokenPipeError):
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    if not isinstance(exc, BrokenPipeError):
        return False
    poll = select.poll()
    for stream in (sys.stdout, sys.stderr):
        try:
            poll.register(stream.fileno(), select.POLLOUT)
        except (AttributeError, OSError, ValueError):  # no stream, or one without a descriptor
            continue
    return any(events & select.POLLERR for _, events in poll.poll(0))


def _closed_streams_to_devnull() -> None:
    """A command started with stdin, stdout or stderr closed (`>&-`: a daemon, a cron job) reads and writes
    /dev/null there: Python left sys.stdout None, and the final flush ended a finished conversion in an internal
    error, a launch before it trained (the env audit); the descriptor's number, free, would have gone to the next
    file opened. A number already reused by a file opened since is left to it."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is not None:
            continue
        try:
            os.fstat(fd)
            setattr(sys, name, open(os.devnull, mode))
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: ``fd`` itself, where it is the only one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # the ranks' and workers' descriptor too
            setattr(sys, name, open(fd, mode, closefd=False))


def main(argv: list[str] | None = None) -> int:
    """Every command: 0 success, 2 bad input (one line), 1 an internal error (one line; its traceback with
    MPATCH_DEBUG=1), 130 interrupted; align and parity: 1 is their negative verdict, 3 an internal error."""
    _closed_streams_to_devnull()
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_known_warnings()  # each rank of a launch runs this too
    defer_megatron_compile()  # before anything imports megatron-core (runtime/deferred_compile.py says why)
    command = argv[0] if argv and argv[0] in SUBCOMMANDS else "mpatch"
    args = None
    try:
        args, extra = build_parser(only=argv[0] if argv else None).parse_known_args(argv)
        if extra:  # argparse names them under the top-level usage, which lists no option of the command
            path = " ".join(str(p) for p in (args.command, getattr(args, "direction", None)) if p)
            raise UserError(f"unrecognized arguments: {' '.join(extra)} ('mpatch {path} --help' lists the options)")
        command = args.command
        _check_working_directory()
        code = int(args.run(args) or 0)
        # Output to a pipe is buffered: a reader gone by now fails this flush, caught here, not at exit.
        sys.stdout.flush()
        return code
    except UserError as exc:
        print(f"mpatch {command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"mpatch {command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return reader_gone()
    except SystemExit:  # argparse's --help and usage errors: their output is flushed here too
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            return reader_gone()
        raise
    except ModuleNotFoundError as exc:
        missing = missing_dependency(exc)
        if missing is None:
            return _internal(command, exc)
        print(f"mpatch {command}: error: {missing}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # noqa: BLE001 - the contract: one line, never a traceback unless asked for
        full = full_disk_error(exc)
        if full is not None:  # a full disk or a file-size limit is bad input, wherever a command met it
            print(f"mpatch {command}: error: {unwritten_line(full, _output_folders(args))}", file=sys.stderr)
            return EXIT_BAD_INPUT
        return _internal(command, exc)


def _output_folders(args) -> dict[str, str]:
    """{option: folder} of the outputs a command writes that a full disk's line may name (align's, eval's)."""
    named = {option: getattr(args, option[2:].replace("-", "_"), None) for option in ("--report-dir", "--output-dir")}
    return {option: folder for option, folder in named.items() if folder}


def _check_working_directory() -> None:
    """A working directory deleted under the shell (``rm -rf`` of the folder it stands in) is the environment's
    problem, not a bug: said here, before any relative path or library fails on it."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise UserError("the working directory no longer exists (it was deleted or replaced after this shell went "
                        "into it): cd to an existing folder and rerun") from None


def missing_dependency(exc: ModuleNotFoundError) -> str | None:
    """What to do about a dependency this Python lacks (the launchers put the repository on PYTHONPATH, so a
    Python without the project's installation imports megatron_patch and stops at its first dependency), or
    None: a module of this project itself is missing, which is a bug."""
    name = (exc.name or "").split(".")[0]
    if not name or name == "megatron_patch":
        return None
    return (f"the Python package '{name}' is not installed in {sys.executable}, which runs mpatch: install "
            "megatron_patch there (pip install -e . in its repository), or set PYTHON to the Python that has it")


def _internal(command: str, exc: BaseException) -> int:
    """One line for a bug (its traceback with MPATCH_DEBUG=1)."""
    if os.environ.get(DEBUG_VARIABLE) == "1":
        traceback.print_exc()
        if getattr(exc, "worker_traceback", ""):  # a rank's own (runtime/launch.py WorkerError)
            print(f"the rank's traceback:\n{exc.worker_traceback}", file=sys.stderr)
    print(f"mpatch {command}: {internal_error(exc)} (a bug: please report it; {DEBUG_VARIABLE}=1 prints the "
          "traceback)", file=sys.stderr)
    return EXIT_INTERNAL.get(command, 1)


def internal_error(exc: BaseException) -> str:
    """'internal error: KeyError: 'x' at file.py:12': the exception and where it was raised, on one line."""
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
    return f"internal error: {type(exc).__name__}: {_one_line(exc)[:300]}{at}"

"""A full disk (or a used-up quota) while an output is written is bad input, not a bug: one line naming the output,
how much room is left, and what to do; exit 2. Every writer leaves its output as it was before the run (the
partial files go, the earlier output stays), so the line can say so. Training's checkpoints say it their own
way (``training.checkpointing``), with which earlier checkpoint a rerun resumes from.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from megatron_patch.errors import UserError

# EFBIG: a file reached the largest size allowed (a job's `ulimit -f`, or the filesystem's own limit)
FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def full_disk_error(exc: BaseException) -> OSError | None:
    """The ENOSPC, EDQUOT or EFBIG ``exc`` is, or was caused by (a writer may wrap it), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL_DISK:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def free_space(output: str | Path) -> str:
    """"N MiB free" on the filesystem of ``output`` (or of its nearest existing parent)."""
    free = _free_bytes(output)
    return "free space unknown" if free is None else f"{free / 2**20:.1f} MiB free"


def _room_and_remedy(full: OSError, where: str | Path, what: str) -> tuple[str, str]:
    if full.errno == errno.EFBIG:
        return ("a file reached the largest size allowed (`ulimit -f`, or the filesystem's limit)",
                f"raise the limit (or choose another {what} on a filesystem without it)")
    return f"{free_space(where)} there", f"free space (or choose another {what})"


def unwritten_line(full: OSError, outputs: dict[str, str | Path] | None = None) -> str:
    """The one line for a full disk, quota or file-size limit met by a command that names no output of its own
    here (align's report, eval's task data and results: each written whole or not at all). A file's write carries
    no name: then the fullest of the command's ``outputs`` ({option: folder}) and TMPDIR, where its working files
    go, is the one named (before, the working directory's room was given, another filesystem's; the env audit)."""
    if full.filename:
        where, named, what = Path(os.fsdecode(full.filename)).parent, f" ({os.fsdecode(full.filename)})", "output"
    else:
        places = {**(outputs or {}), "TMPDIR": tempfile.gettempdir()}
        free = {name: _free_bytes(folder) for name, folder in places.items()}
        what = min(places, key=lambda name: float("inf") if free[name] is None else free[name])
        where, named = Path(places[what]), f" (in {what} {places[what]})"
    room, remedy = _room_and_remedy(full, where, what)
    return (f"writing failed: [Errno {full.errno}] {full.strerror}{named}, {room}; what it was writing is left out "
            f"(an output appears only complete): {remedy} and rerun")


def _free_bytes(output: str | Path) -> int | None:
    """The free bytes of ``output``'s filesystem (or of its nearest existing parent's), None where none is readable."""
    for folder in (Path(output), *Path(output).parents):
        try:
            return shutil.disk_usage(folder).free
        except OSError:
            continue
    return None


@contextlib.contextmanager
def full_disk_is_bad_input(output: str | Path, what: str) -> Iterator[None]:
    """Inside: writing ``output`` (given by the option ``what``). A full disk becomes one ``UserError``; the
    block's own cleanup has run by then (it is raised from the writer's ``finally`` blocks outward)."""
    try:
        yield
    except UserError:  # said already, by a writer inside
        raise
    except Exception as exc:
        full = full_disk_error(exc)
        if full is None:
            raise
        where = f" ({full.filename})" if full.filename else ""
        room, remedy = _room_and_remedy(full, output, what)
        raise UserError(f"writing {output} failed: [Errno {full.errno}] {full.strerror}{where}, {room}; {output} is "
                        f"as it was before this run and no partial file is left: {remedy} and rerun") from None

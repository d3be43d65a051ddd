"""One writer per output: a lock file next to the output, ``.NAME.mpatch-lock``, held (``fcntl.flock``) for
the whole run.

The kernel holds the lock for as long as the writing process lives, and drops it when the process ends,
however it ends (a SIGKILL, the OOM killer): so a second writer is refused in one line naming the first,
and a lock file left by a process that is gone is simply taken over (and said so). Nothing here judges
liveness by PID. The file's content (pid, host, command, start time) only names the owner in messages.

Training runs add the ranks: each rank holds a lock of its own in ``.NAME.mpatch-lock.ranks/`` for as long as
it lives, so a new launcher can see ranks of an earlier run that outlived theirs (``live_ranks``) and
refuse to start beside them, naming their PIDs.

A lock is opened without following symlinks, and only ever as a plain file with no other name: the lock's
content is truncated and rewritten, so a symlink, a hard link (to someone's file), a FIFO, a folder or a
device at its name is refused in one line and left as it is; so is a ranks folder that is not a folder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from megatron_patch.errors import UserError

LOCK_SUFFIX = ".mpatch-lock"
RANKS_SUFFIX = ".mpatch-lock.ranks"


def lock_path(target: str | Path) -> Path:
    target = Path(target).absolute()
    return target.parent / f".{target.name}{LOCK_SUFFIX}"


def _owner_text(info: dict) -> str:
    if not info:
        return "another process (its lock file names no owner)"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"])) if isinstance(
        info.get("started"), (int, float)) else "?"
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')} ({info.get('command', '?')}, started {when})"


def _read_owner(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        info = json.loads(data.decode()) if data else {}
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _not_plain(path: Path, st: os.stat_result) -> UserError | None:
    """The refusal of a lock file that is not a plain file of its own, or None."""
    if stat.S_ISREG(st.st_mode) and st.st_nlink <= 1:  # 0: its owner removed it meanwhile (``_try_flock`` retries)
        return None
    if stat.S_ISLNK(st.st_mode):
        kind = f"a symlink (to {os.readlink(path)})"
    elif stat.S_ISREG(st.st_mode):
        kind = f"a file with {st.st_nlink} names (hard links)"
    else:
        kind = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a folder", stat.S_IFSOCK: "a socket"}.get(
            stat.S_IFMT(st.st_mode), "a device")
    return UserError(f"{path} is {kind}, not a plain file: mpatch's lock is always a plain file of its own, so "
                     "something else put this there; nothing was written through it. Remove it and rerun")


def _open_plain(path: Path) -> int:
    """``path`` opened for reading and writing (created if need be), refused (``_not_plain``) unless it is a
    plain file of its own. Checked before the open (opening a FIFO or a device can have effects of its own)
    and again on what was opened, since the name can change in between."""
    try:
        refusal = _not_plain(path, os.lstat(path))
    except FileNotFoundError:
        refusal = None
    if refusal is not None:
        raise refusal
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # it changed into a symlink, folder or FIFO
            raise _not_plain(path, os.lstat(path)) or exc
        raise
    refusal = _not_plain(path, os.fstat(fd))
    if refusal is not None:
        os.close(fd)
        raise refusal
    return fd


def _try_flock(path: Path, *, shared: bool = False) -> tuple[int, bool]:
    """(fd, locked) for ``path``, opened (created if need be; a plain file only) and, if free, locked."""
    while True:
        fd = _open_plain(path)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            return fd, False
        except OSError:
            os.close(fd)
            raise
        # The owner may have removed the file between our open and our lock: then we hold a lock on a
        # file nobody else can find. Start again on the name as it is now.
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd, True
        except FileNotFoundError:
            pass
        os.close(fd)


def _writer_around(target: Path) -> tuple[Path, dict] | None:
    """(folder, its writer) for a folder above ``target`` whose lock another process holds: a running training run's
    folder took a converter's output into it (its export then replaced that output without a word; the outputs
    audit). Only asked, never taken: a lock file no one holds says nothing."""
    for folder in target.parents:
        if folder.parent == folder:
            break
        try:
            fd = os.open(lock_path(folder), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return folder, _read_owner(fd)
        finally:
            os.close(fd)
    return None


class OutputLock:
    """``with OutputLock(target, "--save-dir"):`` the caller is the one writer of ``target`` until the block
    ends. ``what`` names the option the user gave the output with, for the messages."""

    def __init__(self, target: str | Path, what: str = "output", *, log: Callable[[str], None] | None = None):
        self.target = Path(target).absolute()
        self.path = lock_path(self.target)
        self.what = what
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.fd: int | None = None

    def acquire(self) -> "OutputLock":
        if not self.target.parent.is_dir():
            raise UserError(f"the folder {self.target.parent} (where {self.target.name} would go) does not exist or "
                            f"is not a folder: create it first, or choose another {self.what}")
        # asked before this output's own lock file is made: that file would be a stray one inside the other output
        around = _writer_around(self.target)
        if around is not None:
            folder, holder = around
            raise UserError(f"{self.target} lies inside {folder}, which is being written by {_owner_text(holder)}: "
                            f"wait for it to finish, or choose a {self.what} outside it")
        try:
            fd, locked = _try_flock(self.path)
        except OSError as exc:
            raise UserError(f"cannot lock {self.target} ({exc.strerror or exc}: {self.path}): choose a {self.what} "
                            "in a folder you can write to")
        owner = _read_owner(fd)
        if not locked:
            os.close(fd)
            raise UserError(f"{self.target} is being written by {_owner_text(owner)}: wait for it to finish, or "
                            f"choose another {self.what}")
        if owner:
            self.log(f"note: took over the lock of {self.target} left by {_owner_text(owner)}, which is gone")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                "command": shlex.join(["mpatch" if i == 0 else a for i, a in enumerate(sys.argv[:6])])}
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        except BaseException:  # a full disk: the lock file goes as on any other exit (the s64 audit found it left)
            self.release()
            raise
        return self

    def release(self) -> None:
        """Remove the lock file (still holding the lock, so nobody takes a lock on the removed file), then
        let go."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --- the ranks of a training run -------------------------------------------------------------------------

def _ranks_dir(target: str | Path) -> Path:
    target = Path(target).absolute()
    return target.parent / f".{target.name}{RANKS_SUFFIX}"


def _check_ranks_dir(folder: Path) -> None:
    """The ranks' folder must be a folder itself: through a symlink, the marks of ranks that are gone (every
    file in it that no process holds) would be removed from wherever it leads. One that went meanwhile (its last
    rank's end) passes: the caller's next step on it meets its absence."""
    try:
        mode = os.lstat(folder).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        kind = f"a symlink (to {os.readlink(folder)})" if stat.S_ISLNK(mode) else "not a folder"
        raise UserError(f"{folder} is {kind}: mpatch keeps the marks of a run's ranks in a folder of its own there, "
                        "so something else put this there; nothing was written through it. Remove it and rerun")


def register_rank(target: str | Path) -> int:
    """Mark this process as a rank writing ``target`` for as long as it lives (the returned descriptor holds
    the mark; the kernel drops it when the process ends)."""
    folder = _ranks_dir(target)
    path = folder / f"{socket.gethostname()}.{os.getpid()}"
    while True:
        try:
            folder.mkdir()
        except FileExistsError:
            _check_ranks_dir(folder)
        try:
            fd, locked = _try_flock(path)
            break
        except FileNotFoundError:  # the folder was empty and went (another rank's end, a launcher's live_ranks)
            continue
    if not locked:  # a PID reused on this host while an old holder's descriptor lives on elsewhere
        os.close(fd)
        raise UserError(f"{path} is held by another process: an earlier run still writes {target}")
    return fd


def release_rank(target: str | Path, fd: int) -> None:
    """A rank's own end: its mark removed (the folder too once empty), then its lock let go. A rank that ends
    however it may be leaves its mark to the next launcher's ``live_ranks``; one that ends by returning (done, or
    refused) leaves nothing beside ``target``: another node's ranks, which no launcher of theirs sweeps, did."""
    folder = _ranks_dir(target)
    path = folder / f"{socket.gethostname()}.{os.getpid()}"
    try:
        held, there = os.fstat(fd), os.lstat(path)
        if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino):
            path.unlink()
        folder.rmdir()
    except OSError:
        pass  # gone already, or another rank's mark is still there
    finally:
        os.close(fd)


def live_ranks(target: str | Path) -> list[str]:
    """'pid N on HOST' for every rank of an earlier run that still holds its mark on ``target``; the marks of
    ranks that are gone are removed."""
    folder = _ranks_dir(target)
    if not os.path.lexists(folder):
        return []
    _check_ranks_dir(folder)
    alive = []
    try:
        marks = sorted(folder.iterdir())
    except FileNotFoundError:  # its last rank removed it meanwhile
        return []
    for path in marks:
        try:
            fd, locked = _try_flock(path)
        except OSError:
            continue
        try:
            host, _, pid = path.name.rpartition(".")
            if locked:
                path.unlink(missing_ok=True)
            else:
                alive.append(f"pid {pid} on {host}")
        finally:
            os.close(fd)
    if not alive:
        with contextlib.suppress(OSError):
            folder.rmdir()
    return alive


@contextlib.contextmanager
def locked(target: str | Path, what: str = "output") -> Iterator[OutputLock]:
    lock = OutputLock(target, what).acquire()
    try:
        yield lock
    finally:
        lock.release()

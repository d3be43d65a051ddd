"""A process's scratch folders in TMPDIR (multiprocessing's, for the fork server's socket; torchrun's agent's, for
its ranks' error files), removed when the process ends, and removed by the next launch when it was killed.

A process removes its own at exit, but a SIGKILL, the OOM killer or a lost node leaves them: a pymp-* and a
torchelastic_* per killed launch, piling up in a shared /tmp. So each folder holds an owner file, locked
(``fcntl.flock``) for the process's life; the kernel drops the lock however the process ends, and a folder whose
lock another process can take belongs to no one and is removed. Nothing here judges liveness by PID: processes in
other PID namespaces (containers) may share the TMPDIR.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from typing import Iterator

PREFIX = "mpatch-scratch-"
OWNER = ".owner"
# an owner file still empty: its process is between making it and writing its pid (moments), or died there
_EMPTY_OWNER_GRACE_S = 3600

_held: dict[str, int] = {}  # folder -> its locked owner file's descriptor (the lock lives as long as it is open)


def make_owned_folder(kind: str, base: str | None = None) -> str:
    """A new folder ``PREFIX + kind + random`` in ``base`` (TMPDIR), owned by this process until ``remove``."""
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-", dir=base)
    fd = os.open(os.path.join(folder, OWNER), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    # written once locked: a sweeper that took the lock between the file's making and this reads it empty, and leaves it
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[folder] = fd
    return folder


@contextlib.contextmanager
def scratch_folder(kind: str) -> Iterator[str]:
    """A scratch folder in TMPDIR for the ``with`` block (after sweeping what killed processes left there)."""
    sweep_abandoned()
    folder = make_owned_folder(kind)
    try:
        yield folder
    finally:
        remove(folder)


def remove(folder: str) -> None:
    """Remove one of this process's folders, then let its lock go."""
    shutil.rmtree(folder, ignore_errors=True)
    fd = _held.pop(folder, None)
    if fd is not None:
        os.close(fd)


def sweep_abandoned(base: str | None = None) -> list[str]:
    """Remove the scratch folders in ``base`` (TMPDIR) that this user's processes left when they were killed;
    return their paths. A folder still owned (its lock held), someone else's, or not a plain folder is left."""
    base = base or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(PREFIX) or entry.path in _held:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            fd = os.open(os.path.join(entry.path, OWNER), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            written = os.fstat(fd).st_size > 0
            if written or time.time() - os.fstat(fd).st_mtime > _EMPTY_OWNER_GRACE_S:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
        except OSError:
            pass  # owned: its process is alive
        finally:
            os.close(fd)
    return removed

"""Renames that cannot clobber: Linux's ``renameat2`` with ``RENAME_NOREPLACE`` (the name must be free) and
``RENAME_EXCHANGE`` (two names swap their folders in one step), through ctypes (Python has no ``renameat2``).

Where the filesystem or kernel has no such flags (NFS, Lustre, GPFS and old kernels answer EINVAL or
ENOSYS), ``exact`` is False and the callers fall back to a plain rename under the output's lock
(docs/outputs.md says what is then weaker): a free name is checked, then taken, and a replace becomes two
renames with the previous folder parked under a name the next run recognises (``folders.recover``).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from pathlib import Path

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
# Answers meaning "these flags are not available here", not "this rename is wrong".
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}


class FlagsUnsupported(OSError):
    """The filesystem or kernel cannot do this rename atomically with flags."""


@functools.lru_cache(maxsize=1)
def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # glibc < 2.28, another libc
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def renameat2(src: str | Path, dst: str | Path, flags: int) -> None:
    """``renameat2(AT_FDCWD, src, AT_FDCWD, dst, flags)``; ``FlagsUnsupported`` where the flags are not
    available, ``OSError`` (EEXIST, ENOENT, EPERM...) for anything else."""
    fn = _renameat2()
    if fn is None:
        raise FlagsUnsupported(errno.ENOSYS, "renameat2 is not available in this C library")
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return
    code = ctypes.get_errno()
    if code in _UNSUPPORTED:
        raise FlagsUnsupported(code, os.strerror(code), str(src))
    raise OSError(code, os.strerror(code), str(src), None, str(dst))


def rename_noreplace(src: str | Path, dst: str | Path) -> bool:
    """Rename ``src`` to ``dst`` only if ``dst`` does not exist (FileExistsError otherwise). Returns whether
    that was atomic; without the flag, the check and the rename are two steps, which the output's lock
    keeps other mpatch writers out of."""
    try:
        renameat2(src, dst, RENAME_NOREPLACE)
        return True
    except FlagsUnsupported:
        pass
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)
    return False


def exchange(a: str | Path, b: str | Path) -> None:
    """Swap the folders named ``a`` and ``b`` in one step; ``FlagsUnsupported`` where that cannot be done."""
    renameat2(a, b, RENAME_EXCHANGE)

"""Folders that appear complete or not at all, with one writer at a time, durable once published.

A folder output ``TARGET`` is written under its lock (``lock.OutputLock``) into a hidden sibling
``.TARGET.mpatch-partial.PID`` and published by a rename that cannot clobber:

- a new output: ``renameat2(RENAME_NOREPLACE)``: if anything took the name meanwhile, nothing is replaced;
- a replaced output (``--force``, a training save of an iteration saved before): ``renameat2(RENAME_EXCHANGE)``
  swaps the new folder and the old in one step, so at every instant ``TARGET`` is the whole old output or
  the whole new one, whatever kills the process; the old one, now under the partial name, is removed.

Only the lock holder writes next to ``TARGET``, so whatever partial or parked folder the lock holder finds
there was left by an earlier run that did not finish (``recover``): partials are removed; a previous
output parked by the fallback's two-step replace (``.TARGET.mpatch-replaced.PID``) is put back if
``TARGET`` is missing, removed if the replace completed. Each is said in one line. No PID is checked.

Durability: before a folder is renamed onto its name, every file and folder in it is fsynced, and after the
rename the parent folder is, so after a power loss a name never points at contents that were still only
in the page cache.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
from pathlib import Path
from typing import Callable, Iterator

from megatron_patch.errors import UserError
from megatron_patch.input_files import walk
from megatron_patch.outputs.lock import OutputLock
from megatron_patch.outputs.renames import FlagsUnsupported, exchange, rename_noreplace

PARTIAL_TAG = ".mpatch-partial."
REPLACED_TAG = ".mpatch-replaced."


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- durability -------------------------------------------------------------------------------------

def fsync_file(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Make the entries of folder ``path`` (names created, renamed or removed in it) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform or filesystem that cannot open folders has no folder fsync either
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some network filesystems refuse fsync on a folder (EINVAL); their renames are durable
        # once they return. Anything else (EIO, ENOSPC) is a real failure.
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def write_file_replacing(path: str | Path, data: str | bytes, *, durable: bool = False) -> None:
    """``data`` into ``path`` through a new file beside it, renamed over it: a link at ``path`` is replaced, never
    written through, and the new file is created where nothing is (``O_EXCL | O_NOFOLLOW``: no link planted at
    its name is followed either). ``durable``: fsynced, and the rename too."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with open(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_tree(folder: str | Path) -> None:
    """fsync every file under ``folder``, then every folder, deepest first (their entries)."""
    folders = []
    for dirpath, _dirnames, filenames in walk(folder):
        folders.append(dirpath)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_file(path)
    for dirpath in reversed(folders):
        fsync_dir(dirpath)


# --- names next to an output ------------------------------------------------------------------------

def partial_dir(target: str | Path, pid: int | None = None) -> Path:
    """The hidden sibling ``target`` is written in by process ``pid`` (default: this one)."""
    target = Path(target)
    return target.parent / f".{target.name}{PARTIAL_TAG}{pid or os.getpid()}"


def replaced_dir(target: str | Path, pid: int | None = None) -> Path:
    """Where the fallback replace parks the previous ``target`` between its two renames."""
    target = Path(target)
    return target.parent / f".{target.name}{REPLACED_TAG}{pid or os.getpid()}"


def _remove(path: Path) -> str | None:
    """Remove a folder (or file); None, or why it could not be."""
    errors: list[str] = []
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, onerror=lambda fn, p, exc: errors.append(f"{p}: {exc[1].strerror or exc[1]}"))
    else:
        try:
            path.unlink()
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror or exc}")
    return errors[0] if errors else None


def recover(target: str | Path, log: Callable[[str], None] = _stderr, *, keep: Path | None = None) -> None:
    """What earlier runs left next to ``target`` (call with ``target``'s lock held): partial folders are
    removed, a previous output parked by an interrupted replace is restored or removed. ``keep``: a partial
    folder of this run that must stay. A symlink at either name is removed as a link, never followed: only
    a folder is put back."""
    target = Path(target)
    parent = target.parent
    if not parent.is_dir():
        return
    for p in sorted(parent.glob(f".{glob_escape(target.name)}{PARTIAL_TAG}*")):
        if keep is not None and p == keep:
            continue
        why = _remove(p)
        log(f"note: removed {p.name}, the unfinished output of an earlier run" if why is None else
            f"warning: could not remove {p}, the unfinished output of an earlier run ({why}): remove it by hand")
    for p in sorted(parent.glob(f".{glob_escape(target.name)}{REPLACED_TAG}*")):
        if not os.path.lexists(target) and p.is_dir() and not p.is_symlink():
            try:
                rename_noreplace(p, target)
            except OSError as exc:
                log(f"warning: could not restore {target} from {p} ({exc.strerror or exc}): rename it by hand")
                continue
            fsync_dir(parent)
            log(f"note: restored {target} from {p.name}: an earlier replace of it was interrupted")
        else:
            why = _remove(p)
            log(f"note: removed {p.name}, the previous {target.name} an earlier replace left behind" if why is None
                else f"warning: could not remove {p}, the previous {target.name} ({why}): remove it by hand")


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def remove_stale_partials(target: str | Path) -> None:
    """Partial folders of ``target`` left by earlier runs (the caller is ``target``'s one writer)."""
    recover(target, keep=partial_dir(target))


# --- publishing --------------------------------------------------------------------------------------

def publish(tmp: str | Path, target: str | Path, *, replace: bool = True,
            log: Callable[[str], None] = _stderr) -> None:
    """Make the finished folder ``tmp`` the ``target`` (the caller holds ``target``'s lock).

    Without ``replace``, an existing ``target`` must be an empty folder (it is removed first) and is never
    overwritten. With it, an existing ``target`` is exchanged with ``tmp`` in one step, then removed.
    Everything in ``tmp`` is fsynced first and the parent folder after the rename, so ``target`` is on
    disk with its contents before anything (a tracker) can point at it.
    """
    tmp, target = Path(tmp), Path(target)
    fsync_tree(tmp)
    if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
        target.rmdir()  # "new or empty": an empty folder is not an output to keep
    if not os.path.lexists(target):
        try:
            rename_noreplace(tmp, target)
        except FileExistsError:
            raise UserError(f"{target} appeared while this output was written (by something that does not take "
                            "mpatch's lock): nothing was replaced; move it away and rerun") from None
        except OSError as exc:
            raise UserError(f"cannot create {target} ({exc.strerror or exc}): choose another output") from None
        fsync_dir(target.parent)
        return
    if not replace:
        raise UserError(f"{target} exists: nothing was replaced (pass --force to replace an earlier output)")
    try:
        try:
            exchange(tmp, target)
            old = tmp
        except FlagsUnsupported:
            # Two renames: a kill between them leaves the previous output parked, which ``recover`` restores.
            old = replaced_dir(target)
            os.rename(target, old)
            try:
                os.rename(tmp, target)
            except OSError:
                os.rename(old, target)
                raise
    except OSError as exc:  # an immutable or read-only target, a mount point
        raise UserError(f"cannot replace {target} ({exc.strerror or exc}): it was left as it was; make it writable "
                        "or choose another output") from None
    fsync_dir(target.parent)
    why = _remove(old)
    if why is not None:
        log(f"warning: {target} was replaced, but the previous one could not be removed ({why}): it is in {old}; "
            "remove it by hand")


@contextlib.contextmanager
def atomic_dir(target: str | Path, *, replace: bool = True, check: Callable[[Path], None] | None = None,
               what: str = "output", log: Callable[[str], None] = _stderr) -> Iterator[Path]:
    """Yield a fresh partial folder that becomes ``target`` when the block finishes without error; the lock
    of ``target`` is held throughout. ``check(target)`` runs under the lock, after what earlier runs left
    was cleaned up and before anything is written (the "is this output free" questions)."""
    target = Path(target).absolute()
    with OutputLock(target, what, log=log):
        recover(target, log)
        if check is not None:
            check(target)
        emptied = _take_empty_target(target, what)
        tmp = partial_dir(target)
        try:
            try:
                tmp.mkdir()
            except OSError as exc:
                raise UserError(f"cannot create {tmp} ({exc.strerror or exc}): choose a {what} you can write to")
            yield tmp
            publish(tmp, target, replace=replace, log=log)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # this process's own partial folder (its name holds the PID)
            if emptied is not None and not os.path.lexists(target):
                with contextlib.suppress(OSError):  # the empty folder given, back as it was
                    target.mkdir()
                    os.chmod(target, emptied)
            raise


def _take_empty_target(target: Path, what: str) -> int | None:
    """An empty folder given as the output is removed now, under the lock and before the work (the finished output
    takes its place), and its mode returned so that a failed run puts it back; None where there is none. One that
    cannot be removed (a mount point, an immutable folder) is refused now: the output could never take its place,
    and finding that out at the end threw the work away."""
    if not target.is_dir() or target.is_symlink() or any(target.iterdir()):
        return None
    mode = stat.S_IMODE(target.stat().st_mode)
    try:
        target.rmdir()
    except OSError as exc:
        # a mount point (busy) takes a folder inside it; an immutable or undeletable one takes nothing new
        instead = (f"give a {what} inside it, such as {target / 'out'}" if exc.errno == errno.EBUSY
                   else f"choose another {what}")
        raise UserError(f"{target} is an empty folder that cannot be replaced ({exc.strerror or exc}: a mount point "
                        f"or an immutable folder): {instead}") from None
    return mode


def refuse_unexpanded_home(path: str | Path, what: str) -> None:
    """Refuse a path that begins with a literal ``~`` (quoted in a job script, so no shell expanded it): it named a
    folder called ``~`` in the working directory, and every line after it read as the home folder."""
    first = str(path).split(os.sep, 1)[0]
    if first.startswith("~"):
        raise UserError(f"{what} {path} begins with a literal {first}, which no shell expanded (it was quoted): give "
                        f"the path with $HOME or unquoted, or as ./{path} for a folder of that name here")


def overlap(target: str | Path, inputs) -> Path | None:
    """The input ``target`` would overlap (be, lie inside, or hold), or None. Symlinks are resolved."""
    t = Path(target).resolve()
    for src in inputs:
        if src is None:
            continue
        s = Path(src).resolve()
        if t == s or s in t.parents or t in s.parents:
            return Path(src)
    return None

"""The manifest every output of this project carries: ``mpatch_manifest.json``, every file with its size and
digest, and the tool and version that wrote it.

Written last, into the unpublished folder, by every writer: ``hf2mcore`` and ``mcore2hf`` (after the copier
is done, while the files are still in the page cache), a training save (after megatron's saver returns and
before the tracker moves; the ranks share the hashing), the run's ``final/`` export and ``mpatch
preprocess`` (beside its two files, as ``PREFIX.mpatch_manifest.json``). What it is for:

- ``mpatch verify DIR``, and by default ``mcore2hf`` and every load for training (resume,
  PRETRAIN_CHECKPOINT_PATH): a file that changed after it was written, a flipped byte, a truncated copy is
  named in one line;
- ``--force``: a folder whose manifest names every file in it is an earlier output of this project, and may
  be replaced (``convert.outputs``).

The digest is xxHash's XXH3-128 (``xxhash``): 13 GiB/s on one core of this machine against 1.3 for SHA-256
(docs/performance.md), which keeps it inside the conversion's time. It proves a file is the one written
here, not that its weights are good (docs/security.md). It is not a signature: whoever can change the files
can change the manifest too.

It sits beside the converter's sidecar (``mpatch_checkpoint.json``), not in it: the sidecar describes a
model and only MCore checkpoints have one, while every output has a manifest (HF exports, training
iterations, preprocessed data); and the manifest must be the last file written, covering the sidecar too.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import xxhash

from megatron_patch import __version__
from megatron_patch.errors import UserError

MANIFEST_NAME = "mpatch_manifest.json"
MANIFEST_VERSION = 1
DIGEST = "xxh3_128"
# A file is hashed through a read-only map of this many bytes at a time (populated up front: the pages
# come from the page cache without a copy), so the process holds at most this much per thread.
WINDOW = 16 * 2**20
# Hashing threads: xxhash releases the GIL, and the files are usually in the page cache.
HASH_THREADS = min(4, os.cpu_count() or 1)


class IntegrityError(UserError):
    """A file differs from what its manifest recorded when it was written."""


def digest_file(path: str | Path) -> tuple[int, str]:
    """(size, XXH3-128 hex digest) of one file."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for start in range(0, size, WINDOW):
            length = min(WINDOW, size - start)
            with mmap.mmap(f.fileno(), length, offset=start, prot=mmap.PROT_READ,
                           flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as m:
                h.update(m)
    return size, h.hexdigest()


def _files(folder: Path, exclude: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            if rel != exclude and not path.is_symlink():
                out.append(rel)
    return out


def _tool_versions() -> dict:
    return {"megatron_patch": __version__}


def digests(folder: str | Path, names: Iterable[str], *, sync: bool = True) -> dict[str, dict]:
    """{name: {"size", "xxh3_128"}} for files of ``folder``; with ``sync`` each is fsynced after it is hashed
    (one file's wait for the disk overlaps another's hashing, and the publish's own fsync finds nothing left)."""
    folder = Path(folder)

    def one(name: str) -> tuple[str, dict]:
        size, digest = digest_file(folder / name)
        if sync:
            fd = os.open(folder / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return name, {"size": size, DIGEST: digest}

    names = list(names)
    if len(names) <= 1:
        return dict(map(one, names))
    with ThreadPoolExecutor(min(HASH_THREADS, len(names)), thread_name_prefix="mpatch-hash") as pool:
        return dict(pool.map(one, names))


def write_manifest(folder: str | Path, tool: str, *, name: str = MANIFEST_NAME, files: dict[str, dict] | None = None,
                   sync: bool = True, known: dict[str, dict] | None = None) -> Path:
    """Write ``folder``'s manifest (``name``) listing every file under it (or ``files``, already hashed, e.g.
    by several ranks), named as written by ``tool``. Call it last, before the folder is published. ``known``:
    entries of files hashed already, once complete (a converter's large files, hashed beside its copies)."""
    folder = Path(folder)
    if files is None:
        known = known or {}
        files = {**known, **digests(folder, [n for n in _files(folder, name) if n not in known], sync=sync)}
    # No time stamp: converting the same input twice gives the same bytes, manifest included.
    data = {"manifest_version": MANIFEST_VERSION, "tool": tool, "versions": _tool_versions(), "digest": DIGEST,
            "files": dict(sorted(files.items()))}
    path = folder / name
    with open(path, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
        if sync:
            f.flush()
            os.fsync(f.fileno())
    return path


def unlisted_files(folder: str | Path, name: str = MANIFEST_NAME) -> list[str]:
    """Names of ``folder``'s own files that no manifest names; the files a training run keeps in several
    manifests (one per iteration folder) are counted in theirs."""
    return _files(Path(folder), name)


def read_manifest(path: str | Path) -> dict:
    """A manifest file, checked for shape (one line naming what is wrong)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UserError(f"{path} is unreadable ({exc}): the output's manifest is damaged")
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not isinstance(data.get("manifest_version"), int):
        raise UserError(f"{path} is not a manifest written by mpatch (no 'files' table)")
    if data["manifest_version"] > MANIFEST_VERSION:
        raise UserError(f"{path} has manifest version {data['manifest_version']}; this megatron_patch reads up to "
                        f"{MANIFEST_VERSION}: upgrade megatron_patch")
    if data.get("digest") != DIGEST:
        raise UserError(f"{path} uses digest {data.get('digest')!r}; this megatron_patch checks {DIGEST}")
    for name, entry in files.items():
        if (not isinstance(name, str) or not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get(DIGEST), str) or name.startswith("/") or ".." in Path(name).parts):
            raise UserError(f"{path} has a malformed entry {str(name)[:80]!r}: the output's manifest is damaged")
    return data


def verify_manifest(path: str | Path) -> int:
    """Check every file a manifest lists against its size and digest; returns the bytes checked. Raises
    ``IntegrityError`` naming the first file that differs."""
    path = Path(path)
    folder = path.parent
    data = read_manifest(path)
    entries = data["files"]
    for name, entry in entries.items():  # sizes first: cheap, and names a truncated copy before any hashing
        file = folder / name
        if not file.is_file():
            raise IntegrityError(f"{file} is missing: {path.name} lists it ({data.get('tool', '?')} wrote it)")
        size = file.stat().st_size
        if size != entry["size"]:
            raise IntegrityError(f"{file} is {size} bytes, but {path.name} records {entry['size']}: the file was "
                                 "truncated or changed after it was written")
    found = digests(folder, entries, sync=False)
    for name, entry in entries.items():
        if found[name][DIGEST] != entry[DIGEST]:
            raise IntegrityError(f"{folder / name} does not match its digest in {path.name}: the file was changed "
                                 "or damaged after it was written (a flipped byte, a bad copy)")
    return sum(e["size"] for e in entries.values())


def manifest_of(folder: str | Path) -> Path | None:
    path = Path(folder) / MANIFEST_NAME
    return path if path.is_file() else None


def manifest_for(folder: str | Path) -> Path | None:
    """The manifest covering a checkpoint's weights folder: its own (a training iteration, an HF folder), or
    its parent's when it is the ``release/`` of a converted checkpoint or export."""
    folder = Path(folder)
    own = manifest_of(folder)
    if own is not None:
        return own
    up = manifest_of(folder.parent)
    if up is not None and any(name.startswith(f"{folder.name}/") for name in read_manifest(up)["files"]):
        return up
    return None


class BackgroundCheck:
    """``verify_manifest`` in a thread beside other work (a conversion reading the same files, which are then
    in the page cache): ``result()`` waits and raises what it found."""

    def __init__(self, path: Path):
        self.path = path
        # The files whose every byte it checks (resolved): a reader needs no other check of them.
        self.files = frozenset((path.parent / name).resolve() for name in read_manifest(path)["files"])
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="mpatch-verify", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            verify_manifest(self.path)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by result()
            self.error = exc

    def result(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error

    def failure(self, timeout: float = 30.0) -> BaseException | None:
        """After the work beside it failed: what the check found, if it finishes within ``timeout`` (a damaged
        file explains a failed conversion better than the conversion's own error)."""
        self.thread.join(timeout)
        return self.error if isinstance(self.error, IntegrityError) else None

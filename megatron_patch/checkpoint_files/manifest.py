"""The manifest every output of this project carries: ``mpatch_manifest.json``, every file with its size and
digest, and the tool and version that wrote it.

Written last, into the unpublished folder, by every writer: ``hf2mcore`` and ``mcore2hf`` (after the copier
is done, while the files are still in the page cache), a training save (after megatron's saver returns and
before the tracker moves; the ranks share the hashing), the run's ``final/`` export and ``mpatch
preprocess`` (beside its two files, as ``PREFIX.mpatch_manifest.json``). What it is for:

- ``mpatch verify DIR``, and by default ``mcore2hf`` and every load for training (resume,
  PRETRAIN_CHECKPOINT_PATH): a file that changed after it was written, a flipped byte, a truncated copy is
  named in one line; and, before any byte is hashed, the output is held to exactly what the manifest lists
  (``check_coverage``: no file it does not list, no listed file that is a link, leaves the folder or is not a
  regular file, and not an empty list), so that nothing is read that the manifest does not vouch for;
- ``--force``: a folder whose manifest names every file in it is an earlier output of this project, and may
  be replaced (``checkpoint.outputs``).

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
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import xxhash

from megatron_patch import __version__
from megatron_patch.errors import UserError
from megatron_patch.input_files import contained, read_input_json, walk

MANIFEST_NAME = "mpatch_manifest.json"
MANIFEST_VERSION = 1
DIGEST = "xxh3_128"
# A file is hashed through a read-only map of this many bytes at a time (populated up front: the pages
# come from the page cache without a copy), so the process holds at most this much per thread.
WINDOW = 16 * 2**20
# Hashing threads: xxhash releases the GIL, and the files are usually in the page cache.
HASH_THREADS = min(4, os.cpu_count() or 1)


class IntegrityError(UserError):
    """A file differs from what its manifest recorded when it was written, or the manifest itself is damaged
    (either way, a reader's switch that skips the check reads the output as it is: ``naming_the_switch``)."""


def digest_file(path: str | Path) -> tuple[int, str]:
    """(size, XXH3-128 hex digest) of one file."""
    h = xxhash.xxh3_128()
    # Without blocking (a FIFO put in place of a file), and on the descriptor's own type.
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError(f"{path} is not a regular file: an output of mpatch holds only files")
        size = st.st_size
        for start in range(0, size, WINDOW):
            length = min(WINDOW, size - start)
            with mmap.mmap(f.fileno(), length, offset=start, prot=mmap.PROT_READ,
                           flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as m:
                h.update(m)
    return size, h.hexdigest()


def _files(folder: Path, exclude: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in walk(folder):
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
                   sync: bool = True, known: dict[str, dict] | None = None, records: dict | None = None) -> Path:
    """Write ``folder``'s manifest (``name``) listing every file under it (or ``files``, already hashed, e.g.
    by several ranks), named as written by ``tool``. Call it last, before the folder is published. ``known``:
    entries of files hashed already, once complete (a converter's large files, hashed beside its copies).
    ``records``: more of what the tool knows of its output, each under a key of its own (readers that do not know
    a key pass it over, so a record can be added without a new manifest version)."""
    folder = Path(folder)
    if files is None:
        known = known or {}
        files = {**known, **digests(folder, [n for n in _files(folder, name) if n not in known], sync=sync)}
    # No time stamp: converting the same input twice gives the same bytes, manifest included.
    data = {"manifest_version": MANIFEST_VERSION, "tool": tool, "versions": _tool_versions(), "digest": DIGEST}
    taken = sorted(set(records or ()) & {*data, "files"})
    if taken:
        raise ValueError(f"a manifest record cannot take the manifest's own keys {taken}")
    data = {**data, **(records or {}), "files": dict(sorted(files.items()))}
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
        data = read_input_json(path, inside=path.parent)
    except UserError as exc:
        raise IntegrityError(f"{exc}: the output's manifest is damaged") from None
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict) or not isinstance(data.get("manifest_version"), int):
        raise IntegrityError(f"{path} is not a manifest written by mpatch (no 'files' table)")
    if data["manifest_version"] > MANIFEST_VERSION:
        raise UserError(f"{path} has manifest version {data['manifest_version']}; this megatron_patch reads up to "
                        f"{MANIFEST_VERSION}: upgrade megatron_patch")
    if data.get("digest") != DIGEST:
        raise UserError(f"{path} uses digest {data.get('digest')!r}; this megatron_patch checks {DIGEST}")
    for name, entry in files.items():
        if (not isinstance(name, str) or not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get(DIGEST), str) or name.startswith("/") or ".." in Path(name).parts
                # one file listed twice under two spellings ("./release/x" beside "release/x") verified (tools audit)
                or Path(name).as_posix() != name):
            raise IntegrityError(f"{path} has a malformed entry {str(name)[:80]!r}: the output's manifest is damaged")
    return data


PREFIX_SUFFIXES = (".bin", ".idx")  # what a data prefix's manifest (``PREFIX.mpatch_manifest.json``) covers


def output_files(path: str | Path) -> list[str]:
    """Every name the output of manifest ``path`` holds, whatever it is (file, link, FIFO), relative to the
    manifest's folder: everything under a folder's ``mpatch_manifest.json`` but the manifest itself, or a data
    prefix's ``.bin`` and ``.idx`` beside ``PREFIX.mpatch_manifest.json``."""
    path = Path(path)
    folder = path.parent
    if path.name != MANIFEST_NAME and path.name.endswith(f".{MANIFEST_NAME}"):
        prefix = path.name[:-len(MANIFEST_NAME) - 1]
        return [prefix + s for s in PREFIX_SUFFIXES if os.path.lexists(folder / (prefix + s))]
    out = []
    for dirpath, dirnames, filenames in walk(folder):  # links to folders are listed, never entered
        here = Path(dirpath)
        out += [(here / d).relative_to(folder).as_posix() for d in dirnames if (here / d).is_symlink()]
        out += [(here / f).relative_to(folder).as_posix() for f in filenames]
    return sorted(n for n in out if n != path.name)


def unlisted_entries(folder: str | Path) -> list[str]:
    """Everything under ``folder`` but its manifest, as ``--force`` would delete it: files of any kind, links
    (to folders too, never entered) and empty folders (``NAME/``)."""
    folder = Path(folder)
    return sorted(output_files(folder / MANIFEST_NAME) + _empty_folders(folder))


def _empty_folders(folder: Path) -> list[str]:
    """The empty folders under ``folder`` (``NAME/``), which no manifest lists: something added."""
    return [Path(d).relative_to(folder).as_posix() + "/" for d, dirnames, filenames in walk(folder)
            if not dirnames and not filenames and Path(d) != folder]


def _legacy_unlisted(data: dict) -> bool:
    """A training iteration saved before its manifest listed the folder's hidden files (``.metadata``): those
    are not counted as unlisted (docs/outputs.md)."""
    return str(data.get("tool", "")).startswith("mpatch train") and ".metadata" not in data["files"]


def _listed_problem(folder: Path, name: str) -> str | None:
    """What is wrong with a listed name on disk (None: a regular file of the folder's own)."""
    path = folder / name
    if not os.path.lexists(path):
        return "is missing"
    try:
        contained(folder, name)
    except UserError:
        return f"leads outside {folder} (to {path.resolve()})"
    rel = Path(name)
    links = [p for p in [rel, *list(rel.parents)[:-1]] if (folder / p).is_symlink()]
    # The one layout of links allowed: the hub cache's snapshot files, which lead into its blobs/ (``contained``).
    into_hub_blobs = folder.resolve() not in path.resolve().parents
    if links and not into_hub_blobs:
        link = folder / links[0]
        where = "is" if links[0] == rel else f"lies under {links[0]}, which is"
        return f"{where} a symlink (to {os.readlink(link)})"
    mode = path.stat().st_mode
    if not stat.S_ISREG(mode):
        return "is a FIFO, not a regular file" if stat.S_ISFIFO(mode) else "is not a regular file"
    return None


def check_coverage(path: str | Path) -> dict:
    """The manifest at ``path``, once the output holds exactly what it lists: not an empty list, every listed
    name a regular file of the output's own (not a link, nothing leading outside its folder), no file it does
    not list. Checked before any byte is hashed or read. Raises ``IntegrityError`` naming every problem in one
    line. Every reader that checks a manifest goes through here (``verify_manifest``, ``BackgroundCheck``)."""
    path = Path(path)
    folder = path.parent
    data = read_manifest(path)
    listed = data["files"]
    if not listed:
        raise IntegrityError(f"{path} lists no files, so it vouches for nothing (it was emptied or written by "
                             "hand): refused")
    problems = []
    for name in listed:
        why = _listed_problem(folder, name)
        if why == "is missing":
            problems.append(f"{folder / name} is missing: {path.name} lists it ({data.get('tool', '?')} wrote it)")
        elif why:
            problems.append(f"{path.name} lists {name}, which {why}")
    skip_hidden = _legacy_unlisted(data)
    # an empty folder too, as --force counts it (``unlisted_entries``); a data prefix's manifest covers two files
    empty = _empty_folders(folder) if path.name == MANIFEST_NAME else []
    unlisted = [n for n in output_files(path) + empty if n not in listed and not (skip_hidden and n.startswith("."))]
    if unlisted:
        problems.append(f"{folder} holds {len(unlisted)} file(s) that {path.name} does not list (added after mpatch "
                        f"wrote it): {', '.join(unlisted)}")
    if problems:
        raise IntegrityError("; ".join(problems))
    return data


# A look at a folder before it is read (the launcher's at the iteration it will resume, mcore2hf's and eval's at a
# run's checkpoint folder): every size, and the digests of the files up to this many bytes (train_state.json, the
# metadata, the random states: an edit there is found before anything names the iteration); the reader checks the rest
LOOK_DIGEST_LIMIT = 64 << 20


def verify_manifest(path: str | Path, digest_limit: int | None = None) -> int:
    """Check an output against its manifest: what it holds (``check_coverage``), then every listed file's size
    and digest (``digest_limit``: of the files up to that many bytes only); returns the bytes checked. Raises
    ``IntegrityError`` naming what differs."""
    path = Path(path)
    entries = check_coverage(path)["files"]
    difference = _first_difference(path, entries, digest_limit)
    if difference is not None:
        raise difference
    return sum(e["size"] for e in entries.values())


def _first_difference(path: Path, entries: dict[str, dict], digest_limit: int | None = None) -> IntegrityError | None:
    """The first of ``entries`` (a manifest's, at ``path``) whose file differs from its record: sizes first (cheap,
    and they name a truncated copy before any hashing), then digests (of the files up to ``digest_limit`` bytes)."""
    folder = path.parent
    for name, entry in entries.items():
        file = folder / name
        size = file.stat().st_size
        if size != entry["size"]:
            return IntegrityError(f"{file} is {size} bytes, but {path.name} records {entry['size']}: the file was "
                                  "truncated or changed after it was written")
    hashed = {name: e for name, e in entries.items() if digest_limit is None or e["size"] <= digest_limit}
    found = digests(folder, hashed, sync=False)
    for name, entry in hashed.items():
        if found[name][DIGEST] != entry[DIGEST]:
            return IntegrityError(f"{folder / name} does not match its digest in {path.name}: the file was changed "
                                  "or damaged after it was written (a flipped byte, a bad copy)")
    return None


# On a folder that cannot be read, the files hashed to say which one was changed: its metadata, not its weights.
_DIAGNOSIS_DIGEST_LIMIT = 64 << 20


def damage_against_manifest(folder: str | Path) -> IntegrityError | None:
    """Which file of a checkpoint folder that cannot be read differs from its manifest, where one covers it: a
    truer diagnosis than the reader's own error (a flipped byte in a pickle reads as any exception at all). Files
    that are gone are the reader's to name."""
    folder = Path(folder)
    try:
        path = manifest_for(folder)
        if path is None:
            return None
        prefix = "" if path.parent == folder else f"{folder.name}/"
        entries = {name: e for name, e in read_manifest(path)["files"].items()
                   if name.startswith(prefix) and (path.parent / name).is_file()}
        return _first_difference(path, entries, _DIAGNOSIS_DIGEST_LIMIT)
    except (UserError, OSError):  # a manifest of its own trouble: the reader's error stands
        return None


def naming_the_switch(exc: IntegrityError, switch: str) -> IntegrityError:
    """``exc`` from a reader of a checkpoint, saying how that reader takes the checkpoint as it is: the files
    may have been changed on purpose (checkpoint surgery, a debugging session)."""
    return IntegrityError(f"{exc}; if it was changed on purpose, {switch} reads it as it is")


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
        # What the output holds is checked here, before the reader beside it opens anything.
        listed = check_coverage(path)["files"]
        # The files whose every byte it checks (resolved): a reader needs no other check of them.
        self.files = frozenset((path.parent / name).resolve() for name in listed)
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

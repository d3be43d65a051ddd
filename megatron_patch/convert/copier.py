"""Moves bytes between files with a pool of workers: the converter's only data path.

Everything is planned before this runs (``bytemap``): each output file already exists at its full
size with its headers written, and every tensor byte has a fixed destination. So the work is a
list of independent tasks that any worker can do in any order:

- ``CopyTask``: one contiguous byte range, file to file with ``os.copy_file_range`` (the kernel
  copies page-cache pages; no byte passes through Python). Where the kernel refuses (another file
  system, no support, an old kernel), the copier falls back, once and for all, to ``pread`` /
  ``pwrite`` through a small per-worker buffer. Large ranges are cut into pieces so workers share them.
- ``GatherTask``: moves that are not contiguous (dim-1 slices of row-parallel weights, dtype
  changes): a band of rows at a time is read into memory, sliced (and converted), and written.
  Memory per worker is bounded by ``band_bytes``.
- ``CompareTask``: two stored tensors must hold the same bytes (replicas, tied copies).
- ``CallTask``: anything the plan could not express as moves, done by a function (through torch).

After each copy or gather a worker hands what it wrote to a writeback thread, which asks the kernel to
start writing it to disk (``start_writeback``): the disk writes overlap the copying, and the fsync
before the output is published has little left to wait for.

Each worker opens nothing it could create: output files are only opened for writing, never made, so
a worker still running after the partial output folder was removed cannot bring a file back.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import queue
import re
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

from megatron_patch.checkpoint_files.byte_io import Stored, read_exact, write_all
from megatron_patch.convert.bytemap import Move
from megatron_patch.convert.schedule import ANY_FILE, WHOLE_FILE, Schedule, Work
from megatron_patch.errors import UserError

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

# Contiguous ranges are cut into pieces of this size so that several workers share a large tensor.
COPY_PIECE = 64 * 2**20
# Memory a gather may hold at once (the rows read and the rows assembled).
BAND_BYTES = 32 * 2**20
# A gather copies each row's slice file to file (copy_file_range, like a contiguous copy) when every
# slice it writes is at least this long; shorter ones go through a mapping of the source rows, where one
# pwritev writes a band. Writing bytes from this process's memory into newly made page-cache pages costs
# 2-8x what the kernel's own copy costs on this project's machine (a virtual one), more than the one
# system call a slice of this size costs.
GATHER_COPY_MIN = 4096
# Bytes per pread/pwrite when copy_file_range is not available.
FALLBACK_BUFFER = 8 * 2**20
# copy_file_range errors that mean "not here", not "broken": fall back to reading and writing.
_NO_ZERO_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM, errno.ETXTBSY, errno.EBADF}
# fp16's largest finite value: a wider dtype's values past it become inf when cast.
FP16_MAX = 65504.0

# convert_rows hands torch read-only views of the mapped input files (no copy) and only reads them: torch's
# warning about such views says nothing to a user, so it is silenced for this module's calls alone.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning,
                        module=re.escape(__name__))


@dataclass(frozen=True)
class CopyTask:
    src: str
    src_offset: int
    dst: str
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class GatherTask:
    moves: tuple[Move, ...]
    band_rows: int
    bands: tuple[int, int]          # band indices [first, stop) this task fills
    what: str = "a tensor"          # the tensor moved, for messages


@dataclass(frozen=True)
class CompareTask:
    a: Stored
    b: Stored
    message: str


@dataclass(frozen=True)
class CallTask:
    fn: Callable[["Copier"], int]   # returns the bytes it wrote
    nbytes: int = 0
    writes: tuple[str, ...] | None = None       # the files it writes (None: any)
    reads: tuple[str, int] | None = None        # where it reads first (its place in the read order)
    after: tuple[tuple[str, int, int], ...] = ()   # (path, start, stop): written by the others first
    patches: tuple[tuple[str, int, int], ...] = ()  # (path, start, stop) it writes beside a file's writer


@dataclass
class CopyStats:
    zero_copy_bytes: int = 0
    buffered_bytes: int = 0         # contiguous bytes copied through memory (copy_file_range unavailable)
    gathered_bytes: int = 0
    compared_bytes: int = 0
    called_bytes: int = 0
    fallback_reason: str | None = None
    source_reads: list = field(default_factory=list)   # (path, offset, length) when ``trace`` is on


def copy_range(copier: "Copier", src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int,
               count: bool = True) -> None:
    """Copy ``nbytes`` from ``src_fd`` at ``src_offset`` to ``dst_fd`` at ``dst_offset`` (``count``: add
    them to the zero-copy or buffered bytes; a gather counts its own)."""
    while nbytes > 0:
        if copier.zero_copy:
            try:
                n = os.copy_file_range(src_fd, dst_fd, nbytes, src_offset, dst_offset)
            except OSError as exc:
                if exc.errno not in _NO_ZERO_COPY:
                    raise
                copier.disable_zero_copy(f"copy_file_range: {exc.strerror or exc}")
                continue
            if n == 0:
                raise EOFError(f"the source ends {nbytes} bytes early")
            if count:
                copier.count("zero_copy_bytes", n)
        else:
            buf = copier.buffer(min(nbytes, FALLBACK_BUFFER))
            n = os.preadv(src_fd, [buf], src_offset)
            if n == 0:
                raise EOFError(f"the source ends {nbytes} bytes early")
            written = 0
            while written < n:
                written += os.pwrite(dst_fd, buf[written:n], dst_offset + written)
            if count:
                copier.count("buffered_bytes", n)
        src_offset += n
        dst_offset += n
        nbytes -= n


_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_ZEROS = memoryview(bytes(1 << 20))


def _zeros(n: int) -> memoryview:
    return _ZEROS[:n] if n <= len(_ZEROS) else memoryview(bytes(n))


def write_pieces(fd: int, pieces: list[memoryview], offset: int) -> None:
    """Write byte ``pieces`` back to back from ``offset``: ``pwritev``, IOV_MAX pieces at a time."""
    k = 0
    while k < len(pieces):
        group = pieces[k:k + _IOV_MAX]
        n = os.pwritev(fd, group, offset)
        pos = 0
        for p in group:  # after a short write (rare), the rest of the group piece by piece
            if pos + len(p) > n:
                skip = max(0, n - pos)
                write_all(fd, p[skip:], offset + pos + skip)
            pos += len(p)
        offset += pos
        k += len(group)


class Copier:
    """Runs tasks on ``workers`` threads. ``zero_copy=False`` copies every contiguous range through
    memory instead (the fallback path, also what tests compare the zero-copy path with)."""

    def __init__(self, workers: int = 1, *, zero_copy: bool = True, progress=None, band_bytes: int = BAND_BYTES,
                 trace: bool = False, map_reads: bool = True):
        if workers < 1:
            raise UserError(f"--workers must be at least 1 (got {workers})")
        self.workers = workers
        self.zero_copy = zero_copy and hasattr(os, "copy_file_range")
        self.map_reads = map_reads
        self.progress = progress
        self.band_bytes = band_bytes
        self.trace = trace
        self.stats = CopyStats()
        if not self.zero_copy:
            self.stats.fallback_reason = "copy_file_range not used" if zero_copy is False else "no os.copy_file_range"
        self._lock = threading.Lock()
        self._fds: dict[tuple[str, bool], int] = {}
        self._local = threading.local()
        self._writeback: queue.SimpleQueue | None = None

    # --- shared state --------------------------------------------------------------------------------

    def fd(self, path: str, write: bool = False) -> int:
        key = (path, write)
        fd = self._fds.get(key)
        if fd is None:
            with self._lock:
                fd = self._fds.get(key)
                if fd is None:
                    fd = os.open(path, os.O_WRONLY if write else os.O_RDONLY)
                    if not write:
                        try:
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead window
                        except (AttributeError, OSError):
                            pass  # only a hint
                    self._fds[key] = fd
        return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def count(self, stat: str, n: int) -> None:
        with self._lock:
            setattr(self.stats, stat, getattr(self.stats, stat) + n)

    def note_read(self, path: str, offset: int, length: int) -> None:
        if self.trace:
            with self._lock:
                self.stats.source_reads.append((path, offset, length))

    def disable_zero_copy(self, reason: str) -> None:
        with self._lock:
            if self.zero_copy:
                self.zero_copy = False
                self.stats.fallback_reason = reason

    def buffer(self, size: int) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._local.buf = memoryview(bytearray(max(size, 1)))
        return buf[:size]

    def written(self, path: str, offset: int, nbytes: int) -> None:
        """``nbytes`` of ``path`` from ``offset`` are written: queue them for the writeback thread."""
        if self._writeback is not None:
            self._writeback.put((self.fd(path, True), offset, nbytes))

    def _start_writeback_thread(self) -> threading.Thread | None:
        """A thread that starts the disk writes of what the workers wrote (``start_writeback`` blocks while
        the disk's queue is full, and the kernel's work of submitting the writes, block allocation
        included, runs in the caller: here it runs beside the copying instead of inside it)."""
        if _sync_file_range() is None:
            return None
        self._writeback = queue.SimpleQueue()

        def flush(q=self._writeback):
            while (item := q.get()) is not None:
                start_writeback(*item)

        th = threading.Thread(target=flush, name="mpatch-writeback", daemon=True)
        th.start()
        return th

    def _stop_writeback_thread(self, th: threading.Thread | None, timeout: float | None) -> None:
        """Let the thread finish what is queued (the workers' files stay open until it has), then stop."""
        if th is not None:
            self._writeback.put(None)
            self._writeback = None
            th.join(timeout)

    # --- tasks ---------------------------------------------------------------------------------------

    def copy_tasks(self, src: str, src_offset: int, dst: str, dst_offset: int, nbytes: int) -> list[CopyTask]:
        return [CopyTask(src, src_offset + k, dst, dst_offset + k, min(COPY_PIECE, nbytes - k))
                for k in range(0, nbytes, COPY_PIECE)]

    def gather_tasks(self, moves: list[Move], what: str = "a tensor") -> list[GatherTask]:
        """Tasks for one group of moves that share destinations (all moves into any of its outputs); ``what``:
        the tensor they move, for messages."""
        srcs = list(dict.fromkeys(m.src for m in moves))
        dsts = list(dict.fromkeys(m.dst for m in moves))
        per_row = sum(s.row_bytes for s in srcs) + max(d.row_bytes for d in dsts)
        band_rows = max(1, self.band_bytes // max(per_row, 1))
        bands = -(-max(d.rows for d in dsts) // band_rows)
        # Several bands per task keep the number of tasks small; a task stays well under a second.
        per_task = max(1, (4 * self.band_bytes) // max(band_rows * per_row, 1))
        return [GatherTask(tuple(moves), band_rows, (b, min(bands, b + per_task)), what)
                for b in range(0, bands, per_task)]

    def _copy(self, t: CopyTask) -> int:
        self.note_read(t.src, t.src_offset, t.nbytes)
        try:
            copy_range(self, self.fd(t.src), t.src_offset, self.fd(t.dst, True), t.dst_offset, t.nbytes)
        except EOFError as exc:
            raise UserError(f"cannot read {t.src} ({exc}): the file may be truncated or corrupt")
        return t.nbytes

    def _read_rows(self, src: Stored, first: int, stop: int, arena: list) -> memoryview:
        """Rows [first, stop) of ``src``. ``arena``: [buffer, bytes used, maps]. The rows are mapped from
        the page cache (``mmap``: no copy, so a gathered byte is copied once, by the write) or, where
        mapping fails, read into this worker's reusable buffer (allocated once per worker)."""
        size = (stop - first) * src.row_bytes
        offset = src.offset + first * src.row_bytes
        self.note_read(src.path, offset, size)
        if self.map_reads:
            try:
                return self._map(src.path, offset, size, arena[2])
            except EOFError as exc:
                raise UserError(f"cannot read {src.path} ({exc}): the file may be truncated or corrupt")
            except (OSError, ValueError):
                self.map_reads = False  # a file system without mmap: read into memory from now on
        if arena[1] + size <= len(arena[0]):
            band = arena[0][arena[1]:arena[1] + size]
            arena[1] += size
        else:
            band = memoryview(bytearray(size))
        try:
            read_exact(self.fd(src.path), band, offset)
        except EOFError as exc:
            raise UserError(f"cannot read {src.path} ({exc}): the file may be truncated or corrupt")
        return band

    def _map(self, path: str, offset: int, size: int, maps: list) -> memoryview:
        """``size`` bytes of ``path`` from ``offset``, mapped read-only and populated up front. The file's
        length is checked first: touching a mapped page past its end would kill the process (SIGBUS)."""
        fd = self.fd(path)
        if os.fstat(fd).st_size < offset + size:
            raise EOFError(f"the file ends before byte {offset + size}")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        m = mmap.mmap(fd, offset + size - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                      prot=mmap.PROT_READ, offset=start)
        maps.append(m)
        return memoryview(m)[offset - start:offset - start + size]

    def _band_rows(self, m: Move, r0: int, r1: int, cache: dict, arena: list):
        """(first, stop) destination rows of move ``m`` inside the band [r0, r1) and the source rows they
        take, or None if it has none there. Source rows are read once per band (``cache``): several
        destinations may take slices of the same rows."""
        i0, i1 = max(r0, m.dst_row), min(r1, m.dst_row + m.rows)
        if i0 >= i1:
            return None
        s0 = m.src_row + i0 - m.dst_row
        key = (m.src, s0, s0 + i1 - i0)
        if key not in cache:
            cache[key] = self._read_rows(m.src, s0, s0 + i1 - i0, arena)
        return i0, i1, cache[key]

    def _gather(self, t: GatherTask) -> int:
        """Fill whole rows of each destination, a band at a time: the source rows a band needs are read
        once (shared by all destinations that take slices of them), and each destination band is written
        with one ``pwritev`` of slices of those rows; rows no move covers are zeros."""
        by_dst: dict[Stored, list[Move]] = {}
        for m in t.moves:
            by_dst.setdefault(m.dst, []).append(m)
        buf = getattr(self._local, "arena", None)
        if buf is None or len(buf) < self.band_bytes:
            buf = self._local.arena = memoryview(bytearray(self.band_bytes))
        written = 0
        for band in range(*t.bands):
            r0 = band * t.band_rows
            cache: dict = {}
            arena = [buf, 0, []]
            for dst, moves in by_dst.items():
                r1 = min(r0 + t.band_rows, dst.rows)
                if r0 >= r1:
                    continue
                if any(m.src.dtype != dst.dtype for m in moves):
                    written += self._gather_converting(dst, moves, r0, r1, cache, arena, t.what)
                    continue
                if self.zero_copy and all(m.cols * dst.itemsize >= GATHER_COPY_MIN for m in moves):
                    written += self._gather_copying(dst, moves, r0, r1)
                    continue
                # (dst row, dst byte column, bytes, source band, byte offset in it) for each row of each move
                segments = []
                di, dst_row_bytes = dst.itemsize, dst.row_bytes
                for m in moves:
                    band_rows = self._band_rows(m, r0, r1, cache, arena)
                    if band_rows is None:
                        continue
                    i0, i1, rows = band_rows
                    rb, width = m.src.row_bytes, m.cols * di
                    start, col = m.src_col * di, m.dst_col * di
                    segments += [(i, col, width, rows, (i - i0) * rb + start) for i in range(i0, i1)]
                segments.sort(key=lambda seg: (seg[0], seg[1]))
                pieces, at = [], r0 * dst_row_bytes
                for row, col, width, rows, offset in segments:
                    here = row * dst_row_bytes + col
                    if here > at:
                        pieces.append(_zeros(here - at))
                    elif here < at:
                        raise ValueError(f"internal error: two moves write the same bytes of {dst.path}")
                    pieces.append(rows[offset:offset + width])
                    at = here + width
                if r1 * dst_row_bytes > at:
                    pieces.append(_zeros(r1 * dst_row_bytes - at))
                write_pieces(self.fd(dst.path, True), pieces, dst.offset + r0 * dst_row_bytes)
                self.written(dst.path, dst.offset + r0 * dst_row_bytes, (r1 - r0) * dst_row_bytes)
                written += (r1 - r0) * dst_row_bytes
                del pieces, segments
            del cache
            _unmap(arena[2])
            if self._stop.is_set():
                break
        return written

    def _gather_copying(self, dst: Stored, moves: list[Move], r0: int, r1: int) -> int:
        """A destination band whose row slices are long: each slice copied file to file (rows no move
        covers stay as created: zeros)."""
        di, dst_fd = dst.itemsize, self.fd(dst.path, True)
        segments = []
        for m in moves:
            i0, i1 = max(r0, m.dst_row), min(r1, m.dst_row + m.rows)
            rb, width = m.src.row_bytes, m.cols * di
            src_at = m.src.offset + (m.src_row - m.dst_row) * rb + m.src_col * di
            dst_at = dst.offset + m.dst_col * di
            segments += [(dst_at + i * dst.row_bytes, m.src.path, src_at + i * rb, width) for i in range(i0, i1)]
        segments.sort()
        for dst_offset, src, src_offset, width in segments:
            self.note_read(src, src_offset, width)
            try:
                copy_range(self, self.fd(src), src_offset, dst_fd, dst_offset, width, count=False)
            except EOFError as exc:
                raise UserError(f"cannot read {src} ({exc}): the file may be truncated or corrupt")
        self.written(dst.path, dst.offset + r0 * dst.row_bytes, (r1 - r0) * dst.row_bytes)
        return (r1 - r0) * dst.row_bytes

    def _gather_converting(self, dst: Stored, moves: list[Move], r0: int, r1: int, cache: dict, arena: list,
                           what: str) -> int:
        """A destination band whose sources have another dtype: assembled in memory, converted as torch does."""
        # numpy (0.1 s) only where a dtype changes: a conversion that moves bytes runs without it
        import numpy as np

        out = np.zeros((r1 - r0, dst.row_bytes), dtype=np.uint8)
        for m in moves:
            band_rows = self._band_rows(m, r0, r1, cache, arena)
            if band_rows is None:
                continue
            i0, i1, rows = band_rows
            si, di = m.src.itemsize, dst.itemsize
            band = np.frombuffer(rows, dtype=np.uint8).reshape(i1 - i0, m.src.row_bytes)
            piece = band[:, m.src_col * si:(m.src_col + m.cols) * si]
            if m.src.dtype != dst.dtype:
                piece = convert_rows(piece, m.src.dtype, dst.dtype, what)
            out[i0 - r0:i1 - r0, m.dst_col * di:(m.dst_col + m.cols) * di] = piece
        write_all(self.fd(dst.path, True), out, dst.offset + r0 * dst.row_bytes)
        self.written(dst.path, dst.offset + r0 * dst.row_bytes, out.nbytes)
        return out.nbytes

    def _compare(self, t: CompareTask) -> int:
        if t.a.dtype != t.b.dtype or t.a.shape != t.b.shape:
            raise UserError(t.message)
        step = max(t.a.row_bytes, 1) * max(1, self.band_bytes // 2 // max(t.a.row_bytes, 1))
        total = t.a.nbytes
        for k in range(0, total, step):
            n = min(step, total - k)
            a, b = bytearray(n), bytearray(n)
            try:
                read_exact(self.fd(t.a.path), memoryview(a), t.a.offset + k)
                read_exact(self.fd(t.b.path), memoryview(b), t.b.offset + k)
            except EOFError as exc:
                raise UserError(f"cannot read {t.a.path} or {t.b.path} ({exc}): the file may be truncated or corrupt")
            if a != b:
                raise UserError(t.message)
        return total

    def _read_ahead(self, task) -> None:
        ranges = [(task.src, task.src_offset, task.nbytes)] if isinstance(task, CopyTask) else \
            [(m.src.path, *m.src_range) for m in task.moves] if isinstance(task, GatherTask) else []
        for path, offset, length in ranges[:64]:
            try:
                os.posix_fadvise(self.fd(path), offset, length, os.POSIX_FADV_WILLNEED)
            except (AttributeError, OSError):
                return  # only a hint

    def _run_one(self, task) -> None:
        if isinstance(task, CopyTask):
            n = self._copy(task)
            self.written(task.dst, task.dst_offset, task.nbytes)
        elif isinstance(task, GatherTask):
            n = self._gather(task)
            self.count("gathered_bytes", n)
        elif isinstance(task, CompareTask):
            self.count("compared_bytes", self._compare(task))
            return
        else:
            n = task.fn(self)
            self.count("called_bytes", n)
        if self.progress is not None:
            with self._lock:
                self.progress.update(n, tensors=0)

    def run(self, tasks: list) -> CopyStats:
        """Do every task; the first error stops the others and is raised here (also on Ctrl-C).

        Tasks are taken in the order of the bytes they read, so that the sources are read front to
        back, as the kernel's read-ahead expects, one writer per output file at a time, each after the
        tasks it waits for (``schedule``); on taking a task, a worker asks the kernel to start reading
        the task ``workers`` places further on (``posix_fadvise`` WILLNEED: at most one task ahead per
        worker, in the page cache, not in this process's memory).
        """
        self._stop = threading.Event()
        errors: list[BaseException] = []
        tasks = sorted(tasks, key=_read_order)
        plan = Schedule([_work_of(t) for t in tasks])

        def work():
            try:
                while not self._stop.is_set():
                    i = plan.take()
                    if i is None:
                        return
                    if i + self.workers < len(tasks):
                        self._read_ahead(tasks[i + self.workers])
                    self._run_one(tasks[i])
                    plan.done(i)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                with self._lock:
                    errors.append(exc)
                self._stop.set()
                plan.stop()

        threads = [threading.Thread(target=work, name=f"mpatch-copy-{i}", daemon=True)
                   for i in range(min(self.workers, max(len(tasks), 1)))]
        writeback = self._start_writeback_thread()
        for th in threads:
            th.start()
        try:
            for th in threads:
                while th.is_alive():
                    th.join(0.2)
        except BaseException:
            # Ctrl-C / SIGTERM: stop handing out tasks; a worker inside one large copy finishes it,
            # one stuck longer is abandoned (daemon threads), the caller removes the partial output.
            self._stop.set()
            plan.stop()
            deadline = time.monotonic() + 2
            for th in threads:
                th.join(max(0.0, deadline - time.monotonic()))
            self._stop_writeback_thread(writeback, max(0.0, deadline - time.monotonic()))
            raise
        self._stop_writeback_thread(writeback, None)
        if errors:
            raise errors[0]
        return self.stats


def _unmap(maps: list) -> None:
    """Unmap a band's source rows now (their pages stay in the page cache), so that the process holds
    one band per worker; a mapping something still views is left to the garbage collector."""
    for m in maps:
        try:
            m.close()
        except BufferError:
            pass
    maps.clear()


_SYNC_FILE_RANGE_WRITE = 2


@functools.lru_cache(maxsize=1)
def _sync_file_range():
    """libc's sync_file_range (Linux), or None."""

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` of ``fd`` from ``offset`` to disk now (0: to the end),
    without waiting for the disk. The output is fsynced before it is published
    (``checkpoint_files.layout.publish``); started as each range is done, the disk writes overlap the copying
    instead of all waiting for that final fsync."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # only a hint: an error changes nothing


def _read_order(task) -> tuple:
    """By the first byte read; checks and whole-tensor work that say nothing of it first."""
    if isinstance(task, CopyTask):
        return (1, task.src, task.src_offset)
    if isinstance(task, GatherTask):
        first = min((m.src.path, m.src_range[0]) for m in task.moves)
        return (1, first[0], first[1] + task.bands[0])
    if isinstance(task, CallTask) and task.reads is not None:
        return (1, *task.reads)
    return (0, "", 0)


def _work_of(task) -> Work:
    """What ``schedule`` needs to know of a task: the files and bytes it writes, what it waits for."""
    if isinstance(task, CopyTask):
        return Work(frozenset((task.dst,)), ((task.dst, task.dst_offset, task.dst_offset + task.nbytes),))
    if isinstance(task, GatherTask):
        ranges = {}
        for m in task.moves:
            d = m.dst
            stop = min(task.bands[1] * task.band_rows, d.rows)
            ranges[d] = (d.path, d.offset + task.bands[0] * task.band_rows * d.row_bytes, d.offset + stop * d.row_bytes)
        return Work(frozenset(d.path for d in ranges), tuple(ranges.values()))
    if isinstance(task, CallTask):
        if task.writes is None:
            return Work(ranges=((ANY_FILE, 0, WHOLE_FILE),), after=task.after)
        return Work(frozenset(task.writes), tuple((p, 0, WHOLE_FILE) for p in task.writes) + task.patches, task.after)
    return Work()


def convert_rows(piece, src: str, dst: str, what: str = "a tensor"):
    """Bytes of ``src``-dtype elements (a 2-D uint8 array, rows of whole elements) as ``dst`` elements,
    rounded as torch's ``Tensor.to`` rounds (torch imported here: only dtype changes need it); ``what``: the
    tensor they belong to, for ``cast``'s message."""
    # only dtype changes need numpy and torch
    import numpy as np
    import torch

    rows = piece.shape[0]
    src_t = torch.from_numpy(np.ascontiguousarray(piece)).view(getattr(torch, src))
    return cast(src_t, dst, what).view(torch.uint8).numpy().reshape(rows, -1)


def cast(tensor, dtype: str, what: str):
    """``tensor`` as ``dtype`` (a name), as ``Tensor.to`` converts it. Into fp16 from a dtype of wider range, a
    finite value past fp16's would become inf: UserError naming ``what`` (the check reads the values just cast)."""
    import torch

    out = tensor.to(getattr(torch, dtype))
    if out.dtype == torch.float16 and tensor.dtype in (torch.float32, torch.float64, torch.bfloat16):
        overflow = out.isinf()
        if overflow.any():
            overflow &= ~tensor.isinf()  # an inf stored is kept, not made
            if overflow.any():
                largest = tensor[overflow].abs().max().item()
                raise UserError(f"{what} holds a value of magnitude {largest:g}, past fp16's largest ({FP16_MAX:g}): "
                                "it would become inf; convert with --dtype bf16 or fp32")
    return out

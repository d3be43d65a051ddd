"""Which task a copier worker takes next.

Tasks go in the order of the bytes they read (the sources front to back, as the kernel's read-ahead
expects), with two exceptions:

- **One writer per file at a time.** A file system writes into one file under that file's lock (the
  inode's ``i_rwsem``), so a second worker writing the same file adds nothing but waiting, and the
  kernel spins on that lock, on a core the other work needs (14% of an mcore2hf profile went there,
  with two workers writing its one safetensors file). A worker takes instead the first task in order
  that writes another file or writes nothing (a CRC check, a comparison), and waits when none is left.
- **A task may wait for others**: one with ``after`` ranges starts once every task writing bytes in
  them is done (a zip record's CRC-32 is sealed as soon as all of its bytes are in place, beside the
  copies still running, instead of in a pass after them).
"""

from __future__ import annotations

import bisect
import heapq
import threading
from collections import defaultdict
from dataclasses import dataclass

# a byte range of a file: (path, start, stop)
Range = tuple[str, int, int]
WHOLE_FILE = 1 << 62
ANY_FILE = "\0any"   # the path of a task that may write in any file (a function whose writes are not known)


@dataclass(frozen=True)
class Work:
    """What the schedule knows of a task."""

    writes: frozenset[str] = frozenset()   # files it writes (one writer per file at a time)
    ranges: tuple[Range, ...] = ()         # the bytes it writes, for the tasks that wait for them
    after: tuple[Range, ...] = ()          # bytes that must all be written before it starts


class Schedule:
    """Hands out the indices of ``works`` (already in read order) to workers: ``take``, then ``done``."""

    def __init__(self, works: list[Work]):
        self.works = works
        self._cond = threading.Condition()
        self._busy: set[str] = set()
        self._pending = len(works)
        self._stopped = False
        # The tasks that write the same files wait in one queue (a heap of indices); the queues whose
        # files are free are offered in the order of their first task.
        self._queues: dict[frozenset, list[int]] = defaultdict(list)
        self._offered: list[tuple[int, frozenset]] = []
        self._blocked: dict[str, list[frozenset]] = defaultdict(list)   # queues waiting for a busy file
        self._waits_for = [0] * len(works)                             # unfinished tasks each one waits for
        self._dependents: dict[int, list[int]] = defaultdict(list)
        for i, deps in enumerate(_dependencies(works)):
            self._waits_for[i] = len(deps)
            for d in deps:
                self._dependents[d].append(i)
        for i in range(len(works)):
            if not self._waits_for[i]:
                self._queue(i)

    def _queue(self, i: int) -> None:
        key = self.works[i].writes
        heapq.heappush(self._queues[key], i)
        self._offer(key)

    def _offer(self, key: frozenset) -> None:
        if self._queues[key]:
            heapq.heappush(self._offered, (self._queues[key][0], key))

    def take(self) -> int | None:
        """The next task to run, or None when none is left (or the run was stopped)."""
        with self._cond:
            while not self._stopped and self._pending:
                while self._offered:
                    first, key = heapq.heappop(self._offered)
                    queue = self._queues[key]
                    if not queue or queue[0] != first:
                        continue   # a stale offer: the queue's head changed since
                    busy = next((p for p in key if p in self._busy), None)
                    if busy is not None:
                        self._blocked[busy].append(key)
                        continue
                    i = heapq.heappop(queue)
                    self._pending -= 1
                    self._busy |= key
                    if not key:   # writes nothing: the next such task may run beside it
                        self._offer(key)
                    return i
                self._cond.wait(0.2)
            return None

    def done(self, i: int) -> None:
        with self._cond:
            key = self.works[i].writes
            self._busy -= key
            if key:
                self._offer(key)
            for path in key:
                for other in self._blocked.pop(path, ()):
                    self._offer(other)
            for d in self._dependents.pop(i, ()):
                self._waits_for[d] -= 1
                if not self._waits_for[d]:
                    self._queue(d)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


def _dependencies(works: list[Work]) -> list[list[int]]:
    """For each task, the tasks writing bytes in its ``after`` ranges. Writes to one file never overlap
    (each byte has one writer), so the writers of a range are neighbours once sorted by where they
    start; a task that may write anywhere in a file (``WHOLE_FILE``) is a writer of every range of it."""
    by_path: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    anywhere: dict[str, list[int]] = defaultdict(list)
    for i, w in enumerate(works):
        for path, start, stop in w.ranges:
            if stop >= WHOLE_FILE or path == ANY_FILE:
                anywhere[path].append(i)
            else:
                by_path[path].append((start, stop, i))
    starts = {}
    for path, writes in by_path.items():
        writes.sort()
        starts[path] = [s for s, _, _ in writes]
    out = []
    for w in works:
        deps = set()
        for path, start, stop in w.after:
            deps.update(anywhere.get(path, ()))
            deps.update(anywhere.get(ANY_FILE, ()))
            writes = by_path.get(path, [])
            k = max(0, bisect.bisect_right(starts.get(path, []), start) - 1)
            while k < len(writes) and writes[k][0] < stop:
                if writes[k][1] > start:
                    deps.add(writes[k][2])
                k += 1
        out.append(sorted(deps))
    return out

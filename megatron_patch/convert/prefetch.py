"""Produce the next transfer's tensors on a second thread while the current one is written.

A conversion is a chain read -> cut or glue -> write, one transfer after another. Reading (``pread``),
torch's copies and concatenations, and writing all release the GIL, so running ``produce`` for
transfer i+1 on a helper thread while the caller writes transfer i overlaps the two halves of the
work. Memory stays bounded: the helper starts on an item only when fewer than ``ahead + 1`` items
are alive (the one the caller holds plus ``ahead`` ready ones), so at most ``ahead`` transfers more
than the serial chain are in memory. The caller must drop its reference to an item's value before
asking for the next one (``del``), or that item stays alive one step longer.

Order and results are exactly those of ``[produce(x) for x in items]``; an exception raised by
``produce`` reaches the caller when it asks for that item, and nothing after it is produced.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_END = object()


class Prefetcher(Iterator[tuple[T, R]]):
    def __init__(self, items: Iterable[T], produce: Callable[[T], R], ahead: int = 1):
        if ahead < 0:
            raise ValueError("ahead must be >= 0")
        self._items = iter(items)
        self._produce = produce
        self._slots = threading.Semaphore(ahead + 1)
        self._ready: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._held = False  # the caller holds an item's slot
        self._done = False
        self._thread = threading.Thread(target=self._run, name="mpatch-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._items:
                while not self._slots.acquire(timeout=0.05):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                value = self._produce(item)
                self._ready.put((item, value, None))
                del value
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            self._ready.put((None, None, exc))
            return
        self._ready.put(_END)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[T, R]:
        if self._held:
            self._held = False
            self._slots.release()
        if self._done:
            raise StopIteration
        entry = self._ready.get()
        if entry is _END:
            self._done = True
            raise StopIteration
        item, value, exc = entry
        if exc is not None:
            self._done = True
            self.close()
            raise exc
        self._held = True
        return item, value

    def close(self) -> None:
        """Stop producing (the helper finishes the item in hand, then exits)."""
        self._stop.set()
        self._done = True
        # Unblock a helper waiting for a slot, drop what it made.
        while True:
            try:
                self._ready.get_nowait()
            except queue.Empty:
                break
        if threading.current_thread() is not self._thread:
            # After a normal end the helper has already finished; after an error or Ctrl-C it may be
            # inside a read, and what it makes is dropped anyway (it is a daemon thread).
            self._thread.join(timeout=1)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Bytes at known places of files: a stored tensor's address, and the few reads and writes every checkpoint
format here is built from (no torch: the converter moves bytes, not tensors)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from megatron_patch.dtypes import ITEMSIZE
from megatron_patch.errors import UserError


@dataclass(frozen=True)
class Stored:
    """A dense C-contiguous tensor of ``shape`` and ``dtype`` (a dtype name) at ``offset`` of ``path``."""

    path: str
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def cols(self) -> int:
        """Elements per dim-0 row."""
        return math.prod(self.shape[1:]) if self.shape else 1

    @property
    def inner(self) -> int:
        """Elements per dim-1 index (a dim-1 column is this many contiguous elements)."""
        return math.prod(self.shape[2:]) if len(self.shape) > 2 else 1

    @property
    def row_bytes(self) -> int:
        return self.cols * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


def read_exact(fd: int, view: memoryview, offset: int) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise EOFError(f"the file ends {len(view) - got} bytes early")
        got += n


def read_range(path, offset: int, nbytes: int) -> bytearray:
    """``nbytes`` of ``path`` from ``offset`` (the GIL is released while reading); UserError naming the
    file if it cannot be read or ends early."""
    buf = bytearray(nbytes)
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            read_exact(fd, memoryview(buf), offset)
        finally:
            os.close(fd)
    except (OSError, EOFError) as exc:
        raise UserError(f"cannot read {path} ({exc}): the file may be truncated or corrupt")
    return buf


def create_file(path, size: int, pieces) -> None:
    """Create ``path`` at its full ``size`` (sparse: rows never written read as zeros) with ``pieces``
    ((offset, bytes): headers, pickles) in place; the tensors' bytes are copied in later, in any order."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        for offset, data in pieces:
            write_all(fd, data, offset)
    finally:
        os.close(fd)


def write_all(fd: int, view, offset: int) -> None:
    view = memoryview(view).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)

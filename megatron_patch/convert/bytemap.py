"""Where tensor bytes are, and which bytes go where: the converter's plan, before any byte moves.

Every tensor the converter reads or writes is ``Stored``: dense, C-contiguous, at a known byte offset
of a known file (a safetensors entry, a record of a torch.save zip, a chunk inside a ``.distcp``
file). Seen as a 2-D array (dim 0 by everything else), a split's ``Block`` (rows, optionally dim-1
columns, of one HF tensor) becomes a ``Move``: a box of one stored tensor copied into a box of
another. A move whose boxes span whole rows on both sides and keeps the dtype is one contiguous byte
range on each side, which goes file to file (``os.copy_file_range``); any other move (dim-1 slices of
a row-parallel split, a dtype change) is gathered in user space, a band of rows at a time.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from megatron_patch.checkpoint_files.byte_io import Stored


@dataclass(frozen=True)
class Move:
    """Rows ``[src_row, src_row + rows)`` x elements ``[src_col, src_col + cols)`` of ``src`` (in its 2-D
    view) into the same-sized box of ``dst`` at (``dst_row``, ``dst_col``), converting the dtype if the
    two differ."""

    src: Stored
    src_row: int
    src_col: int
    dst: Stored
    dst_row: int
    dst_col: int
    rows: int
    cols: int

    @property
    def contiguous(self) -> bool:
        """One byte range on each side: whole rows of both tensors, same dtype."""
        return (self.src.dtype == self.dst.dtype and self.cols == self.src.cols == self.dst.cols
                and self.src_col == 0 and self.dst_col == 0)

    @property
    def src_range(self) -> tuple[int, int]:
        return self.src.offset + self.src_row * self.src.row_bytes, self.rows * self.src.row_bytes

    @property
    def dst_range(self) -> tuple[int, int]:
        return self.dst.offset + self.dst_row * self.dst.row_bytes, self.rows * self.dst.row_bytes

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.dst.itemsize


def shard_shape(blocks, part_shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of a shard made of ``blocks`` of tensors of ``part_shapes``."""
    rows, rest = 0, None
    for b in blocks:
        ref = part_shapes[0 if b.part is None else b.part]
        trailing = tuple(ref[1:])
        if b.cols is not None:
            trailing = (b.cols[1] - b.cols[0],) + trailing[1:]
        if rest is None:
            rest = trailing
        elif b.part is not None and trailing != rest:
            raise ValueError(f"blocks of one shard differ in trailing shape: {rest} vs {trailing}")
        rows += b.num_rows
    return (rows,) + (rest or ())


def block_moves(blocks, parts: list[Stored], shard: Stored, *, to_shard: bool = True) -> list[Move]:
    """The moves that build ``shard`` from ``parts`` (``to_shard``), or the HF ``parts`` back from
    ``shard`` (the same boxes, the other way round). Padding blocks move nothing: an output file is
    created at its full size, so rows never written read as zeros."""
    moves, row = [], 0
    for b in blocks:
        if b.part is not None:
            part = parts[b.part]
            inner = part.inner
            col0, width = (0, part.cols) if b.cols is None else (b.cols[0] * inner, (b.cols[1] - b.cols[0]) * inner)
            if width != shard.cols or b.rows[1] > part.rows:
                raise ValueError(f"a block of {width} x {b.num_rows} does not fit a shard of {shard.shape} "
                                 f"or a tensor of {part.shape}")
            if to_shard:
                moves.append(Move(part, b.rows[0], col0, shard, row, 0, b.num_rows, width))
            else:
                moves.append(Move(shard, row, 0, part, b.rows[0], col0, b.num_rows, width))
        row += b.num_rows
    if row != shard.rows:
        raise ValueError(f"blocks of {row} rows for a shard of {shard.shape}")
    return moves


@dataclass(frozen=True)
class Tiled:
    """A tensor stored as several boxes: ``tiles`` are (first row, stop row, first element column, stop
    element column, where, row, column) in the tensor's 2-D view: that box is the box of ``where``'s 2-D
    view at (row, column). A torch_dist checkpoint keeps a SwiGLU ``linear_fc1`` as its gate and up
    halves, a TP=2 one each half in two chunks, and a chunk may hold more than the box (several layers)."""

    shape: tuple[int, ...]
    dtype: str
    tiles: tuple[tuple[int, int, int, int, Stored, int, int], ...]

    @property
    def whole(self) -> Stored:
        """Stands for the tensor in moves until ``resolve`` sends them to the tiles."""
        return Stored("", 0, self.shape, self.dtype)

    def resolve(self, moves: list[Move]) -> list[Move]:
        """Moves out of ``whole`` as moves out of the tiles that hold those bytes."""
        out = []
        for m in moves:
            for r0, r1, c0, c1, where, wr, wc in self.tiles:
                i0, i1 = max(r0, m.src_row), min(r1, m.src_row + m.rows)
                j0, j1 = max(c0, m.src_col), min(c1, m.src_col + m.cols)
                if i0 < i1 and j0 < j1:
                    out.append(Move(where, i0 - r0 + wr, j0 - c0 + wc, m.dst, m.dst_row + i0 - m.src_row,
                                    m.dst_col + j0 - m.src_col, i1 - i0, j1 - j0))
        return out


def box_tiles(shape: tuple[int, ...], start: tuple[int, ...], size: tuple[int, ...], src: Stored,
              src_start: tuple[int, ...]) -> list[tuple[int, int, int, int, Stored, int, int]]:
    """The box at ``start`` of ``size`` of a tensor of ``shape``, held by the dense tensor ``src`` at
    ``src_start``, as tiles of ``Tiled`` (boxes of both 2-D views).

    ``src`` may have more (leading) dims than the tensor: the box is 1 wide there (a layer or expert
    axis). One tile when the box spans whole dims past the second on both sides (megatron's chunks
    always do); otherwise one tile per index of the dims before the first such dim."""
    lead = len(src.shape) - len(shape)
    if lead < 0 or any(s != 1 for s in size[:lead]) or len(size) != len(src.shape):
        raise ValueError(f"a box of {size} in a tensor of {shape} cannot come from a chunk of {src.shape}")
    item = src.itemsize
    chunk = tuple(src.shape[lead:])
    base = 0  # elements before the box's slice of the leading axes
    for d in range(lead):
        base = base * src.shape[d] + src_start[d]
    base *= math.prod(chunk)
    start_in, size_in, q = tuple(start), tuple(size[lead:]), tuple(src_start[lead:])
    n = len(shape)
    if n == 0:
        return [(0, 1, 0, 1, Stored(src.path, src.offset + base * item, (1, 1), src.dtype), 0, 0)]
    # the first dim m >= 1 past which the box spans whole dims of both tensors
    m = next((d for d in range(1, n) if all(size_in[k] == shape[k] == chunk[k] for k in range(d + 1, n))), n)
    rows_src, cols_src = chunk[0], math.prod(chunk[1:])
    where = Stored(src.path, src.offset + base * item, (rows_src, cols_src), src.dtype)
    if m >= n:  # 1-D
        return [(start_in[0], start_in[0] + size_in[0], 0, 1, Stored(where.path, where.offset, (rows_src, 1),
                                                                       src.dtype), q[0], 0)]
    inner = math.prod(shape[m + 1:])
    run = size_in[m] * inner
    tiles = []
    for idx in itertools.product(*(range(size_in[k]) for k in range(1, m))):
        col_dst = _flat(tuple(start_in[k] + i for k, i in zip(range(1, m), idx)) + (start_in[m],), shape[1:m + 1]) * inner
        col_src = _flat(tuple(q[k] + i for k, i in zip(range(1, m), idx)) + (q[m],), chunk[1:m + 1]) * inner
        tiles.append((start_in[0], start_in[0] + size_in[0], col_dst, col_dst + run, where, q[0], col_src))
    return tiles


def _flat(index: tuple[int, ...], dims: tuple[int, ...]) -> int:
    out = 0
    for i, d in zip(index, dims):
        out = out * d + i
    return out

"""How one MCore parameter is cut from (and glued back into) its Hugging Face tensors.

Each split is a pair of exact inverses: ``shards(parts, n)`` turns the HF tensors into the ``n``
tensor-parallel shards, and ``merge(shards)`` turns the shards back into the HF tensors. Slicing and
concatenation only, so a round trip is bit-identical in any dtype.

``blocks(shapes, n)`` says the same without tensors: which rows (and dim-1 columns) of which HF
tensor each shard stacks, so the converter can move bytes file to file without loading them. A
split that cannot say it returns None, and is run on tensors instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_patch.errors import UserError
from megatron_patch.lazy import LazyModule

torch = LazyModule("torch", __name__)  # only the tensor methods need it; the block descriptions do not


@dataclass(frozen=True)
class SplitContext:
    """Model numbers some splits need (query-group geometry, vocabulary padding)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int


@dataclass(frozen=True)
class Block:
    """Rows ``[start, stop)`` of HF tensor ``part`` (all its dim-1 columns, or only ``cols``); with
    ``part`` None, ``stop - start`` rows of zeros (vocabulary padding). A shard is its blocks stacked
    on dim 0, in order."""

    part: int | None
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]


class Split:
    name = "split"
    # The HF tensor is stored transposed ([in, out]) from the linear layer's [out, in] (gpt-oss's experts).
    transposed = False

    def blocks(self, shapes: list[tuple[int, ...]], n: int, ctx: SplitContext) -> list[list[Block]] | None:
        """For each of the ``n`` shards, the blocks of the HF tensors (of ``shapes``) it stacks on dim 0;
        None when this split is not made of row and column blocks (it then runs on tensors)."""
        return None

    def shards(self, parts: list[torch.Tensor], n: int, ctx: SplitContext) -> list[torch.Tensor]:
        raise NotImplementedError

    def merge(self, shards: list[torch.Tensor], ctx: SplitContext) -> list[torch.Tensor]:
        raise NotImplementedError

    def merged_shapes(self, shape: tuple[int, ...], ctx: SplitContext) -> list[tuple[int, ...]]:
        """The shapes of the HF tensors a whole (TP=1) parameter of ``shape`` merges back into. The splits
        here say it from shapes alone (the converter's start-up imports no torch); any other split runs
        ``merge`` on a shape-only (meta) tensor."""
        return [tuple(m.shape) for m in self.merge([torch.empty(shape, device="meta")], ctx)]

    def merge_pieces(self, shards: list[torch.Tensor], ctx: SplitContext) -> list[list[torch.Tensor]]:
        """``merge`` without the final copy: for each HF tensor, contiguous pieces (views into the shards
        where possible) whose concatenation on dim 0 is that tensor, byte for byte. A writer puts them
        on disk one after another instead of first gluing them together in memory."""
        return [[m] for m in self.merge(shards, ctx)]

    def __repr__(self) -> str:
        return self.name


def _even(size: int, n: int) -> int:
    if size % n:
        raise UserError(f"cannot split a dimension of {size} into {n} equal shards")
    return size // n


def _chunk(t: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    if t.shape[dim] % n:
        raise UserError(f"cannot split a dimension of {t.shape[dim]} into {n} equal shards")
    return [c.contiguous() for c in torch.chunk(t, n, dim=dim)]


class Replicated(Split):
    """Same tensor on every rank (norms, router). Merging checks the replicas agree."""

    name = "replicated"

    def blocks(self, shapes, n, ctx):
        if not shapes[0]:
            return None
        return [[Block(0, (0, shapes[0][0]))] for _ in range(n)]

    def merged_shapes(self, shape, ctx):
        return [tuple(shape)]

    def shards(self, parts, n, ctx):
        return [parts[0]] * n

    def merge(self, shards, ctx):
        first = shards[0]
        for i, other in enumerate(shards[1:], 1):
            if not torch.equal(first, other):
                raise ValueError(f"replica {i} differs from replica 0 of a parameter that must be identical on every rank")
        return [first]


class Column(Split):
    """Split on the output dimension (dim 0): column-parallel layers whose rows are whole heads or
    units in order (MLA's up projections, an MTP layer's eh_proj)."""

    name = "column"

    def blocks(self, shapes, n, ctx):
        rows = _even(shapes[0][0], n)
        return [[Block(0, (k * rows, (k + 1) * rows))] for k in range(n)]

    def merged_shapes(self, shape, ctx):
        return [tuple(shape)]

    def shards(self, parts, n, ctx):
        return _chunk(parts[0], n, 0)

    def merge(self, shards, ctx):
        return [torch.cat(shards, 0)]

    def merge_pieces(self, shards, ctx):
        return [_contiguous_rows(shards)]


class Row(Split):
    """Split on the input dimension (dim 1): attention output and MLP down projections."""

    name = "row"

    def blocks(self, shapes, n, ctx):
        rows, cols = shapes[0][0], _even(shapes[0][1], n)
        return [[Block(0, (0, rows), (k * cols, (k + 1) * cols))] for k in range(n)]

    def merged_shapes(self, shape, ctx):
        return [tuple(shape)]

    def shards(self, parts, n, ctx):
        return _chunk(parts[0], n, 1)

    def merge(self, shards, ctx):
        return [torch.cat(shards, 1)]


class VocabParallel(Split):
    """Embedding / output rows, zero-padded to the padded vocabulary, then split on dim 0."""

    name = "vocab"

    def blocks(self, shapes, n, ctx):
        if shapes[0][0] != ctx.vocab_size:
            raise UserError(f"a vocabulary tensor has {shapes[0][0]} rows but config.json says vocab_size={ctx.vocab_size}")
        per = _even(ctx.padded_vocab_size, n)
        out = []
        for k in range(n):
            start, stop = k * per, (k + 1) * per
            real = max(0, min(stop, ctx.vocab_size) - start)
            shard = [Block(0, (start, start + real))] if real else []
            if per - real:
                shard.append(Block(None, (0, per - real)))
            out.append(shard)
        return out

    def merged_shapes(self, shape, ctx):
        return [(ctx.vocab_size, *shape[1:])]

    def shards(self, parts, n, ctx):
        t = parts[0]
        if t.shape[0] != ctx.vocab_size:
            raise UserError(f"a vocabulary tensor has {t.shape[0]} rows but config.json says vocab_size={ctx.vocab_size}")
        pad = ctx.padded_vocab_size - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))], 0)
        return _chunk(t, n, 0)

    def merge(self, shards, ctx):
        return [torch.cat(shards, 0)[: ctx.vocab_size].contiguous()]

    def merge_pieces(self, shards, ctx):
        pieces, rows = [], 0
        for shard in shards:  # drop the padding rows at the end
            take = min(shard.shape[0], ctx.vocab_size - rows)
            if take > 0:
                pieces.append(shard[:take])
            rows += take
        return [_contiguous_rows(pieces)]


class GroupedQKV(Split):
    """q, k, v fused per query group: [q heads of group g; k_g; v_g] for each g, then split by groups.

    Works for weights ([rows, hidden]) and biases ([rows]) alike.
    """

    name = "qkv"

    def _groups(self, ctx: SplitContext):
        return ctx.num_kv_heads, ctx.num_heads // ctx.num_kv_heads * ctx.head_dim, ctx.head_dim

    def blocks(self, shapes, n, ctx):
        groups, q_rows, kv_rows = self._groups(ctx)
        self._check_rows([s[0] for s in shapes], ctx)
        per = _even(groups, n)
        return [[Block(j, (g * size, (g + 1) * size))
                 for g in range(k * per, (k + 1) * per) for j, size in ((0, q_rows), (1, kv_rows), (2, kv_rows))]
                for k in range(n)]

    def _check_rows(self, rows: list[int], ctx: SplitContext) -> None:
        groups, q_rows, kv_rows = self._groups(ctx)
        expect = {"q": groups * q_rows, "k": groups * kv_rows, "v": groups * kv_rows}
        for name, r in zip("qkv", rows):
            if r != expect[name]:
                raise UserError(
                    f"{name}_proj has {r} rows, the config implies {expect[name]} "
                    f"({ctx.num_heads} heads, {ctx.num_kv_heads} key/value heads, head_dim {ctx.head_dim})")

    def merged_shapes(self, shape, ctx):
        groups, q_rows, kv_rows = self._groups(ctx)
        if shape[0] != groups * (q_rows + 2 * kv_rows):
            raise UserError(f"a fused q/k/v parameter has {shape[0]} rows, the config implies {groups * (q_rows + 2 * kv_rows)}")
        rest = tuple(shape[1:])
        return [(groups * q_rows, *rest), (groups * kv_rows, *rest), (groups * kv_rows, *rest)]

    def shards(self, parts, n, ctx):
        q, k, v = parts
        groups, q_rows, kv_rows = self._groups(ctx)
        rest = tuple(q.shape[1:])
        self._check_rows([t.shape[0] for t in parts], ctx)
        fused = torch.cat([q.reshape(groups, q_rows, *rest), k.reshape(groups, kv_rows, *rest),
                           v.reshape(groups, kv_rows, *rest)], dim=1)
        return [s.reshape(-1, *rest) for s in _chunk(fused, n, 0)]

    def merge(self, shards, ctx):
        groups, q_rows, kv_rows = self._groups(ctx)
        fused = torch.cat(shards, 0)
        rest = tuple(fused.shape[1:])
        fused = fused.reshape(groups, q_rows + 2 * kv_rows, *rest)
        q, k, v = torch.split(fused, [q_rows, kv_rows, kv_rows], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]

    def merge_pieces(self, shards, ctx):
        groups, q_rows, kv_rows = self._groups(ctx)
        out: list[list[torch.Tensor]] = [[], [], []]
        for shard in shards:  # each shard holds whole query groups, in order
            rest = tuple(shard.shape[1:])
            fused = shard.contiguous().reshape(-1, q_rows + 2 * kv_rows, *rest)
            for g in range(fused.shape[0]):
                for j, part in enumerate(torch.split(fused[g], [q_rows, kv_rows, kv_rows], dim=0)):
                    out[j].append(part)
        return out


class GateUp(Split):
    """SwiGLU gate and up projections: each split on dim 0, rank i holds [gate_i; up_i]."""

    name = "gate_up"

    def blocks(self, shapes, n, ctx):
        if tuple(shapes[0]) != tuple(shapes[1]):
            raise UserError(f"gate and up projections differ in shape: {tuple(shapes[0])} vs {tuple(shapes[1])}")
        per = _even(shapes[0][0], n)
        return [[Block(0, (k * per, (k + 1) * per)), Block(1, (k * per, (k + 1) * per))] for k in range(n)]

    def merged_shapes(self, shape, ctx):
        half = (_even(shape[0], 2), *shape[1:])
        return [half, half]

    def shards(self, parts, n, ctx):
        gate, up = parts
        if gate.shape != up.shape:
            raise UserError(f"gate and up projections differ in shape: {tuple(gate.shape)} vs {tuple(up.shape)}")
        return [torch.cat([g, u], 0) for g, u in zip(_chunk(gate, n, 0), _chunk(up, n, 0))]

    def merge(self, shards, ctx):
        halves = [torch.chunk(s, 2, 0) for s in shards]
        return [torch.cat([h[0] for h in halves], 0).contiguous(), torch.cat([h[1] for h in halves], 0).contiguous()]

    def merge_pieces(self, shards, ctx):
        halves = [torch.chunk(s.contiguous(), 2, 0) for s in shards]
        return [[h[0] for h in halves], [h[1] for h in halves]]


class FusedGateUp(GateUp):
    """A GeGLU / SwiGLU input projection stored fused as one tensor, [gate; up] on dim 0 (Gemma 4's experts:
    ``gate_up_proj`` [experts, 2 x ffn, hidden], each expert's slice [2 x ffn, hidden]): split as ``GateUp``."""

    name = "gate_up_fused"

    def blocks(self, shapes, n, ctx):
        half = _even(shapes[0][0], 2)
        per = _even(half, n)
        return [[Block(0, (k * per, (k + 1) * per)), Block(0, (half + k * per, half + (k + 1) * per))]
                for k in range(n)]

    def merged_shapes(self, shape, ctx):
        return [tuple(shape)]

    def shards(self, parts, n, ctx):
        return GATE_UP.shards(list(_chunk(parts[0], 2, 0)), n, ctx)

    def merge(self, shards, ctx):
        return [torch.cat(GATE_UP.merge(shards, ctx), 0)]

    def merge_pieces(self, shards, ctx):
        return [[p for half in GATE_UP.merge_pieces(shards, ctx) for p in half]]


class InterleavedGateUp(Split):
    """A fused SwiGLU input projection stored transposed with gate and up in alternating columns (gpt-oss's
    experts: HF ``gate_up_proj`` [hidden, 2 x ffn], gate = columns 0, 2, ..., up = 1, 3, ...; its bias
    [2 x ffn] alike): de-interleaved into megatron-core's [gate; up] rows, then split as ``GateUp``."""

    name = "gate_up_interleaved"
    transposed = True

    def shards(self, parts, n, ctx):
        t = parts[0].t() if parts[0].dim() == 2 else parts[0]
        if t.shape[0] % 2:
            raise UserError(f"a gate/up projection of {t.shape[0]} outputs cannot alternate gate and up")
        return GATE_UP.shards([t[0::2].contiguous(), t[1::2].contiguous()], n, ctx)

    def merge(self, shards, ctx):
        gate, up = GATE_UP.merge(shards, ctx)
        t = torch.stack([gate, up], 1).reshape(2 * gate.shape[0], *gate.shape[1:])
        return [(t.t() if t.dim() == 2 else t).contiguous()]


class TransposedRow(Split):
    """A row-parallel weight stored transposed ([in, out]: gpt-oss's experts' ``down_proj``): megatron-core's
    [out, in], split on its input dimension."""

    name = "row_transposed"
    transposed = True

    def shards(self, parts, n, ctx):
        return [c.t().contiguous() for c in _chunk(parts[0], n, 0)]

    def merge(self, shards, ctx):
        return [torch.cat([s.t() for s in shards], 0).contiguous()]


class RowPieces(Split):
    """A shard stacked from row ranges of its HF tensors, described once (``pieces``); the blocks, the
    shards and the merge all follow from that description, so they cannot disagree."""

    def part_rows(self, ctx: SplitContext) -> list[int]:
        """Rows of each HF tensor."""
        raise NotImplementedError

    def pieces(self, ctx: SplitContext, n: int) -> list[list[tuple[int, int, int]]]:
        """For each of the ``n`` shards, its (HF tensor, first row, stop row) ranges in order."""
        raise NotImplementedError

    def _check(self, rows: list[int], ctx: SplitContext) -> None:
        want = self.part_rows(ctx)
        if list(rows) != want:
            raise UserError(f"{self.name}: HF tensors with {list(rows)} rows, the config implies {want}")

    def blocks(self, shapes, n, ctx):
        self._check([s[0] for s in shapes], ctx)
        return [[Block(p, (a, b)) for p, a, b in shard] for shard in self.pieces(ctx, n)]

    def shards(self, parts, n, ctx):
        self._check([t.shape[0] for t in parts], ctx)
        return [torch.cat([parts[p][a:b] for p, a, b in shard], 0).contiguous() for shard in self.pieces(ctx, n)]

    def merge(self, shards, ctx):
        rest = tuple(shards[0].shape[1:])
        out = [shards[0].new_empty((rows,) + rest) for rows in self.part_rows(ctx)]
        for shard, pieces in zip(shards, self.pieces(ctx, len(shards))):
            row = 0
            for p, a, b in pieces:
                out[p][a:b] = shard[row:row + b - a]
                row += b - a
        return out


class GatedQKV(RowPieces):
    """q, its output gate, k and v, per query group (megatron-core's ``attention_output_gate``): a group's rows
    are [q heads; gate heads; k; v]. The HF ``q_proj`` holds each head's query and gate one after the other
    (Qwen3-Next: [q_h; gate_h] per head); ``k_proj`` and ``v_proj`` as for ``GroupedQKV``."""

    name = "qkv_gated"

    def part_rows(self, ctx):
        return [2 * ctx.num_heads * ctx.head_dim, ctx.num_kv_heads * ctx.head_dim, ctx.num_kv_heads * ctx.head_dim]

    def pieces(self, ctx, n):
        hd, per = ctx.head_dim, ctx.num_heads // ctx.num_kv_heads
        groups = _even(ctx.num_kv_heads, n)
        out = []
        for k in range(n):
            shard = []
            for g in range(k * groups, (k + 1) * groups):
                heads = range(g * per, (g + 1) * per)
                shard += [(0, 2 * h * hd, (2 * h + 1) * hd) for h in heads]
                shard += [(0, (2 * h + 1) * hd, (2 * h + 2) * hd) for h in heads]
                shard += [(1, g * hd, (g + 1) * hd), (2, g * hd, (g + 1) * hd)]
            out.append(shard)
        return out


def _even_ranges(part: int, total_rows: int, n: int) -> list[tuple[int, int, int]]:
    per = _even(total_rows, n)
    return [(part, k * per, (k + 1) * per) for k in range(n)]


@dataclass(frozen=True, eq=False)
class ConcatPieces(RowPieces):
    """Rows that are several pieces back to back, each split evenly over the shards: shard k holds
    [piece 0's k-th part; piece 1's k-th part; ...] (megatron-core's Gated DeltaNet keeps its input
    projection and convolution so). ``layout`` gives, per HF tensor, the rows of the pieces it holds, in
    order (Qwen3.5: in_proj_qkv holds q, k and v; in_proj_z, in_proj_b, in_proj_a one each)."""

    layout: tuple[tuple[int, ...], ...]
    name: str = "concat_pieces"

    def part_rows(self, ctx):
        return [sum(sizes) for sizes in self.layout]

    def pieces(self, ctx, n):
        ranges = []  # per piece, its n even parts
        for part, sizes in enumerate(self.layout):
            start = 0
            for size in sizes:
                ranges.append([(part, start + a, start + b) for _, a, b in _even_ranges(part, size, n)])
                start += size
        return [[piece[k] for piece in ranges] for k in range(n)]


@dataclass(frozen=True, eq=False)
class GroupedDeltaNetInput(RowPieces):
    """Qwen3-Next's fused Gated DeltaNet input projections, grouped by key head: ``in_proj_qkvz`` holds, for
    each key head, [q (key_dim); k (key_dim); v; z (value_dim x value heads per key head)], ``in_proj_ba``
    [b; a (value heads per key head)]; megatron-core's shard k is [q; k; v; z; b; a] of its key heads."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    name: str = "deltanet_grouped_input"

    def part_rows(self, ctx):
        r = self.value_heads // self.key_heads
        return [self.key_heads * (2 * self.key_dim + 2 * r * self.value_dim), self.key_heads * 2 * r]

    def pieces(self, ctx, n):
        r, hk, hv = self.value_heads // self.key_heads, self.key_dim, self.value_dim
        group = 2 * hk + 2 * r * hv
        per = _even(self.key_heads, n)
        offsets = ((0, hk), (hk, hk), (2 * hk, r * hv), (2 * hk + r * hv, r * hv))
        out = []
        for k in range(n):
            groups = range(k * per, (k + 1) * per)
            shard = [(0, g * group + off, g * group + off + size) for off, size in offsets for g in groups]
            shard += [(1, g * 2 * r + off, g * 2 * r + off + r) for off in (0, r) for g in groups]
            out.append(shard)
        return out


def _contiguous_rows(pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.contiguous() for p in pieces]


REPLICATED, COLUMN, ROW, VOCAB, QKV, GATE_UP = Replicated(), Column(), Row(), VocabParallel(), GroupedQKV(), GateUp()
GATE_UP_INTERLEAVED, ROW_TRANSPOSED, QKV_GATED = InterleavedGateUp(), TransposedRow(), GatedQKV()
GATE_UP_FUSED = FusedGateUp()

"""Chunks over the distributed optimizer's bucket shards, and the store that keeps them on two tiers.

The distributed optimizer gives each data-parallel rank one contiguous shard of every gradient
bucket; inside a shard each parameter owns a contiguous range (``Span``), in the same place in the
gradient buffer and in the parameter buffer. A chunk is a run of consecutive spans of one shard,
packed next-fit up to a capacity: its fp32 master weights, ``exp_avg`` and ``exp_avg_sq`` live in one
``[3, capacity]`` tensor, and the span views the optimizer works on point into it. Because a chunk is
one contiguous range of the buffers, its gradients come over as one copy and its updated parameters
go back as one copy, and moving the chunk between tiers is one copy of one tensor: bit for bit, never
recomputed from the bf16 parameters.

The two tiers are "device" (the accelerator; on a machine without one, host memory tagged as the
device, so that every move, staging copy and policy decision runs in CI) and "host" (pinned host
memory next to a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DEVICE, HOST = "device", "host"
FIELDS = ("param", "exp_avg", "exp_avg_sq")  # rows of a chunk's buffer
ALIGN = 64  # chunk capacities are whole multiples of this many elements (256-byte rows)


@dataclass(frozen=True)
class Span:
    """One parameter's shard on this rank: elements [start, end) of its DDP buffer."""

    key: int  # index of the main parameter in the optimizer's flattened param list
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class Chunk:
    index: int
    buffer: int  # which of the optimizer's DDP buffers
    spans: tuple[Span, ...]
    capacity: int

    @property
    def start(self) -> int:
        return self.spans[0].start

    @property
    def end(self) -> int:
        return self.spans[-1].end

    @property
    def numel(self) -> int:
        """Elements the chunk covers, gaps between spans (the buffer's alignment padding) included."""
        return self.end - self.start

    @property
    def state_numel(self) -> int:
        """Elements of optimizer state that belong to parameters."""
        return sum(s.numel for s in self.spans)

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk's buffer (master, exp_avg, exp_avg_sq in fp32)."""
        return len(FIELDS) * 4 * self.capacity


def _round_up(n: int, to: int = ALIGN) -> int:
    return max(to, -(-n // to) * to)


def next_fit(spans: list[Span], capacity: int) -> list[list[Span]]:
    """Consecutive spans packed next-fit: a chunk takes the next span while its extent (from its first
    span's start to this span's end) fits the capacity; a span larger than the capacity gets a chunk
    of its own."""
    groups: list[list[Span]] = []
    for span in spans:
        if groups and span.end - groups[-1][0].start <= capacity:
            groups[-1].append(span)
        else:
            groups.append([span])
    return groups


def waste(segments: list[list[Span]], capacity: int) -> int:
    """Elements allocated but unused when ``segments`` are packed at ``capacity`` (internal fragmentation)."""
    total = 0
    for spans in segments:
        for group in next_fit(spans, capacity):
            extent = group[-1].end - group[0].start
            total += _round_up(max(capacity, extent)) - extent
    return total


def capacity_candidates(segments: list[list[Span]], min_chunks: int = 16, max_chunks: int = 128,
                        count: int = 48) -> list[int]:
    """Chunk capacities worth trying: ``count`` sizes spaced geometrically between those giving about
    ``max_chunks`` and ``min_chunks`` chunks (enough chunks for a fine offload ratio, few enough to keep
    each copy large), as multiples of ALIGN."""
    total = sum(s[-1].end - s[0].start for s in segments if s)
    if total == 0:
        return [ALIGN]
    lo, hi = max(ALIGN, total // max_chunks), max(ALIGN, -(-total // min_chunks))
    return sorted({_round_up(int(lo * (hi / lo) ** (i / max(1, count - 1)))) for i in range(count)})


def choose_capacity(segments: list[list[Span]], **kwargs) -> int:
    """The candidate capacity with the least internal fragmentation (ties: the smaller, finer one)."""
    return min(capacity_candidates(segments, **kwargs), key=lambda c: (waste(segments, c), c))


@dataclass
class ChunkPlan:
    chunks: list[Chunk]
    capacity: int

    @property
    def state_numel(self) -> int:
        return sum(c.state_numel for c in self.chunks)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def fragmentation(self) -> float:
        """Share of the chunks' buffers holding no parameter's state (alignment gaps and unused tails)."""
        allocated = sum(c.capacity for c in self.chunks)
        return 1.0 - self.state_numel / allocated if allocated else 0.0


def plan_chunks(segments: list[tuple[int, list[Span]]], capacity: int | None = None) -> ChunkPlan:
    """Chunks over this rank's bucket shards: ``segments`` is one (buffer index, spans) per shard.

    Chunks never cross shards: two shards of one rank are not adjacent in the buffer when DP > 1.
    """
    ordered = [(b, sorted(spans, key=lambda s: s.start)) for b, spans in segments if spans]
    if capacity is None:
        capacity = choose_capacity([spans for _, spans in ordered])
    capacity = _round_up(capacity)
    chunks: list[Chunk] = []
    for buffer, spans in ordered:
        for group in next_fit(spans, capacity):
            extent = group[-1].end - group[0].start
            chunks.append(Chunk(len(chunks), buffer, tuple(group), _round_up(max(capacity, extent))))
    return ChunkPlan(chunks, capacity)


def host_chunk_count(chunks: list[Chunk], share: float) -> int:
    """How many chunks, taken from the end, put ``share`` of the optimizer state on the host, to within
    one chunk: the count whose host share is nearest ``share``."""
    if share <= 0 or not chunks:
        return 0
    total = sum(c.state_numel for c in chunks)
    best, best_err, acc = 0, share, 0
    for n, chunk in enumerate(reversed(chunks), 1):
        acc += chunk.state_numel
        err = abs(acc / total - share)
        if err < best_err - 1e-12:
            best, best_err = n, err
    return best


@dataclass
class _Binding:
    """Where the views of one chunk live, re-pointed whenever the chunk moves."""

    main_params: list  # (span offset, numel, main-param tensor)
    states: list  # (span offset, numel, state dict)


@dataclass
class ChunkStore:
    """The buffers of a plan's chunks, each on its tier, and the views bound to them."""

    plan: ChunkPlan
    device: torch.device
    pin_host: bool = False
    tiers: list[str] = field(default_factory=list)
    data: list[torch.Tensor] = field(default_factory=list)
    _bindings: list[_Binding] = field(default_factory=list)
    _host_cache: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def chunks(self) -> list[Chunk]:
        return self.plan.chunks

    def allocate(self, tiers: list[str]) -> None:
        self.tiers = list(tiers)
        self.data = [self._new_buffer(c, t) for c, t in zip(self.chunks, self.tiers)]
        self._bindings = [_Binding([], []) for _ in self.chunks]

    def _new_buffer(self, chunk: Chunk, tier: str) -> torch.Tensor:
        if tier == DEVICE:
            return torch.zeros((len(FIELDS), chunk.capacity), dtype=torch.float32, device=self.device)
        cached = self._host_cache.get(chunk.index)
        if cached is not None:
            return cached
        buf = torch.zeros((len(FIELDS), chunk.capacity), dtype=torch.float32, device="cpu", pin_memory=self.pin_host)
        if self.pin_host:
            # Pinning is slow (page-locking); a chunk keeps its host buffer once it has one.
            self._host_cache[chunk.index] = buf
        return buf

    def row(self, index: int, field_name: str) -> torch.Tensor:
        """A chunk's master weights / exp_avg / exp_avg_sq over its whole range (gaps included)."""
        return self.data[index][FIELDS.index(field_name), : self.chunks[index].numel]

    def span_view(self, index: int, field_name: str, span: Span) -> torch.Tensor:
        off = span.start - self.chunks[index].start
        return self.data[index][FIELDS.index(field_name), off: off + span.numel]

    def bind_main_param(self, index: int, span: Span, tensor: torch.Tensor) -> None:
        tensor.data = self.span_view(index, "param", span)
        self._bindings[index].main_params.append((span, tensor))

    def bind_state(self, index: int, span: Span, state: dict) -> None:
        for name in FIELDS[1:]:
            state[name] = self.span_view(index, name, span)
        self._bindings[index].states.append((span, state))

    def move(self, index: int, tier: str) -> int:
        """Move chunk ``index`` to ``tier`` (one copy of its whole buffer); returns the bytes copied."""
        if self.tiers[index] == tier:
            return 0
        old = self.data[index]
        new = self._new_buffer(self.chunks[index], tier)
        new.copy_(old, non_blocking=self.pin_host)
        if self.pin_host and tier == HOST:
            torch.cuda.current_stream().synchronize()  # the host copy must be complete before it is read
        self.data[index], self.tiers[index] = new, tier
        for span, tensor in self._bindings[index].main_params:
            tensor.data = self.span_view(index, "param", span)
        for span, state in self._bindings[index].states:
            for name in FIELDS[1:]:
                state[name] = self.span_view(index, name, span)
        return old.numel() * old.element_size()

    def bytes_on(self, tier: str) -> int:
        return sum(c.nbytes for c, t in zip(self.chunks, self.tiers) if t == tier)

    def state_numel_on(self, tier: str) -> int:
        return sum(c.state_numel for c, t in zip(self.chunks, self.tiers) if t == tier)


def spans_of_shard(param_ranges: list[tuple[int, int, int]]) -> list[Span]:
    """(key, start, end) triples -> Spans sorted by position."""
    return sorted((Span(k, s, e) for k, s, e in param_ranges if e > s), key=lambda s: s.start)


def chunk_count_for(bytes_available: int, chunks: list[Chunk]) -> int:
    """How many chunks from the front fit in ``bytes_available``."""
    used, n = 0, 0
    for chunk in chunks:
        if used + chunk.nbytes > bytes_available:
            break
        used += chunk.nbytes
        n += 1
    return n


__all__ = ["DEVICE", "HOST", "FIELDS", "Span", "Chunk", "ChunkPlan", "ChunkStore", "plan_chunks", "next_fit",
           "choose_capacity", "capacity_candidates", "waste", "host_chunk_count", "spans_of_shard", "chunk_count_for"]

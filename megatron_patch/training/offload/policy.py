"""Where the optimizer chunks live: a fixed share (static) or what the device can hold (auto).

A layout is a number k: chunks [0, k) on the device, the rest on the host. Evictions take the last
device chunks, promotions the first host chunks, so the layout is one number and every decision is
easy to read in the logs.

``AutoPolicy`` follows the reference design (a budget from the memory statistics, keep on the device
what fits, a safety margin) and adds what it lacked, so chunks do not bounce between tiers:

- headroom = capacity - margin - model data - peak non-model data of the last step;
- headroom < 0: evict at once, the fewest chunks whose bytes cover the deficit;
- otherwise promote only after ``patience`` consecutive steps with room for the next chunk, no sooner
  than ``cooldown`` steps after the last eviction, and only as many chunks as the smallest headroom
  of those steps holds.

Decisions depend on the readings alone, so the same readings give the same layout schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_patch.training.offload.probe import MemoryReading


@dataclass(frozen=True)
class Decision:
    device_chunks: int
    headroom: int | None  # bytes; None when the policy does not read memory
    action: str  # "hold" | "evict" | "promote"


class StaticPolicy:
    def __init__(self, device_chunks: int):
        self.device_chunks = device_chunks

    def decide(self, iteration: int, reading: MemoryReading | None, chunk_bytes: list[int],
               device_chunks: int) -> Decision:
        return Decision(self.device_chunks, None, "hold")


@dataclass
class AutoPolicy:
    margin: int
    patience: int = 3
    cooldown: int = 5
    last_eviction: int | None = None
    _room: list[int] = field(default_factory=list)  # headrooms of the current streak

    def decide(self, iteration: int, reading: MemoryReading, chunk_bytes: list[int], device_chunks: int) -> Decision:
        headroom = reading.capacity - self.margin - reading.model_bytes - reading.peak_non_model
        k = device_chunks
        if headroom < 0:
            freed = 0
            while k > 0 and freed < -headroom:
                k -= 1
                freed += chunk_bytes[k]
            self._room = []
            if k < device_chunks:
                self.last_eviction = iteration
                return Decision(k, headroom, "evict")
            return Decision(k, headroom, "hold")
        if k == len(chunk_bytes) or headroom < chunk_bytes[k]:
            self._room = []
            return Decision(k, headroom, "hold")
        self._room.append(headroom)
        cooled = self.last_eviction is None or iteration - self.last_eviction > self.cooldown
        if len(self._room) < self.patience or not cooled:
            return Decision(k, headroom, "hold")
        budget = min(self._room[-self.patience:])
        while k < len(chunk_bytes) and chunk_bytes[k] <= budget:
            budget -= chunk_bytes[k]
            k += 1
        self._room = []
        return Decision(k, headroom, "promote")

    def state_dict(self) -> dict:
        return {"last_eviction": self.last_eviction, "room": list(self._room)}

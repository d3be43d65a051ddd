"""How much device memory a step used: the readings the ``auto`` policy decides from.

A probe is told where a step's phases begin and end and returns one ``MemoryReading`` per step:
the device's capacity, the model data resident when the step started (parameters, gradient buffers,
the optimizer chunks on the device, anything else that persists) and the peak of everything else
(activations, workspaces, staging) during forward/backward and during the update.

- ``CudaProbe``: torch.cuda's allocator statistics (``memory_allocated`` at the start of the step,
  ``max_memory_allocated`` after a peak reset at each phase start).
- ``AccountingProbe``: without a GPU the "device" is host memory tagged as the device; its use is
  accounted, not measured: the bytes of the device-tier tensors, plus the activation estimate of the
  memory plan as non-model data.
- ``ScriptedProbe``: device room for a scripted share of the optimizer state per iteration
  (``MP_OFFLOAD_PROBE_SCRIPT``), to drive evictions and promotions deterministically in tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_patch.errors import UserError


@dataclass(frozen=True)
class MemoryReading:
    capacity: int  # bytes the device offers
    model_bytes: int  # resident at the start of the step, optimizer chunks on the device included
    peak_fwd_bwd: int  # non-model bytes at the forward/backward peak
    peak_update: int  # non-model bytes at the update's peak

    @property
    def peak_non_model(self) -> int:
        return max(self.peak_fwd_bwd, self.peak_update)


@dataclass(frozen=True)
class Accounting:
    """What the optimizer knows of its own state when a reading is taken."""

    device_chunk_bytes: int
    total_chunk_bytes: int
    static_model_bytes: int  # parameters and gradient buffers


class MemoryProbe:
    def begin_step(self, iteration: int) -> None:
        pass

    def end_phase(self, phase: str) -> None:
        """``phase`` ("fwd_bwd" or "update") has just finished."""

    def reading(self, iteration: int, accounting: Accounting) -> MemoryReading:
        raise NotImplementedError


class CudaProbe(MemoryProbe):
    def __init__(self, capacity: int | None = None, cuda=None):
        self.cuda = cuda or torch.cuda  # injectable for tests of the arithmetic
        self.capacity = capacity or int(self.cuda.mem_get_info()[1])
        self._start = 0
        self._peaks: dict[str, int] = {}

    def begin_step(self, iteration: int) -> None:
        self.cuda.synchronize()
        self._start = int(self.cuda.memory_allocated())
        self._peaks = {}
        self.cuda.reset_peak_memory_stats()

    def end_phase(self, phase: str) -> None:
        self.cuda.synchronize()
        self._peaks[phase] = int(self.cuda.max_memory_allocated())
        self.cuda.reset_peak_memory_stats()

    def reading(self, iteration: int, accounting: Accounting) -> MemoryReading:
        start = self._start
        return MemoryReading(self.capacity, start, max(0, self._peaks.get("fwd_bwd", start) - start),
                             max(0, self._peaks.get("update", start) - start))


class AccountingProbe(MemoryProbe):
    def __init__(self, capacity: int, activation_bytes: int):
        self.capacity = capacity
        self.activation_bytes = activation_bytes

    def reading(self, iteration: int, accounting: Accounting) -> MemoryReading:
        model = accounting.static_model_bytes + accounting.device_chunk_bytes
        return MemoryReading(self.capacity, model, self.activation_bytes, 0)


class ScriptedProbe(MemoryProbe):
    """From each listed iteration on, the device has room (beyond the margin and the static model
    data) for ``device_fraction`` of the optimizer chunks' bytes."""

    def __init__(self, device_fraction: dict[int, float], margin: int):
        if 1 not in device_fraction:
            device_fraction = {1: 1.0, **device_fraction}
        self.device_fraction = dict(sorted(device_fraction.items()))
        self.margin = margin

    @classmethod
    def from_file(cls, path: str | Path, margin: int) -> "ScriptedProbe":
        try:
            script = json.loads(Path(path).read_text())
            fractions = {int(k): float(v) for k, v in script["device_fraction"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UserError(f"MP_OFFLOAD_PROBE_SCRIPT {path}: expected JSON like "
                            f'{{"device_fraction": {{"1": 1.0, "3": 0.4}}}} ({exc})')
        bad = [k for k, v in fractions.items() if k < 1 or not 0.0 <= v <= 1.0]
        if bad:
            raise UserError(f"MP_OFFLOAD_PROBE_SCRIPT {path}: iterations must be >= 1 and fractions in [0, 1]")
        return cls(fractions, margin)

    def fraction_at(self, iteration: int) -> float:
        current = 1.0
        for it, frac in self.device_fraction.items():
            if it <= iteration:
                current = frac
        return current

    def reading(self, iteration: int, accounting: Accounting) -> MemoryReading:
        room = int(self.fraction_at(iteration) * accounting.total_chunk_bytes)
        capacity = self.margin + accounting.static_model_bytes + room
        return MemoryReading(capacity, accounting.static_model_bytes + accounting.device_chunk_bytes, 0, 0)

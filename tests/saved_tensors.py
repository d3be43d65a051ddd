"""What autograd keeps for backward, measured: the activation memory of a step, on any device.

``SavedTensorMeter`` wraps a forward/backward in ``torch.autograd.graph.saved_tensors_hooks``. Every
tensor autograd saves is counted once per storage (a view and its base are one allocation), from the
moment it is saved until autograd drops it after using it in backward, so ``peak`` is the largest
amount of saved activation memory alive at once: all the micro-batches a pipeline keeps in flight,
and the blocks that full recomputation rebuilds during backward. Parameters are model state, not
activations, and are left out (they are saved by every matmul).
"""

from __future__ import annotations

import torch


class _Saved:
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: int, meter: "SavedTensorMeter"):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter._release(self.key)


class SavedTensorMeter:
    def __init__(self, exclude: list[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._refs: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._hooks = None

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or storage.nbytes() == 0:
            return tensor
        if key not in self._refs:
            self._refs[key] = 0
            self._bytes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.live -= self._bytes.pop(key)

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

"""Norms that several families' layers share, as megatron-core layer-spec modules (``config, hidden_size, eps``).

- ``ZeroCenteredRMSNorm``: an RMSNorm whose weight is stored zero-centred and scales by ``1 + weight``, computed
  in float32 (Qwen3-Next and Qwen3.5 in every norm; Gemma's RMSNorm is the same). The weight is kept as stored,
  so bf16 round trips stay bit-exact.
"""

from __future__ import annotations

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with a zero-centred weight: ``norm(x) * (1 + weight)`` in float32."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        if config.sequence_parallel:  # its gradient is summed over the TP group (finalize_model_grads)
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)

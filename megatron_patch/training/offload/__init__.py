"""Optimizer CPU offload as the reference designed it: chunks over the distributed optimizer's
bucket shards, a store whose moves are bit-exact, a memory probe, a static or auto policy.

See docs/optimizer-offload.md. The trainer uses ``settings_from_config`` and
``build_chunked_optimizer``; everything else is in the submodules.
"""

from __future__ import annotations

from megatron_patch.training.offload.optimizer import (  # noqa: F401
    GiB, OffloadController, OffloadSettings, build_chunked_optimizer)


def settings_from_config(cfg, initial_share: float = 0.0, activation_bytes: int = 0) -> OffloadSettings:
    """The run's offload settings (``RunConfig``); ``initial_share``/``activation_bytes`` from the memory plan."""
    return OffloadSettings(
        policy=cfg.optimizer_offload_policy, ratio=cfg.optimizer_offload_fraction, initial_share=initial_share,
        numerics=cfg.offload_numerics, margin_bytes=int(cfg.offload_margin_gb * GiB), patience=cfg.offload_patience,
        cooldown=cfg.offload_cooldown,
        chunk_elements=None if cfg.offload_chunk_mb is None else max(1, int(cfg.offload_chunk_mb * 2**20 / 4)),
        probe_script=cfg.offload_probe_script,
        capacity_bytes=None if cfg.gpu_memory_gb is None else int(cfg.gpu_memory_gb * GiB),
        activation_bytes=activation_bytes, timing=cfg.offload_timing)

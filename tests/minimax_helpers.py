"""MiniMax-M2 test helpers: workers importable for the "spawn" start of local rank processes."""

from __future__ import annotations

import torch

from megatron_patch.runtime.distributed import ParallelLayout


def grads_worker(hf_dir: str, layout: ParallelLayout, sequence_parallel: bool) -> dict | None:
    """One global batch through megatron-core's schedule, DDP and ``finalize_model_grads`` (which sums the q/k
    norms' gradients over TP), from the HF weights at ``layout``: the losses and every gradient gathered whole
    (TP rank 0; None elsewhere)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.model_io import load_hf_weights
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import init_model_parallel
    from tests.runtime_helpers import forward_backward, full_tensors, make_batches

    init_model_parallel(layout)
    arch = parse_arch(hf_dir)
    model = build_model(arch, layout, torch.float32, sequence_parallel=sequence_parallel)
    load_hf_weights(model, arch, layout, HFCheckpointReader(hf_dir))
    config = model.config
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    losses = forward_backward(model, make_batches())
    grads = full_tensors(model, "grad")
    from megatron.core import parallel_state

    return dict(losses=losses, grads=grads) if parallel_state.get_tensor_model_parallel_rank() == 0 else None

"""What a training run really allocates, counted on each rank (for tests/test_memory_plan.py).

``measure_rank`` runs on every rank of a local job: the trainer builds the run exactly as
``mpatch train`` does, takes one training step with the saved-tensor meter around it, and reports
the bytes of every model-state tensor (each storage once) and the peak of saved activations.
"""

from __future__ import annotations


def _bytes(tensor, seen: set) -> int:
    storage = tensor.untyped_storage()
    key = storage.data_ptr()
    if key in seen or storage.nbytes() == 0:
        return 0
    seen.add(key)
    return storage.nbytes()


def model_state_bytes(models: list, optimizer) -> dict:
    """Parameters and gradient buffers of the DDP-wrapped chunks, and the optimizer's tensors by tier."""
    from megatron_patch.training.offload.chunks import DEVICE
    from megatron_patch.training.offload.optimizer import ChunkedDistributedOptimizer

    seen: set = set()
    out = {"params": 0, "grads": 0, "optimizer_device": 0, "optimizer_host": 0}
    for m in models:
        for b in [*m.buffers, *m.expert_parallel_buffers]:
            if b.param_data is not None:
                out["params"] += _bytes(b.param_data, seen)
            out["grads"] += _bytes(b.grad_data, seen)
        for p in m.module.parameters():
            out["params"] += _bytes(p, seen)
    for sub in optimizer.chained_optimizers:
        if isinstance(sub, ChunkedDistributedOptimizer):
            for tier, buf in zip(sub.store.tiers, sub.store.data):
                out["optimizer_device" if tier == DEVICE else "optimizer_host"] += _bytes(buf, seen)
            for grad, param in sub.optimizer._staging.values():
                out["optimizer_host"] += _bytes(grad, seen) + _bytes(param, seen)
            continue
        inner = sub.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                out["optimizer_device"] += _bytes(p, seen)
        for state in inner.state.values():
            for value in state.values():
                if hasattr(value, "untyped_storage"):
                    out["optimizer_device"] += _bytes(value, seen)
    return out


def measure_rank(cfg) -> dict:
    from megatron.core import parallel_state

    from megatron_patch.models.blocks.core_attention import core_attention_of
    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.training.loop import Trainer
    from tests.saved_tensors import SavedTensorMeter

    _forget_moe_metrics()
    init_model_parallel(cfg.layout, seed=cfg.seed)
    trainer = Trainer(cfg)
    trainer.build()
    trainer._param_gather_before_first_step()
    params = [p for m in trainer.models for p in m.parameters()]
    with SavedTensorMeter(exclude=params) as meter:
        trainer.train_step()
    return {"pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "dp_rank": parallel_state.get_data_parallel_rank(), "activations": meter.peak,
            "attention": core_attention_of(trainer.models[0]),
            "leftover": meter.live, **model_state_bytes(trainer.models, trainer.optimizer)}


def _forget_moe_metrics() -> None:
    """megatron-core sizes its per-layer MoE metrics once per process, on the first model's layer count: a later
    model with more MoE layers would index past them, so each configuration measured here starts without them."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker  # 0.19: an object
    except ImportError:  # 0.16: a module-level dict
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def measure_ranks(cfgs: list) -> list[dict]:
    """``measure_rank`` for several configurations in one job (one set of processes, imports paid once)."""
    return [measure_rank(cfg) for cfg in cfgs]

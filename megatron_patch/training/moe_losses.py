"""The MoE routers' load-balancing losses of a step, as Megatron-LM logs them: each loss without its coefficient,
the mean over MoE layers and micro-batches, summed over the ranks that split a micro-batch's tokens and averaged
over data-parallel ranks.

megatron-core's routers record each layer's loss in a tracker on the rank that ran the layer; this reads and clears
it. megatron-core's own reduction (``track_moe_metrics``) needs every rank of a pipeline to hold an entry for each
loss, which a stage without MoE layers (DeepSeek's first dense layers) does not, so the sums are reduced here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# megatron-core's router: the load-balancing type -> the name its loss is tracked and logged under
TRACKED_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                 "global_aux_loss": "global_load_balancing_loss"}


def tracked_losses(config) -> list[str]:
    """The names of the load-balancing losses the routers of ``config`` (a TransformerConfig) add, in the order of
    TRACKED_NAMES: a type of a nonzero coefficient (megatron-core 0.19 takes lists of both)."""
    if not getattr(config, "num_moe_experts", None):
        return []
    types, coeffs = config.moe_router_load_balancing_type, config.moe_aux_loss_coeff
    if isinstance(types, str):
        types, coeffs = [types], [coeffs]
    elif not isinstance(coeffs, (list, tuple)):
        coeffs = [coeffs] * len(types)
    active = {t for t, c in zip(types, coeffs) if c}
    return [name for kind, name in TRACKED_NAMES.items() if kind in active]


def moe_layer_count(config) -> int:
    """How many layers the losses are averaged over: the MoE layers, and the MTP layers as Megatron-LM counts them."""
    freq, layers = config.moe_layer_freq, config.num_layers
    count = sum(freq) if isinstance(freq, (list, tuple)) else sum(1 for i in range(layers) if i % freq == 0)
    return count + (config.mtp_num_layers or 0)


def take_load_balancing_losses(config, num_microbatches: int, dp_size: int, device) -> dict[str, float]:
    """This step's load-balancing losses by name (a collective: every rank calls it), then the tracker cleared."""
    # megatron-core after init_model_parallel, as in loop.py: on CPU its CUDA-only spots are patched first
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    names = tracked_losses(config)
    if not names:
        return {}
    tracker = get_moe_layer_wise_logging_tracker()
    sums = torch.zeros(len(names), dtype=torch.float64, device=device)
    for i, name in enumerate(names):
        entry = tracker.get(name)
        if entry is not None:
            # the ranks of a reduce group hold parts of one loss (summed); data-parallel replicas hold one each
            # (averaged), except where the reduce group already spans them (the global-batch loss)
            sums[i] = entry["values"].double().sum() / (1 if entry.get("reduce_group_has_dp") else dp_size)
    dist.all_reduce(sums)
    clear_aux_losses_tracker()
    sums /= num_microbatches * moe_layer_count(config)
    return dict(zip(names, sums.cpu().tolist()))

"""SFT's per-record loss (MP_SFT_LOSS=record), Pai-Megatron-Patch's: each record's loss is the mean over its own
trained tokens, and a step's loss the mean over the global batch's records.

Pai normalises each record's loss mask to sum 1 and lets megatron-core divide by the records' count
(``--calculate-per-token-loss``), which also rescales the MoE routers' auxiliary losses. Here each micro-batch
carries a per-token weight instead (``loss_weight``: 1/n for each of a record's n trained tokens), scaled so that
megatron-core's own averaging (over micro-batches, then over data-parallel ranks) gives that mean: the rest of
the step, the auxiliary losses included, stays as it is. The weight is per token, so context parallelism's split
of a sample and the THD packing carry it as they carry the mask.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LOSS_WEIGHT = "loss_weight"


def record_weights(batch: dict) -> tuple[torch.Tensor, int]:
    """(each token's weight [b, s]: 1/n for the n trained tokens of its record, 0 elsewhere; the number of records
    with a trained token) of a micro-batch. A row is one record, or, packed, several: each starts where
    ``doc_start`` says (its tail padding one more, untrained)."""
    mask = batch["loss_mask"].float()
    starts = batch["doc_start"].bool().clone() if "doc_start" in batch else torch.zeros_like(mask, dtype=torch.bool)
    starts[:, 0] = True  # a row always starts a record
    record = starts.reshape(-1).long().cumsum(0) - 1
    trained = torch.zeros(int(record[-1]) + 1).index_add_(0, record, mask.reshape(-1))
    share = trained[record]
    weights = torch.where(share > 0, mask.reshape(-1) / share.clamp(min=1), torch.zeros_like(share))
    return weights.reshape(mask.shape), int((trained > 0).sum())


def weigh_records(batches: list[dict], dp_group=None, device=None) -> list[dict]:
    """``batches`` (this rank's micro-batches of a step) with their ``loss_weight``: each record's tokens weigh
    1/n, times micro-batches x data-parallel ranks / the global batch's records, so that megatron-core's mean over
    micro-batches and DDP's over data-parallel ranks leave each record's mean weighing 1/records. ``dp_group``:
    the data-parallel group the records are counted over (a collective, on ``device``); None, for validation,
    leaves the weights unscaled, since only the logged ratio reads them there."""
    weighed = [record_weights(b) for b in batches]
    scale = 1.0
    if dp_group is not None:
        records = torch.tensor([float(sum(n for _, n in weighed))], dtype=torch.float64, device=device)
        dist.all_reduce(records, group=dp_group)
        scale = len(batches) * dist.get_world_size(dp_group) / max(float(records), 1.0)
    return [{**b, LOSS_WEIGHT: w * scale} for b, (w, _) in zip(batches, weighed)]


"""DeepSeek sparse attention in a training run (DeepSeek-V3.2, GLM-5): the MP_DSA_* extras, what megatron-core
cannot run with it refused in one line, the indexer-only mode, and the indexer loss for the log.

- ``MP_DSA_INDEXER_LOSS_SCALE=S`` turns megatron-core's indexer loss on (``dsa_indexer_loss_coeff`` S): the KL
  divergence between the indexer's distribution over keys and the attention's (summed over heads), whose
  gradient reaches the indexer only (its inputs are detached). Off by default: fine-tuning a released model
  keeps its indexer as released (frozen, ``models/blocks/sparse_attention.py``), and the loss holds a dense
  [batch, heads, seq, seq] float32 score matrix per layer.
- ``MP_DSA_INDEXER_ONLY=true`` is DeepSeek's dense warm-up stage: every layer attends densely (all earlier
  keys), everything but the indexers is frozen, and the indexers learn from their loss alone (scale 1 unless
  MP_DSA_INDEXER_LOSS_SCALE says otherwise).
"""

from __future__ import annotations

from megatron_patch.errors import UserError
from megatron_patch.runtime.machine import megatron_core_version, version_tuple

# torch and megatron-core are imported inside the functions that use them: the launcher's checks read this module's
# options before anything imports torch (a refused launch never does). So is blocks.sparse_attention, which imports
# megatron-core at its top.

INDEXER_PARAMS = ".core_attention.indexer."


def dsa_from_options(options, arch) -> dict | None:
    """{"loss_scale": float, "indexer_only": bool} for a sparse-attention model, from the DSA part's options
    (``launcher_options.Options``); None for any other model, which the MP_DSA_* options are refused for."""
    given = [k for k in ("MP_DSA_INDEXER_LOSS_SCALE", "MP_DSA_INDEXER_ONLY") if options.given(k)]
    if arch.sparse_attention is None:
        if given:
            raise UserError(f"{given[0]} applies to DeepSeek sparse attention models (deepseek_v32, glm_moe_dsa), "
                            f"not {arch.family}")
        return None
    only, scale = options["MP_DSA_INDEXER_ONLY"], options["MP_DSA_INDEXER_LOSS_SCALE"]
    if scale is None:
        scale = 1.0 if only else 0.0
    if only and scale == 0:
        raise UserError("MP_DSA_INDEXER_ONLY=true trains the indexers from their loss alone: "
                        "MP_DSA_INDEXER_LOSS_SCALE must be > 0")
    return {"loss_scale": scale, "indexer_only": only}


def check_sparse_attention(cfg) -> None:
    """What DeepSeek sparse attention here cannot run with, in one line each."""
    if cfg.arch.sparse_attention is None:
        return
    if cfg.cp > 1:
        raise UserError(f"CP={cfg.cp} with DeepSeek sparse attention is not supported: megatron-core 0.16 refuses "
                        "context parallelism for DSAttention (0.19 only with all-gather CP), and the sparse attention "
                        "here attends over the whole sequence on one rank: set CP=1")
    if cfg.sft_packing:
        raise UserError("MP_SFT_PACKING=true with DeepSeek sparse attention is not supported: its indexer selects "
                        "keys over one unpacked sequence")
    if cfg.activation_checkpointing == "sel" and version_tuple(megatron_core_version()) < (0, 19):
        # 0.16's selective recompute calls the core attention without the layer input and query latent the
        # indexer needs (an internal error at the first forward); 0.19 passes them
        raise UserError("AC=sel with DeepSeek sparse attention needs megatron-core 0.19 (0.16's selective recompute "
                        "leaves out the inputs its indexer reads): use AC=full or AC=none, or megatron-core 0.19")
    if cfg.lora is not None and "indexer" in cfg.lora["targets"]:
        if not cfg.dsa["loss_scale"]:
            raise UserError("MP_LORA_TARGETS=...indexer: the indexer learns from its loss alone (its inputs are "
                            "detached, its top-k has no gradient): set MP_DSA_INDEXER_LOSS_SCALE > 0")
        if cfg.tp > 1:
            raise UserError(f"MP_LORA_TARGETS=...indexer with TP={cfg.tp} is not supported: the indexer sees the whole "
                            "gathered sequence on every TP rank, where LoRA sums a whole layer's gradients over the "
                            "sequence-parallel shards")
    if cfg.dsa and cfg.dsa["indexer_only"] and cfg.lora is not None:
        raise UserError("MP_DSA_INDEXER_ONLY=true with LoRA (MP_LORA_*): the indexer-only mode trains the indexers "
                        "themselves; choose one")


def config_overrides(cfg) -> dict:
    """TransformerConfig fields of the run's sparse attention."""
    return {"dsa_indexer_loss_coeff": cfg.dsa["loss_scale"]} if cfg.dsa else {}


def setup_indexer_only(chunks: list) -> int:
    """Freeze everything but the indexers and make every layer attend densely; the indexers' parameter count.
    The routers' score-correction biases (buffers megatron-core moves after each step to balance the experts)
    stay as they are too: their update rate is 0, so sign(load) * 0 leaves each bit."""
    # the frozen embedding's output made to need a gradient, as LoRA's is: under AC=full megatron-core's recompute
    # ran every layer under no_grad for an input that needs none, so no indexer loss was computed and nothing
    # trained (grad norm 0 at exit 0; the dsa audit). lora.layers imports megatron-core: ranks only.
    from megatron_patch.lora.layers import input_requires_grad

    trainable = 0
    for chunk in chunks:
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None:
            embedding.register_forward_hook(input_requires_grad)
        chunk.config.moe_router_bias_update_rate = 0.0
        for name, p in chunk.named_parameters():
            p.requires_grad_(INDEXER_PARAMS in f".{name}")
            trainable += p.numel() if p.requires_grad else 0
        for module in chunk.modules():
            if hasattr(module, "dense_warmup"):
                module.dense_warmup = True
    if not trainable:
        raise RuntimeError("MP_DSA_INDEXER_ONLY found no indexer parameters in the model")
    return trainable


def trains(name: str, dsa: dict) -> bool:
    """Whether the parameter ``name`` trains in a sparse-attention run of ``dsa`` (its MP_DSA_* settings)."""
    indexer = INDEXER_PARAMS in f".{name}"
    return indexer if dsa["indexer_only"] else (not indexer or dsa["loss_scale"] > 0)


def split_trainable(cfg, chunks: list[list]) -> tuple[list[list], int]:
    """For the memory plan: each model chunk's trainable parameters (``models.shape.model_shape.RankParam``s, in order) and
    the number of frozen elements."""
    dsa = cfg.dsa or {"loss_scale": 0.0, "indexer_only": False}
    out = [[p for p in params if trains(p.name, dsa)] for params in chunks]
    frozen = sum(p.numel for params in chunks for p in params) - sum(p.numel for params in out for p in params)
    return out, frozen


def take_indexer_loss(device) -> float | None:
    """The mean indexer loss of this step over every layer, micro-batch and rank (a collective: every rank
    calls it), then cleared; None when no layer computed one."""
    import torch
    import torch.distributed as dist

    from megatron_patch.models.blocks.sparse_attention import INDEXER_LOSS

    stats = torch.tensor([float(INDEXER_LOSS["sum"]), float(INDEXER_LOSS["count"])], dtype=torch.float64,
                         device=device)
    INDEXER_LOSS["sum"], INDEXER_LOSS["count"] = 0.0, 0
    dist.all_reduce(stats)
    return float(stats[0] / stats[1]) if stats[1] > 0 else None

"""The training loop on megatron.core: GPTModel, DDP, Megatron optimizer and LR schedule, pipeline
schedules, torch_dist checkpoints. ``train(cfg)`` runs on every rank of an initialised job.

One step, as it reads below: zero the grad buffers, run the pipeline schedule over this rank's
micro-batches (loss averaged over the response/valid tokens), agree on the loss across ranks, stop
or skip on NaN/inf, optimizer step, LR schedule step, log, maybe save.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from megatron_patch.errors import UserError
from megatron_patch.models.blocks import attention_kernels, compiled_fusions, compiled_layers
from megatron_patch.models.blocks.builder import build_model_chunks, pipeline_batch_factor
from megatron_patch.models.shape.model_shape import flops_uncounted, model_shape
from megatron_patch.outputs.folders import write_file_replacing
from megatron_patch.runtime import device, init_model_parallel, watchdog
from megatron_patch.runtime.deferred_compile import set_megatron_fusions
from megatron_patch.runtime.distributed import destroy, init_process_group, move_to_device
from megatron_patch.runtime.machine import Capabilities
from megatron_patch.training import (
    checkpointing,
    data,
    data_files,
    evaluation_run,
    faults,
    fp8_run,
    moe_losses,
    packing,
    record_loss,
    run_folder,
    run_state,
    sft_data,
    sparse_attention_run,
)
from megatron_patch.training.checkpointing import resume_iteration
from megatron_patch.training.gpu_setup import initialize_tp_communicators, warm_up_fused_kernels
from megatron_patch.training.lora_run import cfg_base, describe_trainable, setup_lora
from megatron_patch.training.machine_checks import attention_kernel, core_attention
from megatron_patch.training.megatron_settings import as_megatron_takes_it, megatron_settings
from megatron_patch.training.optimizer_mends import mend_optimizers
from megatron_patch.training.offload import build_chunked_optimizer, settings_from_config
from megatron_patch.training.node_agreement import agree_on_launch
from megatron_patch.training.packing import use_packed_local_attention
from megatron_patch.training.throughput import WARMUP_ITERATIONS, describe, peak_tflops, summarize, tflops_text

# megatron-core is imported inside the functions, after init_model_parallel: on a machine without CUDA the CPU
# compatibility layer (runtime/cpu_compat.py) must patch torch before megatron binds names at import.


class TrainingStopped(UserError):
    """A NaN/inf loss (with MP_NAN_POLICY=stop)."""


def flops_per_iteration(arch, cfg) -> float | None:
    """Model FLOPs of one global batch, in Megatron-LM's convention (models/shape/model_shape.py); None where the
    formula cannot count the model's attention (``flops_uncounted``: DeepSeek-V4's), rather than a wrong number."""
    if flops_uncounted(arch):
        return None
    return model_shape(arch).flops_per_token(cfg.sample_length) * cfg.global_batch_size * cfg.sample_length


def _memory_gib() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30

    return psutil.Process().memory_info().rss / 2**30


def _token_losses(vocab_size: int, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy [b, s] from this TP rank's vocabulary slice of the logits [s, b, v/tp] (megatron-core's
    layout; the signature of its ``compute_language_model_loss``, which this replaces in a model with MTP layers).

    The rows megatron pads the vocabulary with are excluded from the softmax: left in, their logits
    (0 from zero-initialised rows) add probability mass no token can have, and a converted model
    starts with a higher loss than it has in transformers.
    """
    from megatron.core import parallel_state, tensor_parallel

    local = logits.shape[-1]
    first = parallel_state.get_tensor_model_parallel_rank() * local
    if first + local > vocab_size:
        padded = torch.arange(first, first + local, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padded, -1e9 if logits.dtype == torch.float32 else -1e4)
    losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.transpose(0, 1).contiguous())
    return losses.transpose(0, 1)


def _loss_func(loss_mask: torch.Tensor, labels: torch.Tensor, vocab_size: int, cp_size: int, token_losses: bool,
               loss_weight: torch.Tensor | None, output_tensor: torch.Tensor):
    """The micro-batch's loss: the mean over the tokens the mask keeps, or (``loss_weight``, MP_SFT_LOSS=record) the
    weighted sum, each record's mean scaled to its share of the step (training/record_loss.py). Also returns
    (weighted sum, weight, trained tokens) for exact logging: the logged loss is the first over the second, summed
    over the step. ``output_tensor``: the logits [b, s, v/tp], or (``token_losses``: a model with MTP layers, which
    takes the labels) the losses [b, s]."""
    from megatron.core import parallel_state

    if token_losses:
        losses = output_tensor.reshape(-1)
    else:
        losses = _token_losses(vocab_size, labels, output_tensor.transpose(0, 1).contiguous()).reshape(-1)
    mask = loss_mask.reshape(-1).float()
    weight = mask if loss_weight is None else loss_weight.reshape(-1).float()
    total = torch.sum(losses * weight)
    # the report is a tensor of its own: megatron-core's schedule scales the loss it is given in place
    stats = torch.stack([total.detach(), weight.sum(), mask.sum()])
    if cp_size > 1:
        dist.all_reduce(stats, group=parallel_state.get_context_parallel_group())
    # (``loss_weight`` holds each token's whole share of the step.) This CP rank's share of the sequence's mean:
    # megatron-core's schedule multiplies a (loss, report) pair by the CP size and DDP averages the gradients over
    # DP x CP, so the shares' gradients add up to the mean's. (Megatron-LM's older loss functions multiplied by the
    # CP size themselves; here that doubled it.)
    loss = total if loss_weight is not None else total / stats[1].clamp(min=1)
    return loss, {"lm loss": stats}


def split_for_context_parallel(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """This context-parallel rank's part of each [b, s] tensor: chunks r and 2*CP-1-r of 2*CP.

    The layout megatron-core's CP attention and RoPE expect (Megatron-LM's get_batch_on_this_cp_rank):
    with causal masking a late chunk costs more than an early one, so each rank takes one of each.
    """
    if cp_size == 1:
        return batch
    out = {}
    for key, value in batch.items():
        chunks = value.chunk(2 * cp_size, dim=1)
        out[key] = torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=1)
    return out


@dataclass(frozen=True)
class StepContext:
    """What the forward step needs besides the batch (fixed for a run)."""
    vocab_size: int
    device: torch.device
    cp_size: int = 1
    cp_rank: int = 0
    # A model with multi-token-prediction layers: they compute their loss in the forward, from the labels.
    mtp: bool = False


def prepare_batch(batch: dict, ctx: StepContext) -> tuple[dict, object]:
    """A micro-batch as the model takes it: packed samples in THD form, on the device, this CP rank's part.

    Returns (batch, PackedSeqParams or None).
    """

    params = None
    if "doc_start" in batch:
        batch, thd = packing.thd_batch(batch)
        params = packing.packed_seq_params(thd["cu_seqlens"].to(ctx.device, non_blocking=True), thd["max_seqlen"])
    batch = {k: v.to(ctx.device, non_blocking=True) for k, v in batch.items()}
    if params is None:
        batch = split_for_context_parallel(batch, ctx.cp_size, ctx.cp_rank)
    return batch, params


def _forward_step(ctx: StepContext, data_iterator, model):
    batch, packed = prepare_batch(next(data_iterator), ctx)
    if ctx.mtp:
        # megatron-core computes the MTP layers' loss inside the forward, from the labels (and adds its gradient to
        # the backward), and returns the main head's per-token losses, each through ``_token_losses``.
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                       loss_mask=batch["loss_mask"], packed_seq_params=packed)
    else:
        # No labels: the model returns logits, and the loss (with the vocabulary padding masked) is ours.
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), packed_seq_params=packed)
    return output, partial(_loss_func, batch["loss_mask"], batch["labels"], ctx.vocab_size, ctx.cp_size, ctx.mtp,
                           batch.get(record_loss.LOSS_WEIGHT))


def ddp_buffer_layout(config, ddp_config, chunk, disable_bucketing: bool) -> dict:
    """``DistributedDataParallel``'s ``full_param_layout`` argument, where megatron-core has one (0.19).

    From 0.19 the distributed optimizer's DDP buffers are laid out by the caller, with the optimizer's own
    ``compute_full_param_layout``, as Megatron-LM does before it builds DDP; left to DDP it still works but
    warns. The arguments are the ones DDP would use: the same process groups (DDP's own set-up function),
    the bucket size it defaults to, and no bucketing on later pipeline stages, later model chunks, or
    without grad-reduce overlap."""

    from megatron.core.distributed import DistributedDataParallel

    if not ddp_config.use_distributed_optimizer or \
            "full_param_layout" not in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {}
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection.setup_process_groups_for_ddp(None, config, ddp_config)
    bucket = ddp_config.bucket_size
    if bucket is None:
        bucket = max(40_000_000, 1_000_000 * groups["dp_group"].size())
    pp_group = groups["pp_group"]
    pp_rank = (pp_group[0] if isinstance(pp_group, list) else pp_group).rank()
    if not ddp_config.overlap_grad_reduce or disable_bucketing or pp_rank > 0:
        bucket = None
    params = [p for p in chunk.parameters() if p.requires_grad]
    layout = DistributedOptimizer.compute_full_param_layout(
        params, bucket, groups["intra_dp_cp_group"].size(), ddp_config,
        expert_data_parallel_world_size=groups["intra_expt_dp_group"].size())
    return {"full_param_layout": layout}


def configure_overlap(config, models: list, ddp_settings: dict) -> None:
    """The schedule's hooks for overlapping DP communication with compute (Megatron-LM's train()).

    grad_sync_func: each pipeline stage starts its gradient reduction as soon as its last backward
    is done; param_sync_func: the interleaved schedule gathers the next chunk's parameters ahead.
    """
    one = len(models) == 1
    config.no_sync_func = models[0].no_sync if one else [m.no_sync for m in models]
    if ddp_settings["overlap_grad_reduce"]:
        config.grad_sync_func = models[0].start_grad_sync if one else [m.start_grad_sync for m in models]
    if ddp_settings["overlap_param_gather"] and not one:
        config.param_sync_func = [m.start_param_sync for m in models]


class Trainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.log_rank = 0
        self.writer = None
        self.metrics_file = None
        self.eval_file = None

    # --- set-up -----------------------------------------------------------------------------------

    def build(self) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


        cfg = self.cfg
        self.arch = cfg.arch
        self.settings = megatron_settings(cfg, fp8_run.implementation(cfg, Capabilities.detect()))
        device = self._device()
        # One GPTModel per virtual pipeline stage (one in all without MP_VP).
        chunks = build_model_chunks(self.arch, cfg.layout, cfg.precision.dtype, pp_first_stage_layers=cfg.pp0_layers,
                                    core_attention=core_attention(cfg, Capabilities.detect()),
                                    **as_megatron_takes_it(self.settings["transformer_config"]))
        if cfg.sft_packing:
            for c in chunks:
                use_packed_local_attention(c)
        if self.arch.mtp_layers:  # the heads' losses (the main one and each MTP layer's) mask the vocabulary padding
            for c in chunks:
                c.compute_language_model_loss = partial(_token_losses, self.arch.vocab_size)
        move_to_device(chunks, device)
        caps = Capabilities.detect()
        fp8 = fp8_run.implementation(cfg, caps) if cfg.precision.fp8 else None
        if fp8 == fp8_run.TORCHAO:  # the chosen GEMMs of megatron-core's own linears in float8 (docs/fp8.md)
            # torchao comes with float8: imported only when PR=fp8 runs on torchao
            from megatron_patch.models.blocks import float8

            recipe = fp8_run.recipe(cfg, fp8)
            gemms = float8.convert_chunks(chunks, recipe, cfg.fp8_filter, self.arch.linear_attention)
            self._log_of_stage(float8.describe_gemms(gemms, recipe))  # each stage its own layers (the fdoc audit)
        if cfg.compile_fusions:
            self._log(compiled_fusions.describe(compiled_fusions.compile_fusions(chunks)))
        if cfg.compile_layers:
            self._log_of_stage(compiled_layers.describe(compiled_layers.compile_layers(
                chunks, on_decided=self._log_compiled)))
        if device.type == "cuda" and core_attention(cfg, caps) == "sdpa":  # FA3/FA4 behind torch SDPA, where installed
            attention_kernels.activate(attention_kernels.flash_implementation(
                True, caps.compute_capability, caps.flash_attention_3, caps.flash_attention_4))
        self.resume_iteration = self._latest()
        self.last_checkpoint = self.resume_iteration  # where a rerun would go on from
        # Read by rank 0 alone, which writes them into each checkpoint.
        self.side_files = checkpointing.side_files_source(cfg, self.resume_iteration) if self.rank == 0 else None
        if self.side_files and self.resume_iteration is None:
            for line in checkpointing.carried_tokenizer_notes(self.side_files, cfg):
                self._log(line)
        if cfg.lora is not None:  # the base loaded and frozen, the adapters attached (training/lora_run.py)
            base = cfg_base(cfg)
            checkpointing.load_starting_weights(cfg, chunks, base)
            setup_lora(cfg, chunks, base, self.resume_iteration is not None, self._log)
            self._log(describe_trainable(chunks))
        elif self.resume_iteration is None and cfg.pretrain_checkpoint:
            self._load_pretrained(chunks)
        # MP_EVAL_TASKS evaluates these chunks as they train, with the tokenizer the run's checkpoints carry
        self.chunks = chunks
        self.eval_tokenizer = self.eval_generation_folder = None
        if cfg.eval_tasks:
            side_files = checkpointing.side_files_source(cfg, self.resume_iteration)
            self.eval_tokenizer = evaluation_run.load_tokenizer(
                checkpointing.side_files_folder(side_files, "tokenizer.json"), cfg)
            self.eval_generation_folder = checkpointing.side_files_folder(side_files, "generation_config.json")
        if cfg.dsa and cfg.dsa["indexer_only"]:  # before DDP: its buffers hold the trainable parameters only
            self._log(f"indexer-only (dense warm-up): {sparse_attention_run.setup_indexer_only(chunks):,} indexer "
                      "parameters train, the rest is frozen")
        config = chunks[0].config
        ddp_config = DistributedDataParallelConfig(**self.settings["ddp"])
        # As Megatron-LM does: only the first chunk's gradient buckets are bucketed for overlap.
        self.models = [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=i > 0,
                                               **ddp_buffer_layout(c.config, ddp_config, c, i > 0))
                       for i, c in enumerate(chunks)]
        self.config = config
        configure_overlap(config, self.models, self.settings["ddp"])
        config.finalize_model_grads_func = finalize_model_grads
        self.offload = None

        offload = settings_from_config(cfg)
        if offload.enabled:
            # auto starts from the share the memory plan states and checked against the device (the dry run's
            # "starts with N%": each rank had started from its stage's own, less where another rank needs more: the
            # dryrun audit), and without a GPU the plan's activations stand for the measured non-model data
            # (offload/probe.py)
            from megatron_patch.training.memory_plan import plan_memory

            plan = plan_memory(cfg)
            stage = plan.stage(parallel_state.get_pipeline_model_parallel_rank())
            offload = settings_from_config(cfg, initial_share=plan.offload_share,
                                           activation_bytes=stage.activations + stage.transient)
        if offload.enabled:
            # megatron's distributed optimizer with its state in chunks on two tiers (training/offload/)
            self.optimizer, self.offload = build_chunked_optimizer(
                OptimizerConfig(**self.settings["optimizer"]), self.models, offload)
            self._log(self.offload.describe())
        else:
            self.optimizer = get_megatron_optimizer(OptimizerConfig(**self.settings["optimizer"]), self.models)
        mend_optimizers(self.optimizer)  # so that what megatron-core trains it also saves and resumes
        config.grad_scale_func = self.optimizer.scale_loss
        self.scheduler = OptimizerParamScheduler(self.optimizer, **self.settings["scheduler"])
        self.iteration = 0
        if self.resume_iteration is not None:

            # The launch's schedule rules a resumed run (megatron_settings): the loaded param groups take the
            # launch's peak and floor (checkpointing.load), which megatron-core's scheduler reads before its own,
            # and the rate of the next step is the new schedule's, not the one the checkpoint's last step set.
            checkpointing.load(cfg, self.resume_iteration, self.models, self.optimizer, self.scheduler)
            self.scheduler.step(increment=0)
            self.iteration = self.resume_iteration
            self._log(f"resumed from {checkpointing.iteration_dir(cfg.checkpoint_dir, self.iteration)}")
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.step_context = StepContext(vocab_size=self.arch.vocab_size, device=device, cp_size=cfg.cp,
                                        cp_rank=parallel_state.get_context_parallel_rank(), mtp=self.arch.mtp_layers > 0)
        self._build_data()
        if device.type == "cuda":
            if config.bias_activation_fusion:
                warm_up_fused_kernels(cfg, self.arch, cfg.precision.dtype, device)

    def _load_pretrained(self, chunks: list) -> None:
        """A converted checkpoint into this rank's model chunk(s)."""
        cfg = self.cfg
        checkpointing.load_starting_weights(cfg, chunks, cfg.pretrain_checkpoint)
        self._log(f"loaded pretrained weights from {cfg.pretrain_checkpoint}")

    def _latest(self):
        return resume_iteration(self.cfg.checkpoint_dir, self._log, verify=run_state.resume_look(self.cfg.no_verify))

    def _build_data(self) -> None:
        cfg = self.cfg
        valid_samples = cfg.eval_iters * cfg.global_batch_size
        if cfg.sft:  # JSON records or Pai's SFT idxmap, whose every id was checked before any rank started
            self.train_data, self.valid_data, how = sft_data.build_sft_datasets(cfg, self.arch.vocab_size)
            self._log(f"SFT data: {how}")
            samples, trained = len(self.train_data), cfg.train_iters * cfg.global_batch_size
            self._log(f"SFT data: {samples} samples, {trained} trained in {cfg.train_iters} steps: "
                      f"{trained / samples:.2f} epochs; "
                      + ("the loss is the mean of each record's mean over its trained tokens (MP_SFT_LOSS=record, "
                         "Pai's)" if cfg.sft_loss == "record" else
                         "the loss is each micro-batch's mean over its trained tokens (MP_SFT_LOSS=token)"))
            if samples < cfg.global_batch_size:  # samples repeat, in order, within one optimizer step
                self._log(f"note: the {samples} SFT samples are fewer than one global batch ({cfg.global_batch_size}):"
                          " each step trains some of them more than once, and some more often than others")
        else:
            # Its files were checked before any rank started (every token id included: training.data_files).
            trained = cfg.train_iters * cfg.global_batch_size
            self.train_data, self.valid_data = data.build_pretraining_datasets(cfg, trained, valid_samples)
            inferred = data_files.inferred_weights(cfg, trained)
            if inferred:
                self._log(f"note: DATASET_PATH lists {len(inferred)} prefixes without weights, whose one epoch holds "
                          f"{sum(inferred)} samples, and the run trains {trained}: they are blended by the samples "
                          f"of that epoch ({' '.join(f'{w} {p}' for w, p in zip(inferred, cfg.dataset_path))}), each "
                          "repeated over epochs as one prefix alone is (megatron-core builds one epoch of a list "
                          "without weights)")
            if cfg.sft_packing:  # documents kept apart at the tokenizer's end-of-document id, as Pai's packing
                eod, name = data_files.end_of_document(cfg)
                self.train_data, self.valid_data = (packing.DocumentsApart(d, eod) if d is not None else None
                                                    for d in (self.train_data, self.valid_data))
                self._log(f"MP_SFT_PACKING=true: each sample's documents attend only within themselves, positions "
                          f"restarting after each end-of-document token (id {eod}, {name})")

    # --- logging --------------------------------------------------------------------------------------

    def _log(self, text: str) -> None:
        if self.rank == self.log_rank:
            print(text, flush=True)

    def _log_compiled(self, kind) -> None:
        """MP_COMPILE: what was compiled of a kind of layer, once its first layer has run (the first step)."""
        self._log_of_stage("\n".join(f"torch.compile: {line}" for line in kind.lines()))

    def _log_of_stage(self, text: str) -> None:
        """What a pipeline stage says of its own layers (MP_COMPILE's): said by the stage's first rank, each line
        naming the stage, where PP>1; rank 0 alone left the later stages' layers unsaid (the cmp audit)."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1:
            return self._log(text)
        if (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_context_parallel_rank()) == (0, 0, 0):
            stage = ps.get_pipeline_model_parallel_rank()
            print("\n".join(f"pipeline stage {stage}: {line}" for line in text.splitlines()), flush=True)

    def _open_logs(self) -> None:
        if self.rank != self.log_rank:
            return
        out = Path(self.cfg.output_basepath)
        self.metrics_file, note = run_folder.open_metrics(out, resumed=self.iteration)
        if note:
            self._log(f"note: {note}")
        if self.cfg.eval_tasks:
            self.eval_file, note = run_folder.open_metrics(out, run_folder.EVAL_RESULTS, resumed=self.iteration)
            if note:
                self._log(f"note: {note}")
        unnamed = run_folder.tensorboard_cannot_name(out / "tensorboard")
        if unnamed:
            print(f"note: {unnamed}; metrics go to the console and log/metrics.jsonl only", flush=True)
            return
        try:
            from torch.utils.tensorboard import SummaryWriter

            # its events past the checkpoint resumed from are dropped, as metrics.jsonl's records are
            self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=self.iteration + 1)
        except ImportError:
            print("note: tensorboard is not installed; metrics go to the console and log/metrics.jsonl only", flush=True)

    def _record(self, metrics: dict) -> None:
        if self.rank != self.log_rank:
            return
        self.metrics_file.write(json.dumps(metrics) + "\n")
        self.metrics_file.flush()
        if self.writer is not None:
            step = metrics["iteration"]
            for k, v in metrics.items():
                if k != "iteration" and isinstance(v, (int, float)) and v is not None:
                    self.writer.add_scalar(k.replace(" ", "_"), v, step)

    # --- steps ----------------------------------------------------------------------------------------

    def _run_schedule(self, batches: list[dict], forward_only: bool) -> torch.Tensor:
        """(the loss's weighted sum, its weight, the trained tokens) over this global batch, the same on every rank."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        cfg = self.cfg
        # The interleaved schedule takes one iterator per chunk; each chunk reads every micro-batch
        # in order (the first chunk its tokens, the last its labels and loss mask).
        if cfg.sft_loss == "record":  # Pai's per-record mean: each record's tokens weigh 1/its trained tokens
            batches = record_loss.weigh_records(
                batches, None if forward_only else parallel_state.get_data_parallel_group(), self._device())
        iterators = [iter(batches) for _ in self.models] if len(self.models) > 1 else iter(batches)
        # Packed micro-batches travel between stages as one THD row of all their tokens.
        seq, mbs = ((cfg.micro_batch_size * cfg.sample_length, 1) if cfg.sft_packing
                    else (cfg.sample_length, cfg.micro_batch_size))
        mbs *= pipeline_batch_factor(self.models[0])
        out = get_forward_backward_func()(
            forward_step_func=partial(_forward_step, self.step_context), data_iterator=iterators,
            model=self.models, num_microbatches=len(batches), seq_length=seq,
            micro_batch_size=mbs, forward_only=forward_only)
        stats = torch.zeros(3, dtype=torch.float64)  # the loss's weighted sum, its weight, the trained tokens
        if self.last_stage:
            for d in out:
                stats += d["lm loss"].double().cpu()
            dp_group = parallel_state.get_data_parallel_group()
            stats = stats.to(self._device())
            dist.all_reduce(stats, group=dp_group)
        stats = stats.to(self._device())
        # The last global rank sits on the last pipeline stage: everyone takes its numbers.
        dist.broadcast(stats, src=self.world - 1)
        return stats.cpu()

    @staticmethod
    def _device():
        return device()

    def train_step(self) -> dict:
        cfg = self.cfg
        batches = data.micro_batches(self.train_data, self.iteration, cfg, self.dp_rank, self.dp_size)
        for m in self.models:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.offload is not None:
            self.offload.begin_step(self.iteration + 1)
        result = self._step(batches)
        if self.offload is not None:
            result["offload"] = self.offload.after_update(self.iteration + 1)
        return result

    def _take_mtp_losses(self, num_microbatches: int) -> list[float]:
        """Each MTP layer's loss of this step (the mean over micro-batches and data-parallel ranks, as Megatron-LM
        logs it), then cleared; every rank gets the last stage's numbers (a collective)."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        tracker = MTPLossLoggingHelper.tracker
        # megatron-core 0.16 keeps the losses under "values"; 0.19 under "loss_values", beside accuracy counts,
        # with its reduce/clean helpers renamed to match
        key, reduce, clean = (("loss_values", "reduce_metrics_in_tracker", "clean_metrics_in_tracker")
                              if hasattr(MTPLossLoggingHelper, "reduce_metrics_in_tracker")
                              else ("values", "reduce_loss_in_tracker", "clean_loss_in_tracker"))
        values = torch.zeros(self.arch.mtp_layers, dtype=torch.float64, device=self._device())
        if self.last_stage and key in tracker:
            getattr(MTPLossLoggingHelper, reduce)()
            values = (tracker[key].double() / num_microbatches).to(values.device)
            getattr(MTPLossLoggingHelper, clean)()
        dist.broadcast(values, src=self.world - 1)
        return values.cpu().tolist()

    def _step(self, batches: list[dict]) -> dict:
        cfg = self.cfg
        stats = self._run_schedule(batches, forward_only=False)
        mtp_losses = self._take_mtp_losses(len(batches)) if self.arch.mtp_layers else []
        balancing = moe_losses.take_load_balancing_losses(self.models[0].config, len(batches), self.dp_size,
                                                          self._device())
        if self.offload is not None:
            self.offload.after_backward()
        if faults.due(cfg.faults, "overflow", self.iteration + 1):
            faults.fill_gradients_with_inf(self.models)
        loss = float(stats[0] / max(float(stats[1]), 1.0))
        # fp16's loss scaler finds inf/nan gradients itself (the optimizer skips the step and lowers the scale); in
        # bf16 and fp32 nothing does, and clipping an infinite norm multiplies by 0: every weight became NaN
        problem = (f"loss is {loss}" if not math.isfinite(loss) else
                   None if cfg.precision.fp16 or self._gradients_finite() else
                   f"the gradients hold inf/nan (loss {loss:.4f})")
        if problem is not None:
            if cfg.nan_policy == "stop":
                raise TrainingStopped(f"{problem} at iteration {self.iteration + 1}: training stopped before its "
                                      f"update ({self._resume_point()}); lower LR, check the data, or set "
                                      "MP_NAN_POLICY=skip")
            self._log(f"iteration {self.iteration + 1}: {problem}, step skipped (MP_NAN_POLICY=skip)")
            for m in self.models:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
            return {"loss": loss, "skipped": True, "lr": self.optimizer.param_groups[0]["lr"],
                    "tokens": float(stats[2]), "mtp_losses": mtp_losses,
                    "balancing_losses": balancing}
        indexer_loss = sparse_attention_run.take_indexer_loss(self._device()) if cfg.dsa and cfg.dsa["loss_scale"] \
            else None
        scale = self._loss_scale()
        # The rate this update applies: the scheduler moves after the step, so reading it afterwards (as
        # Megatron-LM's log does) would show the next iteration's.
        lr = self.optimizer.param_groups[0]["lr"]
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
        else:
            # megatron found inf/nan gradients (an fp16 overflow): no update, no scheduler step.
            after = self._loss_scale()
            self._log(f"iteration {self.iteration + 1}: inf/nan gradients, step skipped"
                      + (f" (loss scale {scale:g} -> {after:g})" if scale is not None else ""))
        return {"loss": loss, "skipped": not ok, "lr": lr, "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens": float(stats[2]), "loss_scale": scale, "indexer_loss": indexer_loss, "mtp_losses": mtp_losses,
                "balancing_losses": balancing}

    def _gradients_finite(self) -> bool:
        """Every gradient of every rank finite, as megatron-core's clipping will need its norm: each DDP buffer's
        norm (an overflow of the sum of squares counts too), one flag all-reduced."""
        bad = torch.zeros(1, device=self._device())
        for m in self.models:
            for buffer in [*m.buffers, *m.expert_parallel_buffers]:
                norm = torch.linalg.vector_norm(buffer.grad_data, dtype=torch.float32)
                bad += (~torch.isfinite(norm)).float()
        dist.all_reduce(bad)
        return not bool(bad.item())

    def _resume_point(self) -> str:
        """Where a rerun goes on from, for a message that stops the run."""
        if self.last_checkpoint is not None:
            folder = checkpointing.iteration_dir(self.cfg.checkpoint_dir, self.last_checkpoint)
            return f"the last checkpoint is {folder}"
        start = self.cfg.pretrain_checkpoint or "the random initialisation"
        return f"no checkpoint was saved yet: a rerun starts again from {start}"

    def _loss_scale(self) -> float | None:
        """fp16's dynamic loss scale (None without one: bf16 and fp32 train unscaled)."""
        if not self.cfg.precision.fp16:
            return None
        return float(self.optimizer.get_loss_scale())

    def evaluate(self) -> float:
        cfg = self.cfg
        for m in self.models:
            m.eval()
        total = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for i in range(cfg.eval_iters):
                batches = data.micro_batches(self.valid_data, i, cfg, self.dp_rank, self.dp_size)
                total += self._run_schedule(batches, forward_only=True)
        for m in self.models:
            m.train()
        return float(total[0] / max(float(total[1]), 1.0))

    def evaluate_tasks(self) -> None:
        """MP_EVAL_TASKS on the live model (every rank): one log line per task metric, TensorBoard's
        eval/TASK/METRIC, a line of eval/results.jsonl."""
        # lm-eval comes with evaluation.evaluate: imported only by a run with MP_EVAL_TASKS
        from megatron_patch.evaluation.evaluate import metric_values

        results = evaluation_run.evaluate(self.chunks, self.cfg, self.eval_tokenizer, self.eval_generation_folder)
        if self.rank != self.log_rank:
            return
        for name, value in metric_values(results).items():
            task, metric = name.split("/", 1)
            self._log(f"evaluation at iter {self.iteration}: {task} {metric} {value:.4f}")
            if self.writer is not None:
                self.writer.add_scalar(f"eval/{name}", value, self.iteration)
        if self.writer is not None:
            self.writer.flush()
        self.eval_file.write(evaluation_run.record_line(self.iteration, results))
        self.eval_file.flush()

    # --- the loop -------------------------------------------------------------------------------------

    def run(self) -> dict:
        cfg = self.cfg
        self._open_logs()
        flops = flops_per_iteration(self.arch, cfg)
        peak = self._peak_tflops() if flops is not None else None
        losses = {}
        if flops is None:
            self._log(f"TFLOP/s and MFU are not counted: {flops_uncounted(self.arch)}")

        stop_at = cfg.train_iters if cfg.exit_interval is None else min(cfg.train_iters, cfg.exit_interval)
        if self.iteration >= stop_at:  # a rerun after a failed export: it said "iterations 5..4" (the tdoc audit)
            where = ("is the run's last" + (", whose model is exported now" if cfg.save else "")
                     if stop_at == cfg.train_iters else f"is at or past MP_EXIT_INTERVAL={cfg.exit_interval}")
            self._log(f"nothing left to train: iteration {self.iteration} of {cfg.train_iters} {where}")
        else:
            self._log(f"training {cfg.family} {cfg.model_size} {cfg.layout} DP={self.dp_size} on {self.world} "
                      f"{'GPU' if torch.cuda.is_available() else 'CPU process'}(es): iterations {self.iteration + 1}.."
                      f"{cfg.train_iters}, {cfg.num_microbatches} micro-batches of {cfg.micro_batch_size} x "
                      f"{cfg.sample_length} tokens per DP rank; attention "
                      f"{attention_kernel(cfg, Capabilities.detect())}")
        first = self.iteration + 1
        records = []
        self._param_gather_before_first_step()
        while self.iteration < stop_at:
            watchdog.set_phase(f"iteration {self.iteration + 1}")
            if faults.due(cfg.faults, "kill", self.iteration + 1):
                faults.kill_this_process()
            if faults.due(cfg.faults, "error", self.iteration + 1):
                raise faults.InjectedError(f"MP_INJECT_FAULT=error@{self.iteration + 1}")
            start = time.time()
            result = self.train_step()
            self.iteration += 1
            elapsed = time.time() - start
            if self.iteration == first:
                self._param_gather_after_first_step()
            losses[self.iteration] = result["loss"]
            tokens = cfg.global_batch_size * cfg.sample_length
            tflops = flops / elapsed / self.world / 1e12 if flops is not None else None
            metrics = {"iteration": self.iteration, "loss": result["loss"],
                       "lr": result["lr"], "grad_norm": result.get("grad_norm"),
                       "tokens_per_s": tokens / elapsed, "tflops_per_gpu": tflops, "memory_gib": _memory_gib(),
                       "iteration_s": elapsed, "tokens": tokens, "loss_tokens": result["tokens"],
                       "skipped": result["skipped"], "warmup": self.iteration < first + WARMUP_ITERATIONS}
            if result.get("loss_scale") is not None:
                metrics["loss_scale"] = result["loss_scale"]
            if result.get("indexer_loss") is not None:
                metrics["indexer_loss"] = result["indexer_loss"]
            for k, value in enumerate(result.get("mtp_losses", [])):  # Megatron-LM's "mtp_1 loss", ...
                metrics[f"mtp_{k + 1}_loss"] = value
            metrics.update(result.get("balancing_losses", {}))  # Megatron-LM's names: "load_balancing_loss", ...
            metrics.update(result.get("offload", {}))
            records.append(metrics)
            if peak:
                metrics["mfu"] = tflops / peak
            self._record(metrics)
            if self.iteration % cfg.log_interval == 0 or self.iteration == stop_at:
                gn = metrics["grad_norm"]
                self._log(f"iter {self.iteration:6d}/{cfg.train_iters} | loss {result['loss']:.4f} | "
                          + (f"indexer loss {metrics['indexer_loss']:.4f} | " if "indexer_loss" in metrics else "")
                          + "".join(f"mtp_{k + 1} loss {v:.4f} | " for k, v in enumerate(result.get("mtp_losses", [])))
                          + "".join(f"{name.replace('_', ' ')} {v:.4f} | "
                                    for name, v in result.get("balancing_losses", {}).items())
                          + f"lr {metrics['lr']:.3e} | grad norm {gn if gn is None else f'{gn:.3f}'} | "
                          + (f"loss scale {metrics['loss_scale']:g} | " if "loss_scale" in metrics else "")
                          + f"tokens/s {metrics['tokens_per_s']:.0f}"
                          + (f" | TFLOP/s/{self._rank_unit(short=True)} {tflops_text(tflops)}" if tflops is not None
                             else "")
                          + (f" | MFU {metrics['mfu']:.1%}" if peak else "")
                          + f" | mem {metrics['memory_gib']:.2f} GiB | {elapsed * 1000:.0f} ms"
                          + (f" | offload {metrics['offload_share']:.0%}" if "offload_share" in metrics else ""))
            # every MP_EVAL_INTERVAL iterations, and after the last one (Megatron-LM's pretrain() validates at its end)
            if self.valid_data is not None and cfg.eval_interval and (
                    self.iteration % cfg.eval_interval == 0 or self.iteration == cfg.train_iters):
                watchdog.set_phase(f"validation after iteration {self.iteration}")
                vloss = self.evaluate()
                self._log(f"validation at iter {self.iteration}: loss {vloss:.4f} | ppl {math.exp(min(vloss, 50)):.2f}")
                self._record({"iteration": self.iteration, "valid_loss": vloss})
            if cfg.save and (self.iteration % cfg.save_interval == 0 or self.iteration == stop_at):
                checkpointing.save(cfg, self.iteration, self.models, self.optimizer, self.scheduler,
                                   side_files=self.side_files)
                self.last_checkpoint = self.iteration
            if evaluation_run.due(cfg, self.iteration):
                watchdog.set_phase(f"task evaluation after iteration {self.iteration}")
                self.evaluate_tasks()
        if self.iteration < first:  # resumed with nothing left to train: put back what the first step would have
            self._param_gather_after_first_step()
        self._report_throughput(records, peak)
        if cfg.save and self.iteration == cfg.train_iters:
            checkpointing.export_model(cfg, self.iteration, self.models, cfg.precision.dtype,
                                       side_files=self.side_files)
        if self.writer is not None:
            self.writer.close()
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.eval_file is not None:
            self.eval_file.close()
        return {"rank": self.rank, "iteration": self.iteration, "losses": losses}

    def _param_gather_before_first_step(self) -> None:
        """With overlapped parameter all-gathers, the first step runs without them (Megatron-LM's order).

        The weights are already complete on every rank (initialised or loaded); a gather before the
        first optimizer step would only spread a loading error to all ranks.
        """
        self._param_sync_func = self.config.param_sync_func
        if self.settings["ddp"]["overlap_param_gather"]:
            for m in self.models:
                m.disable_forward_pre_hook(param_sync=False)
            self.config.param_sync_func = None

    def _param_gather_after_first_step(self) -> None:
        if self.settings["ddp"]["overlap_param_gather"]:
            for m in self.models:
                m.enable_forward_pre_hook()
            self.config.param_sync_func = self._param_sync_func

    def _report_throughput(self, records: list[dict], peak: float | None) -> None:
        """The closing throughput line and ``log/throughput.json``, of this launch's iterations. A launch that
        trained none (a rerun that only exports) or warm-up ones alone keeps the file an earlier launch wrote (it was
        replaced by null; the tdoc audit)."""
        if not records:
            return
        summary = summarize(records, peak)
        if summary is not None:
            # Peak memory is per rank: report the largest.
            mem = torch.tensor([summary["peak_memory_gib"]], dtype=torch.float64, device=self._device())
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
            summary["peak_memory_gib"] = float(mem)
        if self.rank != self.log_rank:
            return
        self._log(describe(summary, per=self._rank_unit()))
        if summary is not None:
            write_file_replacing(Path(self.cfg.output_basepath) / run_folder.THROUGHPUT,
                                 json.dumps(summary, indent=2) + "\n")

    def _rank_unit(self, short: bool = False) -> str:
        """What one rank's TFLOP/s are per: a GPU, or on CPU a process."""
        return "GPU" if self._device().type == "cuda" else "proc" if short else "process"

    def _peak_tflops(self) -> float | None:
        if not torch.cuda.is_available():
            return None
        return peak_tflops(torch.cuda.get_device_name())


def train(cfg) -> dict:
    """Run on every rank (process group from RANK/WORLD_SIZE/MASTER_*)."""

    set_megatron_fusions(cfg.compile_fusions)  # megatron-core's jit-fused helpers: compiled or eager, as the run says
    watchdog.set_phase("joining the job")
    init_process_group(cfg.dist_timeout_min)
    cfg = agree_on_launch(cfg)  # before any group a node's other TP would split
    init_model_parallel(cfg.layout, seed=cfg.seed, timeout_minutes=cfg.dist_timeout_min)
    # the phase the first beat sends: the job has formed once the heartbeat starts
    watchdog.set_phase("building the model, optimizer and data")
    watchdog.start(dist.get_rank(), dist.get_world_size(), cfg.dist_timeout_min)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and dist.get_rank() == 0:
        print(f"restart {restart} of {os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')} (MP_MAX_RESTARTS): "
              "resuming from the latest complete checkpoint", flush=True)
    cfg = replace(cfg, faults=faults.of_attempt(cfg.faults, restart))
    if cfg.tp_comm_overlap:

        initialize_tp_communicators(cfg, cfg.arch.hidden_size)
    trainer = Trainer(cfg)
    trainer.build()
    result = trainer.run()
    # Leave the job together and in order, heartbeat first: with the process group or a heartbeat still open
    # when the interpreter exits, a rank of a two-node gloo job was once aborted after its last iteration.
    watchdog.stop()
    watchdog.set_phase("leaving the job")
    dist.barrier()
    destroy()
    return result

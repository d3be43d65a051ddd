"""megatron-core's distributed optimizer with its state in chunks that move between device and host.

megatron-core 0.16.1's own offload (``HybridDeviceOptimizer``) splits whole parameters once, at
construction, by element count, and can move nothing afterwards; without CUDA it offloads nothing
and its step fails (docs/optimizer-offload.md). This keeps everything of megatron's distributed
optimizer (bucket sharding, reduce-scatter, parameter all-gather, grad scaler, gradient clipping,
the ``fully_reshardable`` checkpoint format) and changes only where the fp32 state lives:

- ``ChunkedDistributedOptimizer`` builds the main parameters as views into chunks
  (``chunks.ChunkStore``) instead of one tensor each, reads gradients straight from the DDP gradient
  buffer (one contiguous range per chunk) and lets ``ChunkedAdam`` write the updated parameters into
  the DDP parameter buffer;
- ``OffloadChainedOptimizer`` computes the grad norm and clips on those device gradients (megatron's
  own kernels, in the same order), since a host chunk's main parameters cannot carry device ``.grad``;
- ``OffloadController`` owns the layout: the initial placement, the probe, the policy, the moves
  between steps, and the per-step metrics.

Checkpoints have megatron's format exactly (param, exp_avg, exp_avg_sq per parameter; the step in
the param groups), so they load with or without offload, under any layout.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import psutil
import torch

from megatron_patch.errors import UserError
from megatron_patch.training.offload.adam import ChunkedAdam
from megatron_patch.training.offload.chunks import DEVICE, FIELDS, HOST, ChunkStore, Span, host_chunk_count, plan_chunks
from megatron_patch.training.offload.policy import AutoPolicy, StaticPolicy
from megatron_patch.training.offload.probe import Accounting, AccountingProbe, CudaProbe, MemoryReading, ScriptedProbe

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# processes that import this module without building a megatron-core model (align's main process, the
# launcher's dry run and resume checks) do not pay for it.

GiB = 2**30


@dataclass(frozen=True)
class OffloadSettings:
    policy: str = "off"  # off | static | auto
    ratio: float = 0.0  # static: share of the optimizer state on the host
    initial_share: float = 0.0  # auto: the share it starts from (the memory plan's)
    numerics: str = "fast"  # fast | exact
    margin_bytes: int = 2 * GiB
    patience: int = 3
    cooldown: int = 5
    chunk_elements: int | None = None
    probe_script: str | None = None
    capacity_bytes: int | None = None  # MP_GPU_MEMORY_GB
    activation_bytes: int = 0  # the memory plan's estimate (the accounting probe's non-model data)
    timing: bool = False

    @property
    def enabled(self) -> bool:
        """The chunked optimizer runs: with offload, or for exact numerics without it."""
        return self.policy != "off" or self.numerics == "exact"


class ChunkedDistributedOptimizer:
    """Mixin-built subclass of megatron's DistributedOptimizer (see ``_chunked_class``)."""


def _chunked_class():
    from megatron.core import tensor_parallel
    from megatron.core.fp8_utils import is_float8tensor
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    class _Chunked(DistributedOptimizer, ChunkedDistributedOptimizer):
        def __init__(self, *args, offload: OffloadSettings, **kwargs):
            self.offload = offload
            self.plan = None
            super().__init__(*args, **kwargs)
            if self.is_stub_optimizer:
                return
            for buffer in self.buffers:
                if buffer.grad_dtype != torch.float32 or buffer.param_data is None:
                    raise UserError("the chunked optimizer needs the distributed optimizer with fp32 gradient "
                                    "buffers (DO=true; grad_reduce_in_fp32)")
            self.optimizer = ChunkedAdam(self.optimizer.param_groups, self.store, self._chunk_layout,
                                         self._grad_views, self._param_views, offload.numerics)

        # --- construction: main parameters as views into chunks ----------------------------------------

        def _build_model_and_main_param_groups(self, gbuf_ranges, param_gbuf_map, opt_group_ranges, config):
            """megatron's grouping (model/shard, fp16/fp32), with placeholders for the main parameters
            that ``materialize`` binds to chunk views; the order of the optimizer's params is megatron's."""
            m16_groups, m32_groups, s16_groups, s32_groups, s32from16_groups = [], [], [], [], []
            where = {}  # id(main) -> (gbuf index, Range in the buffer, group index)
            for group_index, group_range in enumerate(opt_group_ranges):
                m16, m32, s16, s32, s32from16 = [], [], [], [], []
                for model_param in group_range["params"]:
                    gbuf_index, dtype, bucket_index = param_gbuf_map[model_param]
                    ranges = gbuf_ranges[gbuf_index][dtype][bucket_index]["param_map"][model_param]
                    if is_float8tensor(model_param):
                        raise UserError("optimizer offload does not support FP8 parameters (fp8 weights in the "
                                        "DDP buffer): train with PR=bf16, or without OPTIMIZER_OFFLOAD")
                    main = torch.empty(0, dtype=torch.float32)
                    tensor_parallel.copy_tensor_model_parallel_attributes(main, model_param)
                    if hasattr(model_param, "shared"):
                        main.shared = model_param.shared
                    where[id(main)] = (gbuf_index, ranges["gbuf_world"], group_index)
                    if model_param.type() in ("torch.cuda.HalfTensor", "torch.cuda.BFloat16Tensor"):
                        pr = ranges["param"]
                        shard = model_param.detach().view(-1)[pr.start: pr.end]
                        tensor_parallel.copy_tensor_model_parallel_attributes(shard, model_param)
                        if hasattr(model_param, "shared"):
                            shard.shared = model_param.shared
                        model_param.main_param = main
                        model_param.main_param_sharded = True
                        m16.append(model_param)
                        s16.append(shard)
                        s32from16.append(main)
                    elif model_param.type() == "torch.cuda.FloatTensor":
                        m32.append(model_param)
                        s32.append(main)
                    else:
                        raise TypeError(f"parameters must be fp32, fp16 or bf16, got {model_param.type()}")
                group_range["orig_group"]["params"] = [*s32, *s32from16]
                for outer, inner in ((m16_groups, m16), (m32_groups, m32), (s16_groups, s16), (s32_groups, s32),
                                     (s32from16_groups, s32from16)):
                    outer.append(inner)
            self._plan_chunks(opt_group_ranges, where)
            return m16_groups, m32_groups, s16_groups, s32_groups, s32from16_groups

        def _plan_chunks(self, opt_group_ranges, where) -> None:
            mains = [p for g in opt_group_ranges for p in g["orig_group"]["params"]]
            self._mains = mains
            shards: dict[tuple[int, int], list[Span]] = {}
            self._span_of: dict[int, tuple[int, Span]] = {}
            for key, main in enumerate(mains):
                gbuf_index, world, group_index = where[id(main)]
                bucket = self._bucket_of(gbuf_index, world.start)
                span = Span(key, world.start, world.end)
                shards.setdefault((gbuf_index, bucket), []).append(span)
                self._span_of[key] = (group_index, span)
            segments = [(gbuf, spans) for (gbuf, _), spans in sorted(shards.items())]
            self.plan = plan_chunks(segments, self.offload.chunk_elements)
            # no buffer: an MoE model's experts' optimizer on a pipeline stage without experts (its groups empty)
            device = self.buffers[0].grad_data.device if self.buffers else torch.device(
                "cuda" if torch.cuda.is_available() else "cpu")
            self.store = ChunkStore(self.plan, device, pin_host=device.type == "cuda")
            self._chunk_layout = []
            self._chunk_of_key = {}
            for chunk in self.plan.chunks:
                by_group: dict[int, list] = {}
                for span in chunk.spans:
                    group_index, _ = self._span_of[span.key]
                    by_group.setdefault(group_index, []).append((span, mains[span.key]))
                    self._chunk_of_key[span.key] = chunk.index
                self._chunk_layout.append(by_group)
            self._grad_views = [self.buffers[c.buffer].grad_data[c.start: c.end] for c in self.plan.chunks]
            self._param_views = [self.buffers[c.buffer].param_data[c.start: c.end] for c in self.plan.chunks]
            self._main_grads = [self.buffers[self.plan.chunks[self._chunk_of_key[k]].buffer].grad_data[
                                    self._span_of[k][1].start: self._span_of[k][1].end] for k in range(len(mains))]

        def _bucket_of(self, gbuf_index: int, start: int) -> int:
            for b, bucket in enumerate(self.buffers[gbuf_index].buckets):
                if bucket.offset <= start < bucket.offset + bucket.grad_data.numel():
                    return b
            raise AssertionError(f"element {start} is in no bucket of buffer {gbuf_index}")

        def materialize(self, tiers: list[str]) -> None:
            """Allocate the chunks on their tiers, fill the masters from the parameters, bind the views."""
            store = self.store
            store.allocate(tiers)
            for chunk in self.plan.chunks:
                store.row(chunk.index, "param").copy_(self._param_views[chunk.index])
                for span in chunk.spans:
                    main = self._mains[span.key]
                    store.bind_main_param(chunk.index, span, main)
                    store.bind_state(chunk.index, span, self.optimizer.state[main])

        # --- gradients: read from the DDP buffer, never copied into .grad -------------------------------

        def _copy_model_grads_to_main_grads(self):
            pass  # the main gradients are views of the reduced DDP gradient buffer (self._main_grads)

        def _collect_main_grad_data_for_unscaling(self):
            return list(self._main_grads)

        def get_main_grads_for_grad_norm(self):
            tp_group = getattr(self, "tp_group", None)
            return [g for main, g in zip(self._mains, self._main_grads)
                    if param_is_not_shared(main) and param_is_not_tensor_parallel_duplicate(main, tp_group)]

        def get_grads_for_grad_norm(self, grad_norm_group=None):
            """megatron-core 0.19's name for the same question (0.16 asks ``get_main_grads_for_grad_norm``);
            left to megatron's default it reads the main parameters' ``.grad``, which the chunks never set,
            and the norm came out 0. No parameter here belongs to a separate grad-norm group."""
            return [] if grad_norm_group is not None else self.get_main_grads_for_grad_norm()

        def main_grads_for_clipping(self):
            return list(self._main_grads)

        # --- parameters: ChunkedAdam.step wrote them into the DDP buffer ----------------------------------

        def _copy_main_params_to_model_params(self):
            pass

        def _copy_model_params_to_main_params(self, state_dict=None):
            if state_dict is not None:
                return super()._copy_model_params_to_main_params(state_dict)
            for chunk in self.plan.chunks:
                self.store.row(chunk.index, "param").copy_(self._param_views[chunk.index])

        # --- checkpoints: megatron's format, with the step count this optimizer owns ---------------------

        def state_dict(self):
            inner = self.optimizer.state_dict()
            groups = []
            for group in inner["param_groups"]:
                group = dict(group)
                del group["params"]
                group["step"] = self.optimizer.step_count
                groups.append(group)
            out = {"optimizer": {"param_groups": groups}}
            if self.grad_scaler:
                out["grad_scaler"] = self.grad_scaler.state_dict()
            return out

        def _get_main_param_and_optimizer_states(self, model_param):
            group_index, group_order = self.model_param_group_index_map[model_param]
            main = self.optimizer.param_groups[group_index]["params"][group_order]
            state = self.optimizer.state[main]
            return {"param": main, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}

        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            current = self._get_main_param_and_optimizer_states(model_param)
            for key, dst in current.items():
                dst.copy_(tensors[key])

    return _Chunked


@functools.lru_cache(maxsize=1)
def chunked_optimizer_class():
    return _chunked_class()


def _chained_class():
    from megatron.core.optimizer.clip_grads import multi_tensor_applier, multi_tensor_scale_impl
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    class OffloadChainedOptimizer(ChainedOptimizer):
        """megatron's ChainedOptimizer.step with gradient clipping on the chunked optimizers' device
        gradients (megatron clips ``param.grad`` of the main parameters, which host chunks lack)."""

        @torch.no_grad()
        def step(self):
            if self.config.log_num_zeros_in_grad:
                raise UserError("counting zero gradients is not supported with the chunked optimizer")
            if self.prepare_grads():
                return False, None, None
            grad_norm = self.get_grad_norm()
            for optimizer in self.chained_optimizers:
                if getattr(optimizer, "is_stub_optimizer", False) or optimizer.config.clip_grad <= 0.0:
                    continue
                grads = optimizer.main_grads_for_clipping()
                # megatron's clip_grad_by_total_norm_fp32, on the same gradients in the same order
                clip_coeff = optimizer.config.clip_grad / (grad_norm + 1.0e-6)
                if grads and clip_coeff < 1.0:
                    overflow = torch.zeros(1, dtype=torch.int, device=grads[0].device)
                    multi_tensor_applier(multi_tensor_scale_impl, overflow, [grads, grads], clip_coeff)
            return self.step_with_ready_grads(), grad_norm, None

    return OffloadChainedOptimizer


@functools.lru_cache(maxsize=1)
def offload_chained_class():
    return _chained_class()


def build_chunked_optimizer(config, models: list, settings: OffloadSettings):
    """``get_megatron_optimizer(config, models)`` with the chunked distributed optimizer in place of
    megatron's: its factory names ``DistributedOptimizer`` in its own module, which is replaced for the
    duration of the call (the constructor signature is the same)."""
    import megatron.core.optimizer as mcore_optimizer

    if not config.use_distributed_optimizer:
        raise UserError("optimizer offload needs the distributed optimizer (DO=true)")
    if config.use_precision_aware_optimizer or config.optimizer_cpu_offload:
        raise UserError("the chunked optimizer replaces megatron-core's precision-aware optimizer and its CPU "
                        "offload; do not set both")
    original = mcore_optimizer.DistributedOptimizer
    mcore_optimizer.DistributedOptimizer = functools.partial(chunked_optimizer_class(), offload=settings)
    try:
        chained = mcore_optimizer.get_megatron_optimizer(config, models)
    finally:
        mcore_optimizer.DistributedOptimizer = original
    optimizer = offload_chained_class()(chained.chained_optimizers)
    controller = OffloadController(optimizer, models, settings)
    return optimizer, controller


class OffloadController:
    """Placement, measurement and moves for the chunked optimizers of one rank."""

    def __init__(self, optimizer, models: list, settings: OffloadSettings):
        self.settings = settings
        self.subs = [o for o in optimizer.chained_optimizers if not getattr(o, "is_stub_optimizer", False)]
        self.chunks = [(sub, c) for sub in self.subs for c in sub.plan.chunks]
        self.chunk_bytes = [c.nbytes for _, c in self.chunks]
        self.state_numel = sum(c.state_numel for _, c in self.chunks)
        device = self.subs[0].store.device if self.subs else torch.device("cpu")
        self.static_model_bytes = sum(
            b.grad_data.numel() * b.grad_data.element_size()
            + (b.param_data.numel() * b.param_data.element_size() if b.param_data is not None else 0)
            for m in models for b in [*m.buffers, *m.expert_parallel_buffers])
        margin = settings.margin_bytes
        host = 0
        if settings.policy == "static":
            host = host_chunk_count([c for _, c in self.chunks], settings.ratio)
        elif settings.policy == "auto":
            host = host_chunk_count([c for _, c in self.chunks], settings.initial_share)
        self.device_chunks = len(self.chunks) - host
        if settings.policy == "auto":
            self.policy = AutoPolicy(margin, settings.patience, settings.cooldown)
            if settings.probe_script:
                self.probe = ScriptedProbe.from_file(settings.probe_script, margin)
            elif device.type == "cuda":
                self.probe = CudaProbe(settings.capacity_bytes)
            else:
                self.probe = AccountingProbe(settings.capacity_bytes or psutil.virtual_memory().total,
                                             settings.activation_bytes)
        else:
            self.policy, self.probe = StaticPolicy(self.device_chunks), None
        tiers = [DEVICE if i < self.device_chunks else HOST for i in range(len(self.chunks))]
        start = 0
        for sub in self.subs:
            n = len(sub.plan.chunks)
            sub.materialize(tiers[start: start + n])
            start += n
            if settings.timing:
                sub.optimizer.timing = {}
        self.moved_bytes = 0
        self._t0 = self._fwd_bwd_s = 0.0

    # --- what the trainer calls ----------------------------------------------------------------------

    def begin_step(self, iteration: int) -> None:
        if self.probe is not None:
            self.probe.begin_step(iteration)
        self._t0 = self._clock()

    def after_backward(self) -> None:
        if self.probe is not None:
            self.probe.end_phase("fwd_bwd")
        self._fwd_bwd_s = self._clock() - self._t0

    def _clock(self) -> float:
        """Seconds, after the device has finished its queued work when MP_OFFLOAD_TIMING asks for it."""

        if self.settings.timing and torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def after_update(self, iteration: int) -> dict:
        """Read memory, decide, move (between steps, bit for bit); the step's offload metrics."""
        reading: MemoryReading | None = None
        if self.probe is not None:
            self.probe.end_phase("update")
            reading = self.probe.reading(iteration, self.accounting())
        decision = self.policy.decide(iteration, reading, self.chunk_bytes, self.device_chunks)
        moved = self.apply(decision.device_chunks)
        metrics = {"offload_share": self.host_share(), "offload_device_chunks": self.device_chunks,
                   "offload_moved_bytes": moved, "offload_action": decision.action,
                   "offload_staged_bytes": sum(s.optimizer.staged_bytes for s in self.subs)}
        if decision.headroom is not None:
            metrics["offload_budget_bytes"] = decision.headroom
        if reading is not None:
            metrics["offload_peak_non_model_bytes"] = reading.peak_non_model
            metrics["offload_peak_fwd_bwd_bytes"] = reading.peak_fwd_bwd
            metrics["offload_peak_update_bytes"] = reading.peak_update
        if self.settings.timing:
            metrics["offload_fwd_bwd_s"] = self._fwd_bwd_s
            for sub in self.subs:
                for name, seconds in (sub.optimizer.timing or {}).items():
                    metrics[f"offload_{name}"] = metrics.get(f"offload_{name}", 0.0) + seconds
        return metrics

    def apply(self, device_chunks: int) -> int:
        """Make chunks [0, device_chunks) device-resident and the rest host-resident; bytes copied."""
        moved = 0
        for i, (sub, chunk) in enumerate(self.chunks):
            moved += sub.store.move(chunk.index, DEVICE if i < device_chunks else HOST)
        self.device_chunks = device_chunks
        self.moved_bytes += moved
        return moved

    # --- accounting ----------------------------------------------------------------------------------

    def accounting(self) -> Accounting:
        return Accounting(device_chunk_bytes=sum(self.chunk_bytes[: self.device_chunks]),
                          total_chunk_bytes=sum(self.chunk_bytes), static_model_bytes=self.static_model_bytes)

    def host_share(self) -> float:
        if not self.state_numel:
            return 0.0
        host = sum(c.state_numel for i, (_, c) in enumerate(self.chunks) if i >= self.device_chunks)
        return host / self.state_numel

    def describe(self) -> str:
        plans = [s.plan for s in self.subs]
        cap = max((p.capacity for p in plans), default=0)
        frag = (1.0 - sum(p.state_numel for p in plans) / max(1, sum(sum(c.capacity for c in p.chunks) for p in plans)))
        s = self.settings
        what = {"off": "off (exact numerics only)", "static": f"static {s.ratio:g}",
                "auto": f"auto (margin {s.margin_bytes / GiB:g} GiB, patience {s.patience}, cooldown {s.cooldown})"}
        return (f"optimizer offload {what[s.policy]}: {len(self.chunks)} chunks of {cap} elements "
                f"({math.fsum(self.chunk_bytes) / 2**20:.1f} MiB of fp32 {'/'.join(FIELDS)}, fragmentation "
                f"{frag:.1%}), {len(self.chunks) - self.device_chunks} on the host ({self.host_share():.1%} "
                f"of the state), numerics {s.numerics}")

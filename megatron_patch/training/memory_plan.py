"""Per-rank memory of a training run, worked out before launch (``MP_DRY_RUN=1``) and checked against it.

Model state is counted exactly as megatron-core lays it out: each pipeline stage's parameters in
module order (from the shapes megatron-core builds: ``models/shape/model_shape.py``), into DDP buffers (with the distributed optimizer: every parameter starting at a multiple
of 64 elements, buckets of ``max(4e7, 1e6*DP)`` elements on the first stage only, each padded to a
multiple of lcm(DP, 128), tied embeddings in a bucket of their own), fp32 gradient buffers for mixed
precision, and the optimizer state of this rank's shard of every bucket: fp32 master weights for
16-bit parameters, Adam's two moments, torch's per-parameter step where torch's Adam runs; with
OPTIMIZER_OFFLOAD the chunks of the chunked optimizer (``training/offload``) on their tiers.

Activations are what autograd saves for backward (``tests/saved_tensors.py``), per micro-batch and
layer, for the layer implementation that runs: megatron-core's local spec (torch RMSNorm; its unfused
attention with an fp32 softmax and GQA keys/values expanded per head, or the SDPA core attention: no s^2
term; what runs on CPU, where the tests check the model against the measurement) or transformer-engine's
(fused norm+linear and fused attention: no s^2 term; from TE's saved tensors, not measured here). Then per recompute mode (sel:
core attention recomputed; full: block inputs plus one recomputed block), sequence parallelism (norm
and linear inputs split over TP), context parallelism (the sequence split over CP) and the micro-
batches a pipeline stage keeps in flight (1F1B: PP - stage; interleaved: megatron's warm-up count).

The transient peak (logits in fp32 and their gradient, or one layer's activations) and the offload
share ``auto`` would start from complete the plan. A configuration whose device memory exceeds
``MP_GPU_MEMORY_GB`` (default: the visible GPU's memory) is refused before launch.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib.util
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

from megatron_patch.models.blocks.core_attention import SDPA, UNFUSED
from megatron_patch.models.shape.model_shape import RankParam as Param
from megatron_patch.models.shape.model_shape import chunk_layers, model_shape
from megatron_patch.runtime.machine import Capabilities, experts_grouped_whenever_etp_differs
from megatron_patch.training import fp8_run
from megatron_patch.training.lora_run import layer_adapters
from megatron_patch.training.machine_checks import local_core_attention
from megatron_patch.units import GiB, human_bytes

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.
# So is offload.chunks, which imports torch at its top.

PARAM_ALIGN = 64  # megatron pads each parameter's start with the distributed optimizer


# --- parameters per rank, in module order: from the model's shape (models/shape/model_shape.py) ---------------------------

def stage_layers(arch, cfg, pp_rank: int) -> list[int]:
    """Layers of each model chunk of pipeline rank ``pp_rank`` (one entry per virtual stage)."""
    pp, vp, layers = cfg.pp, cfg.virtual_pipeline or 1, arch.num_layers
    if cfg.pp0_layers is not None and pp > 1:
        return [cfg.pp0_layers if pp_rank == 0 else (layers - cfg.pp0_layers) // (pp - 1)]
    return [layers // (pp * vp)] * vp


def chunk_params(arch, cfg, pp_rank: int, vp_stage: int, spec: str = "local") -> list[Param]:
    """The parameters of one model chunk, in the order ``named_parameters()`` gives them."""
    return model_shape(arch).rank_params(cfg.layout, pp_rank, vp_stage, pp_first_stage_layers=cfg.pp0_layers,
                                         spec=spec)


# --- DDP buffers and the distributed optimizer's shards ------------------------------------------------------

@dataclass
class Buffer:
    """One DDP buffer: where each parameter sits (element ranges) and the buckets."""

    params: list[tuple[Param, int, int]]  # (param, start, end)
    buckets: list[tuple[int, int]]
    dp: int  # data-parallel size its shards are split over (distributed optimizer)

    @property
    def numel(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0


def buffer_layout(params: list[Param], dp: int, bucket_size: int | None, distributed_optimizer: bool) -> Buffer:
    """megatron-core's _ParamAndGradBuffer index computation (param_and_grad_buffer.py, 0.16)."""
    def pad(n, d):
        return -(-n // d) * d

    divisor = math.lcm(dp, 128)
    placed, buckets = [], []
    start = bucket_start = 0
    in_bucket = 0
    end = 0
    for p in reversed(params):
        if distributed_optimizer:
            start = pad(start, PARAM_ALIGN)
        if p.shared_embedding and distributed_optimizer and in_bucket:
            bucket_end = pad(start, divisor)
            buckets.append((bucket_start, bucket_end))
            bucket_start = start = bucket_end
            in_bucket = 0
        end = start + p.numel
        placed.append((p, start, end))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or (p.shared_embedding and distributed_optimizer):
            bucket_end = pad(end, divisor) if distributed_optimizer else end
            buckets.append((bucket_start, bucket_end))
            bucket_start = start = bucket_end
            in_bucket = 0
        else:
            start = end
    if in_bucket:
        buckets.append((bucket_start, pad(end, divisor) if distributed_optimizer else end))
    return Buffer(placed, buckets, dp)


def shard_spans(buffer: Buffer, dp_rank: int):
    """This DP rank's part of every bucket: (bucket index, [(param, start, end) clipped to the shard])."""
    # Parameters lie in the buffer one after another, so those a shard meets are found by bisection (a
    # scan of every parameter per bucket took minutes for a 671B model's 47k expert weights).
    starts = [a for _, a, _ in buffer.params]
    ends = [e for _, _, e in buffer.params]
    out = []
    for b, (lo, hi) in enumerate(buffer.buckets):
        size = (hi - lo) // buffer.dp
        s0, s1 = lo + dp_rank * size, lo + (dp_rank + 1) * size
        near = buffer.params[bisect.bisect_right(ends, s0):bisect.bisect_left(starts, s1)]
        out.append((b, [(p, max(a, s0), min(e, s1)) for p, a, e in near if min(e, s1) > max(a, s0)]))
    return out


# --- activations per micro-batch -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    s: int  # sequence length on this CP rank
    b: int
    h: int
    a: int  # attention width (heads * head_dim)
    kvw: int  # key/value width
    hn: int
    heads: int
    f: int  # MLP width per layer (dense: ffn; MoE: per-token routed expert width + shared)
    vocab: int  # padded vocabulary
    tp: int
    sp: bool
    d: int  # activation bytes (2 for bf16/fp16, 4 for fp32)
    qk_norm: bool = False  # per-head norms of queries and keys (Qwen3)
    # LoRA (None: full fine-tuning): a layer's adapted linears as (target, mode, input width on this rank,
    # the adapters' total rank, output rows on this rank, adapters, tokens per sequence position it sees)
    lora: tuple | None = None
    # DeepSeek sparse attention's indexer (None: none): (heads, head dim, top-k, whether it trains: its loss is on)
    indexer: tuple | None = None
    # hyper-connections (None: one residual stream): (streams, Sinkhorn-Knopp iterations of the stream mix)
    streams: tuple | None = None

    @property
    def s_sp(self) -> int:
        return self.s // self.tp if self.sp else self.s


def layer_activations(sh: Shape, ac: str, spec: str, attention: str = UNFUSED) -> int:
    """Bytes one transformer layer saves for backward for one micro-batch (no full recompute); ``attention``:
    the local spec's core attention."""
    s, b, h, a, kvw, hn, tp, d = sh.s, sh.b, sh.h, sh.a, sh.kvw, sh.hn, sh.tp, sh.d
    np_, ssp, f = sh.heads // tp, sh.s_sp, sh.f
    if spec == "local":
        # torch RMSNorm (fp32 internally): its fp32 input, the normalised fp32 values and 1/rms, twice
        norms = 2 * (2 * ssp * b * h * 4 + ssp * b * 4)
        linear_inputs = 2 * ssp * b * h * d + s * b * a // tp * d + s * b * f // tp * d  # qkv, fc1; proj; fc2
        rope = 4 * s * hn * d
        if ac == "sel":
            # recomputed core attention keeps q, k (after RoPE) and the qkv output (v is a view of it)
            attention = s * b * (a + kvw) // tp * d + s * b * (a + 2 * kvw) // tp * d + 4
        elif attention == SDPA:
            # SDPA keeps its inputs (q, k after RoPE; v a view of the qkv output) and the fp32 log-sum-exp of
            # each query and head; keys and values stay grouped (enable_gqa). Its output is laid out so that the
            # projection's input is a view of it, counted with the linear inputs.
            attention = s * b * (a + kvw) // tp * d + s * b * (a + 2 * kvw) // tp * d + b * np_ * s * 4
        else:
            # q, k, v expanded to every head, the causal mask, the fp32 softmax and (below fp32) its cast
            # for the AV matmul
            attention = 3 * s * b * a // tp * d + s * s + b * np_ * s * s * (4 + (d if d != 4 else 0))
        swiglu = 4 * s * b * f // tp * d  # fc1 output (both halves), silu output, the gated half
        # q/k norms as the input norms above: fp32 input, normalised values and 1/rms per head
        qk_norms = (2 * s * b * (a + kvw) // tp * 4 + s * b * (a + kvw) // hn // tp * 4) if sh.qk_norm else 0
        if sh.lora is not None:
            # a frozen base: norms keep no normalised values for their weight's gradient, linear layers no
            # input (megatron-core's frozen-weight path); the adapters keep theirs (lora_activations)
            norms = 2 * (ssp * b * h * 4 + ssp * b * 4)
            qk_norms -= s * b * (a + kvw) // tp * 4 if sh.qk_norm else 0
            linear_inputs = lora_activations(sh)
        return (norms + linear_inputs + rope + attention + swiglu + qk_norms + indexer_activations(sh)
                + 2 * hyper_connection_activations(sh))
    # transformer-engine: norm fused into the next linear (its input, the normalised output, 1/rms),
    # fused attention keeps q, k, v, the output and fp32 softmax statistics, fused SwiGLU keeps its input
    norm_linear = 2 * (2 * ssp * b * h * d + ssp * b * 4)
    attention = s * b * (a + 2 * kvw) // tp * d + s * b * a // tp * d + b * np_ * s * 4
    mlp = 2 * s * b * f // tp * d + s * b * f // tp * d
    qk_norms = (s * b * (a + kvw) // tp * d + s * b * (a + kvw) // hn // tp * 4) if sh.qk_norm else 0
    # LoRA: the adapters' tensors on top (transformer-engine's savings from a frozen base are not counted)
    extra = lora_activations(sh, inputs=False) if sh.lora is not None else 0
    return norm_linear + attention + mlp + qk_norms + extra + 2 * hyper_connection_activations(sh)


def hyper_connection_activations(sh: Shape) -> int:
    """What one hyper-connected step (DeepSeek-V4's attn_hc or ffn_hc, models/deepseek_v4/hyper_connections.py)
    keeps for backward around its sublayer, over the streams [s, b, n, h] of this rank's tokens: the streams (and
    their float32 copy below fp32), 1/rms and the normalised float32 streams the mix projection reads, the mix
    logits, the pre and post sigmoids, the pre mix, the softmax of the comb logits, each Sinkhorn-Knopp division's
    input and divisor (2 * iterations - 1 of them), the sublayer's output, post and comb cast for the final mix.
    The sublayer's own tensors are the layer's (the norm before it is the layer formula's too). Measured equal to
    autograd's saved tensors (tests/test_memory_plan.py)."""
    if sh.streams is None:
        return 0
    n, iterations = sh.streams
    t, h, d = sh.s_sp * sh.b, sh.h, sh.d
    streams = t * n * h * (d + (4 if d != 4 else 0) + 4)  # the streams, their float32 copy, the normalised ones
    mixes = t * 4 + t * (2 + n) * n * 4 + 3 * t * n * 4 + t * n * n * 4  # 1/rms, logits, sigmoids and pre, softmax
    sinkhorn = (2 * iterations - 1) * t * (n * n + n) * 4
    return streams + mixes + sinkhorn + t * h * d + t * n * d + t * n * n * d


def hyper_head_activations(sh: Shape) -> int:
    """What the streams' collapse before the final norm (V4's hc_head) keeps for backward: the streams, their float32
    copy below fp32, 1/rms, the normalised streams, the mix logits, its sigmoid and the pre mix."""
    if sh.streams is None:
        return 0
    n = sh.streams[0]
    t, h, d = sh.s_sp * sh.b, sh.h, sh.d
    return t * n * h * (d + (4 if d != 4 else 0) + 4) + t * 4 + 3 * t * n * 4


def indexer_activations(sh: Shape) -> int:
    """What a DeepSeek sparse attention layer's indexer keeps for backward, only while its loss trains it (its
    inputs are detached, its top-k has no gradient): its key projection's output and the key LayerNorm's
    statistics, its float32 q and k, the ReLU'd per-head scores [b, s, heads, s] and the weights they are
    summed with, the top-k's int64 indices, and the loss's softmax, log and target of the index scores
    [b, s, s] (the attention's own scores there are taken without gradient). The sparse attention itself is
    counted as the unfused one: its scores are dense, masked to the kept keys."""
    if sh.indexer is None or not sh.indexer[3]:
        return 0
    heads, dim, topk, _ = sh.indexer
    s, b = sh.s, sh.b
    key = b * s * dim * sh.d + 2 * b * s * 4
    return key + 4 * (b * s * heads * s + b * s * heads * dim + b * s * dim + b * s * heads + 3 * b * s * s) \
        + 8 * b * s * min(topk, s)


def indexer_transient(sh: Shape) -> int:
    """The indexer's largest temporary, trained or not: its float32 per-head scores [b, s, heads, s], and with
    its loss on, the attention's float32 scores [b, heads / TP, s, s] that the loss compares with."""
    if sh.indexer is None:
        return 0
    heads, _, _, trains = sh.indexer
    return 4 * sh.b * sh.s * sh.s * (heads + (sh.heads // sh.tp if trains else 0))


def lora_activations(sh: Shape, inputs: bool = True) -> int:
    """What a layer's adapters keep for backward: each adapted linear's input (once per distinct input; under SP
    the column-parallel adapters gather it over the sequence), the low-rank product z, and the combined A and
    the fused B they multiply by."""
    s, b, d = sh.s, sh.b, sh.d
    out, seen = 0, set()
    for target, mode, width, rank, rows, adapters, fan in sh.lora:
        tokens = s * b * fan
        if inputs and (target, width) not in seen:
            seen.add((target, width))
            out += tokens * width * d
        out += tokens * rank * d + rows * rank * d + (rank * width * d if adapters > 1 else 0)
    return round(out)


def head_activations(sh: Shape, first: bool, last: bool, spec: str) -> int:
    """Embedding and loss: token ids; final norm, output layer input, fp32 softmax of the logits."""
    frozen = sh.lora is not None and spec == "local"  # a frozen embedding keeps no ids, its final norm no x-hat
    out = sh.b * sh.s * 8 if first and not frozen else 0
    if last:
        ssp = sh.s_sp
        norm = 2 * ssp * sh.b * sh.h * 4 + ssp * sh.b * 4 if spec == "local" else 2 * ssp * sh.b * sh.h * sh.d + ssp * sh.b * 4
        out += norm - (ssp * sh.b * sh.h * 4 if frozen else 0) + ssp * sh.b * sh.h * sh.d + sh.s * sh.b * sh.vocab // sh.tp * 4 + sh.s * sh.b + sh.s * sh.b * 8
        out += hyper_head_activations(sh)
    return out


def full_recompute_block_inputs(sh: Shape, blocks: int, spec: str) -> int:
    """What uniform full recompute keeps per micro-batch: each block's input, and the fp32 RoPE table."""
    streams = sh.streams[0] if sh.streams is not None else 1  # a block's input is every residual stream
    return blocks * sh.s_sp * sh.b * sh.h * sh.d * streams + (sh.s * sh.hn * 4 if spec == "local" else 0)


# --- the plan ---------------------------------------------------------------------------------------------

@dataclass
class StageMemory:
    pp_rank: int
    layers: int
    params: int = 0
    grads: int = 0
    optimizer_device: int = 0
    optimizer_host: int = 0
    activations: int = 0  # peak saved for backward
    per_microbatch: int = 0
    in_flight: int = 0
    transient: int = 0
    fp8_casts: int = 0  # torchao's float8 copies of one GEMM's operands (training/fp8_run.cast_bytes)
    optimizer_elements: int = 0
    trainable: int = 0  # parameters this rank trains (elements; LoRA: adapters) and holds frozen
    frozen: int = 0
    float32_elements: int = 0  # parameters held in float32 in a 16-bit run (FamilyConfig.float32_parameters)
    chunks: list = field(default_factory=list, repr=False)  # (nbytes, state elements) per chunk, device first

    @property
    def model_state(self) -> int:
        return self.params + self.grads + self.optimizer_device + self.optimizer_host

    @property
    def device(self) -> int:
        return self.params + self.grads + self.optimizer_device + self.activations + self.transient + self.fp8_casts


@dataclass
class MemoryPlan:
    spec: str
    stages: list[StageMemory]
    capacity: int | None  # bytes of device memory per rank, None when unknown
    capacity_source: str
    offload_policy: str
    offload_share: float  # host share of the optimizer state (static: the ratio; auto: where it starts)
    margin: int
    attention: str | None = None  # the local spec's core attention (models/blocks/core_attention.py); None with TE

    def stage(self, pp_rank: int) -> StageMemory:
        return self.stages[pp_rank]

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.device)

    def problem(self) -> str | None:
        """Why this configuration cannot run on the device, or None."""
        if self.capacity is None:
            return None
        worst = self.worst
        if worst.device <= self.capacity:
            return None
        hint = "AC=full, a smaller BATCH_SIZE or more TP/PP"
        if self.offload_policy != "auto":
            hint = f"OPTIMIZER_OFFLOAD=auto, {hint}"
        return (f"the memory plan needs {human_bytes(worst.device)} on pipeline stage {worst.pp_rank} and the device has "
                f"{human_bytes(self.capacity)} ({self.capacity_source}): try {hint} (MP_DRY_RUN=1 prints the plan)")

    def lines(self) -> list[str]:
        layers = f"{self.spec} layers" + (f", {self.attention} attention" if self.attention else "")
        out = [f"memory plan per rank ({layers}; device memory {human_bytes(self.capacity)}, "
               f"{self.capacity_source}):"]
        for st in self.stages:
            frozen = f" ({st.trainable:,} trainable, {st.frozen:,} frozen)" if st.frozen else ""
            out.append(f"  stage {st.pp_rank} ({st.layers} layers): params {human_bytes(st.params)}{frozen}, grads "
                       f"{human_bytes(st.grads)}, optimizer state {human_bytes(st.optimizer_device)} on the device + "
                       f"{human_bytes(st.optimizer_host)} on the host, activations {human_bytes(st.activations)} "
                       f"({st.in_flight} micro-batch(es) x {human_bytes(st.per_microbatch)}), transient "
                       f"{human_bytes(st.transient)}"
                       + (f", float8 casts {human_bytes(st.fp8_casts)}" if st.fp8_casts else "")
                       + f" -> device {human_bytes(st.device)}")
        if self.offload_policy == "auto":
            out.append(f"  OPTIMIZER_OFFLOAD=auto starts with {self.offload_share:.0%} of the optimizer state on the "
                       f"host (margin {self.margin / GiB:g} GiB), then follows what each step measures")
        elif self.offload_policy == "static":
            out.append(f"  OPTIMIZER_OFFLOAD static: {self.offload_share:.0%} of the optimizer state on the host")
        return out

    def to_dict(self) -> dict:
        return {"spec": self.spec, "attention": self.attention, "capacity_bytes": self.capacity, "capacity_source": self.capacity_source,
                "offload_policy": self.offload_policy, "offload_share": self.offload_share,
                "stages": [{k: v for k, v in st.__dict__.items() if k != "chunks"} | {"device": st.device,
                                                                                       "model_state": st.model_state}
                           for st in self.stages],
                "problem": self.problem()}


def _spec(cfg, caps=None) -> str:
    """The layers the run will build: the local spec on ENV=cpu, and on a GPU transformer-engine's when it
    is installed (planned from a machine without a GPU, a GPU run is assumed to have it). ``caps``: the
    machine's ``Capabilities`` (default: this one's)."""
    if cfg.device == "cpu" or cfg.arch.sparse_attention is not None:
        return "local"  # DeepSeek sparse attention builds its own local modules with or without TE
    if caps is None:
        caps = Capabilities.detect()
    return "local" if caps.cuda and not caps.transformer_engine else "te"


def _attention(cfg, spec: str) -> str | None:
    if cfg.arch.sparse_attention is not None:
        return UNFUSED  # DeepSeek sparse attention: dense scores masked to the kept keys, an fp32 softmax
    if cfg.arch.family_config is not None and not cfg.arch.family_config.core_attention:
        return None  # a family's own attention (DeepSeek-V4's): no core-attention kernel to name
    return local_core_attention(cfg) if spec == "local" else None


def _capacity(cfg) -> tuple[int | None, str]:
    if cfg.gpu_memory_gb is not None:
        return int(cfg.gpu_memory_gb * GiB), "MP_GPU_MEMORY_GB"
    if cfg.env != "cpu":
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory), torch.cuda.get_device_name(0)
    return None, "unknown: set MP_GPU_MEMORY_GB"


def _shape(arch, cfg, layer: int | None = None) -> Shape:
    """The activations' sizes of decoder layer ``layer`` (its attention type may have a shape of its own; None:
    the layer the plan's formula stands for, with the model's attention shape)."""
    if arch.is_moe:
        # tokens spread evenly: each token runs top-k experts (per EP rank: its share), plus the shared expert
        f = arch.moe_topk * arch.moe_ffn_hidden_size + arch.shared_expert_ffn_hidden_size
    else:
        f = arch.ffn_hidden_size
    d = cfg.precision.itemsize
    qk_norm = any("self_attention.q_layernorm." in n for layer in model_shape(arch).layers.values() for n in layer)
    lora = None
    if cfg.lora is not None:
        lora = layer_adapters(arch, cfg, _spec(cfg), layer)
    sparse = arch.sparse_attention
    indexer = None if sparse is None else (sparse.n_heads, sparse.head_dim, sparse.topk,
                                           bool(cfg.dsa and cfg.dsa["loss_scale"]))
    attention = arch.attention_shape(layer if layer is not None else 0)
    streams = arch.family_config.hyper_connections if arch.family_config is not None else None
    return Shape(s=cfg.sample_length // cfg.cp, b=cfg.micro_batch_size, h=arch.hidden_size,
                 a=arch.num_heads * attention.head_dim, kvw=attention.num_kv_heads * attention.head_dim,
                 hn=attention.head_dim,
                 heads=arch.num_heads, f=f, vocab=arch.padded_vocab_size(), tp=cfg.tp, sp=cfg.sequence_parallel, d=d,
                 qk_norm=qk_norm, lora=lora, indexer=indexer, streams=streams)


def in_flight(cfg, pp_rank: int) -> int:
    """Micro-batches (for VP: chunk micro-batches) whose activations a stage holds at its peak."""
    m, pp, vp = cfg.num_microbatches, cfg.pp, cfg.virtual_pipeline or 1
    if pp == 1:
        return 1
    if vp == 1:
        return min(pp - pp_rank, m)
    return min((pp - pp_rank - 1) * 2 + (vp - 1) * pp + 1, m * vp)


def stage_memory(arch, cfg, pp_rank: int, spec: str, dp_rank: int = 0) -> StageMemory:
    """Pipeline stage ``pp_rank``'s memory on data-parallel rank ``dp_rank``."""
    return _stage_memories(arch, cfg, pp_rank, spec, [dp_rank])[0]


def stage_memories(arch, cfg, pp_rank: int, spec: str) -> list[StageMemory]:
    """Pipeline stage ``pp_rank``'s memory on each data-parallel rank: with the distributed optimizer each holds its
    own shard of the optimizer state, whose parameters' spans (torch's step per span) and chunks (OPTIMIZER_OFFLOAD)
    fall differently, so that DP rank 1 held more on the device than rank 0's plan said (the odoc audit)."""
    return _stage_memories(arch, cfg, pp_rank, spec, None)


def _stage_memories(arch, cfg, pp_rank: int, spec: str, dp_ranks) -> list[StageMemory]:
    """The stage on each of ``dp_ranks`` (None: every DP rank whose shard differs)."""
    attention = _attention(cfg, spec)
    param_bytes = cfg.precision.itemsize
    grad_bytes = 4  # fp32 gradient buffers (grad_reduce_in_fp32 with mixed precision)
    do = cfg.distributed_optimizer
    vp = cfg.virtual_pipeline or 1
    dp = cfg.data_parallel_size
    dense_dp = dp * cfg.cp
    expert_dp = cfg.world_size // (cfg.pp * cfg.ep * (cfg.etp or cfg.tp))
    bucket_size = max(40_000_000, 1_000_000 * dense_dp)
    chunks = [chunk_params(arch, cfg, pp_rank, v, spec) for v in range(vp)]
    # A family's float32 parameters in a 16-bit run (FamilyConfig.float32_parameters): 4 bytes each, their own master
    # copy, and a DDP buffer of their own (DDP keeps one per parameter dtype)
    kept = arch.family_config.float32_parameters if arch.family_config is not None and param_bytes != 4 else ()

    def float32(p) -> bool:
        return any(part in kept for part in p.name.split("."))

    st = StageMemory(pp_rank, sum(stage_layers(arch, cfg, pp_rank)))
    st.float32_elements = sum(p.numel for params in chunks for p in params if float32(p))
    if cfg.lora is not None:
        # LoRA: the frozen base is held as it is, outside the DDP buffers (no gradient, no optimizer state)
        from megatron_patch.training.lora_run import split_trainable

        chunks, frozen = split_trainable(arch, cfg, chunks, pp_rank, spec)
        st.params += frozen * param_bytes
        st.frozen = frozen
    elif arch.sparse_attention is not None:
        # DeepSeek sparse attention: the indexers frozen without their loss, or everything else in the indexer-
        # only warm-up (training/sparse_attention_run.py); frozen weights held outside the DDP buffers
        from megatron_patch.training.sparse_attention_run import split_trainable as dsa_split

        chunks, frozen = dsa_split(cfg, chunks)
        st.params += frozen * param_bytes
        st.frozen = frozen
    elif arch.family_config is not None and arch.family_config.frozen_parameters:
        # a family's own frozen weights (DeepSeek-V4's indexer), held outside the DDP buffers as well
        pieces = arch.family_config.frozen_parameters
        held = [p for params in chunks for p in params if any(piece in p.name for piece in pieces)]
        chunks = [[p for p in params if not any(piece in p.name for piece in pieces)] for params in chunks]
        st.params += sum(p.numel * (4 if float32(p) else param_bytes) for p in held)
        st.frozen = sum(p.numel for p in held)
    st.trainable = sum(p.numel for params in chunks for p in params)
    dense_buffers, expert_buffers = [], []
    for v, params in enumerate(chunks):
        bucketed = bucket_size if (pp_rank == 0 and v == 0) else None
        own_groups = expert_process_groups(cfg)
        for buffers, group, dp_size in ((dense_buffers, [p for p in params if not (p.expert and own_groups)],
                                         dense_dp),
                                        (expert_buffers, [p for p in params if p.expert and own_groups], expert_dp)):
            for wide in (False, True):
                members = [p for p in group if float32(p) == wide]
                if members:
                    buffers.append((buffer_layout(members, dp_size, bucketed, do), 4 if wide else param_bytes))
    # torch's Adam keeps a scalar step per parameter where neither transformer-engine nor Apex is installed
    step_bytes = 0 if _fused_adam_available() else 4
    offload = cfg.optimizer_offload_policy != "off" or cfg.offload_numerics == "exact"
    from megatron_patch.training.offload.chunks import Span, plan_chunks

    capacity = None if cfg.offload_chunk_mb is None else max(1, int(cfg.offload_chunk_mb * 2**20 / 4))
    for buffers in (dense_buffers, expert_buffers):
        for buf, buf_bytes in buffers:
            st.grads += buf.numel * grad_bytes
            st.params += (buf.numel if do else sum(p.numel for p, _, _ in buf.params)) * buf_bytes
    st.per_microbatch, st.transient = _activations(arch, cfg, pp_rank, spec, attention)
    if spec == "local" and arch.sparse_attention is None:  # PR=fp8 on the local spec is torchao's float8
        st.fp8_casts = fp8_run.cast_bytes(cfg)
    st.in_flight = in_flight(cfg, pp_rank)
    st.activations = _peak_activations(arch, cfg, pp_rank, spec, attention, st.per_microbatch, st.in_flight)

    def on_rank(dp_rank: int) -> StageMemory:
        """``st`` with ``dp_rank``'s optimizer state: one distributed optimizer for the dense buffers, one for the
        expert buffers (EP > 1)."""
        held = dataclasses.replace(st, chunks=[])
        for buffers, group_dp in ((dense_buffers, dense_dp), (expert_buffers, expert_dp)):
            segments = []
            for index, (buf, buf_bytes) in enumerate(buffers):
                master = 4 if buf_bytes != 4 else 0  # fp32 parameters are their own master weights
                if do:
                    for _, spans in shard_spans(buf, dp_rank % group_dp):
                        n = sum(e - s for _, s, e in spans)
                        held.optimizer_elements += n
                        if offload:
                            segments.append((index, [Span(i, s, e) for i, (_, s, e) in enumerate(spans)]))
                        else:
                            held.optimizer_device += n * (master + 8) + len(spans) * step_bytes
                else:
                    n = sum(p.numel for p, _, _ in buf.params)
                    held.optimizer_elements += n
                    held.optimizer_device += n * (master + 8) + len(buf.params) * step_bytes
            if offload and segments:
                held.chunks += [(c.nbytes, c.state_numel, c.capacity) for c in plan_chunks(segments, capacity).chunks]
        return held

    if dp_ranks is None:
        dp_ranks = range(max(dense_dp, expert_dp)) if do else [0]
    return [on_rank(r) for r in dp_ranks]


def expert_process_groups(cfg) -> bool:
    """Whether the experts' weights sit in DDP's expert buffer, reduced and sharded over expert data
    parallelism (megatron's ``allreduce=False``): with EP > 1, and from megatron-core 0.19 also when
    ETP differs from TP. Otherwise they are dense parameters like any other."""
    if cfg.ep > 1:
        return True
    return cfg.layout.expert_tp != cfg.tp and experts_grouped_whenever_etp_differs()


def _fused_adam_available() -> bool:
    """Whether megatron-core's optimizer is TE's or Apex's FusedAdam (its HAVE_APEX_OR_TE), without
    importing megatron-core (seconds) in the launcher."""

    return any(importlib.util.find_spec(m) is not None for m in ("transformer_engine", "apex"))


def _layer_shapes(arch, cfg, pp_rank: int) -> list[Shape]:
    """The activations' sizes of each decoder layer of pipeline rank ``pp_rank`` (its chunks' layers in turn):
    one per layer, since an attention type may have a shape of its own (``Arch.attention_shape``)."""
    if not arch.own_attention_shapes:  # every layer alike: the formula's one
        return [_shape(arch, cfg)] * sum(stage_layers(arch, cfg, pp_rank))
    of_shape: dict = {}
    out = []
    for v in range(len(stage_layers(arch, cfg, pp_rank))):
        for i in chunk_layers(arch, cfg.layout, pp_rank, v, cfg.pp0_layers):
            key = arch.attention_shape(i)
            if key not in of_shape:
                of_shape[key] = _shape(arch, cfg, i)
            out.append(of_shape[key])
    return out


def _activations(arch, cfg, pp_rank: int, spec: str, attention: str | None) -> tuple[int, int]:
    """(saved bytes per micro-batch of this stage, transient peak)."""
    sh = _shape(arch, cfg)
    vp = cfg.virtual_pipeline or 1
    layers = stage_layers(arch, cfg, pp_rank)
    first, last = pp_rank == 0, pp_rank == cfg.pp - 1
    ac = cfg.activation_checkpointing
    per_layer = [layer_activations(s, ac, spec, attention) for s in _layer_shapes(arch, cfg, pp_rank)]
    if ac == "full":
        blocks = sum(-(-n // cfg.ac_layers) for n in layers)
        # the RoPE table of the widest heads
        body = full_recompute_block_inputs(max(_layer_shapes(arch, cfg, pp_rank), key=lambda s: s.hn), blocks, spec)
    else:
        body = sum(per_layer)
    head = head_activations(sh, first, last, spec)
    logits = sh.s * sh.b * sh.vocab // sh.tp * (4 + 4 + sh.d) if last else 0
    transient = max(logits, max(per_layer) * (cfg.ac_layers if ac == "full" else 1), indexer_transient(sh))
    return (body + head) // (vp if vp > 1 else 1), transient


def _peak_activations(arch, cfg, pp_rank, spec, attention, per_microbatch: int, flights: int) -> int:
    peak = per_microbatch * flights
    if cfg.activation_checkpointing == "full":
        # during backward one block of MP_AC_LAYERS layers is rebuilt; the loss's tensors are gone by then
        sh = _shape(arch, cfg)
        block = cfg.ac_layers * max(layer_activations(s, "none", spec, attention)
                                    for s in _layer_shapes(arch, cfg, pp_rank))
        head = head_activations(sh, pp_rank == 0, pp_rank == cfg.pp - 1, spec)
        embed_only = head_activations(sh, pp_rank == 0, False, spec)
        peak = max(peak, peak - head + embed_only + block)
    return peak


def plan_memory(cfg, spec: str | None = None, caps=None) -> MemoryPlan:
    """The plan for ``cfg`` (a RunConfig): every pipeline stage, on its data-parallel rank that holds the most on
    the device. ``spec``: "local" or "te" (default: what the run builds on the machine ``caps`` describes, default
    this one)."""
    arch = cfg.arch
    spec = spec or _spec(cfg, caps)
    per_rank = [stage_memories(arch, cfg, p, spec) for p in range(cfg.pp)]
    capacity, source = _capacity(cfg)
    margin = int(cfg.offload_margin_gb * GiB)
    policy = cfg.optimizer_offload_policy
    share = cfg.optimizer_offload_fraction if policy == "static" else 0.0
    if policy == "auto":
        share = max(auto_share(st, capacity, margin) for ranks in per_rank for st in ranks)
    if policy != "off" or cfg.offload_numerics == "exact":
        for st in (st for ranks in per_rank for st in ranks):
            _place_chunks(st, share if policy != "off" else 0.0, cfg.precision.itemsize)
    stages = [max(ranks, key=lambda st: (st.device, st.optimizer_host)) for ranks in per_rank]
    return MemoryPlan(spec, stages, capacity, source, policy, share, margin, _attention(cfg, spec))


def auto_share(st: StageMemory, capacity: int | None, margin: int) -> float:
    """The host share of the optimizer state that leaves ``margin`` free on this stage."""
    if capacity is None or not st.chunks:
        return 0.0
    room = capacity - margin - (st.params + st.grads + st.activations + st.transient + st.fp8_casts)
    used, k = 0, 0
    for nbytes, _, _ in st.chunks:
        if used + nbytes > room:
            break
        used += nbytes
        k += 1
    total = sum(n for _, n, _ in st.chunks)
    return sum(n for _, n, _ in st.chunks[k:]) / total if total else 0.0


def _place_chunks(st: StageMemory, share: float, param_bytes: int) -> None:
    """Chunks [0, k) on the device, the rest on the host with their staging buffers (fp32 gradients in,
    parameters out), as the offload controller places them at the start."""

    from megatron_patch.training.offload.chunks import host_chunk_count

    host = host_chunk_count([SimpleNamespace(state_numel=n) for _, n, _ in st.chunks], share)
    k = len(st.chunks) - host
    st.optimizer_device = sum(nb for nb, _, _ in st.chunks[:k])
    st.optimizer_host = sum(nb + cap * (4 + param_bytes) for nb, _, cap in st.chunks[k:])

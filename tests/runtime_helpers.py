"""Tiny Megatron-Core models and the worker functions the runtime tests start with ``run_local``.

Everything here is module-level so that "spawn" children (the ``run_local`` ranks and the helper
processes of the torch_dist checkpoint writer) can import it. The workers return plain tensors and
numbers; the assertions live in tests/test_runtime.py.

How layouts are compared: a one-process TP=1 reference run builds the model from a seed, saves it
with ``dist_checkpointing`` and records losses, gradients and a short training run. Every other
layout loads that checkpoint, runs the same data and must reproduce those numbers.
"""

from __future__ import annotations

import os

import torch

from megatron_patch.runtime.distributed import ParallelLayout, init_model_parallel

VOCAB = 128
SEQ = 16
HIDDEN = 64
MICRO_BATCH = 2
NUM_MICROBATCHES = 4


# --- model -------------------------------------------------------------------------------------

def tiny_config(layout: ParallelLayout, *, moe_dispatcher: str | None = None, num_layers: int = 2,
                sequence_parallel: bool | None = None):
    from megatron.core.transformer import TransformerConfig

    if sequence_parallel is None:
        # megatron-core requires sequence parallelism when experts and tensors are both split.
        sequence_parallel = moe_dispatcher is not None and layout.tp > 1 and layout.ep > 1
    kwargs = dict(
        num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        bias_activation_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
        sequence_parallel=sequence_parallel,
    )
    if moe_dispatcher is not None:
        kwargs.update(
            num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64, moe_grouped_gemm=False,
            moe_token_dispatcher_type=moe_dispatcher, moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
        )
    return TransformerConfig(**kwargs)


def build_model(config, tie_embeddings: bool | None = None):
    """GPTModel for this rank's pipeline stage. The dense model ties its input embedding and output
    layer (as Qwen2's small models do), so PP>1 exercises megatron's embedding-group all-reduce."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm"
    )
    return GPTModel(
        config, spec, vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="rope",
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=(config.num_moe_experts is None) if tie_embeddings is None else tie_embeddings,
    )


def make_batches(num_microbatches: int = NUM_MICROBATCHES, seed: int = 7) -> list[dict]:
    """Fixed token batches, one dict per micro-batch, independent of the global RNG."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return out


def dp_slice(batches: list[dict]) -> list[dict]:
    """This data-parallel rank's share of the global batch (contiguous blocks of micro-batches)."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    per = len(batches) // dp
    return batches[rank * per:(rank + 1) * per]


# --- forward/backward through megatron's pipeline schedules --------------------------------------

def _loss_func(output_tensor):
    loss = output_tensor.float().mean()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    tokens = batch["tokens"]
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=batch["labels"])
    return output, _loss_func


def forward_backward(model, batches: list[dict], forward_only: bool = False) -> list[float]:
    """One global step over ``batches`` with ``get_forward_backward_func()``; losses on the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fwd_bwd = get_forward_backward_func()
    out = fwd_bwd(
        forward_step_func=_forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
        forward_only=forward_only,
    )
    return [float(d["lm loss"]) for d in out]


# --- checkpoints ---------------------------------------------------------------------------------

def save_model(model, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)


def load_model(model, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir)
    model.load_state_dict(state)


# --- gathering a sharded model back into full tensors ----------------------------------------------

def _global_name(model, name: str) -> str:
    """Rename stage-local ``decoder.layers.<i>`` to the global layer index."""
    from megatron.core.utils import get_attr_wrapped_model

    if not name.startswith("decoder.layers."):
        return name
    decoder = get_attr_wrapped_model(model, "decoder")
    local = int(name.split(".")[2])
    layer = decoder.layers[local]
    return f"decoder.layers.{layer.layer_number - 1}." + name.split(".", 3)[3]


def _gather_along(tensor: torch.Tensor, dim: int, group, glu: bool) -> torch.Tensor:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    if glu:  # each rank holds [gate_r; up_r]: the full weight is [gate_0..gate_n; up_0..up_n]
        halves = [p.chunk(2, dim=dim) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return torch.cat(parts, dim=dim)


def full_tensors(model, which: str = "param") -> dict[str, torch.Tensor]:
    """Parameters (or their gradients) of this pipeline stage, gathered over tensor/expert parallelism.

    Keys are global parameter names; expert weights are keyed by global expert index.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    config = model.config
    out = {}
    for name, param in model.named_parameters():
        name = name.removeprefix("module.")
        if which == "param":
            t = param.data
        else:
            t = getattr(param, "main_grad", None)
            if t is None:
                t = param.grad
            if t is None:
                t = torch.zeros_like(param)
        is_expert = not getattr(param, "allreduce", True)
        glu = name.endswith("linear_fc1.weight") and config.gated_linear_unit
        if getattr(param, "tensor_model_parallel", False):
            group = (parallel_state.get_expert_tensor_parallel_group() if is_expert
                     else parallel_state.get_tensor_model_parallel_group())
            t = _gather_along(t, param.partition_dim, group, glu)
        gname = _global_name(model, name)
        if is_expert and ".local_experts." in gname:
            ep_rank = parallel_state.get_expert_model_parallel_rank()
            local_count = config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
            head, rest = gname.split(".local_experts.", 1)
            idx, tail = rest.split(".", 1)
            gname = f"{head}.local_experts.{ep_rank * local_count + int(idx)}.{tail}"
        out[gname] = t.detach().clone()
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        # Each expert-parallel rank holds different experts: collect them all.
        group = parallel_state.get_expert_model_parallel_group()
        gathered = [None] * dist.get_world_size(group)
        experts = {k: v for k, v in out.items() if ".local_experts." in k}
        dist.all_gather_object(gathered, experts, group=group)
        for part in gathered:
            out.update(part)
    return out


def gather_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [b, s, vocab] of a single-stage model (tensor-parallel gathered)."""
    from megatron.core import parallel_state

    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        logits = model(tokens, position_ids, None)
    return _gather_along(logits, -1, parallel_state.get_tensor_model_parallel_group(), glu=False)


def _stage_info() -> dict:
    from megatron.core import parallel_state as ps

    return dict(
        tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(), ep_rank=ps.get_expert_model_parallel_rank(),
        last_stage=ps.is_pipeline_last_stage(),
    )


# --- workers -------------------------------------------------------------------------------------

def dense_reference_worker(ckpt_dir: str) -> dict:
    """TP=1: build from the seed, save, and record losses/gradients of one global batch."""
    layout = ParallelLayout()
    init_model_parallel(layout, seed=1234)
    model = build_model(tiny_config(layout))
    save_model(model, ckpt_dir)
    losses = forward_backward(model, make_batches())
    return dict(losses=losses, grads=full_tensors(model, "grad"), params=full_tensors(model, "param"))


def fwd_bwd_worker(layout: ParallelLayout, ckpt_dir: str, use_ddp: bool) -> dict:
    """Load the reference weights at ``layout`` and run one global batch through the schedules."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    init_model_parallel(layout, seed=1234)
    config = tiny_config(layout)
    model = build_model(config)
    load_model(model, ckpt_dir)
    if use_ddp:
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        config.finalize_model_grads_func = finalize_model_grads
    losses = forward_backward(model, dp_slice(make_batches()))
    info = _stage_info()
    grads = full_tensors(model, "grad")
    keep = info["tp_rank"] == 0 and info["dp_rank"] == 0
    return dict(info, losses=losses, grads=grads if keep else None)


def moe_reference_worker(ckpt_dir: str) -> dict:
    """MoE model at TP=1/EP=1: build from the seed, save, record losses/gradients."""
    layout = ParallelLayout()
    init_model_parallel(layout, seed=4321)
    model = build_model(tiny_config(layout, moe_dispatcher="allgather"))
    save_model(model, ckpt_dir)
    losses = forward_backward(model, make_batches())
    return dict(losses=losses, grads=full_tensors(model, "grad"))


def moe_worker(layout: ParallelLayout, ckpt_dir: str, dispatchers: tuple[str, ...]) -> dict:
    """Load the MoE reference at ``layout`` and run one DDP step per token dispatcher."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    init_model_parallel(layout, seed=4321)
    results = {}
    for dispatcher in dispatchers:
        config = tiny_config(layout, moe_dispatcher=dispatcher)
        model = build_model(config)
        load_model(model, ckpt_dir)
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
        config.finalize_model_grads_func = finalize_model_grads
        losses = forward_backward(model, dp_slice(make_batches()))
        grads = full_tensors(model, "grad")
        local_experts = {
            name: float(p.main_grad.abs().sum()) for name, p in model.named_parameters() if ".local_experts." in name
        }
        results[dispatcher] = dict(losses=losses, grads=grads, local_expert_grad_sums=local_experts)
    return dict(_stage_info(), results=results)


# --- Megatron DDP + optimizer ---------------------------------------------------------------------

LR = 1e-3
CLIP_GRAD = 1.0


def build_trainable(layout: ParallelLayout, ckpt_dir: str, distributed_optimizer: bool, overlap_grad_reduce: bool):
    """Reference weights at ``layout``, wrapped in megatron's DDP, with megatron's Adam."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = tiny_config(layout)
    model = build_model(config)
    load_model(model, ckpt_dir)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, overlap_grad_reduce=overlap_grad_reduce,
        # Small buckets, so that overlapped reduction really runs as several in-flight collectives.
        bucket_size=20_000 if overlap_grad_reduce else None,
    )
    model = DistributedDataParallel(config, ddp_config, model)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, clip_grad=CLIP_GRAD, bf16=False, fp16=False,
                        use_distributed_optimizer=distributed_optimizer),
        [model],
    )
    return model, optimizer


def train_steps(model, optimizer, steps: int, batches: list[dict]) -> list[dict]:
    """``steps`` optimizer steps on the same global batch; per step: this rank's micro-batch losses,
    the grad norm the optimizer reports (before clipping), and the norm left after clipping."""
    history = []
    for _ in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(model, dp_slice(batches))
        ok, grad_norm, _ = optimizer.step()
        history.append(dict(losses=losses, ok=bool(ok), grad_norm=float(grad_norm),
                            clipped_norm=float(optimizer.get_grad_norm())))
    return history


def train_worker(layout: ParallelLayout, ckpt_dir: str, variants: tuple[tuple[bool, bool], ...], steps: int) -> dict:
    """Train from the reference weights once per (distributed_optimizer, overlap_grad_reduce)."""
    init_model_parallel(layout, seed=1234)
    runs = {}
    for distributed_optimizer, overlap in variants:
        model, optimizer = build_trainable(layout, ckpt_dir, distributed_optimizer, overlap)
        runs[(distributed_optimizer, overlap)] = train_steps(model, optimizer, steps, make_batches())
    return dict(_stage_info(), runs=runs)


# --- dist_checkpointing across layouts ------------------------------------------------------------

PROBE_TOKENS_SEED = 11


def _probe_tokens() -> torch.Tensor:
    return make_batches(1, seed=PROBE_TOKENS_SEED)[0]["tokens"]


# megatron-core 0.16's default ('fully_sharded_model_space') builds flattened-range shards that its
# own dist_checkpointing now rejects; 'fully_reshardable' is what Megatron-LM passes and it
# reshards across TP, PP and DP.
OPTIMIZER_CKPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _state(model, optimizer, is_loading: bool) -> dict:
    model_sd = model.module.sharded_state_dict()
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPTIMIZER_CKPT_METADATA)
    return {"model": model_sd, "optimizer": optim_sd}


def save_checkpoint_worker(layout: ParallelLayout, ref_dir: str, out_dir: str, steps_before: int) -> dict:
    """Train a few distributed-optimizer steps at ``layout``, save model+optimizer, train one more.

    Returns what a correct restore elsewhere must reproduce: the full parameters and logits at the
    save, and the losses of the step after it (which depend on Adam's moments and step count).
    """
    from megatron.core import dist_checkpointing

    init_model_parallel(layout, seed=1234)
    model, optimizer = build_trainable(layout, ref_dir, distributed_optimizer=True, overlap_grad_reduce=False)
    train_steps(model, optimizer, steps_before, make_batches())
    os.makedirs(out_dir, exist_ok=True)
    dist_checkpointing.save(_state(model, optimizer, is_loading=False), out_dir)
    params = full_tensors(model.module, "param")
    logits = gather_logits(model.module, _probe_tokens())
    after = train_steps(model, optimizer, 2, make_batches())
    return dict(_stage_info(), params=params, logits=logits, after=after)


def _restore(layout: ParallelLayout, ref_dir: str, ckpt_dir: str, with_optimizer: bool) -> dict:
    from megatron.core import dist_checkpointing

    model, optimizer = build_trainable(layout, ref_dir, distributed_optimizer=True, overlap_grad_reduce=False)
    before = full_tensors(model.module, "param")
    if with_optimizer:
        state = dist_checkpointing.load(_state(model, optimizer, is_loading=True), ckpt_dir)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    else:
        # In fp32 the distributed optimizer steps the model's own parameters (it keeps no separate
        # fp32 copy), so restoring the model alone leaves a fresh Adam: the control case.
        state = dist_checkpointing.load({"model": model.module.sharded_state_dict()}, ckpt_dir)
        model.module.load_state_dict(state["model"])
    params = full_tensors(model.module, "param")
    logits = gather_logits(model.module, _probe_tokens())
    after = train_steps(model, optimizer, 2, make_batches())
    return dict(before=before, params=params, logits=logits, after=after)


def load_checkpoint_worker(layout: ParallelLayout, ref_dir: str, ckpt_dir: str, with_model_only_control: bool) -> dict:
    """Build at ``layout`` from the reference weights, restore the checkpoint (model + optimizer),
    report what ``save_checkpoint_worker`` reported; optionally also a model-only restore."""
    init_model_parallel(layout, seed=999)
    out = dict(_stage_info(), full=_restore(layout, ref_dir, ckpt_dir, with_optimizer=True))
    if with_model_only_control:
        out["model_only"] = _restore(layout, ref_dir, ckpt_dir, with_optimizer=False)
    return out


# --- gloo itself ------------------------------------------------------------------------------------

def world_worker() -> tuple[int, int]:
    """This rank's place in the world it joined, after one collective over it."""
    import torch
    import torch.distributed as dist

    from megatron_patch.runtime.distributed import init_process_group

    init_process_group(timeout_minutes=1)
    dist.all_reduce(torch.ones(1))
    return dist.get_rank(), dist.get_world_size()


def gloo_collectives_worker() -> dict:
    """The collectives megatron uses that NCCL has and gloo might not, with known answers."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    from megatron_patch.runtime.distributed import init_process_group

    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)), backend="gloo")
    out = {"backend": dist.get_backend(group)}

    # Even reduce-scatter / all-gather (distributed optimizer, sequence parallelism).
    rs = torch.zeros(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * world) + rank, group=group)
    out["reduce_scatter_tensor"] = rs
    ag = torch.zeros(2 * world)
    dist.all_gather_into_tensor(ag, torch.full((2,), float(rank)), group=group)
    out["all_gather_into_tensor"] = ag

    # The same inside megatron's coalescing manager, as DDP issues it for bucketed grads.
    from torch.distributed import _coalescing_manager

    a, b = torch.zeros(2), torch.zeros(1)
    with _coalescing_manager(group, async_ops=True) as cm:
        dist.reduce_scatter_tensor(a, torch.arange(2.0 * world) + rank, group=group, async_op=True)
        dist.reduce_scatter_tensor(b, torch.ones(world) * (rank + 1), group=group, async_op=True)
    cm.wait()
    out["coalesced_reduce_scatter"] = (a, b)

    # Uneven all-to-all (alltoall MoE dispatcher): rank r sends r+1+j rows to rank j.
    send = [rank + 1 + j for j in range(world)]
    recv = [j + 1 + rank for j in range(world)]
    inp = torch.cat([torch.full((n, 3), float(10 * rank + j)) for j, n in enumerate(send)])
    res = torch.empty(sum(recv), 3)
    dist.all_to_all_single(res, inp, recv, send, group=group)
    out["all_to_all_uneven"] = res[:, 0]

    # Uneven gather/reduce-scatter along dim 0 through megatron's own helpers (ETP>1 alltoall).
    sizes = [j + 1 for j in range(world)]
    gathered = mappings._gather_along_first_dim(torch.full((rank + 1, 2), float(rank)), group, sizes)
    out["megatron_uneven_gather"] = gathered[:, 0]
    scattered = mappings._reduce_scatter_along_first_dim(torch.ones(sum(sizes), 2) * (rank + 1), group, sizes)
    out["megatron_uneven_reduce_scatter"] = scattered
    return out


# --- run_local's error paths ----------------------------------------------------------------------

def stuck_after_a_bar(ready_dir: str) -> None:
    """A rank that drew a tqdm bar (lm-eval's are drawn with ``disable`` too) and then does not end on Ctrl-C, as one
    blocked in a collective: run_local kills it. Says it is ready with a file in ``ready_dir``."""
    import time

    from tqdm import tqdm

    for _ in tqdm(range(2), disable=True):
        pass
    open(os.path.join(ready_dir, os.environ["RANK"]), "w").close()
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            time.sleep(0.1)
        except KeyboardInterrupt:
            pass


def raise_user_error_on_rank_1(message: str):
    from megatron_patch.errors import UserError

    if int(os.environ["RANK"]) == 1:
        raise UserError(message)
    return "ok"


def die_without_reporting(code: int):
    os._exit(code)


def raise_value_error():
    raise ValueError("not a user error")


def join_and_report_world():
    """Joins the job's process group (binding the rendezvous port) and reports the world size."""
    from megatron_patch.runtime.distributed import init_process_group

    import torch.distributed as dist

    init_process_group()
    return dist.get_world_size()


def lose_the_port_on_the_first_attempt(attempts_file: str):
    """Rank 0 of the first attempt loses the rendezvous port (its EADDRINUSE reported last, after rank 1's lost
    connection to it, as under load); the next attempt reports each rank."""
    import os
    import time
    from pathlib import Path

    rank = int(os.environ["RANK"])
    marks = Path(attempts_file)
    if rank == 0:
        attempt = len(marks.read_text()) + 1 if marks.exists() else 1
        marks.write_text("x" * attempt)
    else:
        time.sleep(0.5)  # rank 0 has counted this attempt
        attempt = len(marks.read_text())
    if attempt > 1:
        return rank
    if rank == 1:
        raise RuntimeError("Gloo connectFullMesh failed: Connection closed by peer")
    time.sleep(1.0)
    raise RuntimeError("The server socket has failed to listen on any local network address. code: -98, name: "
                       "EADDRINUSE")

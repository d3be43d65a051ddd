"""Workers for tests/test_fp8.py (module-level, so that ``run_local``'s spawned ranks import them): megatron-core's
parallel linears with torchao's float8 GEMMs (models/blocks/float8.py), against torchao's own ``Float8Linear``."""

from __future__ import annotations

import torch

from megatron_patch.runtime.distributed import ParallelLayout, init_model_parallel

IN, HEADS, GROUPS, HEAD_DIM, FFN, TOKENS = 64, 4, 2, 16, 96, 24


def _linear_attention():
    """A Gated DeltaNet's shape (Qwen3-Next's grouping: in_proj_qkvz of 96 rows, in_proj_ba of 8)."""
    from megatron_patch.models.description.arch import LinearAttentionShape

    return LinearAttentionShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=8, conv_kernel=4)


def _config(tp: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=HEADS, num_query_groups=GROUPS,
                             kv_channels=HEAD_DIM, ffn_hidden_size=FFN, gated_linear_unit=True,
                             add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.bfloat16,
                             bf16=True, tensor_model_parallel_size=tp, gradient_accumulation_fusion=False)


def _whole(seed: int, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * torch.linspace(0.2, 3.0, shape[-1])).to(torch.bfloat16)


def _linears(config, tp: int, rank: int):
    """qkv (column, fused q/k/v), fc1 (column, fused gate/up) and fc2 (row) at this TP rank, with their whole
    weights, as layer-relative names the float8 conversion reads."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    q, kv = HEADS * HEAD_DIM, GROUPS * HEAD_DIM
    kw = dict(config=config, init_method=lambda w: None, bias=False)
    specs = {"self_attention.linear_qkv": (ColumnParallelLinear, IN, q + 2 * kv, 1),
             "mlp.linear_fc1": (ColumnParallelLinear, IN, 2 * FFN, 2),
             "mlp.linear_fc2": (RowParallelLinear, FFN, IN, 3),
             "self_attention.in_proj": (ColumnParallelLinear, IN, sum(_linear_attention().in_proj_rows()), 4)}
    out = {}
    for name, (cls, fan_in, fan_out, seed) in specs.items():
        extra = dict(gather_output=False) if cls is ColumnParallelLinear else dict(input_is_parallel=True,
                                                                                  skip_bias_add=True)
        module = cls(fan_in, fan_out, **kw, **extra)
        whole = _whole(seed, (fan_out, fan_in))
        if name.endswith("in_proj"):  # b and a far smaller than q, k, v and z: one scale for both would show
            whole[-_linear_attention().in_proj_rows()[-1]:] *= 0.01
        with torch.no_grad():
            module.weight.copy_(_shard(name, whole, tp, rank))
        out[name] = (module, whole)
    return out


def _shard(name: str, whole: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's rows (qkv: whole query groups; fc1: its part of gate and of up) or columns (fc2)."""
    if name.endswith("linear_fc2"):
        return whole.chunk(tp, dim=1)[rank]
    if name.endswith(("linear_fc1", "in_proj")):  # each HF part's rows split over TP, a rank's parts in order
        return torch.cat([part.chunk(tp)[rank] for part in _hf_parts(name, whole)])
    return whole.view(GROUPS, -1, whole.shape[1]).chunk(tp)[rank].reshape(-1, whole.shape[1])


def _hf_parts(name: str, whole: torch.Tensor) -> list[torch.Tensor]:
    """The HF linears a fused MCore weight came from: q, k, v (grouped rows gathered), gate and up."""
    if name.endswith("linear_qkv"):
        cols = whole.shape[1]
        grouped = whole.view(GROUPS, -1, cols)
        q = HEADS // GROUPS * HEAD_DIM
        return [grouped[:, :q].reshape(-1, cols), grouped[:, q:q + HEAD_DIM].reshape(-1, cols),
                grouped[:, q + HEAD_DIM:].reshape(-1, cols)]
    if name.endswith("linear_fc1"):
        return list(whole.chunk(2))
    if name.endswith("in_proj"):
        return list(whole.split(_linear_attention().in_proj_rows()))
    return [whole]


def _torchao_reference(name: str, whole: torch.Tensor, x: torch.Tensor, grad: torch.Tensor, recipe: str):
    """torchao's Float8Linear on each HF part of ``whole``: (output, grad of x, grad of the whole weight), laid out
    as MCore's fused weight."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    parts = _hf_parts(name, whole)
    linears = torch.nn.ModuleList(torch.nn.Linear(p.shape[1], p.shape[0], bias=False, dtype=torch.bfloat16)
                                  for p in parts)
    with torch.no_grad():
        for linear, p in zip(linears, parts):
            linear.weight.copy_(p)
    convert_to_float8_training(linears, config=Float8LinearConfig.from_recipe_name(recipe))
    x = x.detach().clone().requires_grad_(True)
    outs = [linear(x) for linear in linears]
    grads = _hf_parts(name, grad.t().contiguous())  # [out, tokens] rows per part
    torch.autograd.backward(outs, [g.t() for g in grads])
    return outs, x.grad, [linear.weight.grad for linear in linears]


def gemms_worker(tp: int, recipes: tuple[str, ...], reduce_amax: bool = True) -> dict:
    """Each linear of ``_linears`` converted with each recipe at ``tp``, run forward and backward on the same
    input and output gradient on every rank, and gathered whole; torchao's Float8Linear on the whole HF parts
    alongside. Returns, per recipe and linear, how the output, input gradient and weight gradient differ
    and whether they are exactly equal (``_difference``). ``reduce_amax=False`` plants a fault: scales from the local shard."""
    from megatron.core import parallel_state

    from megatron_patch.models.blocks import float8

    init_model_parallel(ParallelLayout(tp=tp))
    rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
    if not reduce_amax:
        float8._max_over = lambda amax, group: amax
    config = _config(tp)
    out = {}
    for recipe in recipes:
        for name, (module, whole) in _linears(config, tp, rank).items():
            chunk = torch.nn.Module()
            chunk.decoder = torch.nn.Module()
            chunk.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
            holder, *path = name.split(".")
            setattr(chunk.decoder.layers[0], holder, torch.nn.Module())
            setattr(getattr(chunk.decoder.layers[0], holder), path[0], module)
            float8.convert_chunks([chunk], recipe, "all", _linear_attention())
            x = _whole(10, (TOKENS, whole.shape[1]))
            grad = _whole(11, (TOKENS, whole.shape[0]))
            row = name.endswith("linear_fc2")
            x_local = x.chunk(tp, dim=1)[rank] if row else x
            grad_local = grad if row else _shard(name, grad.t().contiguous(), tp, rank).t().contiguous()
            x_local = x_local.clone().requires_grad_(True)
            y, _ = module(x_local)
            y.backward(grad_local)
            y_whole = _gather(y, name, tp, group, weight=False)
            gw_whole = _gather(module.weight.grad, name, tp, group, weight=True)
            gx = x_local.grad
            if row:
                gx = torch.cat(_all_gather(gx, group), dim=1)
            ref_y, ref_gx, ref_gw = _torchao_reference(name, whole, x, grad, recipe)
            mine_y = _hf_parts(name, y_whole.t().contiguous())
            mine_gw = _hf_parts(name, gw_whole)
            pairs = {"output": (torch.cat([t.t() for t in mine_y], 1), torch.cat(ref_y, 1)),
                     "grad_input": (gx, ref_gx),
                     "grad_weight": (torch.cat(mine_gw), torch.cat(ref_gw))}
            out[(recipe, name)] = {k: _difference(a.detach(), b.detach()) for k, (a, b) in pairs.items()}
    return out


def _difference(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Whether two bf16 results are equal, and their difference's norm relative to the reference's."""
    return {"equal": bool(torch.equal(a, b)),
            "relative": float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))}


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    import torch.distributed as dist

    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return pieces


def _gather(tensor: torch.Tensor, name: str, tp: int, group, weight: bool) -> torch.Tensor:
    """A column-parallel output [tokens, out/tp] or weight gradient [out/tp, in] (a row-parallel one's
    [out, in/tp]) made whole, in MCore's fused layout of the whole weight."""
    if tp == 1:
        return tensor
    if name.endswith("linear_fc2"):
        return torch.cat(_all_gather(tensor, group), dim=1) if weight else tensor
    rows = tensor if weight else tensor.t().contiguous()
    pieces = _all_gather(rows, group)
    if name.endswith(("linear_fc1", "in_proj")):  # each rank's piece of each HF part, the parts in order
        widths = [w // tp for w in (_linear_attention().in_proj_rows() if name.endswith("in_proj") else (FFN, FFN))]
        by_part = zip(*(p.split(widths) for p in pieces))
        whole = torch.cat([t for part in by_part for t in part])
    else:
        whole = torch.cat([p.view(GROUPS // tp, -1, rows.shape[1]) for p in pieces]).reshape(-1, rows.shape[1])
    return whole if weight else whole.t().contiguous()


# --- the torchao reference loop ----------------------------------------------------------------------------------

def torchao_reference_losses(hf_dir, family: str, args: list[str], recipe: str, steps: int) -> list[float]:
    """The losses of ``steps`` iterations of a launcher run (``args``, one data-parallel rank), trained instead on
    the HF model in bf16 with torchao's ``convert_to_float8_training`` on every decoder linear, by a plain
    master-weight loop with Megatron's settings: fp32 master weights and fp32 gradient accumulation over the
    micro-batches, the loss averaged per micro-batch and over them, gradient clipping at 1.0, AdamW (betas 0.9 and
    0.95, eps 1e-8; no weight decay on norms and biases, as megatron's optimizer) and megatron-core's own learning
    rate scheduler. The same batches, in the same order."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from transformers import AutoModelForCausalLM

    from megatron_patch.training.data import build_pretraining_datasets, micro_batches
    from megatron_patch.training.megatron_settings import megatron_settings
    from megatron_patch.training.validation import resolve

    cfg = resolve(family, args, env={})
    train, _ = build_pretraining_datasets(cfg, cfg.train_iters * cfg.global_batch_size, 0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: ".layers." in f".{fqn}",
                               config=Float8LinearConfig.from_recipe_name(recipe))
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    decay = [m for n, m in zip(names, masters) if m.dim() > 1 and not n.endswith(".bias")]
    no_decay = [m for n, m in zip(names, masters) if not (m.dim() > 1 and not n.endswith(".bias"))]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "wd_mult": 0.0}], betas=(0.9, 0.95),
                                  eps=1e-8)
    scheduler = OptimizerParamScheduler(optimizer, **megatron_settings(cfg, "torchao")["scheduler"])
    losses = []
    for step in range(steps):
        batches = micro_batches(train, step, cfg, 0, 1)
        total, count = 0.0, 0
        grads = [torch.zeros_like(m) for m in masters]
        for b in batches:
            logits = model(input_ids=b["tokens"]).logits.float()
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["labels"].reshape(-1),
                                                   reduction="none")
            mask = b["loss_mask"].reshape(-1).float()
            ((ce * mask).sum() / mask.sum() / len(batches)).backward()
            total, count = total + float((ce * mask).sum()), count + int(mask.sum())
            for g, p in zip(grads, params):
                g += p.grad.float()
                p.grad = None
        losses.append(total / count)
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        scale = min(1.0, 1.0 / (float(norm) + 1e-6))
        for m, g in zip(masters, grads):
            m.grad = g * scale
        optimizer.step()
        scheduler.step(increment=1)
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return losses



def plan_and_live_worker(families: tuple[str, ...], recipe: str, fp8_filter) -> dict:
    """Per family: the decoder GEMMs the dry run's plan (``float8_plan.arch_gemms``) puts in float8, and those the
    live tiny model's conversion (``float8.convert_chunks``) does, each as (module, part, float8) with the experts'
    indices left out."""
    import re

    from megatron_patch.models.blocks import float8
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.blocks.float8_plan import arch_gemms
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.models.description.tiny import tiny_config

    init_model_parallel(ParallelLayout())
    out = {}
    for family in families:
        arch = parse_arch(tiny_config(family))

        def named(gemms):
            return {(re.sub(r"\.local_experts\.\d+\.", ".", g.module), g.part, g.float8) for g in gemms}

        planned = named(g for layer in arch_gemms(arch, recipe, fp8_filter).values() for g in layer)
        model = build_model(arch, ParallelLayout(), torch.bfloat16)
        live = named(float8.convert_chunks([model], recipe, fp8_filter, arch.linear_attention))
        out[family] = (planned, live)
    return out


def sequence_parallel_worker() -> dict:
    """A column-parallel linear at TP=2 with sequence parallelism, bf16 and float8 (tensorwise, every GEMM): the bytes
    each keeps for backward, and whether the float8 one's output and gradients equal those of its GEMM fed the
    sequence gathered beforehand (how it computed before it kept the local part alone)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
    from megatron.core.transformer import TransformerConfig

    from megatron_patch.models.blocks import float8
    from tests.saved_tensors import SavedTensorMeter

    init_model_parallel(ParallelLayout(tp=2))
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.bfloat16, bf16=True, tensor_model_parallel_size=2,
                            sequence_parallel=True, gradient_accumulation_fusion=False, add_bias_linear=False)
    torch.manual_seed(0)
    x = torch.randn(16, 2, 64, dtype=torch.bfloat16)  # this rank's 16 of 32 positions
    out = {}
    for as_float8 in (False, True):
        torch.manual_seed(1)
        linear = ColumnParallelLinear(64, 256, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                      gather_output=False)
        if as_float8:
            chunk = torch.nn.Module()
            chunk.decoder = torch.nn.Module()
            chunk.decoder.layers = torch.nn.ModuleList([torch.nn.Module()])
            chunk.decoder.layers[0].mlp = torch.nn.Module()
            chunk.decoder.layers[0].mlp.linear_fc1 = linear
            float8.convert_chunks([chunk], "tensorwise", "all", None)
        local = x.clone().requires_grad_()
        with SavedTensorMeter(exclude=[linear.weight]) as meter:
            y, _ = linear(local)
            out[f"saved_{'float8' if as_float8 else 'bf16'}"] = meter.live
            y.float().square().sum().backward()
        if as_float8:  # the same GEMM fed the gathered sequence
            before = x.clone().requires_grad_()
            weight = linear.weight.detach().clone().requires_grad_()
            gathered = gather_from_sequence_parallel_region(before, tensor_parallel_output_grad=True,
                                                            group=linear.tp_group)
            y0 = float8.Float8ParallelMatmul.apply(gathered, weight, float8.torchao_config("tensorwise"),
                                                   float8._mm_config(float8.torchao_config("tensorwise")),
                                                   float8.Sharding("column", linear.tp_group), linear._float8_parts)
            y0.float().square().sum().backward()
            out["same"] = (torch.equal(y, y0) and torch.equal(local.grad, before.grad)
                           and torch.equal(linear.weight.grad, weight.grad))
    return out

"""LoRA test helpers: random non-zero peft adapters made by peft itself, peft's logits, and MCore's logits of
the same adapters in local rank processes (workers here are importable for the "spawn" start)."""

from __future__ import annotations

from pathlib import Path

import torch


def load_hf(hf_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, attn_implementation="eager")


def make_peft_adapter(hf_dir, out, *, modules=None, experts: bool = True, seed: int = 1, r: int = 3,
                      lora_alpha: float = 5, **config) -> Path:
    """A peft adapter of ``hf_dir`` whose every A and B is random (peft starts B at zero), saved by peft: on the
    modules its family declares LoRA sites (``peft_targets``), or on those of ``modules`` (leaf names) it has."""
    from peft import LoraConfig, get_peft_model

    from megatron_patch.models.description.registry import parse_arch

    model = load_hf(hf_dir)
    targets = peft_targets(parse_arch(hf_dir), experts=experts)
    if modules is not None:
        leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        targets["target_modules"] = [m for m in modules if m in leaves]
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=lora_alpha, **targets, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(str(out))
    return Path(out)


def peft_targets(arch, experts: bool = True) -> dict:
    """peft's ``target_modules`` and ``target_parameters`` for every module the family's weight table gives a LoRA
    site (``lora.plan.target_modules``: names relative to a layer, as peft names them; the routed experts' stacked
    parameters unless ``experts`` is False), less those peft reads as the routed experts on some MoE model types
    (``peft_io.peft_reinterpreted``)."""
    from megatron_patch.lora.peft_io import peft_reinterpreted
    from megatron_patch.lora.plan import target_modules

    skip = peft_reinterpreted(arch.hf_config.get("model_type"))
    names = [n for group in target_modules(arch).values() for n in group]
    stacked = [n.removesuffix(" (parameter)") for n in names if n.endswith(" (parameter)")]
    return {"target_modules": [n for n in names if not n.endswith(" (parameter)") and n.rsplit(".", 1)[-1] not in skip],
            "target_parameters": stacked if experts and stacked else None}


def as_text_class(tensors: dict) -> dict:
    """An exported adapter's tensors named as peft names them on the text-only class: Qwen3.5's exports name the
    language model as its hub class does (``model.language_model.``), AutoModelForCausalLM has it at ``model.``."""
    return {k.replace("base_model.model.model.language_model.", "base_model.model.model."): v for k, v in tensors.items()}


def peft_logits(hf_dir, adapter, tokens, merged: bool = False) -> torch.Tensor:
    """Logits of ``peft.PeftModel.from_pretrained(base, adapter)`` (or of its ``merge_and_unload``)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_hf(hf_dir), str(adapter)).eval()
    with torch.no_grad():
        if merged:
            model = model.merge_and_unload()
        return model(tokens).logits.float()


def hf_logits(hf_dir, tokens) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(hf_dir).eval()(tokens).logits.float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def lora_logits_worker(cases: list[tuple], layout, tokens) -> list:
    """On every rank: for each (base, adapters) build the model at ``layout``, load the base (an HF folder through
    the in-memory mapping, or a checkpoint), add the adapters (a peft folder or a LoRA checkpoint, or none) and
    return the logits (last stage; None elsewhere)."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.loading import load_checkpoint_into_model
    from megatron_patch.checkpoint.model_io import load_hf_weights
    from megatron_patch.lora.sources import add_adapters, open_adapters
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.blocks.inference import forward_logits
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import init_model_parallel

    out = []
    init_model_parallel(layout)
    for base, adapters, arch_source in cases:
        arch = parse_arch(arch_source)
        model = build_model(arch, layout, torch.float32)
        lora = open_adapters(adapters, arch) if adapters not in ("", "None") else None
        if (Path(base) / "config.json").is_file():
            load_hf_weights(model, arch, layout, HFCheckpointReader(base))
        else:
            load_checkpoint_into_model(model, lora.base if lora is not None and lora.base else base, layout)
        if lora is not None:
            add_adapters([model], arch, lora, layout, torch.float32)
        out.append(forward_logits(model, tokens, arch.vocab_size))
        del model
    return out


def mcore_lora_logits(cases: list[tuple], layout, tokens) -> list[torch.Tensor]:
    from megatron_patch.runtime.launch import run_local

    per_rank = run_local(lora_logits_worker, layout.world_size, [tuple(map(str, c)) for c in cases], layout, tokens)
    return [next(r[i] for r in per_rank if r[i] is not None) for i in range(len(cases))]


def peft_training_reference(hf_dir, adapter, cfg, lrs: list[float]) -> tuple[list[float], dict]:
    """What peft plus a plain ``torch.optim.AdamW`` loop does on the launcher's batches with the launcher's
    optimizer settings (AdamW betas 0.9/0.95, eps 1e-8, the run's weight decay (the family's default: 0.01 for
    qwen2_moe as in Pai, 0.1 for most) on the 2-D adapter weights, gradients
    clipped to norm 1.0, the step's learning rate ``lrs[i]``; each micro-batch's mean token loss, averaged over
    the micro-batches): the losses of each step and the trained adapter (peft's state dict)."""
    import torch.nn.functional as F
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    from megatron_patch.training.data import build_pretraining_datasets, micro_batches

    train, _ = build_pretraining_datasets(cfg, cfg.train_iters * cfg.global_batch_size, 0)
    model = PeftModel.from_pretrained(load_hf(hf_dir), str(adapter), is_trainable=True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay)
    losses = []
    for step, lr in enumerate(lrs):
        opt.zero_grad()
        batches = micro_batches(train, step, cfg, 0, 1)
        total = count = 0.0
        for b in batches:
            logits = model(input_ids=b["tokens"]).logits
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b["labels"].reshape(-1), reduction="none")
            mask = b["loss_mask"].reshape(-1).float()
            ((ce * mask).sum() / mask.sum().clamp(min=1) / len(batches)).backward()
            total, count = total + float((ce * mask).sum()), count + float(mask.sum())
        losses.append(total / count)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    return losses, {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def lora_gradients_worker(hf_dir: str, adapter: str, layout, sequence_parallel: bool, tokens) -> tuple:
    """(logits, {adapter parameter: gradient}) of an HF base with a peft adapter at ``layout``, the gradient of the
    logits weighted by fixed random numbers, for the adapter factors every TP rank holds whole (those megatron's
    finalize_model_grads sums over TP under sequence parallelism summed here too). Rank 0's; None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.checkpoint.model_io import load_hf_weights
    from megatron_patch.lora.sources import add_adapters, open_adapters
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import init_model_parallel

    arch = parse_arch(hf_dir)
    init_model_parallel(layout)
    model = build_model(arch, layout, torch.float32, sequence_parallel=sequence_parallel)
    load_hf_weights(model, arch, layout, HFCheckpointReader(hf_dir))
    add_adapters([model], arch, open_adapters(adapter, arch), layout, torch.float32)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = gather_from_tensor_model_parallel_region(model(tokens, positions, None))[..., :arch.vocab_size]
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
    (logits * weights).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        if ".lora." in f".{name}" and p.grad is not None and not getattr(p, "tensor_model_parallel", False):
            grad = p.grad.clone()
            if getattr(p, "sequence_parallel", False):
                torch.distributed.all_reduce(grad, group=ps.get_tensor_model_parallel_group())
            grads[name] = grad
    return (logits.detach(), grads) if torch.distributed.get_rank() == 0 else None

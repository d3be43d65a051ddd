"""Workers for MP_COMPILE's tests (tests/test_compiled_layers.py, tests/test_fp8.py; module-level, so that
``run_local``'s spawned ranks import them): tiny models compiled as ``compiled_layers.compile_layers`` compiles a
run's layers, against the same models eager."""

from __future__ import annotations

import dataclasses

import torch

from megatron_patch.runtime.distributed import ParallelLayout, init_model_parallel


def _batches(vocab_size: int, tokens: int = 32):
    gen = torch.Generator().manual_seed(0)
    # two batches: a compiled part that kept the first one's inputs as constants would get the second wrong
    return [torch.randint(0, vocab_size, (2, tokens), generator=gen) for _ in range(2)], \
        torch.arange(tokens).unsqueeze(0).expand(2, -1)


def compiled_layers_worker(hf_dir: str, fp8_recipe: str | None, ablation: str | None = None) -> dict:
    """The logits of a tiny model (bf16; with ``fp8_recipe`` every decoder GEMM in torchao float8; ``ablation``: an
    aligner variant, "attention_sdpa" for FL=true's core attention) eager, then with ``MP_COMPILE``'s compilation
    (inductor), on two batches: the worst of their relative differences, of each one's error against the same
    model in fp32 (eager's is the noise a bf16 result carries), the layers compiled, each kind's decision and the
    graphs dynamo built."""
    from torch._dynamo.utils import counters

    from megatron_patch.align.runner import McoreRun, _build_and_load
    from megatron_patch.models.blocks import compiled_layers, float8

    init_model_parallel(ParallelLayout())
    reference, arch = _build_and_load(McoreRun("fp32", hf_dir=hf_dir, ablation=ablation), ParallelLayout())
    model, _ = _build_and_load(McoreRun("bf16", hf_dir=hf_dir, ablation=ablation), ParallelLayout())
    if fp8_recipe is not None:
        float8.convert_chunks([model], fp8_recipe, "all", arch.linear_attention)
    batches, positions = _batches(arch.vocab_size)
    with torch.no_grad():
        exact = [reference(tokens, positions, None).float() for tokens in batches]
        eager = [model(tokens, positions, None).float() for tokens in batches]
        torch._dynamo.reset()
        counters.clear()
        compiled = compiled_layers.compile_layers([model])
        out = [model(tokens, positions, None).float() for tokens in batches]

    def worst(a, b):
        return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b))

    return {"relative": worst(out, eager), "bf16_noise": worst(eager, exact), "compiled_error": worst(out, exact),
            "layers": compiled.layers, "num_layers": arch.num_layers,
            "decisions": [k.plan.decision for k in compiled.kinds], "lines": compiled.lines(),
            "graphs": int(counters["stats"]["unique_graphs"])}


def traced_apart_worker(family: str) -> dict:
    """``family``'s tiny bf16 model trained one step on each of two batches, eager, then compiled as MP_COMPILE
    compiles it with dynamo's graphs run as traced (backend "eager": what is tested is which code runs, not
    inductor's kernels): the largest differences of the logits and of the gradients (both should be 0), the
    parameters that got a gradient eager but not compiled, each kind's decision and parts compiled, and how many
    graphs were run."""
    from megatron_patch.models.blocks import compiled_layers
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.models.description.tiny import tiny_config

    init_model_parallel(ParallelLayout())
    arch = parse_arch(tiny_config(family))
    torch.manual_seed(0)
    model = build_model(arch, ParallelLayout(), torch.bfloat16, core_attention="sdpa")
    batches, positions = _batches(arch.vocab_size, 16)

    def steps():
        logits, grads = [], []
        for tokens in batches:
            model.zero_grad(set_to_none=True)
            out = model(tokens, positions, None)
            out.float().square().mean().backward()
            logits.append(out.detach().float())
            grads.append({n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None})
        return logits, grads

    eager_logits, eager_grads = steps()
    graphs_run = []

    def counting(gm, example_inputs):
        def run(*args):
            graphs_run.append(1)
            return gm.forward(*args)
        return run

    torch._dynamo.reset()
    compiled = compiled_layers.compile_layers([model], backend=counting)
    logits, grads = steps()
    return {"logits": max(float((a - b).abs().max()) for a, b in zip(logits, eager_logits)),
            "grads": max(float((g[n] - e[n]).abs().max()) for g, e in zip(grads, eager_grads) for n in e if n in g),
            "missing": sorted({n for g, e in zip(grads, eager_grads) for n in e if n not in g}),
            "kinds": [dataclasses.asdict(k.plan) | {"label": k.label, "layers": k.layers,
                                                    "compiled": [p for p, d, _ in k.plan.leaves() if d == "whole"]}
                      for k in compiled.kinds],
            "lines": compiled.lines(), "graphs_run": len(graphs_run)}


def layer_count_worker() -> dict:
    """family -> (layers ``compile_layers`` takes, the tiny model's decoder layers, and the same two with one MTP
    layer where the family builds them): set up only, nothing runs or compiles."""
    from megatron_patch.models.blocks import compiled_layers
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import families, parse_arch
    from megatron_patch.models.description.tiny import tiny_config

    init_model_parallel(ParallelLayout())
    out = {}
    for name, family in families().items():
        arch = parse_arch(tiny_config(name))
        archs = [arch] + ([dataclasses.replace(arch, mtp_layers=1)] if family.builds_mtp else [])
        counts = []
        for a in archs:
            model = build_model(a, ParallelLayout(), torch.bfloat16, core_attention="sdpa")
            counts += [compiled_layers.compile_layers([model]).layers, a.num_layers + a.mtp_layers]
        out[name] = counts
    return out

"""``MP_COMPILE=true``: each transformer layer compiled with ``torch.compile`` (megatron-core's local spec, bf16
and fp8, CPU and GPU): the graph capture PAI-TorchAcc gets from XLA, done with what torch ships.

Each ``TransformerLayer`` is compiled in place (``nn.Module.compile``): its class, parameters and state dict do not
change, so checkpoints are the same either way. Norms, RoPE, SwiGLU, the residual adds and torchao's float8
casts (``models/blocks/float8.py``) become generated kernels around the GEMMs. Where dynamo cannot trace a
piece of the layer it breaks the graph there and runs the piece eagerly (the layer is then several graphs);
``graph_breaks`` lists them, and the dry run prints that list for one layer of the run's family.

``MP_COMPILE_FUSIONS`` (``compiled_fusions.py``) stays the lighter option: it compiles only the memory-bound
pieces, in seconds. The two are not combined (validation refuses both at once): a whole compiled layer already
covers those pieces.
"""

from __future__ import annotations

import torch

from megatron_patch.runtime.distributed import ParallelLayout, init_model_parallel
from megatron_patch.runtime.launch import run_local

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# launcher's dry run imports this module before it knows whether it will build a model.


def compile_layers(models) -> dict:
    """Compile every ``TransformerLayer`` of ``models`` (model chunks) in place; returns what was compiled."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    layers = 0
    for model in models:
        for module in model.modules():
            if isinstance(module, TransformerLayer) and getattr(module, "_compiled_call_impl", None) is None:
                module.compile()
                layers += 1
    return {"layers": layers}


def describe(compiled: dict) -> str:
    return f"torch.compile: {compiled['layers']} transformer layers, each compiled whole (MP_COMPILE)"


def graph_breaks(layer, *args, **kwargs) -> list[str]:
    """Where dynamo breaks ``layer``'s graph when it runs on ``args``: one line per break (empty: one graph)."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(*args, **kwargs)
    out = []
    for reason in explained.break_reasons:
        frame = reason.user_stack[-1] if reason.user_stack else None
        where = f" ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})" if frame is not None else ""
        out.append(f"{reason.reason.splitlines()[0]}{where}")
    torch._dynamo.reset()
    return out


def family_layer_graph_breaks(family: str, dtype_name: str, fp8: tuple[str, object] | None,
                              core_attention: str | None) -> list[str]:
    """The graph breaks of the first transformer layer of ``family``'s tiny model (the same layer code as any
    size), built as a run builds it: ``dtype_name``, torchao float8 with (recipe, filter) ``fp8``, the core
    attention. Runs in a process of its own (``run_local``): it joins a process group of one."""
    return run_local(_graph_breaks_worker, 1, family, dtype_name, fp8, core_attention)[0]


def _graph_breaks_worker(family: str, dtype_name: str, fp8, core_attention) -> list[str]:
    # imported here, in the process of its own that builds the tiny model
    from megatron.core.transformer.transformer_layer import TransformerLayer

    # imported here: the builder imports this module, so a top-level import would make a cycle
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.models.description.tiny import tiny_config

    init_model_parallel(ParallelLayout())
    arch = parse_arch(tiny_config(family))
    dtype = getattr(torch, dtype_name)
    model = build_model(arch, ParallelLayout(), dtype, core_attention=core_attention)
    if fp8 is not None:
        # torchao comes with float8: imported only for an fp8 model
        from megatron_patch.models.blocks import float8

        float8.convert_chunks([model], *fp8)
    layer = next(m for m in model.modules() if isinstance(m, TransformerLayer))
    seen = {}

    def keep(module, args, kwargs):
        seen.setdefault("inputs", (args, kwargs))

    handle = layer.register_forward_pre_hook(keep, with_kwargs=True)
    tokens = torch.zeros(1, 16, dtype=torch.long)
    with torch.no_grad():
        model(tokens, torch.arange(16).unsqueeze(0), None)
    handle.remove()
    args, kwargs = seen["inputs"]
    return graph_breaks(layer, *args, **kwargs)

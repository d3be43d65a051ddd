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

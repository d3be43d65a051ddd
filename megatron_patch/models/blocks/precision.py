"""Parameters a family keeps in float32 in a bf16/fp16 model, as transformers' ``_keep_in_fp32_modules_strict`` does.

A family builds such parameters in float32 whatever ``params_dtype`` is, and declares them with
``keep_in_float32(model, modules)``: each parameter under a module named in ``modules`` (a whole component of its
qualified name, as transformers matches them) is marked, and ``cast_parameters`` (which ``build_model`` runs) leaves
marked parameters as they are. megatron-core's DDP buffers group parameters by dtype, and both its optimizers keep a
float32 parameter as its own master copy, so a model of mixed dtypes trains as it is; their checkpoint code needs
``training/optimizer_mends.py`` to save and load it.
"""

from __future__ import annotations

import torch

_MARK = "keep_in_float32"


def keep_in_float32(model: torch.nn.Module, modules: tuple[str, ...]) -> int:
    """Marks the parameters under the modules (or the parameters) named ``modules``; returns how many. They must be
    float32."""
    marked = 0
    for name, param in model.named_parameters():
        if any(part in modules for part in name.split(".")):
            if param.dtype != torch.float32:
                raise TypeError(f"{name} is declared float32 but was built in {param.dtype}")
            setattr(param, _MARK, True)
            marked += 1
    return marked


def kept_in_float32(param: torch.Tensor) -> bool:
    return getattr(param, _MARK, False)


def cast_parameters(chunks: list, dtype: torch.dtype) -> None:
    """Every floating-point parameter in the model's dtype (what Megatron-LM's Float16Module does, for training and
    inference alike). ``build_model`` runs it, so that training, ``mpatch align`` and ``mpatch eval`` run one model.

    megatron-core's local layer spec builds its norms with torch's RMSNorm, which ignores ``params_dtype``: a bf16
    model kept fp32 norm weights, so final/ held mixed dtypes and megatron's non-distributed fp16/bf16 optimizer
    failed to save (its checkpoint code maps only the 16-bit parameters), and align and eval ran norms more precise
    than the model that trains (and than transformers' bf16 model), each outside torch's fused kernel (input and
    weight of two dtypes). transformer-engine's norms already take ``params_dtype``. Buffers are left as built, and so are the parameters a family declares float32 (above:
    DeepSeek-V4's hyper-connections and norms, as transformers keeps them).
    """
    for chunk in chunks:
        for param in chunk.parameters():
            if param.is_floating_point() and param.dtype != dtype and not kept_in_float32(param):
                param.data = param.data.to(dtype)

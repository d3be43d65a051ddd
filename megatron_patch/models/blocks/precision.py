"""Parameters a family keeps in float32 in a bf16/fp16 model, as transformers' ``_keep_in_fp32_modules_strict`` does.

A family builds such parameters in float32 whatever ``params_dtype`` is, and declares them with
``keep_in_float32(model, modules)``: each parameter under a module named in ``modules`` (a whole component of its
qualified name, as transformers matches them) is marked, and the training loop's ``cast_parameters`` leaves marked
parameters as they are. megatron-core's DDP buffers group parameters by dtype, and both its optimizers keep a
float32 parameter as its own master copy, so a model of mixed dtypes trains as it is.
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

"""Tiny random HF checkpoints of each family, made locally (tests, demo, quick start; no model hub)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from megatron_patch.models.description.registry import get_family

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# processes that import this module without building a megatron-core model (align's main process, the
# launcher's dry run and resume checks) do not pay for it.


def tiny_config(family: str, **overrides) -> dict:
    # a deep copy: transformers writes into the nested tables it is given (rope_theta into rope_scaling)
    return copy.deepcopy({**get_family(family).tiny_config, **overrides})


def make_tiny_hf_checkpoint(family: str, out_dir: str | Path, seed: int = 0, *, transformers_defaults: bool = False,
                            **overrides) -> Path:
    """Save a randomly initialised HF model of ``family`` (fp32) to ``out_dir``; return the folder.

    ``transformers_defaults``: the fields ``overrides`` leaves out take the defaults of transformers' config class
    (config.json as transformers writes it), not the family's tiny config's values.

    Every parameter is drawn at random, norms and biases included, and so is every stored buffer
    (DeepSeek's router score correction bias), so a mapping that drops or swaps any of them changes
    the logits; a buffer that must hold valid values (DeepSeek-V4's hash tables) is drawn by its family
    (``ModelFamily.tiny_buffer``).
    """
    # transformers (0.6 s to import on 2 cores) only where a tiny model is made
    import transformers

    tiny = tiny_config(family)
    raw = {"model_type": tiny["model_type"], "architectures": tiny["architectures"], **overrides} \
        if transformers_defaults else tiny_config(family, **overrides)
    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(seed)
    model = getattr(transformers, get_family(family).hf_auto_class).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
        stored = set(model.state_dict())
        own = get_family(family).tiny_buffer
        for name, b in model.named_buffers():
            drawn = own(raw, name, b) if own is not None and name in stored else None
            if drawn is not None:
                b.copy_(drawn)
            elif name in stored and b.is_floating_point():
                b.normal_(0.0, 0.05)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out

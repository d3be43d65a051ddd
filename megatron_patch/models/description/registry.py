"""The registered model families: each family folder under ``models/`` registers its ``ModelFamily`` from its
``__init__.py``; ``families()`` imports every such folder once, so adding a folder adds a family.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
from pathlib import Path

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import Arch, read_config_json
from megatron_patch.models.description.config_checks import check_arch, check_config_values
from megatron_patch.models.description.family import ModelFamily

_FAMILIES: dict[str, ModelFamily] = {}
# Family folders that are being built register nothing (tests/test_code_layout.py's BEING_BUILT), but where this
# variable names them (comma-separated): their tests set it, so that the processes they start register them too.
BEING_BUILT_VARIABLE = "MPATCH_FAMILIES_BEING_BUILT"
_DISCOVERED = False
# Sub-packages of models/ that hold what families share, by kind (models/__init__.py), not a family.
NOT_FAMILIES = frozenset({"description", "blocks", "shape", "mapping"})


def register(family: ModelFamily) -> ModelFamily:
    """Called by a family's own ``__init__.py``."""
    known = _FAMILIES.get(family.name)
    if known is not None and known is not family:
        raise RuntimeError(f"two model families are named {family.name!r}")
    claimed = {t: f.name for f in _FAMILIES.values() if f is not family for t in f.hf_model_types}
    clash = [t for t in family.hf_model_types if t in claimed]
    if clash:
        raise RuntimeError(f"model_type {clash[0]!r} is claimed by both {claimed[clash[0]]} and {family.name}")
    names = {**family.size_aliases, **{k: v for p in family.pai_launchers for k, v in (p.sizes or {}).items()}}
    wrong = [f"{k} -> {v}" for k, v in names.items() if v not in family.presets or k in family.presets and k != v]
    if wrong:
        raise RuntimeError(f"{family.name}: size names that are no preset's or shadow another: {', '.join(wrong)}")
    _FAMILIES[family.name] = family
    return family


def being_built_and_asked_for(name: str) -> bool:
    """Whether a family folder that is being built should register itself in this process."""
    return name in os.environ.get(BEING_BUILT_VARIABLE, "").split(",")


@contextlib.contextmanager
def registered_while_built(family: ModelFamily):
    """``family`` (one being built, which registers nothing yet) in the registry for the length of the block, and
    named in ``BEING_BUILT_VARIABLE`` so that the processes started meanwhile (ranks, the converter's helpers)
    register it too; both as before afterwards. For its tests."""
    families()
    known, variable = _FAMILIES.get(family.name), os.environ.get(BEING_BUILT_VARIABLE)
    register(family)
    os.environ[BEING_BUILT_VARIABLE] = ",".join(filter(None, (variable, family.name)))
    try:
        yield family
    finally:
        if known is None:
            _FAMILIES.pop(family.name, None)
        if variable is None:
            os.environ.pop(BEING_BUILT_VARIABLE, None)
        else:
            os.environ[BEING_BUILT_VARIABLE] = variable


def families() -> dict[str, ModelFamily]:
    """Every registered family by name, in folder order."""
    global _DISCOVERED
    if not _DISCOVERED:
        package = importlib.import_module("megatron_patch.models")
        for module in pkgutil.iter_modules(package.__path__):
            if module.ispkg and module.name not in NOT_FAMILIES:
                importlib.import_module(f"megatron_patch.models.{module.name}")
        _DISCOVERED = True
    return dict(sorted(_FAMILIES.items()))


def get_family(name: str) -> ModelFamily:
    known = families()
    if name not in known:
        raise UserError(f"unknown model family '{name}': supported are {', '.join(known)}")
    return known[name]


def detect_family(raw: dict) -> ModelFamily:
    """The family that claims a config.json: by its ``model_type``, else by its ``architectures``."""
    model_type = raw.get("model_type")
    architectures = raw.get("architectures") or []
    for family in families().values():
        if model_type in family.hf_model_types:
            return family
    if not model_type:
        for family in families().values():
            if any(a in family.hf_architectures for a in architectures):
                return family
    supported = ", ".join(f"{t} ({f.name})" for f in families().values() for t in f.hf_model_types)
    found = f"model_type '{model_type}'" if model_type else f"no model_type (architectures {architectures})"
    raise UserError(f"config.json has {found}: supported model types are {supported}")


def parse_arch(config: dict | str | Path) -> Arch:
    """An ``Arch`` from a config.json dict, file, or HF model folder; every value the family reads checked before
    use (``config_checks``, against the keys the family declares)."""
    raw = config if isinstance(config, dict) else read_config_json(config)
    check_config_values(raw)  # what every config has: its model_type and architectures name the family
    family = detect_family(raw)
    check_config_values(raw, family.config_keys)
    try:
        arch = family.parse_config(raw)
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        # A combination of values the checks above let through and the family cannot read: still bad input.
        raise UserError(f"config.json cannot be read as a {family.name} model ({type(exc).__name__}: {exc}): "
                        "fix the field it names") from None
    check_arch(arch)
    return arch


def has_load_balancing_loss(arch) -> bool:
    """An MoE model whose router megatron-core gives a load-balancing loss (Gemma 4's and DeepSeek-V4's have none)."""
    return arch.is_moe and get_family(arch.family).transformer_config_kwargs(arch).get(
        "moe_router_load_balancing_type") != "none"

"""The model families this package supports: detect one from a config.json, parse it."""

from __future__ import annotations

from pathlib import Path

from megatron_patch.errors import UserError
from megatron_patch.models.arch import Arch, read_config_json
from megatron_patch.models.family import ModelFamily
from megatron_patch.models.llama3_1 import FAMILY as LLAMA3_1
from megatron_patch.models.mixtral import FAMILY as MIXTRAL
from megatron_patch.models.qwen2 import FAMILY as QWEN2
from megatron_patch.models.qwen2_moe import FAMILY as QWEN2_MOE

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (LLAMA3_1, QWEN2, QWEN2_MOE, MIXTRAL)}


def get_family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise UserError(f"unknown model family '{name}': supported are {', '.join(FAMILIES)}")
    return FAMILIES[name]


def detect_family(raw: dict) -> ModelFamily:
    model_type = raw.get("model_type")
    for family in FAMILIES.values():
        if model_type in family.hf_model_types:
            return family
    supported = ", ".join(f"{t} ({f.name})" for f in FAMILIES.values() for t in f.hf_model_types)
    found = f"model_type '{model_type}'" if model_type else "no model_type"
    raise UserError(f"config.json has {found}: supported model types are {supported}")


def parse_arch(config: dict | str | Path) -> Arch:
    """An ``Arch`` from a config.json dict, file, or HF model folder."""
    raw = config if isinstance(config, dict) else read_config_json(config)
    return detect_family(raw).parse_config(raw)

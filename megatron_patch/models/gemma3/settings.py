"""Gemma 3's own settings, typed: what only its modules read (kept in ``Arch.family_config``). A module of its own,
so that the config reader, the layers and the weight table all read it without importing each other."""

import dataclasses

from megatron_patch.models.description.arch import Arch, FamilyConfig


@dataclasses.dataclass(frozen=True)
class Gemma3Settings(FamilyConfig):
    """What only Gemma 3's own modules read: the softmax scale's denominator and the sliding-window layers' RoPE."""

    query_pre_attn_scalar: float
    local_rope_theta: float
    local_rope_scaling: dict | None
    multimodal: bool  # the language model of Gemma3ForConditionalGeneration: its tensors under language_model.


def settings(arch: Arch) -> Gemma3Settings:
    return arch.family_config

"""Gemma 4's own settings, typed: what only its modules read (kept in ``Arch.family_config``). A module of its own,
so that the config reader, the layers and the weight table all read it without importing each other."""

import dataclasses

from megatron_patch.models.description.arch import Arch, FamilyConfig


@dataclasses.dataclass(frozen=True)
class Gemma4Settings(FamilyConfig):
    """What only Gemma 4's own modules read: the full-attention layers' proportional RoPE (the sliding-window
    layers' default RoPE is ``Arch.rope_theta``), the final logits' soft cap, and whether the full-attention
    layers' key projection doubles as their values."""

    full_rope_theta: float
    full_partial_rotary_factor: float  # the share of each head's pairs that rotates; the rest pass through
    full_rope_factor: float
    final_logit_softcapping: float | None
    # attention_k_eq_v: the full-attention layers have no v_proj; their values are the key projection's output
    # before k_norm and RoPE (v_norm still applies), as transformers' Gemma4TextAttention takes them
    full_keys_are_values: bool = False


def settings(arch: Arch) -> Gemma4Settings:
    return arch.family_config

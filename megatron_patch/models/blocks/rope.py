"""RoPE inverse frequencies computed from the config, for MCore's rotary embedding.

megatron-core's own llama3 scaling fixes low/high_freq_factor and the original context length
(1, 4, 8192); a model whose config.json says otherwise would silently get wrong positions. We compute
the frequencies from what config.json says, with transformers' formulas for each RoPE type (default,
linear, llama3, yarn), and install them on the model.

Partial RoPE (GLM-4.5, Qwen3-Next: ``partial_rotary_factor``) rotates only the first
``int(head_dim * factor)`` dimensions of each head, with frequencies computed over that dimension, as
transformers does for every type; megatron-core's ``rotary_percent`` rotates the same leading part and
passes the rest through (``rotary_dim``; the builder hands ``Arch.rotary_percent`` to the GPTModel).

YaRN also scales cos and sin by an attention factor ``a``. Both q and k are rotated, so the scores
grow by ``a**2``: the same as a softmax scale of ``a**2 / sqrt(head_dim)``, which is how it reaches
megatron-core (``softmax_scale``).
"""

from __future__ import annotations

import math

import torch

from megatron_patch.models.description.arch import Arch, yarn_attention_factor


def _plain(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(freqs: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high, old_len = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_dim(arch: Arch) -> int:
    """The leading dimensions of each head that RoPE rotates."""
    return int(arch.head_dim * arch.rotary_percent)


def _yarn(arch: Arch, s: dict) -> tuple[torch.Tensor, float]:
    dim, base = rotary_dim(arch), arch.rope_theta
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    attention_factor = yarn_attention_factor(s)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention_factor)


def inv_freq_and_attention_factor(arch: Arch) -> tuple[torch.Tensor, float]:
    """The inverse frequencies [rotary_dim / 2] and the factor HF scales cos/sin by (1 but for YaRN)."""
    s, dim = arch.rope_scaling, rotary_dim(arch)
    if not s:
        return _plain(arch.rope_theta, dim), 1.0
    kind = s["rope_type"]
    if kind == "linear":
        return _plain(arch.rope_theta, dim) / s["factor"], 1.0
    if kind == "llama3":
        return _llama3(_plain(arch.rope_theta, dim), s), 1.0
    if kind == "yarn":
        return _yarn(arch, s)
    raise ValueError(f"RoPE type {kind!r} reached the model builder unchecked")


def inv_freq(arch: Arch) -> torch.Tensor:
    return inv_freq_and_attention_factor(arch)[0]


def softmax_scale(arch: Arch) -> float | None:
    """The attention softmax scale the RoPE type needs; None: megatron-core's default 1/sqrt(head_dim).
    Multi-latent attention sets its own (megatron-core's MLA computes YaRN's scale itself)."""
    if arch.mla is not None:
        return None
    factor = inv_freq_and_attention_factor(arch)[1]
    return None if factor == 1.0 else factor ** 2 / math.sqrt(arch.head_dim)


def install(model, arch: Arch) -> None:
    """Replace the rotary embedding's frequencies of an MCore GPTModel (before its first forward)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        return
    freqs = inv_freq(arch)
    if freqs.shape != rotary.inv_freq.shape:
        raise ValueError(f"megatron-core built {tuple(rotary.inv_freq.shape)} rotary frequencies, config.json gives "
                         f"{tuple(freqs.shape)}: the model was built without the config's rotary_percent")
    rotary.inv_freq = freqs.to(rotary.inv_freq.device)
    if hasattr(rotary.forward, "cache_clear"):
        rotary.forward.cache_clear()

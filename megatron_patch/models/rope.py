"""RoPE inverse frequencies computed from the config, for MCore's rotary embedding.

megatron-core's own llama3 scaling fixes low/high_freq_factor and the original context length
(1, 4, 8192); a model whose config.json says otherwise would silently get wrong positions. We compute
the frequencies from what config.json says and install them on the model.
"""

from __future__ import annotations

import math

import torch

from megatron_patch.models.arch import Arch


def inv_freq(arch: Arch) -> torch.Tensor:
    dim = arch.head_dim
    freqs = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = arch.rope_scaling
    if not s:
        return freqs
    factor, low, high, old_len = s["factor"], s["low_freq_factor"], s["high_freq_factor"], s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def install(model, arch: Arch) -> None:
    """Replace the rotary embedding's frequencies of an MCore GPTModel (before its first forward)."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None:
        return
    rotary.inv_freq = inv_freq(arch).to(rotary.inv_freq.device)
    if hasattr(rotary.forward, "cache_clear"):
        rotary.forward.cache_clear()

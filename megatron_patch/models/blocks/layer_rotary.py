"""A rotary embedding per attention type: models whose layer types rotate their heads differently (Gemma 3's
sliding-window layers with one RoPE base, its full-attention layers with another).

megatron-core's GPTModel computes one rotary embedding per forward and hands it to every layer. A family whose
layer types differ installs ``RotaryPerLayerType`` in its place (from its ``finish_model`` hook): it computes
one embedding per type, stacked on a leading axis in ``layer_type_order``, a tensor, so that whatever carries
the embedding to the layers (activation recomputation saves it for backward) carries it unchanged. The
family's attention (``RotaryOfLayerType``, mixed into its self-attention class) takes its own type's.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_patch.models.description.arch import FULL_ATTENTION, Arch


def layer_type_order(arch: Arch) -> tuple[str, ...]:
    """The attention types whose embeddings ``RotaryPerLayerType`` stacks, in stacking order."""
    return tuple(sorted(set(arch.layer_types) or {FULL_ATTENTION}))


class RotaryPerLayerType(torch.nn.Module):
    """The rotary embeddings of each attention type, stacked [types, seq, 1, 1, dim]."""

    def __init__(self, rotaries: dict[str, RotaryEmbedding]):
        super().__init__()
        self.layer_types = tuple(sorted(rotaries))
        self.rotaries = [rotaries[t] for t in self.layer_types]  # no parameters or persistent buffers

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.rotaries[0].get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, **kwargs) -> torch.Tensor:
        return torch.stack([r(max_seq_len, offset, packed_seq, **kwargs) for r in self.rotaries])


def install_per_layer_type(model, arch: Arch, inv_freqs: dict[str, torch.Tensor]) -> None:
    """Give each attention type of ``model`` (a GPTModel, on a stage that has the rotary embedding) its own
    inverse frequencies, computed by the family from config.json; each is megatron-core's RotaryEmbedding as the
    model built it (rotary share, interleaving, context parallelism), with its frequencies replaced."""
    built = getattr(model, "rotary_pos_emb", None)
    if built is None:
        return
    if set(inv_freqs) != set(layer_type_order(arch)):
        raise ValueError(f"rotary frequencies for {sorted(inv_freqs)}, but the layers are {layer_type_order(arch)}")
    rotaries = {}
    for layer_type, freqs in inv_freqs.items():
        rotary = copy.copy(built)
        if freqs.shape != built.inv_freq.shape:
            raise ValueError(f"{layer_type}: {tuple(freqs.shape)} rotary frequencies, megatron-core built "
                             f"{tuple(built.inv_freq.shape)}")
        rotary.inv_freq = freqs.to(built.inv_freq.device)
        rotaries[layer_type] = rotary
    model.rotary_pos_emb = RotaryPerLayerType(rotaries)


class RotaryOfLayerType:
    """Mixed into a self-attention class ahead of megatron-core's: the layer's attention type (``layer_type``, a
    spec parameter) picks its embedding out of ``RotaryPerLayerType``'s stack."""

    def __init__(self, *args, layer_type: str, layer_types: tuple[str, ...], **kwargs):
        super().__init__(*args, **kwargs)
        self.rotary_index = layer_types.index(layer_type)

    def forward(self, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is not None:
            rotary_pos_emb = rotary_pos_emb[self.rotary_index]
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)

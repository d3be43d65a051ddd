"""A rotary embedding per attention type: models whose layer types rotate their heads differently (Gemma 3's
sliding-window layers with one RoPE base, its full-attention layers with another).

megatron-core's GPTModel computes one rotary embedding per forward and hands it to every layer. A family whose
layer types differ installs ``RotaryPerLayerType`` in its place (from its ``finish_model`` hook): it computes
one embedding per type, stacked on a leading axis in ``layer_type_order``, a tensor, so that whatever carries
the embedding to the layers (activation recomputation saves it for backward) carries it unchanged. The
family's attention (``RotaryOfLayerType``, mixed into its self-attention class) takes its own type's.

A type whose heads have a size of their own (``Arch.own_attention_shapes``: Gemma 4's full-attention layers) has
an embedding of its own width: the stack pads each to the widest, and each layer cuts its own width back out
(megatron-core rotates as many dimensions of a head as the embedding is wide).
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_patch.models.description.arch import FULL_ATTENTION, Arch, AttentionShape


def layer_type_order(arch: Arch) -> tuple[str, ...]:
    """The attention types whose embeddings ``RotaryPerLayerType`` stacks, in stacking order."""
    return tuple(sorted(set(arch.layer_types) or {FULL_ATTENTION}))


class RotaryPerLayerType(torch.nn.Module):
    """The rotary embeddings of each attention type, stacked [types, seq, 1, 1, dim] (zero-padded to the widest
    dim)."""

    def __init__(self, rotaries: dict[str, RotaryEmbedding]):
        super().__init__()
        self.layer_types = tuple(sorted(rotaries))
        self.rotaries = [rotaries[t] for t in self.layer_types]  # no parameters or persistent buffers

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.rotaries[0].get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, **kwargs) -> torch.Tensor:
        embeddings = [r(max_seq_len, offset, packed_seq, **kwargs) for r in self.rotaries]
        widest = max(e.shape[-1] for e in embeddings)
        return torch.stack([torch.nn.functional.pad(e, (0, widest - e.shape[-1])) for e in embeddings])


def install_per_layer_type(model, arch: Arch, inv_freqs: dict[str, torch.Tensor]) -> None:
    """Give each attention type of ``model`` (a GPTModel, on a stage that has the rotary embedding) its own
    inverse frequencies, computed by the family from config.json; each is megatron-core's RotaryEmbedding as the
    model built it (rotary share, interleaving, context parallelism), with its frequencies replaced. A type whose
    heads have a size of their own (``Arch.attention_shape``) has as many frequencies as its heads have pairs
    (times the rotary share); its layers are told the width to take."""
    built = getattr(model, "rotary_pos_emb", None)
    if built is None:
        return
    if set(inv_freqs) != set(layer_type_order(arch)):
        raise ValueError(f"rotary frequencies for {sorted(inv_freqs)}, but the layers are {layer_type_order(arch)}")
    own_head = dict(arch.own_attention_shapes)
    rotaries, widths = {}, {}
    for layer_type, freqs in inv_freqs.items():
        rotary = copy.copy(built)
        want = built.inv_freq.shape[0]
        if layer_type in own_head:  # megatron-core built the model's head size: this type's is in proportion
            want = want * own_head[layer_type].head_dim // arch.head_dim
        if tuple(freqs.shape) != (want,):
            raise ValueError(f"{layer_type}: {tuple(freqs.shape)} rotary frequencies, its heads take ({want},)")
        rotary.inv_freq = freqs.to(built.inv_freq.device)
        rotaries[layer_type], widths[layer_type] = rotary, 2 * want
    model.rotary_pos_emb = RotaryPerLayerType(rotaries)
    for module in model.modules():
        if isinstance(module, RotaryOfLayerType):
            module.rotary_width = widths[module.layer_type]


class RotaryOfLayerType:
    """Mixed into a self-attention class ahead of megatron-core's: the layer's attention type (``layer_type``, a
    spec parameter) picks its embedding out of ``RotaryPerLayerType``'s stack, ``rotary_width`` of it (set by
    ``install_per_layer_type``)."""

    rotary_width: int | None = None

    def __init__(self, *args, layer_type: str, layer_types: tuple[str, ...], **kwargs):
        super().__init__(*args, **kwargs)
        self.layer_type = layer_type
        self.rotary_index = layer_types.index(layer_type)

    def forward(self, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is not None:
            rotary_pos_emb = rotary_pos_emb[self.rotary_index]
            if self.rotary_width is not None:
                rotary_pos_emb = rotary_pos_emb[..., :self.rotary_width]
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)


class OwnAttentionShape:
    """Mixed into a self-attention class ahead of megatron-core's: the layer built with its own key/value heads and
    head size (``attention_shape``, a spec parameter: ``Arch.attention_shape``), in a copy of the model's
    TransformerConfig, since megatron-core's has one ``num_query_groups`` and ``kv_channels`` for every layer."""

    def __init__(self, config, *args, attention_shape: AttentionShape | None = None, **kwargs):
        own = None if attention_shape is None else (attention_shape.num_kv_heads, attention_shape.head_dim)
        if own is not None and own != (config.num_query_groups, config.kv_channels):
            config = copy.copy(config)
            config.num_query_groups, config.kv_channels = attention_shape.num_kv_heads, attention_shape.head_dim
        super().__init__(config, *args, **kwargs)

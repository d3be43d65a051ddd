"""Multi-token-prediction layers as DeepSeek-V3 lays them out in a hub checkpoint, which GLM-4.5 follows.

Such a checkpoint stores its MTP layers after the decoder's, as ``model.layers.{num_layers + k}``: a full
decoder layer, the norms of the embedding and of the hidden state (``enorm``, ``hnorm``), the projection
of both (``eh_proj``), the head's norm (``shared_head.norm``), and copies of the model's embedding and
output head (``embed_tokens``, ``shared_head.head``). megatron-core's MTP block (``mtp.layers.{k}``)
holds the same layer and norms, and uses the model's own embedding and head. A family with these
layers builds its table from its own decoder-layer rules (``mtp_rules``) and declares the copies
(``mtp_copies``); the converter keeps them with ``--mtp``.
"""

from __future__ import annotations

import dataclasses

from megatron_patch.models.blocks.decoder import HF_LAYER, MC_LAYER
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.mapping import COLUMN, REPLICATED, Rule

MTP_LAYER = "mtp.layers.{layer}"


def num_mtp_layers(raw: dict) -> int:
    """The multi-token-prediction layers a hub checkpoint carries after its decoder layers."""
    return int(raw.get("num_nextn_predict_layers") or raw.get("num_mtp_layers") or 0)


def mtp_rules(layer_rules: list[Rule]) -> list[Rule]:
    """The MTP block's rules: ``layer_rules`` (a decoder layer's, of the kind the MTP layer is) moved into
    the MTP layer, with its own norms and eh_proj around it. They take no LoRA adapters: transformers does
    not build MTP layers, so peft cannot put any there."""
    layer = [dataclasses.replace(r, mcore=r.mcore.replace(MC_LAYER, f"{MTP_LAYER}.transformer_layer"), mtp=True,
                                 lora=None)
             for r in layer_rules]
    return layer + [
        Rule(f"{MTP_LAYER}.enorm.weight", f"{HF_LAYER}.enorm.weight", REPLICATED, mtp=True),
        Rule(f"{MTP_LAYER}.hnorm.weight", f"{HF_LAYER}.hnorm.weight", REPLICATED, mtp=True),
        Rule(f"{MTP_LAYER}.eh_proj.weight", f"{HF_LAYER}.eh_proj.weight", COLUMN, mtp=True),
        Rule(f"{MTP_LAYER}.final_layernorm.weight", f"{HF_LAYER}.shared_head.norm.weight", REPLICATED, mtp=True),
    ]


def mtp_copies(arch: Arch) -> dict[str, str]:
    """HF tensors of each MTP layer that copy the model's embedding and output head."""
    out = {}
    for k in range(arch.mtp_layers):
        hf = HF_LAYER.replace("{layer}", str(arch.num_layers + k))
        out[f"{hf}.embed_tokens.weight"] = "model.embed_tokens.weight"
        out[f"{hf}.shared_head.head.weight"] = "lm_head.weight"
    return out

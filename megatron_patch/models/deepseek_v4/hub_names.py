"""DeepSeek-V4's tensors as DeepSeek publishes them (DeepSeek-V4-Flash/Pro's safetensors, its inference code's
names: ``embed.weight``, ``layers.N.attn.wq_a.weight``, ``hc_head_fn``, FP8/FP4 weights beside ``X.scale``), shown
to the converter under the names transformers' ``save_pretrained`` writes (mapping.py's, ``model.``-prefixed).

transformers 5.24 loads the hub's names through its ``conversion_mapping`` ("deepseek_v4") and writes them back
under ``model.`` with only the top-level tensors renamed (``embed`` -> ``model.embed_tokens``, ``norm`` ->
``model.norm``, ``hc_head_fn`` -> ``model.hc_head.hc_fn``; ``head`` stays) and the attention's key/value norm as
``attn.norm`` (its ``.norm.`` -> ``.kv_norm.`` renaming, reversed); its FP8 quantizer renames a block scale
``X.scale`` to ``X.weight_scale_inv``. ``HubNamedReader`` applies exactly that renaming to a reader of the hub's
files, so one weight table reads either; a folder holding names of both is refused."""

from __future__ import annotations

import re

from megatron_patch.errors import UserError

# hub name (in full) -> transformers' save name, for the model-level tensors
TOP_LEVEL = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "head.weight",
             **{f"hc_head_{part}": f"model.hc_head.hc_{part}" for part in ("fn", "base", "scale")}}
# a decoder layer's tensor named differently by the two (the hub's -> transformers' save name, within the layer)
IN_LAYER = {"attn.kv_norm.weight": "attn.norm.weight"}
LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# the multi-token-prediction layers (a decoder layer with e_proj, h_proj, enorm, hnorm, norm and hc_head_* of its
# own, under ``mtp.{k}.``): transformers builds none and ignores them on load; carried under the hub's names
MTP = re.compile(r"mtp\.\d+\..+")
SCALE = re.compile(r"(.+)\.scale")  # a quantized weight's scales (not hc_*_scale: those end in _scale)


def hub_to_saved(name: str) -> str | None:
    """transformers' save name of hub tensor ``name``, None where ``name`` is not one of the hub's names."""
    scale = SCALE.fullmatch(name)
    if scale:
        weight = hub_to_saved(f"{scale.group(1)}.weight")
        return None if weight is None else weight.removesuffix(".weight") + ".weight_scale_inv"
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    if MTP.fullmatch(name):
        return name
    layer = LAYER.fullmatch(name)
    if layer:
        return f"model.layers.{layer.group(1)}.{IN_LAYER.get(layer.group(2), layer.group(2))}"
    return None


def is_hub_named(names) -> bool:
    """Whether a folder's tensor names are the hub's (False: transformers' save names); a mixture is refused. The
    MTP layers' names (``mtp.{k}.``) are the same in both: an export carries them under the hub's names."""
    names = list(names)
    hub = [n for n in names if n in TOP_LEVEL and n != "head.weight" or n.startswith("layers.")]
    saved = [n for n in names if n.startswith("model.")]
    if hub and saved:
        raise UserError(f"the checkpoint mixes DeepSeek's own tensor names ({hub[0]}) with transformers' saved ones "
                        f"({saved[0]}): convert a folder written in one naming")
    return bool(hub)


class HubNamedReader:
    """A reader of the hub's files that shows transformers' save names; everything else is the reader's."""

    def __init__(self, reader):
        self.reader, self.folder = reader, reader.folder
        self.hub: dict[str, str] = {}  # saved name -> hub name
        unknown = []
        for name in reader.keys():
            saved = hub_to_saved(name)
            if saved is None:
                unknown.append(name)
            else:
                self.hub[saved] = name
        if unknown:
            raise UserError(f"{unknown[0]} is not one of DeepSeek-V4's tensor names (and {len(unknown) - 1} more): "
                            "the checkpoint is not one DeepSeek-V4's table reads")

    def keys(self) -> list[str]:
        return sorted(self.hub)

    def __contains__(self, name: str) -> bool:
        return name in self.hub

    def stored(self, name: str):
        return self.reader.stored(self.hub[name])

    def get(self, name: str):
        return self.reader.get(self.hub[name])

    def dtype(self, name: str) -> str:
        return self.reader.dtype(self.hub[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.reader.shape(self.hub[name])

    def nbytes(self, name: str) -> int:
        return self.reader.nbytes(self.hub[name])

    def read_bytes(self, name: str) -> bytearray:
        return self.reader.read_bytes(self.hub[name])


def mtp_prefixes(arch, count: int) -> tuple[str, ...]:
    """Where the hub's ``count`` multi-token-prediction layers are (``ModelFamily.hf_mtp_prefixes``)."""
    return tuple(f"mtp.{k}." for k in range(count))


def hf_names_view(reader):
    """``reader`` itself when it holds transformers' save names, a ``HubNamedReader`` over it when the hub's."""
    return HubNamedReader(reader) if is_hub_named(reader.keys()) else reader

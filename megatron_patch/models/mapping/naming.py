"""Parameter names of the two MCore layer specs, so checkpoints cross between them.

Checkpoints use the transformer-engine spec's names (what Megatron-LM writes): a norm fused into the
linear layer after it is ``<linear>.layer_norm_weight``, and grouped experts are ``weight{j}``. The
local spec, used where TE is absent, keeps norms as separate modules and experts as a list of MLPs
(their biases, gpt-oss's, ``bias{j}`` in TE).
Renaming is the whole difference: the tensors themselves are laid out identically.

Which norms TE fuses depends on the layer, not on the model: a dense MLP fuses its pre-MLP norm, an
MoE layer keeps ``pre_mlp_layernorm``; standard attention fuses the input norm into ``linear_qkv``,
multi-latent attention keeps ``input_layernorm`` and fuses its latent norms into the up projections
(Qwen3's q/k norms stay modules of their own in both specs). So local -> TE renames a layer's norm only when the
layer has the linear it fuses into, which the state dict itself tells; a model may mix both kinds.
"""

from __future__ import annotations

import re
from typing import Iterable

# (TE name, local name); the local names of fused norms.
_TE_TO_LOCAL = [
    (r"(.*)\.self_attention\.linear_qkv\.layer_norm_weight$", r"\1.input_layernorm.weight"),
    # Gated DeltaNet (linear attention) fuses the input norm into its input projection
    (r"(.*)\.self_attention\.in_proj\.layer_norm_weight$", r"\1.input_layernorm.weight"),
    (r"(.*)\.mlp\.linear_fc1\.layer_norm_weight$", r"\1.pre_mlp_layernorm.weight"),
    (r"(.*)\.self_attention\.linear_q_up_proj\.layer_norm_weight$", r"\1.self_attention.q_layernorm.weight"),
    (r"(.*)\.self_attention\.linear_kv_up_proj\.layer_norm_weight$", r"\1.self_attention.kv_layernorm.weight"),
    (r"(.*)\.mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$", r"\1.mlp.experts.local_experts.\4.\2.\3"),
]
# local norm -> (the linear it fuses into, the TE name), relative to the layer prefix.
_FUSED_NORMS = [
    ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("input_layernorm.weight", "self_attention.in_proj.weight", "self_attention.in_proj.layer_norm_weight"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc1.layer_norm_weight"),
    # MLA's latent norms, fused into the up projections after them.
    ("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.weight",
     "self_attention.linear_q_up_proj.layer_norm_weight"),
    ("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.weight",
     "self_attention.linear_kv_up_proj.layer_norm_weight"),
]
_LOCAL_EXPERT = re.compile(r"(.*)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
# megatron-core 0.19 renamed the MTP layer's module from transformer_layer to mtp_model_layer; its torch_dist
# keys keep the old name (it remaps them itself), and so do the weight tables and legacy rank files here.
_MTP_LAYER_019 = re.compile(r"^(mtp\.layers\.\d+\.)mtp_model_layer\.")


def checkpoint_name(name: str) -> str:
    """A live model's parameter name as checkpoints spell it (the same on 0.16; MTP renamed back on 0.19)."""
    return _MTP_LAYER_019.sub(r"\1transformer_layer.", name)


def te_to_local_name(name: str) -> str:
    for pattern, repl in _TE_TO_LOCAL:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name


def local_to_te_names(names: Iterable[str]) -> dict[str, str]:
    """local name -> TE name for every name of one model (or rank) state dict."""
    names = list(names)
    present = {checkpoint_name(n) for n in names}
    out = {}
    for original in names:
        name = new = checkpoint_name(original)
        m = _LOCAL_EXPERT.match(name)
        if m:
            new = f"{m.group(1)}.mlp.experts.{m.group(3)}.{m.group(4)}{m.group(2)}"
        else:
            for norm, fused_into, te_name in _FUSED_NORMS:
                if name.endswith("." + norm):
                    prefix = name[: -len(norm)]
                    if prefix + fused_into in present:
                        new = prefix + te_name
        out[original] = new
    return out


def to_spec(state_dict: dict, spec: str) -> dict:
    """Rename a TE-named state dict for ``spec`` ("te" or "local")."""
    if spec == "te":
        return dict(state_dict)
    return {te_to_local_name(k): v for k, v in state_dict.items()}


def from_spec(state_dict: dict, spec: str) -> dict:
    """Rename a ``spec`` state dict to TE names, dropping TE's per-module ``_extra_state`` entries."""
    items = {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}
    if spec == "te":
        return items
    renamed = local_to_te_names(items)
    return {renamed[k]: v for k, v in items.items()}

"""Parameter names of the two MCore layer specs, so checkpoints cross between them.

Checkpoints use the transformer-engine spec's names (what Megatron-LM writes): norms fused into the
following linear layer, grouped experts as ``weight{j}``. The local spec, used where TE is absent,
keeps norms as separate modules and experts as a list of MLPs. Renaming is the whole difference:
the tensors themselves are laid out identically.
"""

from __future__ import annotations

import re

# (TE name, local name) for dense layers; MoE layers keep pre_mlp_layernorm in both specs.
_DENSE = [
    (r"(.*)\.self_attention\.linear_qkv\.layer_norm_weight$", r"\1.input_layernorm.weight"),
    (r"(.*)\.mlp\.linear_fc1\.layer_norm_weight$", r"\1.pre_mlp_layernorm.weight"),
]
_MOE = [
    (r"(.*)\.self_attention\.linear_qkv\.layer_norm_weight$", r"\1.input_layernorm.weight"),
    (r"(.*)\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$", r"\1.mlp.experts.local_experts.\3.\2.weight"),
]


_LOCAL_TO_TE_DENSE = [
    (r"(.*)\.input_layernorm\.weight$", r"\1.self_attention.linear_qkv.layer_norm_weight"),
    (r"(.*)\.pre_mlp_layernorm\.weight$", r"\1.mlp.linear_fc1.layer_norm_weight"),
]
_LOCAL_TO_TE_MOE = [
    (r"(.*)\.input_layernorm\.weight$", r"\1.self_attention.linear_qkv.layer_norm_weight"),
    (r"(.*)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r"\1.mlp.experts.\3.weight\2"),
]


def _rename(name: str, table) -> str:
    for pattern, repl in table:
        new, n = re.subn(pattern, repl, name)
        if n:
            return new
    return name


def te_to_local(name: str, moe: bool) -> str:
    return _rename(name, _MOE if moe else _DENSE)


def local_to_te(name: str, moe: bool) -> str:
    return _rename(name, _LOCAL_TO_TE_MOE if moe else _LOCAL_TO_TE_DENSE)


def to_spec(state_dict: dict, spec: str, moe: bool) -> dict:
    """Rename a TE-named state dict for ``spec`` ("te" or "local")."""
    if spec == "te":
        return dict(state_dict)
    return {te_to_local(k, moe): v for k, v in state_dict.items()}


def from_spec(state_dict: dict, spec: str, moe: bool) -> dict:
    """Rename a ``spec`` state dict to TE names, dropping TE's per-module ``_extra_state`` entries."""
    items = {k: v for k, v in state_dict.items() if not k.endswith("_extra_state")}
    if spec == "te":
        return items
    return {local_to_te(k, moe): v for k, v in items.items()}

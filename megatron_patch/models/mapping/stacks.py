"""HF tensors that hold one tensor per expert along their first dimension.

transformers stores some models' experts fused (gpt-oss: ``mlp.experts.gate_up_proj`` [experts, hidden,
2 x ffn]), where megatron-core keeps one weight per expert. A family's weight table names each expert's
own tensor, a *member* (``mlp.experts.{expert}.gate_up_proj``), and the family declares which stacked
HF tensor holds which members, in order (``ModelFamily.hf_stacked``). The engine and the converter
read a member as its slice of the stacked tensor (a contiguous byte range of the file: still a byte
move) and write the stacked tensor back from its members.
"""

from __future__ import annotations

from typing import Iterable

# stacked HF name -> the member names it holds along dim 0, in order
Stacks = dict[str, tuple[str, ...]]


def member_index(stacks: Stacks) -> dict[str, tuple[str, int]]:
    """member -> (stacked name, its index)."""
    return {m: (name, i) for name, members in stacks.items() for i, m in enumerate(members)}


def stacked_names(names: Iterable[str], stacks: Stacks) -> set[str]:
    """``names`` with every member replaced by the stacked tensor that holds it."""
    index = member_index(stacks)
    return {index[n][0] if n in index else n for n in names}


def experts_stacks(arch, layer_pattern: str, tensors: Iterable[str], member_pattern: str) -> Stacks:
    """The stacks of every MoE layer: ``layer_pattern.format(layer=L) + "." + t`` holds
    ``member_pattern.format(layer=L, expert=e, tensor=t)`` for each expert e."""
    out: Stacks = {}
    for layer in range(arch.num_layers):
        if arch.is_moe_layer(layer):
            for t in tensors:
                out[f"{layer_pattern.format(layer=layer)}.{t}"] = tuple(
                    member_pattern.format(layer=layer, expert=e, tensor=t) for e in range(arch.num_experts))
    return out

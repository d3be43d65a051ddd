"""Qwen3.5 HF <-> MCore weight table: Qwen3-Next's (``models/qwen3_next/mapping.py``) with the language model's
tensors under ``model.language_model.`` and the Gated DeltaNet's separate input projections
(``in_proj_qkv`` [q; k; v of every head], ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) cut into
megatron-core's [q; k; v; z; beta; alpha] per TP rank. The MTP layer keeps Qwen3-Next's ``mtp.*``."""

import dataclasses

from megatron_patch.models.blocks.decoder import embedding_and_head_rules
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.mapping import ConcatPieces, Rule
from megatron_patch.models.qwen3_next.mapping import full_attention_rules, linear_attention_rules, mlp_rules, mtp_rules

LANGUAGE_MODEL = "model.language_model."


def _in_language_model(rule: Rule) -> Rule:
    def moved(name):
        return LANGUAGE_MODEL + name[len("model."):] if name.startswith("model.") else name

    lora = rule.lora
    if lora is not None and lora.hf_param is not None:  # the routed experts' stacked parameter, where peft adapts them
        lora = dataclasses.replace(lora, hf_param=moved(lora.hf_param))
    return dataclasses.replace(rule, hf=tuple(moved(h) for h in rule.hf),
                               tied_to=None if rule.tied_to is None else moved(rule.tied_to), lora=lora)


def weight_rules(arch: Arch) -> list[Rule]:
    linear = arch.linear_attention
    qk, v, heads = linear.num_key_heads * linear.key_head_dim, linear.num_value_heads * linear.value_head_dim, \
        linear.num_value_heads
    in_proj = (("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"),
               ConcatPieces(((qk, qk, v), (v,), (heads,), (heads,))))
    layer = full_attention_rules() + linear_attention_rules(arch, in_proj) + mlp_rules(arch)
    rules = [_in_language_model(r) for r in embedding_and_head_rules() + layer]
    return rules + (mtp_rules(arch, layer) if arch.mtp_layers else [])

"""Qwen3-Next HF <-> MCore weight table: gated full attention with q/k norms, Gated DeltaNet layers (their
fused input projections regrouped into megatron-core's [q; k; v; z; beta; alpha] per TP rank), MoE with a
gated shared expert, and, with --mtp, the multi-token-prediction layer (``mtp.*``)."""

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.decoder import (
    HF_LAYER, MC_LAYER, dense_mlp_rules, embedding_and_head_rules, moe_rules, shared_expert_rules)
from megatron_patch.models.blocks.mtp import MTP_LAYER
from megatron_patch.models.description.arch import FULL_ATTENTION, LINEAR_ATTENTION, Arch
from megatron_patch.models.mapping import (
    COLUMN, QKV_GATED, REPLICATED, ROW, ConcatPieces, GroupedDeltaNetInput, LoraSite, Rule, Split)

ATTN, LINEAR, MC_ATTN = f"{HF_LAYER}.self_attn", f"{HF_LAYER}.linear_attn", f"{MC_LAYER}.self_attention"


def full_attention_rules() -> list[Rule]:
    full = FULL_ATTENTION
    return [
        Rule(f"{MC_ATTN}.linear_qkv.layer_norm_weight", f"{HF_LAYER}.input_layernorm.weight", REPLICATED, attention=full),
        Rule(f"{MC_ATTN}.linear_qkv.weight", (f"{ATTN}.q_proj.weight", f"{ATTN}.k_proj.weight", f"{ATTN}.v_proj.weight"),
             QKV_GATED, attention=full, lora=LoraSite("qkv")),
        Rule(f"{MC_ATTN}.q_layernorm.weight", f"{ATTN}.q_norm.weight", REPLICATED, attention=full),
        Rule(f"{MC_ATTN}.k_layernorm.weight", f"{ATTN}.k_norm.weight", REPLICATED, attention=full),
        Rule(f"{MC_ATTN}.linear_proj.weight", f"{ATTN}.o_proj.weight", ROW, attention=full, lora=LoraSite("proj")),
    ]


def conv_split(arch: Arch) -> Split:
    """The causal convolution's channels, [q; k; v] of every head, each split over TP."""
    linear = arch.linear_attention
    qk, v = linear.num_key_heads * linear.key_head_dim, linear.num_value_heads * linear.value_head_dim
    return ConcatPieces(((qk, qk, v),))


def linear_attention_rules(arch: Arch, in_proj: tuple[tuple[str, ...], Split]) -> list[Rule]:
    """A Gated DeltaNet layer; ``in_proj``: its HF input projections (relative to linear_attn) and their split.
    Its input and output projections take LoRA adapters as the attention's ``qkv`` and ``proj``."""
    linear, names = LINEAR_ATTENTION, tuple(f"{LINEAR}.{n}" for n in in_proj[0])
    return [
        Rule(f"{MC_ATTN}.in_proj.layer_norm_weight", f"{HF_LAYER}.input_layernorm.weight", REPLICATED, attention=linear),
        Rule(f"{MC_ATTN}.in_proj.weight", names, in_proj[1], attention=linear, lora=LoraSite("qkv")),
        Rule(f"{MC_ATTN}.conv1d.weight", f"{LINEAR}.conv1d.weight", conv_split(arch), attention=linear),
        Rule(f"{MC_ATTN}.dt_bias", f"{LINEAR}.dt_bias", COLUMN, attention=linear),
        Rule(f"{MC_ATTN}.A_log", f"{LINEAR}.A_log", COLUMN, attention=linear),
        Rule(f"{MC_ATTN}.out_norm.weight", f"{LINEAR}.norm.weight", REPLICATED, attention=linear),
        Rule(f"{MC_ATTN}.out_proj.weight", f"{LINEAR}.out_proj.weight", ROW, attention=linear, lora=LoraSite("proj")),
    ]


def mlp_rules(arch: Arch) -> list[Rule]:
    rules = dense_mlp_rules() if arch.has_dense_layers else []
    if arch.is_moe:
        rules += moe_rules(router="mlp.gate.weight", expert="mlp.experts.{expert}",
                           gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight")
        rules += shared_expert_rules("mlp.shared_expert", gate="mlp.shared_expert_gate.weight")
    return rules


def mtp_rules(arch: Arch, layer: list[Rule], hf_prefix: str = "mtp") -> list[Rule]:
    """The MTP layer as Qwen3-Next's checkpoints hold it: ``mtp.layers.{k}`` (a full-attention layer), its
    norms of the embedding and hidden state before ``mtp.fc``, and ``mtp.norm``."""
    if arch.mtp_layers > 1:
        raise UserError(f"{arch.mtp_layers} multi-token-prediction layers: Qwen3-Next's checkpoints share one mtp.fc "
                        "and its norms, which megatron-core's MTP layers each have: convert with one")
    moved = [dataclasses.replace(r, mcore=r.mcore.replace(MC_LAYER, f"{MTP_LAYER}.transformer_layer"),
                                 hf=tuple(h.replace(HF_LAYER, f"{hf_prefix}.layers.{{mtp_layer}}") for h in r.hf),
                                 mtp=True)
             for r in layer if r.attention in (None, FULL_ATTENTION)]
    return moved + [
        Rule(f"{MTP_LAYER}.enorm.weight", f"{hf_prefix}.pre_fc_norm_embedding.weight", REPLICATED, mtp=True),
        Rule(f"{MTP_LAYER}.hnorm.weight", f"{hf_prefix}.pre_fc_norm_hidden.weight", REPLICATED, mtp=True),
        Rule(f"{MTP_LAYER}.eh_proj.weight", f"{hf_prefix}.fc.weight", COLUMN, mtp=True),
        Rule(f"{MTP_LAYER}.final_layernorm.weight", f"{hf_prefix}.norm.weight", REPLICATED, mtp=True),
    ]


def weight_rules(arch: Arch) -> list[Rule]:
    linear = arch.linear_attention
    in_proj = (("in_proj_qkvz.weight", "in_proj_ba.weight"),
               GroupedDeltaNetInput(linear.num_key_heads, linear.num_value_heads, linear.key_head_dim,
                                    linear.value_head_dim))
    layer = full_attention_rules() + linear_attention_rules(arch, in_proj) + mlp_rules(arch)
    return embedding_and_head_rules() + layer + (mtp_rules(arch, layer) if arch.mtp_layers else [])

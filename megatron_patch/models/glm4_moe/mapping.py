"""GLM-4.5 HF <-> MCore weight table: GQA attention with q/k/v biases and optional q/k norms, dense first
layers, MoE layers (router with its score-correction bias, routed experts, shared experts) and, when
converted with them, the multi-token-prediction layers."""

from megatron_patch.models.blocks.decoder import (
    attention_rules, dense_mlp_rules, embedding_and_head_rules, expert_bias_rule, moe_rules, qk_norm_rules,
    shared_expert_rules)
from megatron_patch.models.blocks.mtp import mtp_rules
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.mapping import Rule


def weight_rules(arch: Arch) -> list[Rule]:
    layer = attention_rules(arch.qkv_bias) + (qk_norm_rules() if arch.hf_config.get("use_qk_norm") else [])
    layer += moe_rules(router="mlp.gate.weight", expert="mlp.experts.{expert}",
                       gate="gate_proj.weight", up="up_proj.weight", down="down_proj.weight")
    layer += [expert_bias_rule()] + (shared_expert_rules() if arch.shared_expert_ffn_hidden_size else [])
    return (embedding_and_head_rules() + layer + (dense_mlp_rules() if arch.dense_layers else [])
            + (mtp_rules(layer) if arch.mtp_layers else []))

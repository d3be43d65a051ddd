"""gpt-oss HF <-> MCore weight table: attention with biases and sinks, the router with its bias, and the
experts, which transformers stores stacked and transposed, gate and up interleaved
(``mlp.experts.gate_up_proj`` [experts, hidden, 2 x ffn], ``down_proj`` [experts, ffn, hidden], their
biases): each expert's slice is a member of the stacked tensor (``models/mapping/stacks.py``)."""

from megatron_patch.models.blocks.decoder import HF_LAYER, MC_LAYER, attention_rules, embedding_and_head_rules
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.mapping import (
    COLUMN, GATE_UP_INTERLEAVED, REPLICATED, ROW_TRANSPOSED, LayerKind, LoraSite, Rule, Scope)
from megatron_patch.models.mapping.stacks import Stacks, experts_stacks

EXPERTS = f"{HF_LAYER}.mlp.experts"
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def weight_rules(arch: Arch) -> list[Rule]:
    moe, expert = LayerKind.MOE, f"{EXPERTS}.{{expert}}"
    fc1, fc2 = f"{MC_LAYER}.mlp.experts.linear_fc1", f"{MC_LAYER}.mlp.experts.linear_fc2"
    return embedding_and_head_rules() + attention_rules(qkv_bias=True, proj_bias=True) + [
        # one sink logit per head: split with the heads
        Rule(f"{MC_LAYER}.self_attention.core_attention.softmax_offset", f"{HF_LAYER}.self_attn.sinks", COLUMN),
        Rule(f"{MC_LAYER}.pre_mlp_layernorm.weight", f"{HF_LAYER}.post_attention_layernorm.weight", REPLICATED,
             layers=moe),
        Rule(f"{MC_LAYER}.mlp.router.weight", f"{HF_LAYER}.mlp.router.weight", REPLICATED, layers=moe),
        Rule(f"{MC_LAYER}.mlp.router.bias", f"{HF_LAYER}.mlp.router.bias", REPLICATED, layers=moe),
        # LoRA as peft's target_parameters puts it on the stacked [E, in, out] tensors (transposed, interleaved)
        Rule(f"{fc1}.weight{{expert}}", f"{expert}.gate_up_proj", GATE_UP_INTERLEAVED, Scope.EXPERT, layers=moe,
             lora=LoraSite("experts", hf_param=f"{EXPERTS}.gate_up_proj")),
        Rule(f"{fc1}.bias{{expert}}", f"{expert}.gate_up_proj_bias", GATE_UP_INTERLEAVED, Scope.EXPERT, layers=moe),
        Rule(f"{fc2}.weight{{expert}}", f"{expert}.down_proj", ROW_TRANSPOSED, Scope.EXPERT, layers=moe,
             lora=LoraSite("experts", hf_param=f"{EXPERTS}.down_proj")),
        # a row-parallel layer adds its whole bias once, after the reduction
        Rule(f"{fc2}.bias{{expert}}", f"{expert}.down_proj_bias", REPLICATED, Scope.EXPERT, layers=moe),
    ]


def hf_stacked(arch: Arch) -> Stacks:
    return experts_stacks(arch, EXPERTS, EXPERT_TENSORS, EXPERTS + ".{expert}.{tensor}")

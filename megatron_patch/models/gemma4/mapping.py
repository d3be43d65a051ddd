"""Gemma 4 HF <-> MCore weight table: q/k/v fused with the input norm, q/k norms, the output projection and the
norm after it, the pre-MLP norm fused into GeGLU's [gate; up], the down projection and the norm after it, and the
layer's stored scalar; the tensors under ``model.`` (Gemma4ForCausalLM). With ``enable_moe_block`` the MLP's rules
are the MoE block's (``moe_rules``). With ``attention_k_eq_v`` the
full-attention layers have no ``v_proj``: their ``linear_qkv`` fuses q and k alone (``GroupedQK``)."""

from megatron_patch.models.description.arch import FULL_ATTENTION, SLIDING_ATTENTION, Arch
from megatron_patch.models.gemma4.settings import settings
from megatron_patch.models.mapping import (
    COLUMN, GATE_UP, GATE_UP_FUSED, QKV, REPLICATED, ROW, VOCAB, LayerKind, LoraSite, Rule, Scope)
from megatron_patch.models.mapping.splits import RowPieces
from megatron_patch.models.mapping.stacks import Stacks, experts_stacks

MC = "decoder.layers.{layer}"
HF = "model.layers.{layer}"


class GroupedQK(RowPieces):
    """q and k fused per query group, ``[q heads of group g; k_g]`` for each g, split by groups: ``GroupedQKV``
    without the values, for a layer whose keys double as them (the layer reads its values from the k rows)."""

    name = "qk"

    def part_rows(self, ctx):
        return [ctx.num_heads * ctx.head_dim, ctx.num_kv_heads * ctx.head_dim]

    def pieces(self, ctx, n):
        hd, per = ctx.head_dim, ctx.num_kv_heads // n  # validate_layout: TP divides every layer's key/value heads
        q = ctx.num_heads // ctx.num_kv_heads * hd
        return [[piece for g in range(k * per, (k + 1) * per)
                 for piece in ((0, g * q, (g + 1) * q), (1, g * hd, (g + 1) * hd))] for k in range(n)]


QK = GroupedQK()


def qkv_rules(arch: Arch, attn: str) -> list[Rule]:
    """``linear_qkv``'s weight and the key norm: from q, k and v; with ``attention_k_eq_v``, from q and k alone on
    the full-attention layers (transformers builds no v_proj there); on a layer that reuses another's keys and
    values (KV sharing), from q alone, without a key norm."""
    own = settings(arch)
    mcore, lora = f"{MC}.self_attention.linear_qkv.weight", LoraSite("qkv")
    qkv = (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight")
    reuse = frozenset(i for i in range(arch.num_layers) if own.reuses_kv(i))
    own_kv = frozenset(range(arch.num_layers)) - reuse if reuse else None
    key_norm = Rule(f"{MC}.self_attention.k_layernorm.weight", f"{attn}.k_norm.weight", REPLICATED, only=own_kv)
    shared = [Rule(mcore, qkv[0], COLUMN, only=reuse, lora=lora)] if reuse else []
    if not own.full_keys_are_values:
        return [Rule(mcore, qkv, QKV, only=own_kv, lora=lora), key_norm, *shared]
    return [Rule(mcore, qkv, QKV, attention=SLIDING_ATTENTION, only=own_kv, lora=lora),
            Rule(mcore, qkv[:2], QK, attention=FULL_ATTENTION, only=own_kv, lora=lora), key_norm, *shared]


def per_layer_input_rules(arch: Arch) -> list[Rule]:
    """The per-layer input embeddings' weights (per_layer_inputs.py): the model-level ones on the first stage
    (the embedding split by vocabulary, the rest replicated), each layer's replicated."""
    if not settings(arch).per_layer_input_size:
        return []
    mc, first = f"{MC}.per_layer_input", Scope.FIRST_STAGE
    return [
        Rule("per_layer_inputs.embed_tokens.weight", "model.embed_tokens_per_layer.weight", VOCAB, first),
        Rule("per_layer_inputs.model_projection.weight", "model.per_layer_model_projection.weight", REPLICATED, first),
        Rule("per_layer_inputs.projection_norm.weight", "model.per_layer_projection_norm.weight", REPLICATED, first),
        Rule(f"{mc}.gate.weight", f"{HF}.per_layer_input_gate.weight", REPLICATED),
        Rule(f"{mc}.projection.weight", f"{HF}.per_layer_projection.weight", REPLICATED),
        Rule(f"{mc}.norm.weight", f"{HF}.post_per_layer_input_norm.weight", REPLICATED),
    ]


EXPERTS = f"{HF}.experts"
EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def moe_rules() -> list[Rule]:
    """The MoE block (``enable_moe_block``): the dense MLP as the shared expert with its norms, the router, the
    experts (transformers stores them stacked: ``experts.gate_up_proj`` [experts, 2 x ffn, hidden], [gate; up]
    halves, and ``down_proj`` [experts, hidden, ffn]; each expert's slice a member, ``hf_stacked``), and the norms
    around the experts and after the sum."""
    moe, mc, mlp, expert = LayerKind.MOE, f"{MC}.mlp", f"{HF}.mlp", f"{EXPERTS}.{{expert}}"
    return [
        Rule(f"{mc}.shared_experts.pre_layernorm.weight", f"{HF}.pre_feedforward_layernorm.weight", REPLICATED),
        Rule(f"{mc}.shared_experts.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), GATE_UP,
             lora=LoraSite("fc1")),
        Rule(f"{mc}.shared_experts.linear_fc2.weight", f"{mlp}.down_proj.weight", ROW, lora=LoraSite("fc2")),
        Rule(f"{mc}.shared_experts.post_layernorm.weight", f"{HF}.post_feedforward_layernorm_1.weight", REPLICATED),
        Rule(f"{mc}.router.weight", f"{HF}.router.proj.weight", REPLICATED, layers=moe),
        Rule(f"{mc}.router.scale", f"{HF}.router.scale", REPLICATED, layers=moe),
        Rule(f"{mc}.router.per_expert_scale", f"{HF}.router.per_expert_scale", REPLICATED, layers=moe),
        Rule(f"{mc}.pre_experts_layernorm.weight", f"{HF}.pre_feedforward_layernorm_2.weight", REPLICATED),
        Rule(f"{mc}.experts.linear_fc1.weight{{expert}}", f"{expert}.gate_up_proj", GATE_UP_FUSED, Scope.EXPERT,
             layers=moe),
        Rule(f"{mc}.experts.linear_fc2.weight{{expert}}", f"{expert}.down_proj", ROW, Scope.EXPERT, layers=moe),
        Rule(f"{mc}.post_experts_layernorm.weight", f"{HF}.post_feedforward_layernorm_2.weight", REPLICATED),
        Rule(f"{mc}.post_layernorm.weight", f"{HF}.post_feedforward_layernorm.weight", REPLICATED),
    ]


def dense_mlp_rules() -> list[Rule]:
    mlp = f"{HF}.mlp"
    return [
        Rule(f"{MC}.mlp.linear_fc1.layer_norm_weight", f"{HF}.pre_feedforward_layernorm.weight", REPLICATED),
        Rule(f"{MC}.mlp.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), GATE_UP,
             lora=LoraSite("fc1")),
        Rule(f"{MC}.mlp.linear_fc2.weight", f"{mlp}.down_proj.weight", ROW, lora=LoraSite("fc2")),
        Rule(f"{MC}.mlp.post_layernorm.weight", f"{HF}.post_feedforward_layernorm.weight", REPLICATED),
    ]


def hf_stacked(arch: Arch) -> Stacks:
    return experts_stacks(arch, EXPERTS, EXPERT_TENSORS, EXPERTS + ".{expert}.{tensor}")


def weight_rules(arch: Arch) -> list[Rule]:
    attn = f"{HF}.self_attn"
    embedding = "model.embed_tokens.weight"
    return [
        Rule("embedding.word_embeddings.weight", embedding, VOCAB, Scope.FIRST_STAGE),
        Rule(f"{MC}.self_attention.linear_qkv.layer_norm_weight", f"{HF}.input_layernorm.weight", REPLICATED),
        *qkv_rules(arch, attn),
        Rule(f"{MC}.self_attention.q_layernorm.weight", f"{attn}.q_norm.weight", REPLICATED),
        Rule(f"{MC}.self_attention.linear_proj.weight", f"{attn}.o_proj.weight", ROW, lora=LoraSite("proj")),
        Rule(f"{MC}.self_attention.post_layernorm.weight", f"{HF}.post_attention_layernorm.weight", REPLICATED),
        *(moe_rules() if arch.is_moe else dense_mlp_rules()),
        Rule(f"{MC}.layer_scalar.weight", f"{HF}.layer_scalar", REPLICATED),
        *per_layer_input_rules(arch),
        Rule("decoder.final_layernorm.weight", "model.norm.weight", REPLICATED, Scope.LAST_STAGE),
        Rule("output_layer.weight", "lm_head.weight", VOCAB, Scope.LAST_STAGE, tied_to=embedding),
    ]

"""Gemma 4 HF <-> MCore weight table: q/k/v fused with the input norm, q/k norms, the output projection and the
norm after it, the pre-MLP norm fused into GeGLU's [gate; up], the down projection and the norm after it, and the
layer's stored scalar; the tensors under ``model.`` (Gemma4ForCausalLM)."""

from megatron_patch.models.description.arch import Arch
from megatron_patch.models.mapping import GATE_UP, QKV, REPLICATED, ROW, VOCAB, LoraSite, Rule, Scope

MC = "decoder.layers.{layer}"
HF = "model.layers.{layer}"


def weight_rules(arch: Arch) -> list[Rule]:
    attn, mlp = f"{HF}.self_attn", f"{HF}.mlp"
    embedding = "model.embed_tokens.weight"
    return [
        Rule("embedding.word_embeddings.weight", embedding, VOCAB, Scope.FIRST_STAGE),
        Rule(f"{MC}.self_attention.linear_qkv.layer_norm_weight", f"{HF}.input_layernorm.weight", REPLICATED),
        Rule(f"{MC}.self_attention.linear_qkv.weight",
             (f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"), QKV, lora=LoraSite("qkv")),
        Rule(f"{MC}.self_attention.q_layernorm.weight", f"{attn}.q_norm.weight", REPLICATED),
        Rule(f"{MC}.self_attention.k_layernorm.weight", f"{attn}.k_norm.weight", REPLICATED),
        Rule(f"{MC}.self_attention.linear_proj.weight", f"{attn}.o_proj.weight", ROW, lora=LoraSite("proj")),
        Rule(f"{MC}.self_attention.post_layernorm.weight", f"{HF}.post_attention_layernorm.weight", REPLICATED),
        Rule(f"{MC}.mlp.linear_fc1.layer_norm_weight", f"{HF}.pre_feedforward_layernorm.weight", REPLICATED),
        Rule(f"{MC}.mlp.linear_fc1.weight", (f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"), GATE_UP,
             lora=LoraSite("fc1")),
        Rule(f"{MC}.mlp.linear_fc2.weight", f"{mlp}.down_proj.weight", ROW, lora=LoraSite("fc2")),
        Rule(f"{MC}.mlp.post_layernorm.weight", f"{HF}.post_feedforward_layernorm.weight", REPLICATED),
        Rule(f"{MC}.layer_scalar.weight", f"{HF}.layer_scalar", REPLICATED),
        Rule("decoder.final_layernorm.weight", "model.norm.weight", REPLICATED, Scope.LAST_STAGE),
        Rule("output_layer.weight", "lm_head.weight", VOCAB, Scope.LAST_STAGE, tied_to=embedding),
    ]

"""Gemma 4's text model (gemma4_text: Gemma4ForCausalLM), dense or with the MoE block beside the dense MLP (the
26B-A4B: models/gemma4/moe.py), its full-attention layers with heads of their own size and count and, with
attention_k_eq_v, keys that double as values; the on-device sizes' (E2B, E4B) per-layer input embeddings
(per_layer_inputs.py, PP=1 only), KV sharing (kv_sharing.py) and double-wide MLP; what it does not build yet is
refused in one line (config.py)."""

from megatron_patch.models.description.family import HFModules, ModelFamily, TestLayouts
from megatron_patch.models.description.registry import register
from megatron_patch.models.gemma4.config import (
    CONFIG_KEYS, TINY_CONFIG, finish_model, layer_spec, parse_config, transformer_config_kwargs)
from megatron_patch.models.gemma4.mapping import hf_stacked, weight_rules
from megatron_patch.models.gemma4.presets import PRESETS
from megatron_patch.models.gemma4.settings import recompute_refused
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="gemma4", summary="Gemma 4's text model (dense, or MoE beside the dense MLP): embedding x "
                           "sqrt(hidden), norms around attention and MLP, q/k/v norms, GeGLU, sliding-window layers "
                           "with default RoPE and global ones with heads of their own size and count, "
                           "proportional partial RoPE and keys that may double as values, a scalar per layer, "
                           "soft-capped logits, tied embeddings; E2B/E4B's per-layer input embeddings (PP=1), KV "
                           "sharing and double-wide MLP",
    hf_model_types=("gemma4_text",), hf_architectures=("Gemma4ForCausalLM",),
    # dense command lines as before; the MoE block (26B-A4B) takes ETP and EP after CP
    launcher_more_parallel_args=(("ETP", "EP"),),
    parse_config=parse_config, config_keys=CONFIG_KEYS, recompute_refused=recompute_refused,
    weight_rules=weight_rules, hf_stacked=hf_stacked, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, layer_spec=layer_spec, finish_model=finish_model,
    # the attention and MLP outputs as the residual adds them: after the norms that follow each
    # (the MoE block's router returns probabilities first: its logits are its projection's)
    hf_modules=HFModules(attention="post_attention_layernorm", mlp="post_feedforward_layernorm", router="router",
                         router_logits="proj"),
    skeleton_from_megatron_core="its norms after the attention and the MLP and its layer scalar are modules of its own",
    test_layouts=TestLayouts(
        parity=(L(), L(tp=2), L(pp=2)),
        round_trips=(("legacy", L(tp=2, pp=2), "bf16"), ("torch_dist", L(tp=2, pp=2), "fp32")),
        memory_plan=((dict(PR="bf16", DO="true"), {}, False),)),
))

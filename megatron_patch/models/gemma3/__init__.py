"""Gemma 3: Gemma3ForCausalLM (1B) and the language model of Gemma3ForConditionalGeneration (4B-27B), its vision
tower carried beside the checkpoint."""

from megatron_patch.models.description.family import HFModules, ModelFamily, TestLayouts
from megatron_patch.models.gemma3.config import (
    CONFIG_KEYS, TINY_CONFIG, finish_model, layer_spec, parse_config, transformer_config_kwargs)
from megatron_patch.models.gemma3.mapping import weight_rules
from megatron_patch.models.gemma3.presets import PRESETS
from megatron_patch.models.description.registry import register
from megatron_patch.runtime.distributed import ParallelLayout as L

FAMILY = register(ModelFamily(
    name="gemma3", summary="Gemma 3 (text, and the multimodal model's language model with its vision tower carried): "
                           "embedding x sqrt(hidden), zero-centred norms around attention and MLP, q/k norms, GeGLU, "
                           "sliding-window and global layers with two RoPE bases, tied embeddings",
    hf_model_types=("gemma3_text", "gemma3"), hf_architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    parse_config=parse_config, config_keys=CONFIG_KEYS,
    weight_rules=weight_rules, tiny_config=TINY_CONFIG, presets=PRESETS,
    transformer_config_kwargs=transformer_config_kwargs, layer_spec=layer_spec, finish_model=finish_model,
    # the attention and MLP outputs as the residual adds them: after the norms that follow each
    hf_modules=HFModules(embedding=("model.embed_tokens", "model.language_model.embed_tokens"),
                         layers=("model.layers", "model.language_model.layers"),
                         final_norm=("model.norm", "model.language_model.norm"),
                         attention="post_attention_layernorm", mlp="post_feedforward_layernorm"),
    hf_carried=(r"(vision_tower|multi_modal_projector)\..+",),
    hf_loaded_prefixes=(("language_model.model.", "model.language_model."),),
    skeleton_from_megatron_core="its norms after the attention and the MLP are modules of its own",
    test_layouts=TestLayouts(
        parity=(L(), L(tp=2), L(pp=2)),
        round_trips=(("legacy", L(tp=2, pp=2), "bf16"), ("torch_dist", L(tp=2), "fp32")),
        memory_plan=((dict(PR="bf16", DO="true"), {}, False),)),
))

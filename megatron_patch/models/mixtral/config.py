"""Mixtral config.json -> Arch: top-k experts, probabilities renormalised over the chosen k. A
``sliding_window`` makes every layer a sliding-window layer, as transformers' Mixtral attends (as Mistral's)."""

import dataclasses

from megatron_patch.models.blocks.decoder import (
    DECODER_KEYS, parse_decoder_config, sliding_every_layer, sliding_window_kwargs)
from megatron_patch.models.description.arch import Arch, require
from megatron_patch.models.description.config_checks import MAX_EXPERTS, MAX_POSITIONS, Real, Whole
from megatron_patch.models.description.hf_defaults import reads_hf_defaults

# transformers' MixtralConfig defaults where the shared parser's fallbacks differ (hf_defaults.py).
HF_DEFAULTS = {"mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.001,
                           "max_position_embeddings": 4096 * 32, "num_key_value_heads": 8}}


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    arch = parse_decoder_config(raw, "mixtral", qkv_bias=False)
    return dataclasses.replace(
        sliding_every_layer(arch, raw.get("sliding_window")),
        num_experts=require(raw, "num_local_experts"),
        moe_topk=require(raw, "num_experts_per_tok"),
        moe_ffn_hidden_size=require(raw, "intermediate_size"),
        norm_topk_prob=True,
        router_aux_loss_coef=float(raw.get("router_aux_loss_coef") or 0.0),
    )


def transformer_config_kwargs(arch: Arch) -> dict:
    return {"moe_router_pre_softmax": False, **sliding_window_kwargs(arch)}


TINY_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "hidden_act": "silu", "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0, "sliding_window": None,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


# The config.json fields this family reads (checked before it reads them: config_checks).
CONFIG_KEYS = {
    **DECODER_KEYS, "num_local_experts": Whole(0, MAX_EXPERTS), "num_experts_per_tok": Whole(1, MAX_EXPERTS),
    "router_aux_loss_coef": Real(0, closed=True), "sliding_window": Whole(1, MAX_POSITIONS),
}

"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``) config.json -> Arch and the megatron-core
settings of DeepSeek sparse attention.

Both are DeepSeek-V3 (multi-latent attention with a query LoRA, DeepSeekMoE with sigmoid routing and a
score-correction bias, the first layers dense, MTP layers after the decoder's) plus a lightning indexer
in every layer that picks the ``index_topk`` keys each query attends to (``index_n_heads`` heads of
``index_head_dim``, RoPE on their first ``qk_rope_head_dim``). Their tensors have the same names; their
configs differ in values and in the indexer's RoPE: on halves for DeepSeek-V3.2, on interleaved pairs for
GLM-5 (transformers 5.24's ``DeepseekV32Indexer`` and ``GlmMoeDsaIndexer``).

DeepSeek-V3's parsing and megatron-core settings are used as they are (``deepseek_v3/config.py``), read
as DeepSeek-V3 reads them: transformers' V3.2 and GLM-5 routers are always V3's (sigmoid, noaux_tc, groups
scored by their top two experts), whatever ``topk_method`` / ``scoring_func`` say.

Refused in one line: a model without a query LoRA (the indexer reads the query latent), GLM-5's shared
top-k layers (``indexer_types`` "shared": a layer reusing the previous layer's selection), MLP layer
types other than first-k-dense, an indexer wider than its RoPE part allows.
"""

import copy
import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import Arch, SparseAttentionShape, require
from megatron_patch.models.description.config_checks import (
    Given, MAX_HEADS, MAX_LAYERS, MAX_POSITIONS, MAX_WIDTH, Names, Whole)
from megatron_patch.models.description.hf_defaults import config_as_transformers_reads, reads_hf_defaults
from megatron_patch.models.deepseek_v3 import config as v3

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).
# So are blocks.builder, blocks.sparse_attention and blocks.spec_edits, which import them at
# their top: when a model is built.

DSA_TYPES = {"deepseek_v32": False, "glm_moe_dsa": True}  # model_type -> indexer RoPE on interleaved pairs
INDEXED_ATTENTION = "indexed_attention"
# What each transformers release writes into layer_types for a layer with the indexer: 5.24 "indexed_attention",
# 5.17 (the lent GPU machine's) "deepseek_sparse_attention". Both mean the same layer.
INDEXED_ATTENTION_NAMES = {INDEXED_ATTENTION, "deepseek_sparse_attention"}

# transformers' DeepseekV32Config and GlmMoeDsaConfig defaults where the families' fallbacks differ (hf_defaults.py).
# Each names every field DeepSeek-V3's table names (with its own value), so that reading the config as V3's
# (``as_v3``) never takes a V3 default in its place: GLM-5's experts have no groups.
HF_DEFAULTS = {
    "deepseek_v32": {"q_lora_rank": 1536, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
                     "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "num_key_value_heads": 128,
                     "max_position_embeddings": 163840},
    "glm_moe_dsa": {"q_lora_rank": 2048, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "num_key_value_heads": 64,
                    "max_position_embeddings": 202752, "rms_norm_eps": 1e-5},
}


def as_v3(raw: dict) -> dict:
    """config.json as DeepSeek-V3's parsing reads it: V3's routing and interleaved MLA RoPE (transformers' V3.2
    and GLM-5 models have no other), no layer types of the indexer's (null: not given)."""
    # neither model reads mlp_bias or has moe_layer_freq (V3's remote code's): as V3 they would be refused
    return raw | {"layer_types": None, "indexer_types": None, "mlp_layer_types": None, "model_type": "deepseek_v3",
                  "topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_interleave": True, "mlp_bias": None,
                  "moe_layer_freq": None}


def shared_topk_layers(raw: dict, layers: int) -> list[int]:
    """The layers that reuse an earlier layer's top-k, as transformers' GLM-5 config decides them: indexer_types
    where given, else index_topk_pattern ("F"ull / "S"hared per layer), else every index_topk_freq-th layer from
    index_skip_topk_offset on runs its own. DeepSeek-V3.2 has none of these fields: every layer runs its own."""
    if raw.get("model_type") != "glm_moe_dsa":
        return []
    types = raw.get("indexer_types")
    if types is None and raw.get("index_topk_pattern") is not None:
        pattern = raw["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    if types is None:
        freq, offset = max(raw.get("index_topk_freq") or 1, 1), raw.get("index_skip_topk_offset", 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    return [i for i, kind in enumerate(types) if kind != "full"]


def sparse_attention_of(raw: dict) -> SparseAttentionShape:
    layers = require(raw, "num_hidden_layers")
    types = raw.get("layer_types")
    if types is not None and (len(types) != layers or not set(types) <= INDEXED_ATTENTION_NAMES):
        raise UserError(f"config.json layer_types must be {INDEXED_ATTENTION} for each of the {layers} layers: "
                        f"found {types}")
    shared = shared_topk_layers(raw, layers)
    if shared:
        raise UserError(f"indexer_types (or index_topk_pattern / index_topk_freq) gives layers {shared[:4]} a shared "
                        "top-k (reusing an earlier layer's selection): not supported, every layer here runs its own "
                        "indexer")
    mlp_types = raw.get("mlp_layer_types")
    dense = min(raw.get("first_k_dense_replace") or 0, layers)
    if mlp_types is not None and list(mlp_types) != ["dense"] * dense + ["sparse"] * (layers - dense):
        raise UserError(f"mlp_layer_types {mlp_types} is not the first {dense} layers dense and the rest sparse "
                        "(first_k_dense_replace): not supported")
    if raw.get("q_lora_rank") is None:
        raise UserError("q_lora_rank is missing: DeepSeek sparse attention's indexer reads the query latent")
    shape = SparseAttentionShape(topk=require(raw, "index_topk"), n_heads=require(raw, "index_n_heads"),
                                 head_dim=require(raw, "index_head_dim"), rope_head_dim=require(raw, "qk_rope_head_dim"),
                                 rope_interleaved=DSA_TYPES[raw["model_type"]])
    if shape.rope_head_dim > shape.head_dim or shape.rope_head_dim % 2:
        raise UserError(f"index_head_dim={shape.head_dim} cannot hold an even RoPE part of qk_rope_head_dim="
                        f"{shape.rope_head_dim}")
    return shape


@reads_hf_defaults(HF_DEFAULTS)
def parse_config(raw: dict) -> Arch:
    if raw.get("model_type") not in DSA_TYPES:
        raise UserError(f"model_type '{raw.get('model_type')}' is not a DeepSeek sparse attention model")
    sparse = sparse_attention_of(raw)
    arch = v3.parse_config(as_v3(raw))
    return dataclasses.replace(arch, family=raw["model_type"], sparse_attention=sparse, hf_config=raw)


def v3_view(arch: Arch) -> Arch:
    return dataclasses.replace(arch, hf_config=as_v3(config_as_transformers_reads(arch.hf_config, HF_DEFAULTS)))


def transformer_config_kwargs(arch: Arch) -> dict:
    sparse = arch.sparse_attention
    return dict(
        v3.transformer_config_kwargs(v3_view(arch)),
        experimental_attention_variant="dsa", dsa_indexer_n_heads=sparse.n_heads,
        dsa_indexer_head_dim=sparse.head_dim, dsa_indexer_topk=sparse.topk,
        # off unless the launcher asks (MP_DSA_INDEXER_LOSS_COEFF): fine-tuning a released model keeps its indexer
        dsa_indexer_loss_coeff=0.0,
        # the family's local modules, with or without transformer-engine (models/blocks/sparse_attention.py)
        persist_layer_norm=False, apply_rope_fusion=False, moe_grouped_gemm=False, gradient_accumulation_fusion=False,
    )


def layer_spec(arch: Arch, config, use_te: bool, vp_stage, core_attention: str | None):
    """megatron-core's local layer specs (dense and MoE layers as config.json places them) with DeepSeek
    sparse attention as MLA's core attention; the same modules with or without transformer-engine."""
    from megatron_patch.models.blocks import builder
    from megatron_patch.models.blocks.sparse_attention import core_attention_spec

    plain = copy.copy(config)  # megatron-core 0.19's standard block specs refuse an attention variant
    plain.experimental_attention_variant = None
    spec = builder.layer_spec(arch, plain, use_te=False, vp_stage=vp_stage, core_attention=core_attention,
                              family_spec=False)
    attention = core_attention_spec(arch.sparse_attention.rope_interleaved)
    if hasattr(spec, "layer_specs"):
        spec.layer_specs = [_with_sparse_attention(s, attention) for s in spec.layer_specs]
        return spec
    return _with_sparse_attention(spec, attention)


def _with_sparse_attention(layer, attention):
    from megatron_patch.models.blocks.sparse_attention import SparseMLASelfAttention
    from megatron_patch.models.blocks.spec_edits import submodules_of, with_module, with_submodules

    # the latent norms are already transformers' (builder's local MLA layer: LatentRMSNorm); the MLA module lends
    # a generation's inference context to the core attention, whose indexer keeps its keys there
    self_attention = with_module(submodules_of(layer).self_attention, SparseMLASelfAttention)
    self_attention = with_submodules(self_attention, core_attention=attention)
    return with_submodules(layer, self_attention=self_attention)


# A tiny DeepSeek-V3.2: DeepSeek-V3's tiny model (q-LoRA, YaRN, grouped sigmoid routing, a shared expert, the
# first layer dense, 3 layers so that PP=3 splits it) with an indexer of 4 heads of 32 (RoPE on 16) keeping
# the top 8 keys, so that a sequence longer than 8 attends sparsely.
TINY_CONFIG = {
    **{k: v for k, v in v3.TINY_CONFIG.items() if k not in ("topk_method", "scoring_func")},
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "index_topk": 8, "index_n_heads": 4, "index_head_dim": 32,
}

# A tiny GLM-5: the same shape without YaRN (GLM-5 has plain RoPE) and with GLM's RMSNorm epsilon; its indexer
# rotates interleaved pairs.
GLM_TINY_CONFIG = {
    **{k: v for k, v in TINY_CONFIG.items() if k not in ("rope_scaling", "rope_interleave")},
    "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
}


# The config.json fields these families read: DeepSeek-V3's and the indexer's.
CONFIG_KEYS = {
    **v3.CONFIG_KEYS, "index_topk": Whole(1, MAX_POSITIONS), "index_n_heads": Whole(1, MAX_HEADS),
    "index_head_dim": Whole(1, MAX_WIDTH), "index_topk_freq": Whole(1, MAX_LAYERS), "index_topk_pattern": Given(),
    "index_skip_topk_offset": Whole(0, MAX_LAYERS),
    "layer_types": Names(MAX_LAYERS), "indexer_types": Names(MAX_LAYERS), "mlp_layer_types": Names(MAX_LAYERS),
}

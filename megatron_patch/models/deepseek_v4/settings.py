"""DeepSeek-V4's own settings, typed: what only its modules read (kept in ``Arch.family_config``). A module of its own,
so that the config reader, the layers and the weight table all read it without importing each other."""

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import Arch, FamilyConfig

# config.json's names for the attention of each layer (``layer_types``) and for its MoE block (``mlp_layer_types``)
SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"  # compressed sparse attention: every 4 tokens one entry, a top-k indexer
HCA = "heavily_compressed_attention"  # heavily compressed attention: every 128 tokens one entry, no indexer
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)


@dataclasses.dataclass(frozen=True)
class DeepseekV4Settings(FamilyConfig):
    """What only DeepSeek-V4's own modules read. The MoE sizes, the heads and the main RoPE are the Arch's.

    The attention of every layer is a sliding window (``sliding_window`` keys) over one shared key/value head
    (``num_kv_heads=1``: multi-query), with queries through a low-rank latent (``q_lora_rank``), a learnt sink
    per head, RoPE on the last ``qk_rope_head_dim`` of each head, and a grouped output projection (``o_groups``
    groups of heads each through ``o_lora_rank``); CSA and HCA layers add compressed entries (one per
    ``compress_rates[type]`` tokens) with RoPE of their own (``compress_rope_theta``, ``compress_rope_scaling``),
    CSA layers picking ``index_topk`` of them with a lightning indexer (``index_n_heads`` heads of
    ``index_head_dim``)."""

    # per layer (``Arch.layer_types`` holds the attention's too)
    mlp_layer_types: tuple[str, ...]
    # manifold-constrained hyper-connections: hc_mult residual streams, the comb mix projected onto the doubly
    # stochastic matrices by hc_sinkhorn_iters Sinkhorn-Knopp steps, hc_eps the floor of every normalisation
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # attention
    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    compress_rates: tuple[tuple[str, int], ...]  # (layer type, tokens per compressed entry) for CSA and HCA
    compress_rope_theta: float
    compress_rope_scaling: dict | None  # YaRN on the compressed branches (attention_factor 1.0), None: plain RoPE
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # MoE (experts, top-k, sizes and the shared expert are the Arch's)
    scoring_func: str  # "sqrtsoftplus", "softmax" or "sigmoid"
    routed_scaling_factor: float
    swiglu_limit: float  # the experts' (and the shared expert's) gate clamped at most, up into [-limit, limit]
    num_nextn_predict_layers: int  # MTP layers in the hub checkpoint (transformers builds none)

    # the one key/value head is whole on every TP rank; the heads and the output groups split (attention.py)
    replicated_kv_heads = True
    # evaluation: the CSA indexer's choice among compressed entries is not held to the unpadded one (a generation
    # continues its attention's own state in the inference context: attention.py's GenerationState)
    padding_is_neutral = False
    # the CSA indexer is frozen, as DeepSeek-V3.2's without its loss (attention.py)
    frozen_parameters = (".indexer.",)
    # transformers' _keep_in_fp32_modules_strict under megatron-core's names (layers.py marks them on the model);
    # the query latent's norm, q_layernorm, is linear_q_up_proj.layer_norm_weight in the checkpoint the shape reads
    float32_parameters = ("attn_hc", "ffn_hc", "hc_head", "sinks", "position_bias", "q_layernorm", "kv_layernorm",
                          "input_layernorm", "pre_mlp_layernorm", "final_layernorm", "layer_norm_weight")
    core_attention = False  # its attention computes its own scores (attention.py)

    @property
    def hyper_connections(self) -> tuple[int, int]:
        return self.hc_mult, self.hc_sinkhorn_iters

    def check_layout(self, arch, layout, pp_first_stage_layers) -> None:
        if layout.cp > 1:
            raise UserError(f"CP={layout.cp}: DeepSeek-V4's sliding and compressed attention sees the whole sequence on "
                            "one rank (its compressor's windows and the indexer's top-k are not split): set CP=1")
        if self.o_groups % layout.tp:
            raise UserError(f"TP={layout.tp} does not divide DeepSeek-V4's {self.o_groups} output groups "
                            "(o_groups): choose a TP that divides it")

    def least_weight_elements(self, arch) -> int:
        """The embedding, each layer's grouped output projection (heads -> o_groups x o_lora_rank -> hidden, a
        fraction of the common bound's heads x head_dim x hidden) and its experts' up and down projections at half
        a byte per weight (the hub stores them in FP4, two to a byte)."""
        h = arch.hidden_size
        output = arch.num_heads * arch.head_dim * self.o_lora_rank + self.o_groups * self.o_lora_rank * h
        experts = arch.num_experts * 2 * arch.moe_ffn_hidden_size * h // 2
        return arch.vocab_size * h + arch.num_layers * (output + experts)

    def compress_rate(self, layer_type: str) -> int:
        """Tokens per compressed entry of a CSA or HCA layer (0: a sliding-window layer compresses nothing)."""
        return dict(self.compress_rates).get(layer_type, 0)

    def is_hash_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s experts are chosen by the token id (``tid2eid``), not by the router."""
        return self.mlp_layer_types[layer] == HASH_MOE

    def routes_by_token_id(self, layer: int) -> bool:
        return self.is_hash_layer(layer)  # FamilyConfig's question: the aligner holds these layers' routing exact


def settings(arch: Arch) -> DeepseekV4Settings:
    return arch.family_config

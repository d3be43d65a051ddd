"""Core attention for multi-latent attention with megatron-core's local layer spec (CPU).

MLA gives queries and keys a wider head (the RoPE part besides the rest) than values, and builds its
core attention with ``k_channels`` / ``v_channels``; megatron-core 0.16's local ``DotProductAttention``
refuses those keywords although its arithmetic already follows the tensors' own head sizes (scores
from q and k, context from v, reshaped by ``kv_channels``, which the DeepSeek family sets to the value
head size, with the softmax scale MLA passes in). This class only takes the keywords.

``RopeKeyGradsSummed`` sums the shared RoPE key's gradient over TP, which megatron-core's local-spec MLA leaves
per rank (every MLA module here takes it).

``LocalMLASelfAttention`` is the MLA module of the local spec; for a model without a query LoRA (``q_lora_rank`` None,
DeepSeek-V2-Lite, Moonlight) on the local spec. megatron-core 0.19 resolves the latent norms itself and,
under ``qk_layernorm`` without a query LoRA, asks for a fused norm+linear query projection that only
transformer-engine has (and that would add a query norm these models lack). The local spec already
says what to build: the plain query projection, no query norm, the KV latent norm and the plain KV up
projection; this class builds exactly that. 0.16 has no resolver and builds the same from the spec.
"""

from __future__ import annotations

import megatron.core.transformer.multi_latent_attention as mla_module
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_patch.models.blocks.tp_gradients import SumOverTP


class LocalMLACoreAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"multi-latent attention's value heads ({v_channels}) must equal kv_channels "
                             f"({config.kv_channels}) for the local core attentions")
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)


class RopeKeyGradsSummed:
    """MLA on the local spec at TP > 1, with its key/value down projection split over TP: the gradient of the
    shared RoPE key (``k_pos_emb``) summed over the TP ranks.

    megatron-core (0.16, 0.19) gathers the split down projection's output over TP and takes the RoPE key from it
    whole; each rank's attention heads then add their part of its gradient, and the gather's backward keeps each
    rank's own part only (transformer-engine's duplicated projection takes the other branch, which sums them).
    So the down projection's gradient, and everything before it, was wrong at TP=2 (1.4% in the gradient norm of
    DeepSeek-V3's tiny model; the forward equal), in every MLA family. Here the RoPE key's columns pass, after the
    gather, through an identity whose backward all-reduces over TP (``tp_gradients.SumOverTP``)."""

    def get_query_key_value_tensors(self, *args, **kwargs):
        gather = mla_module.gather_from_tensor_model_parallel_region
        kv_lora, rope = self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim
        # the query latent's gather comes first where there is one (q_lora_rank): only the key/value one is changed
        calls = []

        def gather_summing_rope_grads(tensor, *gather_args, **gather_kwargs):
            out = gather(tensor, *gather_args, **gather_kwargs)
            calls.append(out)
            is_kv = len(calls) == (2 if self.config.q_lora_rank is not None else 1)
            if not is_kv or out.size(-1) != kv_lora + rope:
                return out
            latent, rope_key = torch.split(out, [kv_lora, rope], dim=-1)
            return torch.cat([latent, SumOverTP.apply(rope_key)], dim=-1)

        mla_module.gather_from_tensor_model_parallel_region = gather_summing_rope_grads
        try:
            return super().get_query_key_value_tensors(*args, **kwargs)
        finally:
            mla_module.gather_from_tensor_model_parallel_region = gather


class LocalMLASelfAttention(RopeKeyGradsSummed, MLASelfAttention):
    def _resolve_qk_norm_config(self, submodules) -> dict:
        if self.config.q_lora_rank is not None:
            return super()._resolve_qk_norm_config(submodules)
        return dict(linear_q_proj=submodules.linear_q_proj, linear_q_up_proj=IdentityOp,
                    linear_kv_up_proj=submodules.linear_kv_up_proj, q_layernorm=IdentityOp,
                    kv_layernorm=submodules.kv_layernorm)


# transformers' DeepSeek MLA builds its latent norms (q_a_layernorm, kv_a_layernorm) without passing
# rms_norm_eps: they keep RMSNorm's default epsilon whatever config.json says (GLM-5: 1e-5 elsewhere).
LATENT_NORM_EPS = 1e-6


class LatentRMSNorm(WrappedTorchNorm):
    """The local spec's RMSNorm for MLA's query and key/value latents, with transformers' epsilon."""

    def __new__(cls, config, hidden_size: int, eps: float = LATENT_NORM_EPS, **kwargs):
        return super().__new__(cls, config, hidden_size, eps=LATENT_NORM_EPS, **kwargs)

"""Core attention for multi-latent attention with megatron-core's local layer spec (CPU).

MLA gives queries and keys a wider head (the RoPE part besides the rest) than values, and builds its
core attention with ``k_channels`` / ``v_channels``; megatron-core 0.16's local ``DotProductAttention``
refuses those keywords although its arithmetic already follows the tensors' own head sizes (scores
from q and k, context from v, reshaped by ``kv_channels``, which the DeepSeek family sets to the value
head size, with the softmax scale MLA passes in). This class only takes the keywords.

``LocalMLASelfAttention`` is the MLA module for a model without a query LoRA (``q_lora_rank`` None,
DeepSeek-V2-Lite, Moonlight) on the local spec. megatron-core 0.19 resolves the latent norms itself and,
under ``qk_layernorm`` without a query LoRA, asks for a fused norm+linear query projection that only
transformer-engine has (and that would add a query norm these models lack). The local spec already
says what to build: the plain query projection, no query norm, the KV latent norm and the plain KV up
projection; this class builds exactly that. 0.16 has no resolver and builds the same from the spec.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class LocalMLACoreAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"multi-latent attention's value heads ({v_channels}) must equal kv_channels "
                             f"({config.kv_channels}) for the local core attentions")
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)


class LocalMLASelfAttention(MLASelfAttention):
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

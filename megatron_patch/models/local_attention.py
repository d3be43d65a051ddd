"""Core attention for multi-latent attention with megatron-core's local layer spec (CPU).

MLA gives queries and keys a wider head (the RoPE part besides the rest) than values, and builds its
core attention with ``k_channels`` / ``v_channels``; megatron-core 0.16's local ``DotProductAttention``
refuses those keywords although its arithmetic already follows the tensors' own head sizes (scores
from q and k, context from v, reshaped by ``kv_channels``, which the DeepSeek family sets to the value
head size, with the softmax scale MLA passes in). This class only takes the keywords.
"""

from __future__ import annotations

from megatron.core.transformer.dot_product_attention import DotProductAttention


class LocalMLACoreAttention(DotProductAttention):
    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, k_channels=None, v_channels=None):
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"multi-latent attention's value heads ({v_channels}) must equal kv_channels "
                             f"({config.kv_channels}) for the local core attention")
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)

"""Gemma 4's KV sharing (E2B, E4B: ``num_kv_shared_layers``), as transformers 5.24 computes it: the last N layers
have no key or value projection and no k_norm; each takes the keys and values of the last earlier layer of its
attention type (the "store" layer, ``Gemma4Settings.store_of``), after their k_norm and v_norm and before RoPE,
which the reusing layer applies with the same embedding (its type's) as the store layer, so the rotated keys are
the store layer's bit for bit.

On megatron-core, a reusing layer's ``linear_qkv`` holds only the query rows (its builder is handed that size), and
``get_query_key_value_tensors`` returns its queries with the stored keys and values. These pass from the store
layer to the reusing ones in one forward through a dict the model chunk's layers share (``share_store``), so the
store layer and its reusing layers must be in one model chunk (``Gemma4Settings.check_layout`` refuses a pipeline
that parts them) and full activation recomputation, which would recompute the reusing layers from keys computed
without a graph, is refused.
"""

from __future__ import annotations

import dataclasses

from megatron_patch.errors import UserError
from megatron_patch.models.gemma4.settings import KV_SHARING_FULL_RECOMPUTE


class NoKeyNorm:
    """A spec entry that builds no key norm: megatron-core 0.16 builds none for ``None``, 0.19 its default
    (TENorm) instead; both build this class, which gives None."""

    def __new__(cls, *args, **kwargs):
        return None


class SharesKeysValues:
    """Mixed into Gemma 4's self-attention ahead of it: ``kv_sharing`` (a spec parameter) None, "store" (its keys
    and values kept for the reusing layers) or "reuse" (the stored ones taken, no key/value weights)."""

    kv_store: dict | None = None  # set by share_store: the model chunk's layer type -> (keys, values)

    def __init__(self, config, submodules, *args, kv_sharing: str | None = None, **kwargs):
        if kv_sharing == "reuse":
            if config.recompute_granularity == "full":
                raise UserError(KV_SHARING_FULL_RECOMPUTE)  # refused before launch too (settings.recompute_refused)
            shape = kwargs.get("attention_shape")  # the layer's own, else the model's
            rows = config.num_attention_heads * (shape.head_dim if shape else config.kv_channels)
            linear = submodules.linear_qkv
            submodules = dataclasses.replace(submodules, k_layernorm=NoKeyNorm,
                                             linear_qkv=lambda size, _rows, **kw: linear(size, rows, **kw))
        super().__init__(config, submodules, *args, **kwargs)
        self.kv_sharing = kv_sharing

    def get_query_key_value_tensors(self, hidden_states, *args, **kwargs):
        if self.kv_sharing != "reuse":
            query, key, value = super().get_query_key_value_tensors(hidden_states, *args, **kwargs)
            if self.kv_sharing == "store":
                self.kv_store[self.layer_type] = key, value
            return query, key, value
        if self.layer_type not in self.kv_store:
            raise RuntimeError(f"gemma4 layer {self.layer_number}: no stored keys and values for its "
                               f"{self.layer_type} layers (the store layer did not run before it)")
        query, _ = self.linear_qkv(hidden_states)
        query = query.view(*query.shape[:-1], -1, self.hidden_size_per_attention_head)
        key, value = self.kv_store[self.layer_type]
        return self.q_layernorm(query), key, value


def share_store(model) -> None:
    """One store of keys and values for the KV-sharing layers of ``model`` (a model chunk)."""
    store: dict = {}
    for module in model.modules():
        if isinstance(module, SharesKeysValues):
            module.kv_store = store

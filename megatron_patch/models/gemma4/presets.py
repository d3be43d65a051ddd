"""Gemma 4 sizes (MODEL_SIZE in the launcher): ``tiny`` only. Each published size still needs something this model
refuses in one line (config.py), as transformers' ``convert_gemma4_weights.py`` configures them: E2B and E4B
per-layer input embeddings (``hidden_size_per_layer_input=256``) and KV sharing (``num_kv_shared_layers`` 20 and
18); 26B-A4B the MoE block. The 31B needs none of them: its keys doubling as values (``attention_k_eq_v``) and its
full-attention heads of 512 (``global_head_dim``) are built."""

from megatron_patch.models.gemma4.config import TINY_CONFIG

PRESETS = {"tiny": TINY_CONFIG}

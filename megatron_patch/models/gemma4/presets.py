"""Gemma 4 sizes (MODEL_SIZE in the launcher): ``tiny`` only. Every published size (E2B, E4B, 26B-A4B, 31B) has a
head dim on its full-attention layers apart from the sliding ones' (``global_head_dim``), and the E sizes add
per-layer input embeddings and KV sharing, the 26B-A4B the MoE block: each is refused in one line (config.py)
until the model builds it, so none is offered as a preset."""

from megatron_patch.models.gemma4.config import TINY_CONFIG

PRESETS = {"tiny": TINY_CONFIG}

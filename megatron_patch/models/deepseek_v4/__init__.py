"""DeepSeek-V4 (deepseek_v4): hyper-connection streams (hyper_connections.py), sliding, compressed sparse and
heavily compressed attention (attention.py), hash-routed and top-k MoE (moe.py), as the family's own modules on
megatron-core's GPTModel (layers.py); the hub's own tensor names (hub_names.py) and weight table (mapping.py);
docs/deepseek.md."""

from megatron_patch.models.deepseek_v4.family import FAMILY
from megatron_patch.models.description.registry import register

register(FAMILY)

"""Model families (one folder each) and what they share: Arch, the builder, RoPE, tiny models.

The registry of families is ``megatron_patch.models.registry``.
"""

_REGISTRY_NAMES = ("FAMILIES", "get_family", "detect_family", "parse_arch")


def __getattr__(name):
    # Lazy, so that modules the families themselves import (arch, convert.mapping) do not cycle.
    if name in _REGISTRY_NAMES:
        from megatron_patch.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'megatron_patch.models' has no attribute '{name}'")

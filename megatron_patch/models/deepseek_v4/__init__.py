"""DeepSeek-V4 (deepseek_v4): being built, not a registered family yet (docs/deepseek.md). Its ``ModelFamily`` is in
family.py; tests register it for their length (``family.registered()``), and the processes they start (rank
workers, the converter's skeleton helper) register it too, as ``registered()`` names it in the registry's
``BEING_BUILT_VARIABLE``, which they inherit."""

from megatron_patch.models.description.registry import being_built_and_asked_for, register

if being_built_and_asked_for("deepseek_v4"):
    from megatron_patch.models.deepseek_v4.family import FAMILY

    register(FAMILY)

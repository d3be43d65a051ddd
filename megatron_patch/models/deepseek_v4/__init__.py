"""DeepSeek-V4 (deepseek_v4): being built, not a registered family yet (docs/deepseek.md). Its ``ModelFamily`` is in
family.py; tests register it for their length (``family.registered()``), and the processes they start (rank
workers, the converter's skeleton helper) register it too because ``registered()`` names it in
``MPATCH_FAMILIES_BEING_BUILT``, which they inherit."""

import os

BEING_BUILT_VARIABLE = "MPATCH_FAMILIES_BEING_BUILT"

if "deepseek_v4" in os.environ.get(BEING_BUILT_VARIABLE, "").split(","):
    from megatron_patch.models.deepseek_v4.family import FAMILY
    from megatron_patch.models.description.registry import register

    register(FAMILY)

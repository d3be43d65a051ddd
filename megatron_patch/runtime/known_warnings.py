"""Warnings every run on a machine without transformer-engine or Apex would print, several times per rank, and
that say nothing the dry run and ``mpatch info`` do not (what is installed, what runs instead). The project's
entry points (``mpatch``, and through it each rank of a launch) filter exactly these; every other warning shows.
"""

from __future__ import annotations

import warnings

# (message start, the module that warns): megatron-core's import-time fallback notices.
KNOWN = (
    (r"Transformer Engine and Apex are not installed", r"megatron\."),
    (r"Apex is not installed", r"megatron\."),
)


def quiet_known_warnings() -> None:
    for message, module in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)

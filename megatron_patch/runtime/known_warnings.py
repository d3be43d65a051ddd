"""Warnings every run on a machine without transformer-engine or Apex would print, several times per rank, and
that say nothing the dry run and ``mpatch info`` do not (what is installed, what runs instead). The project's
entry points (``mpatch``, and through it each rank of a launch) filter exactly these; every other warning shows.
"""

from __future__ import annotations

import logging
import warnings

# (message start, the module that warns): megatron-core's import-time fallback notices.
KNOWN = (
    (r"Transformer Engine and Apex are not installed", r"megatron\."),
    (r"Apex is not installed", r"megatron\."),
)


# (logger, message start): megatron-core's log warnings that a family's own module classes set off. TransformerLayer
# knows an MLP by identity (MLP, MoELayer, ...): a family's subclass of one (Gemma's MLP with its norm after it,
# Gemma 4's MoE block) gets megatron-core's default process groups, which are the ones this project initialises,
# and a warning per layer and rank.
KNOWN_LOGS = (("megatron.core.transformer.transformer_layer", "Unknown MLP type"),)


class _DropKnown(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_known_warnings() -> None:
    for message, module in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    for name, start in KNOWN_LOGS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnown) and f.start == start for f in logger.filters):
            logger.addFilter(_DropKnown(start))

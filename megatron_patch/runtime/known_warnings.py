"""Warnings every run on a machine without transformer-engine or Apex would print, several times per rank, and
the notices that torchao's and torch's imports print, that say nothing the dry run and ``mpatch info`` do not
(what is installed, what runs instead, which device). The project's entry points (``mpatch``, and through it
each rank of a launch) filter exactly these; every other warning shows.
"""

from __future__ import annotations

import logging
import warnings

# (message start, the module that warns): megatron-core's import-time fallback notices.
KNOWN = (
    (r"Transformer Engine and Apex are not installed", r"megatron\."),
    (r"Apex is not installed", r"megatron\."),
    # megatron-core 0.19 (Python 3.12+) has each rank read its own shards of a torch_dist checkpoint through torch's
    # checkpoint.load(..., no_dist=True), with positional arguments: two notices per rank and load (every launch,
    # resume, align and eval), the second saying that torch.distributed is not initialised in a multi-rank job.
    (r"The argument order of load has been changed", r"torch\.distributed\.checkpoint"),
    (r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a single "
     r"process", r"torch\.distributed\.checkpoint"),
)


# (logger, message start): megatron-core's log warnings that a family's own module classes set off. TransformerLayer
# knows an MLP by identity (MLP, MoELayer, ...): a family's subclass of one (Gemma's MLP with its norm after it,
# Gemma 4's MoE block) gets megatron-core's default process groups, which are the ones this project initialises,
# and a warning per layer and rank.
KNOWN_LOGS = (("megatron.core.transformer.transformer_layer", "Unknown MLP type"),
              # torchao's import, wherever torchao is installed (PR=fp8, the test extras): transformers imports it
              # whenever it loads a model (from 5.25: quantizers/auto.py), so align, eval and a local job printed
              # these each time. Its CUDA extensions that cannot load here are not the float8 training path, and
              # torch's notice is about torchao's own calls. ``models/blocks/float8.py`` installs this filter before
              # its own import of torchao, for callers that came in through no entry point.
              ("torchao", "Failed to load "),
              ("torchao", "Skipping import of cpp extensions"),
              ("torch.utils._pytree", "%s is an Enum subclass and is now natively supported by torch.compile"),
              # megatron-core imports torch's cpp_extension as it loads (nccl_allocator.py); under a CUDA build of
              # torch (what pip gives on Python 3.12+, or for torch > 2.13) on a machine with a CUDA toolkit and no
              # GPU, that import logs this once per process. A GPU run never sees it; on CPU, the dry run and
              # `mpatch info` say the device.
              ("torch.utils.cpp_extension", "No CUDA runtime is found"),
              # megatron-core 0.19 (Python 3.12+) logs this on rank 0 each time a GPTModel is built (every launch,
              # align and eval): its advice is for code that builds the model, which here is this project's.
              ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
              # matplotlib (align's and eval's plots) under a HOME it cannot write (a read-only home on a cluster
              # node): it takes a temporary folder for its config and font cache itself, removes it at exit, and
              # says so in two lines whose advice (set MPLCONFIGDIR) is for a program that plots often; a plot or
              # two a run needs no cache. Its font cache, rebuilt there, adds one more after 5 s.
              ("matplotlib", "mkdir -p failed for path "),
              ("matplotlib", "%s is not a writable directory"),
              ("matplotlib", "Matplotlib created a temporary cache directory"),
              ("matplotlib.font_manager", "Matplotlib is building the font cache"))


class _DropKnown(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def quiet_known_warnings() -> None:
    for message, module in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)
    for name in dict.fromkeys(name for name, _ in KNOWN_LOGS):
        logger = logging.getLogger(name)
        logger.filters[:] = [f for f in logger.filters if not isinstance(f, _DropKnown)]  # once, however often called
        logger.addFilter(_DropKnown(tuple(start for n, start in KNOWN_LOGS if n == name)))

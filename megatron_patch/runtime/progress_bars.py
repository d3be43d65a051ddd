"""Other libraries' progress bars (transformers' "Loading weights", lm-eval's per-task and "Tokenizing inputs"
bars): tqdm frames joined by carriage returns, which a log file keeps as garbage. The product's rule (README,
"Data"): a bar only where stderr is a terminal, and none under --quiet."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Iterator


def bars_wanted(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


def hide_transformers_bars() -> None:
    """transformers' own switch, for every model this process loads."""
    from transformers.utils import logging as hf_logging  # transformers: only where a model is loaded

    hf_logging.disable_progress_bar()


@contextlib.contextmanager
def lm_eval_task_bars(shown: bool) -> Iterator[None]:
    """lm-eval draws a bar per task as it builds the requests, with no switch of its own (its model's bar has one:
    ``MpatchLM(progress_bars=...)``): its module's tqdm is swapped for one that draws nothing, for the block."""
    import lm_eval.api.task as lm_task  # lm-eval: an optional package, imported only where it runs

    if shown:
        yield
        return
    drawing = lm_task.tqdm
    lm_task.tqdm = functools.partial(drawing, disable=True)
    try:
        yield
    finally:
        lm_task.tqdm = drawing

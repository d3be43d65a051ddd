"""Evaluation in place: lm-evaluation-harness over this project's megatron-core model (docs/evaluation.md).

One job: score a model with the harness, at any layout, without converting it to HF first. Imports go
downward: the CLI imports this package; it uses models/, the checkpoint loaders and runtime/; nothing
below imports it.

- ``evaluate.evaluate_checkpoint``: a checkpoint, in local rank processes (``mpatch eval``);
- ``evaluate.evaluate_live_model``: this rank's built model chunks, on every rank of a running job (what
  training calls between iterations);
- ``harness.MpatchLM``: the ``LM`` subclass registered in lm-eval as "mpatch";
- ``runner.ModelRunner``: log-likelihoods and KV-cached generation on the ranks.
"""

import importlib.util
import sys

from megatron_patch.errors import UserError

# The lm-evaluation-harness release this package is written against (the `[eval]` extra pins it).
LM_EVAL_VERSION = "0.4.13"

# What `mpatch eval` and a training run's MP_EVAL_TASKS both read, checked alike: here, where neither lm-eval nor
# torch is imported, so that the launcher's checks stay light.


def require_lm_eval(who: str) -> None:
    """``who`` (e.g. "mpatch eval") runs lm-eval: refused in one line where it is not installed."""
    if importlib.util.find_spec("lm_eval") is None:
        raise UserError(f"{who} runs lm-evaluation-harness, which is not installed: pip install -e \".[eval]\" in "
                        f"megatron_patch's repository (or pip install lm-eval=={LM_EVAL_VERSION})")


def task_names(option: str, raw: str) -> tuple[str, ...]:
    """A comma-separated list of lm-eval task names, given as ``option``."""
    names = tuple(t.strip() for t in raw.split(",") if t.strip())
    if not names:
        raise UserError(f"{option} names no task: give a comma-separated list of lm-eval tasks, e.g. "
                        "mpatch_perplexity")
    return names


def document_limit(option: str, value: float) -> int | float:
    """Documents per task: a count, or a fraction below 1 (lm-eval's ``limit``)."""
    if not value > 0:  # NaN too
        raise UserError(f"{option} must be > 0 (a count, or a fraction below 1), got {value:g}")
    # lm-eval reads 1.5 as 1 document: a fraction above 1 is meant, or a count is mistyped; either way not that
    if value >= 1 and not float(value).is_integer():  # inf too
        raise UserError(f"{option} must be a whole number of documents, or a fraction below 1 (0.5: half of each "
                        f"task's), got {value:g}")
    # a count past any task's documents is all of them; past sys.maxsize lm-eval's islice refused it, in every rank
    # after the model had loaded (and in training, at the first evaluation: the tools audit)
    return min(int(value), sys.maxsize) if value >= 1 else value

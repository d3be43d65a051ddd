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

# The lm-evaluation-harness release this package is written against (the `[eval]` extra pins it).
LM_EVAL_VERSION = "0.4.13"

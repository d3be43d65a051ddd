"""Task evaluation during training (MP_EVAL_TASKS): lm-evaluation-harness on the live model, at the training
layout, every MP_EVAL_TASKS_INTERVAL iterations, with no save or reload (``evaluation.evaluate_live_model``).

What it cannot run is refused before any rank starts: a virtual pipeline (evaluation runs one chunk per rank),
context parallelism, sequence parallelism on a model whose scores depend on padding (DeepSeek sparse attention),
no interval, no HF tokenizer, lm-eval missing, an unknown task (the shipped offline tasks, lm-eval's own and
those under MP_EVAL_INCLUDE_PATH are known) or one whose data cannot be read offline.
Results go to the run's log (one line per task metric), TensorBoard (``eval/TASK/METRIC``) and one JSON line per
evaluation in ``eval/results.jsonl`` (``run_folder.EVAL_RESULTS``), which the run appends to as it does to
``log/metrics.jsonl``.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np

from megatron_patch.errors import UserError
from megatron_patch.evaluation import require_lm_eval
from megatron_patch.runtime.scratch import scratch_folder
from megatron_patch.training.launcher_args import launched_rank

# evaluation.evaluate and evaluation.loading (lm-eval, torch and megatron-core come with them) are imported inside the
# functions that use them: the launcher's checks of a run without MP_EVAL_TASKS never import them.


def settle_options(options) -> None:
    """MP_EVAL_TASKS_INTERVAL's default (the validation interval); the part's other options only with tasks."""
    options.settle("MP_EVAL_TASKS_INTERVAL", eval_interval=options["MP_EVAL_INTERVAL"])
    if options["MP_EVAL_TASKS"] is None:
        for name in ("MP_EVAL_TASKS_INTERVAL", "MP_EVAL_TASKS_LIMIT", "MP_EVAL_INCLUDE_PATH"):
            if options.given(name):
                raise UserError(f"{name} applies to MP_EVAL_TASKS, which is not set")


def check_evaluation(cfg) -> None:
    """What task evaluation during training cannot run with, in one line each."""
    if not cfg.eval_tasks:
        return
    if cfg.virtual_pipeline is not None:
        raise UserError(f"MP_EVAL_TASKS with {cfg.virtual_pipeline_setting} is not supported: evaluation runs one "
                        "model chunk per rank; evaluate the run's checkpoints with `mpatch eval` instead")
    if cfg.cp > 1:
        raise UserError(f"MP_EVAL_TASKS with CP={cfg.cp} is not supported: the evaluation's requests are not split "
                        "over context-parallel ranks; evaluate the run's checkpoints with `mpatch eval` instead")
    if cfg.sequence_parallel and cfg.tp > 1:
        from megatron_patch.evaluation.loading import padding_is_neutral  # lm-eval free; only with MP_EVAL_TASKS

        if not padding_is_neutral(cfg.arch):
            raise UserError(f"MP_EVAL_TASKS with SP=true is not supported for {cfg.arch.family}: sequence parallelism "
                            "pads each request to a multiple of TP, which changes this model's scores; set SP=false "
                            "or evaluate the run's checkpoints with `mpatch eval`")
    if not cfg.eval_tasks_interval:
        raise UserError("MP_EVAL_TASKS needs an interval: MP_EVAL_INTERVAL=0 (no validation) leaves none, so set "
                        "MP_EVAL_TASKS_INTERVAL")
    if not cfg.pretrain_checkpoint and not (cfg.tokenizer and Path(cfg.tokenizer).is_dir()):
        raise UserError("MP_EVAL_TASKS needs the model's HF tokenizer: start from a PRETRAIN_CHECKPOINT_PATH that "
                        "carries one, or set MP_TOKENIZER to its folder")


def check_tasks_exist(cfg) -> None:
    """lm-eval installed, and every task known with its data readable offline, before any rank starts. The ranks,
    which resolve the same arguments, leave it to the launcher: each evaluation prepares its tasks again."""
    if not cfg.eval_tasks or launched_rank(os.environ):
        return
    require_lm_eval("MP_EVAL_TASKS")
    from megatron_patch.evaluation.evaluate import prepare_tasks

    if cfg.eval_include_path and not Path(cfg.eval_include_path).is_dir():
        raise UserError(f"MP_EVAL_INCLUDE_PATH {cfg.eval_include_path} is not a folder: give a folder of lm-eval task "
                        "YAML files")
    with scratch_folder("eval-tasks") as folder:
        try:
            prepare_tasks(settings(cfg), folder)
        except UserError as exc:
            raise UserError(f"MP_EVAL_TASKS: {exc}") from None


def settings(cfg):
    """The run's evaluation settings, ``mpatch eval``'s defaults otherwise: its seed too, not MP_SEED, so that the
    few-shot examples, and the numbers, are those ``mpatch eval`` of the saved checkpoint gives."""
    from megatron_patch.evaluation.evaluate import EvalSettings

    include = (str(Path(cfg.eval_include_path).absolute()),) if cfg.eval_include_path else ()
    return EvalSettings(tasks=tuple(cfg.eval_tasks), include_paths=include, limit=cfg.eval_tasks_limit)


def due(cfg, iteration: int) -> bool:
    """Every MP_EVAL_TASKS_INTERVAL iterations and after the last one, as the validation loss (a run shorter than
    the interval, which defaults to MP_EVAL_INTERVAL's 10000, evaluated nothing and said nothing)."""
    return bool(cfg.eval_tasks) and (iteration % cfg.eval_tasks_interval == 0 or iteration == cfg.train_iters)


def load_tokenizer(folder: Path | None, cfg):
    """transformers' tokenizer from the folder the run's checkpoints carry theirs from (every rank reads it, as it
    starts), refused in one line where ``mpatch eval`` would refuse it: ids beyond the model's vocabulary (scored
    on padding rows, or an index error at the first evaluation, hours in) or no end-of-text token."""
    from megatron_patch.evaluation.loading import check_tokenizer, load_hf_tokenizer

    if folder is None:
        raise UserError("MP_EVAL_TASKS: no HF tokenizer found in PRETRAIN_CHECKPOINT_PATH or MP_TOKENIZER")
    tokenizer = load_hf_tokenizer(folder)
    try:
        check_tokenizer(tokenizer, cfg.arch.vocab_size,
                        give="MP_TOKENIZER, or a PRETRAIN_CHECKPOINT_PATH that carries it")
    except UserError as exc:
        raise UserError(f"MP_EVAL_TASKS: {exc}") from None
    return tokenizer


def evaluate(chunks: list, cfg, tokenizer, generation_folder: Path | None) -> dict | None:
    """lm-eval's results of the live model (global rank 0; None on the others). The chunks are put back in train
    mode, and every random generator as it was: the harness seeds them, and training goes on as without it.
    ``generation_folder``: the one the run's checkpoints take generation_config.json from (generation stops at
    its end-of-text ids, as ``mpatch eval`` of a checkpoint stops)."""
    # lm-eval, and torch with the model's blocks: a rank that evaluates has them, the launcher never imports them
    from megatron_patch.evaluation.evaluate import evaluate_live_model
    from megatron_patch.evaluation.loading import generation_stop_ids
    from megatron_patch.models.blocks.float8 import in_bf16

    saved = _random_states()
    try:
        stop_ids = generation_stop_ids(cfg.hf_config, generation_folder)
        # a PR=fp8 run's float8 GEMMs are a training step's: the model evaluated is the bf16 one it saves
        with in_bf16(chunks):
            results = evaluate_live_model(chunks, cfg.arch, tokenizer, settings(cfg), stop_ids)
    finally:
        for chunk in chunks:
            chunk.train()
        _restore_random_states(saved)
    return None if results is None else results.results


def _random_states() -> tuple:
    import torch
    from megatron.core import tensor_parallel

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return (random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda,
            tensor_parallel.get_cuda_rng_tracker().get_states())


def _restore_random_states(saved: tuple) -> None:
    import torch
    from megatron.core import tensor_parallel

    python, numpy_state, cpu, cuda, tracker = saved
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


def record_line(iteration: int, results: dict) -> str:
    """One line of ``eval/results.jsonl``: the iteration, each task's metrics, and lm-eval's results beside them."""
    from megatron_patch.evaluation.evaluate import metric_values

    return json.dumps({"iteration": iteration, "metrics": metric_values(results), "results": results},
                      ensure_ascii=False) + "\n"

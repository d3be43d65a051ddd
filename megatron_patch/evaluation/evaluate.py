"""Evaluate a model with lm-evaluation-harness: a live model on every rank of a job (``evaluate_live_model``, what
training calls), or a checkpoint in local rank processes (``evaluate_checkpoint``, what ``mpatch eval`` calls).

Every rank runs ``lm_eval.simple_evaluate`` over the same requests in lockstep; the harness's results come back
from global rank 0 as JSON text (lm-eval's own serialisation), with each task's samples when asked for.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from megatron_patch.errors import UserError
from megatron_patch.evaluation import tasks as task_files
from megatron_patch.evaluation.loading import CheckpointToEvaluate, generation_stop_ids, padding_is_neutral
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.runtime.scratch import scratch_folder

# torch, megatron-core and lm-eval are imported inside the functions that use them (on the ranks): the CLI's
# process checks the input and writes the results without a model.


@dataclass(frozen=True)
class EvalSettings:
    """What to evaluate and how, as ``mpatch eval``'s flags say it."""

    tasks: tuple[str, ...]
    include_paths: tuple[str, ...] = ()
    limit: float | None = None
    num_fewshot: int | None = None
    batch_size: int = 8
    log_samples: bool = False
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False
    max_gen_toks: int = 256
    kv_cache: bool = True  # False: generation runs the whole sequence again for each token
    seed: int = 1234
    bootstrap_iters: int = 100000  # lm-eval's default; closed-form standard errors (acc's) need only one > 0
    progress_bars: bool = False  # lm-eval's bars, on rank 0 (runtime/progress_bars.py): a terminal's, never a log's
    extra: dict = field(default_factory=dict)  # further keyword arguments of simple_evaluate


@dataclass
class EvalResults:
    """lm-eval's results (without samples) and each task's samples (when logged), as JSON-ready objects."""

    results: dict
    samples: dict[str, list]


def prepare_tasks(settings: EvalSettings, folder: str | Path) -> list[str]:
    """The include paths an evaluation reads: the project's tasks written into ``folder``, then the user's. The
    task names are checked against them (unknown, a data file missing, too few few-shot examples: one line)."""
    paths = [str(task_files.write_project_tasks(folder)), *settings.include_paths]
    task_files.offline()
    manager = task_files.task_manager(paths, list(settings.tasks))
    task_files.check_tasks(list(settings.tasks), manager)
    # a dataset that cannot be read offline, or too few few-shot examples: one line, now
    task_dict = task_files.load_tasks(list(settings.tasks), manager)
    task_files.check_documents(task_dict)
    task_files.check_fewshot(task_dict, settings.num_fewshot)
    task_files.check_generation_settings(task_dict)
    return paths


def evaluate_live_model(chunks: list, arch, tokenizer, settings: EvalSettings,
                        stop_ids: frozenset[int] = frozenset()) -> EvalResults | None:
    """Evaluate this rank's built and loaded model chunks of ``arch`` (the training layout's, megatron-core's parallel
    state initialised) with ``tokenizer`` (transformers'; ``loading.load_hf_tokenizer``). Every rank of the job
    calls it; global rank 0 gets the results, the others None. Puts the chunks in eval mode: the caller puts them
    back in train mode."""
    # torch and megatron-core: imported only on the ranks that evaluate
    from megatron_patch.evaluation.runner import ModelRunner

    runner = ModelRunner(chunks, arch.vocab_size, arch.max_position_embeddings, kv_cache=settings.kv_cache,
                         padding_is_neutral=padding_is_neutral(arch))
    with scratch_folder("eval-tasks") as folder:
        return run_harness(runner, tokenizer, settings, prepare_tasks(settings, folder), stop_ids)


def run_harness(runner, tokenizer, settings: EvalSettings, include_paths: list[str],
                stop_ids: frozenset[int] = frozenset()) -> EvalResults | None:
    """``lm_eval.simple_evaluate`` over ``runner``; results on global rank 0, None elsewhere."""
    import torch.distributed as dist
    from lm_eval import evaluator, simple_evaluate

    # imported here, beside lm-eval (an optional package), which it subclasses
    from megatron_patch.evaluation.harness import MpatchLM
    from megatron_patch.runtime.progress_bars import lm_eval_task_bars

    # lm-eval records `git describe` of the current folder, whatever it is (and git says "fatal: not a git
    # repository" on stderr elsewhere): the model's provenance is the checkpoint's manifest, not the cwd.
    evaluator.get_git_commit_hash = lambda: None
    # lm-eval bootstraps in a multiprocessing pool of every CPU unless told not to: not from a rank of this job
    os.environ["DISABLE_MULTIPROC"] = "1"
    lm = MpatchLM(runner, tokenizer, batch_size=settings.batch_size, max_gen_toks=settings.max_gen_toks,
                  model_stop_ids=stop_ids, seed=settings.seed, progress_bars=settings.progress_bars)
    with lm_eval_task_bars(settings.progress_bars):
        results = simple_evaluate(
            model=lm, tasks=list(settings.tasks),
            task_manager=task_files.task_manager(include_paths, list(settings.tasks)),
            limit=settings.limit, num_fewshot=settings.num_fewshot, log_samples=settings.log_samples,
            apply_chat_template=settings.apply_chat_template, fewshot_as_multiturn=settings.fewshot_as_multiturn,
            random_seed=settings.seed, numpy_random_seed=settings.seed, torch_random_seed=settings.seed,
            fewshot_random_seed=settings.seed, verbosity="WARNING", bootstrap_iters=settings.bootstrap_iters,
            **settings.extra)
    if results is None or (dist.is_initialized() and dist.get_rank() != 0):
        return None
    return _to_json(results)


def _to_json(results: dict) -> EvalResults:
    """lm-eval's results as plain JSON objects, through lm-eval's own serialisation (numpy numbers, functions in
    task configs), the samples apart."""
    from lm_eval.utils import handle_non_serializable

    samples = results.pop("samples", None) or {}

    def plain(obj):
        return json.loads(json.dumps(obj, default=handle_non_serializable, ensure_ascii=False))

    return EvalResults(plain(results), {name: plain(rows) for name, rows in samples.items()})


def evaluate_checkpoint_worker(checkpoint: CheckpointToEvaluate, layout: ParallelLayout, dtype: str,
                               settings: EvalSettings, include_paths: list[str]) -> EvalResults | None:
    """Runs on every rank of ``evaluate_checkpoint``'s job: build, load, evaluate."""
    # torch and megatron-core: imported only in the ranks the job starts
    from megatron_patch.evaluation.loading import load_model
    from megatron_patch.evaluation.runner import ModelRunner
    from megatron_patch.runtime import init_model_parallel

    task_files.offline()
    if os.environ.get("RANK", "0") != "0":
        settings = dataclasses.replace(settings, progress_bars=False)  # rank 0's bars, not one per rank
    init_model_parallel(layout)
    chunks = load_model(checkpoint, layout, dtype)
    runner = ModelRunner(chunks, checkpoint.arch.vocab_size, checkpoint.arch.max_position_embeddings,
                         kv_cache=settings.kv_cache, padding_is_neutral=padding_is_neutral(checkpoint.arch))
    tokenizer = checkpoint.load_tokenizer()
    return run_harness(runner, tokenizer, settings, include_paths,
                       generation_stop_ids(checkpoint.model_config, checkpoint.model_dir))


def evaluate_checkpoint(checkpoint: CheckpointToEvaluate, layout: ParallelLayout, settings: EvalSettings,
                        dtype: str = "fp32") -> EvalResults:
    """Evaluate ``checkpoint`` at ``layout`` in ``layout.world_size`` local processes (gloo on CPU)."""
    # imported here: the launcher's module pulls in torch, which reading the arguments does not need
    from megatron_patch.runtime.launch import run_local

    with scratch_folder("eval-tasks") as folder:
        include_paths = prepare_tasks(settings, folder)
        per_rank = run_local(evaluate_checkpoint_worker, layout.world_size, checkpoint, layout, dtype, settings,
                             include_paths, timeout=24 * 3600)
    if per_rank[0] is None:
        raise RuntimeError("rank 0 returned no results")
    return per_rank[0]


def summary_rows(results: dict) -> list[dict]:
    """One row per task and metric, for a one-screen table."""
    rows = []
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            if key == "alias" or "," not in key or "_stderr" in key:
                continue
            metric, filter_name = key.split(",", 1)
            shown = f"{value:.4f}" if isinstance(value, float) else str(value)
            rows.append({"task": task, "metric": metric, "filter": filter_name, "value": shown,
                         "n": results.get("n-samples", {}).get(task, {}).get("effective", "")})
    if not rows:
        raise UserError("the evaluation produced no metric")
    return rows


def metric_values(results: dict) -> dict[str, float]:
    """Each number lm-eval reports, stderr aside, by ``TASK/METRIC`` (``TASK/METRIC/FILTER`` where the filter is
    not lm-eval's "none"): what training logs and `--all-iterations` plots."""
    values = {}
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            if "," in key and "_stderr" not in key and isinstance(value, (int, float)) and not isinstance(value, bool):
                metric, filter_name = key.split(",", 1)
                values[f"{task}/{metric}" + ("" if filter_name == "none" else f"/{filter_name}")] = float(value)
    return values


def write_results(results: EvalResults, folder: str | Path, command: str) -> None:
    """lm-eval's results as its CLI writes them (``results.json``, the command that made them added) and each
    task's samples as JSON lines (``samples_TASK.jsonl``), into ``folder`` (the partial output folder)."""
    folder = Path(folder)
    (folder / "results.json").write_text(json.dumps({**results.results, "command": command}, indent=2,
                                                    ensure_ascii=False) + "\n")
    for task, rows in results.samples.items():
        (folder / samples_file_name(task, results.samples)).write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def samples_file_name(task: str, tasks) -> str:
    """``samples_TASK.jsonl``, with what a file name cannot hold in TASK (lm-eval takes a task named ``qa/v1``: its
    samples' file was an internal error after the whole evaluation, its results lost: the eval audit) written as _,
    and the task's place among ``tasks`` added where that makes two names alike."""
    def safe(name: str) -> str:
        return re.sub(r"[^\w.-]", "_", name).lstrip(".") or "_"

    name = safe(task)
    if name in [safe(other) for other in tasks if other != task]:
        name += f"-{list(tasks).index(task) + 1}"
    return f"samples_{name}.jsonl"

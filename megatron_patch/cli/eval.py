"""`mpatch eval`: lm-evaluation-harness tasks on a checkpoint, with this project's megatron-core model at any layout."""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import warnings
from pathlib import Path

from megatron_patch.checkpoint.foreign import iteration_before
from megatron_patch.checkpoint_files.layout import iteration_dir
from megatron_patch.checkpoint_files.manifest import IntegrityError, naming_the_switch
from megatron_patch.cli.common import (SEED_RANGE, add_layout_args, check_not_empty, check_seed, layout_from_args,
                                       print_table, sigterm_as_interrupt)
from megatron_patch.checkpoint.outputs import atomic_output_dir, make_parent_folders
from megatron_patch.errors import UserError
from megatron_patch.evaluation import document_limit, require_lm_eval, task_names
from megatron_patch.runtime.progress_bars import bars_wanted

# torch, megatron-core and lm-eval (an optional extra) are imported inside the functions that use them:
# `mpatch eval --help` and every other subcommand start without them.


def command_line(args) -> str:
    """The command that reproduces this evaluation (recorded with the results)."""
    parts = ["mpatch", "eval", "--load-dir", args.load_dir, "--tasks", ",".join(task_names("--tasks", args.tasks))]
    for path in args.include_path or []:
        parts += ["--include-path", path]
    for flag, value in (("--limit", args.limit), ("--num-fewshot", args.num_fewshot), ("--tokenizer", args.tokenizer),
                        ("--hf-config", args.hf_config), ("--base-dir", args.base_dir),
                        ("--output-dir", args.output_dir)):
        if value is not None:  # --limit 4, not the 4.0 argparse's float holds
            parts += [flag, str(int(value) if isinstance(value, float) and value.is_integer() else value)]
    parts += ["--batch-size", str(args.batch_size), "--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep)]
    if args.etp is not None:
        parts += ["--etp", str(args.etp)]
    parts += ["--dtype", args.dtype, "--seed", str(args.seed), "--bootstrap-iters", str(args.bootstrap_iters)]
    for flag in ("all_iterations", "log_samples", "apply_chat_template", "fewshot_as_multiturn", "no_kv_cache",
                 "no_verify", "force"):
        if getattr(args, flag):
            parts.append("--" + flag.replace("_", "-"))
    return shlex.join(parts)


@sigterm_as_interrupt
def run(args) -> int:
    require_lm_eval("mpatch eval")
    # lm-eval, torch and megatron-core come with these: imported only once lm-eval is known to be installed
    from megatron_patch.evaluation.evaluate import EvalSettings, summary_rows, write_results
    from megatron_patch.evaluation.iterations import saved_iterations
    from megatron_patch.evaluation.loading import open_for_evaluation
    from megatron_patch.evaluation.tasks import check_include_path

    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    layout = layout_from_args(args)
    check_not_empty(args.output_dir, "--output-dir")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    if args.bootstrap_iters < 0:
        raise UserError(f"--bootstrap-iters must be >= 0, got {args.bootstrap_iters}")
    check_seed(args.seed)
    if args.fewshot_as_multiturn and not args.apply_chat_template:
        raise UserError("--fewshot-as-multiturn makes the few-shot examples turns of a chat: it needs "
                        "--apply-chat-template")
    for path in args.include_path or ():
        check_include_path(path)
    settings = EvalSettings(
        tasks=task_names("--tasks", args.tasks),
        include_paths=tuple(str(Path(p).absolute()) for p in args.include_path or ()),
        limit=None if args.limit is None else document_limit("--limit", args.limit),
        num_fewshot=args.num_fewshot, batch_size=args.batch_size, log_samples=args.log_samples,
        apply_chat_template=args.apply_chat_template, fewshot_as_multiturn=args.fewshot_as_multiturn,
        kv_cache=not args.no_kv_cache, seed=args.seed, bootstrap_iters=args.bootstrap_iters,
        progress_bars=bars_wanted(args.quiet))
    if args.all_iterations and not args.output_dir:
        raise UserError("--all-iterations writes each iteration's results and the plot into --output-dir: give one")
    iterations = saved_iterations(args.load_dir) if args.all_iterations else [(None, Path(args.load_dir))]
    try:
        checkpoints = [(iteration, open_for_evaluation(folder, layout, args.tokenizer, args.hf_config,
                                                       verify=not args.no_verify,
                                                       chat_template=args.apply_chat_template,
                                                       base_dir=args.base_dir))
                       for iteration, folder in iterations]
    except IntegrityError as exc:
        raise naming_the_switch(exc, "--no-verify") from None
    # what reading the checkpoints found worth saying (an --hf-config they ignore), once, as `mpatch convert` does
    for note in dict.fromkeys(note for _, checkpoint in checkpoints for note in checkpoint.notes):
        print(f"warning: {note}", file=sys.stderr, flush=True)
    # the layout run, with hf2mcore's default ETP (said under --quiet too: it is not the layout asked for)
    layout, layout_note = checkpoints[0][1].layout, checkpoints[0][1].layout_note
    if layout_note:
        print(f"eval: {layout_note}", file=sys.stderr, flush=True)
    if args.output_dir:
        make_parent_folders(args.output_dir, inputs=_inputs(args), what="--output-dir")
    if args.all_iterations:
        return _all_iterations(args, layout, settings, checkpoints)
    # The results folder follows the one output rule (docs/outputs.md): checked and locked before the run,
    # published whole, with a manifest, after it.
    with _output_dir(args) if args.output_dir else contextlib.nullcontext() as partial:
        results = _evaluate(args, layout, settings, checkpoints[0][1])
        rows = summary_rows(results.results)
        if partial is not None:
            write_results(results, partial, command_line(args))
    print_table(rows, ["task", "metric", "filter", "value", "n"])
    if args.output_dir:
        print(f"results: {Path(args.output_dir) / 'results.json'}"
              + (f" (+ samples of {len(results.samples)} tasks)" if results.samples else ""))
    return 0


def _output_dir(args):
    """--output-dir under the one output rule: new, or an earlier mpatch eval's replaced with --force."""
    return atomic_output_dir(args.output_dir, args.force, tool="mpatch eval", inputs=_inputs(args), what="--output-dir")


def _inputs(args) -> tuple:
    return (args.load_dir, args.tokenizer, args.hf_config, *(args.include_path or ()))


def _evaluate(args, layout, settings, checkpoint):
    """One checkpoint evaluated in local rank processes, said first unless --quiet."""
    # lm-eval, torch and megatron-core come with evaluation.evaluate: imported only once lm-eval is installed
    from megatron_patch.evaluation.evaluate import evaluate_checkpoint

    if not args.quiet:
        print(f"mpatch eval: {', '.join(settings.tasks)} on {checkpoint.load_dir} ({checkpoint.arch.family}, "
              f"{layout}, {args.dtype}), {layout.world_size} rank(s)", flush=True)
    try:
        return evaluate_checkpoint(checkpoint, layout, settings, args.dtype)
    except IntegrityError as exc:
        raise naming_the_switch(_with_the_previous_iteration(exc, args.load_dir), "--no-verify") from None


def _with_the_previous_iteration(exc: IntegrityError, load_dir: str) -> IntegrityError:
    """A run's checkpoint folder whose newest iteration failed its manifest as it was read (the look that chose it
    hashes the small files only): the refusal names the newest complete iteration before it, which reads."""
    before = iteration_before(load_dir)  # after the iteration the evaluation chose
    if before is None:
        return exc
    damaged, previous = before
    return IntegrityError(f"{exc}; --load-dir {iteration_dir(damaged.parent, previous)} evaluates the newest complete "
                          "iteration before it")


def _all_iterations(args, layout, settings, checkpoints: list) -> int:
    """Each saved iteration evaluated in turn into OUT/iter_XXXXXXX/, then OUT/all_iterations.json (each
    iteration's metrics) and OUT/metrics.png (each metric against the iteration, next to the training loss)."""
    # lm-eval, torch and megatron-core come with these: imported only once lm-eval is known to be installed
    from megatron_patch.evaluation.evaluate import metric_values, write_results
    from megatron_patch.evaluation.iterations import PLOT, SUMMARY, training_losses

    losses = training_losses(args.load_dir)
    points, rows = [], []
    with _output_dir(args) as partial:
        for iteration, checkpoint in checkpoints:
            results = _evaluate(args, layout, settings, checkpoint)
            values = metric_values(results.results)
            if not values:
                raise UserError("the evaluation produced no metric")
            folder = Path(partial) / Path(checkpoint.load_dir).name
            folder.mkdir()
            write_results(results, folder, command_line(args))
            points.append({"iteration": iteration, "metrics": values})
            rows += [{"iteration": iteration, "metric": name, "value": f"{value:.4f}"}
                     for name, value in values.items()]
        (Path(partial) / SUMMARY).write_text(json.dumps(
            {"command": command_line(args), "iterations": points,
             "training_loss": "log/metrics.jsonl beside the checkpoint folder" if losses else None}, indent=2) + "\n")
        drawn = _plot(points, losses, Path(partial) / PLOT)
    print_table(rows, ["iteration", "metric", "value"])
    print(f"results: {Path(args.output_dir) / SUMMARY}, each iteration's in {Path(args.output_dir)}/iter_XXXXXXX/"
          + (f", the plot {Path(args.output_dir) / PLOT}" if drawn else ", no plot")
          + ("" if losses else " (no training loss found beside the checkpoint folder)"))
    return 0


def _plot(points: list[dict], losses: dict[int, float], path: Path) -> bool:
    """The plot, its notes said; whether it was drawn. The run's log is untrusted input, and a picture of the
    results is not worth the results: whatever fails in drawing it is one warning, and they are published."""
    # as the rest of evaluation/: imported only once lm-eval is known to be installed
    from megatron_patch.evaluation.iterations import plot

    try:
        notes = plot(points, losses, path)
    except Exception as exc:  # noqa: BLE001 - matplotlib's errors on odd data are of many kinds
        path.unlink(missing_ok=True)
        print(f"warning: no plot: drawing {path.name} failed ({type(exc).__name__}: {exc})", file=sys.stderr,
              flush=True)
        return False
    for note in notes:
        print(f"note: {note}", file=sys.stderr, flush=True)
    return True


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval", help="lm-evaluation-harness tasks on a checkpoint, in place (no HF export)",
        description="Evaluate a Megatron-Core checkpoint (a conversion, a run's iteration or final, a LoRA run with "
                    "its adapters applied) with lm-evaluation-harness, on this project's model at the layout asked "
                    "for, in local rank processes (gloo on CPU, NCCL on GPU). Tasks are lm-eval's own (when their "
                    "data can be reached), local YAML under --include-path, and the project's offline tasks "
                    "mpatch_perplexity, mpatch_arithmetic_choice and mpatch_arithmetic (docs/evaluation.md). "
                    "Exit 0 done, 2 bad input, 1 internal error.")
    p.add_argument("--load-dir", required=True, help="the checkpoint: its folder, or one iteration's (iter_XXXXXXX)")
    p.add_argument("--all-iterations", action="store_true",
                   help="--load-dir is a run's checkpoint/ folder: evaluate every saved iteration, and draw each "
                        "metric against the iteration next to the training loss (needs --output-dir)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task or group names")
    p.add_argument("--include-path", action="append", default=None, metavar="DIR",
                   help="a folder of lm-eval task YAML files (repeatable)")
    p.add_argument("--limit", type=float, default=None,
                   help="documents per task: a count, or a fraction below 1 (default: all)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (default 8)")
    add_layout_args(p)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="the model's dtype (default fp32, in which results equal lm-eval's HF backend's)")
    p.add_argument("--tokenizer", default=None,
                   help="an HF tokenizer folder (default: the one the checkpoint carries)")
    p.add_argument("--hf-config", default=None,
                   help="the HF config.json (or its folder) of a checkpoint without this project's sidecar")
    p.add_argument("--base-dir", default=None, metavar="DIR",
                   help="a LoRA run's base checkpoint, where it is no longer where the run recorded it (checked by "
                        "digest, as mcore2hf --merge-lora's)")
    p.add_argument("--output-dir", default=None,
                   help="write results.json (and samples_TASK.jsonl with --log-samples) into this new folder, with a "
                        "manifest")
    p.add_argument("--force", action="store_true",
                   help="replace the --output-dir of an earlier mpatch eval; folders mpatch did not write are never "
                        "replaced")
    p.add_argument("--log-samples", action="store_true", help="keep every request and answer (samples_TASK.jsonl)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="render prompts with the tokenizer's chat template")
    p.add_argument("--fewshot-as-multiturn", action="store_true",
                   help="with --apply-chat-template: few-shot examples as conversation turns")
    p.add_argument("--no-kv-cache", action="store_true",
                   help="generate without a KV cache (each token runs the whole sequence again)")
    p.add_argument("--seed", type=int, default=1234, help=f"seed of few-shot sampling and sampled generation ({SEED_RANGE}, default 1234)")
    p.add_argument("--bootstrap-iters", type=int, default=100000, metavar="N",
                   help="resamples for the standard errors of metrics without a closed form (median, f1, bleu...; "
                        "lm-eval's default 100000); 0: no standard errors at all")
    p.add_argument("--no-verify", action="store_true",
                   help="do not check the checkpoint's files against its mpatch_manifest.json (for a checkpoint "
                        "edited on purpose)")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.set_defaults(run=run)

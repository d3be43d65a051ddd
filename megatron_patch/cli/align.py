"""`mpatch align`: HF vs Megatron-Core (or HF vs HF), layer by layer, with a verdict and a report."""

from __future__ import annotations

import contextlib
import importlib.util
import shlex
import warnings
from pathlib import Path

from megatron_patch.align.bounds import DEFAULT_TOLERANCE, FP32_KL, FP32_REL_L2
from megatron_patch.align.report import PLOT_NAME, print_summary, write_report
from megatron_patch.checkpoint.outputs import atomic_output_dir, make_parent_folders
from megatron_patch.checkpoint_files.manifest import IntegrityError, naming_the_switch
from megatron_patch.cli.common import (SEED_RANGE, add_layout_args, check_not_empty, check_seed, layout_from_args,
                                       sigterm_as_interrupt)
from megatron_patch.errors import UserError
from megatron_patch.models.blocks.float8_plan import KINDS, RECIPES, parse_filter
from megatron_patch.runtime.progress_bars import bars_wanted, hide_transformers_bars

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.
# So are the modules a subcommand runs (cli/__init__.py): align.alignment, align.parity, align.verdict.


def command_line(args) -> str:
    """The command that reproduces this run, spelled out in full (recorded in the report)."""
    parts = ["mpatch", "align", "--hf-dir", args.hf_dir]
    for flag, value in (("--mcore-dir", args.mcore_dir), ("--hf-dir-2", args.hf_dir_2), ("--text-file", args.text_file)):
        if value:
            parts += [flag, value]
    parts += ["--tp", str(args.tp), "--pp", str(args.pp), "--ep", str(args.ep)]
    if args.etp is not None:
        parts += ["--etp", str(args.etp)]
    if args.peft_dir:
        parts += ["--peft-dir", args.peft_dir]
    if args.base_dir:
        parts += ["--base-dir", args.base_dir]
    parts += ["--dtype", args.dtype]
    if args.dtype == "fp8":
        parts += ["--fp8-recipe", args.fp8_recipe, "--fp8-filter", args.fp8_filter]
    parts += ["--seq-len", str(args.seq_len), "--batch", str(args.batch), "--seed", str(args.seed),
              "--tolerance", f"{args.tolerance:g}"]
    if args.only_dtype:
        parts.append("--only-dtype")
    if args.no_verify:
        parts.append("--no-verify")
    if args.ablate:
        parts.append("--ablate")
    parts += ["--report-dir", args.report_dir] + (["--force"] if args.force else [])
    return shlex.join(parts)


DEFAULT_FP8_RECIPE, DEFAULT_FP8_FILTER = "tensorwise", "auto"


def resolve_fp8_options(args) -> None:
    """--fp8-recipe and --fp8-filter choose what --dtype fp8 runs: with another --dtype they would be ignored, so
    they are refused there; with --dtype fp8 their defaults are filled in."""
    given = [flag for flag, value in (("--fp8-recipe", args.fp8_recipe), ("--fp8-filter", args.fp8_filter))
             if value is not None]
    if given and args.dtype != "fp8":
        raise UserError(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} --dtype fp8, got --dtype "
                        f"{args.dtype}: add --dtype fp8, or drop {' and '.join(given)}")
    args.fp8_recipe = args.fp8_recipe or DEFAULT_FP8_RECIPE
    args.fp8_filter = args.fp8_filter or DEFAULT_FP8_FILTER


@sigterm_as_interrupt
def run(args) -> int:
    from megatron_patch.align.alignment import AlignSettings, run_alignment
    check_seed(args.seed)
    check_not_empty(args.report_dir, "--report-dir")
    if args.force and not args.report_dir:  # it was accepted, and did nothing (the tools audit)
        raise UserError("--force replaces an earlier report in --report-dir, and none is given: give --report-dir, or "
                        "drop --force")
    resolve_fp8_options(args)
    if args.peft_dir and importlib.util.find_spec("peft") is None:
        # before the HF model loads (it stopped 13-33 s in, at the first phase: the newuser audit)
        raise UserError("--peft-dir compares against peft's own model of the adapter: pip install peft")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    if not bars_wanted(args.quiet):
        hide_transformers_bars()
    settings = AlignSettings(
        hf_dir=args.hf_dir, mcore_dir=args.mcore_dir, hf_dir_2=args.hf_dir_2, layout=layout_from_args(args),
        dtype=args.dtype, seq_len=args.seq_len, batch=args.batch, seed=args.seed, text_file=args.text_file,
        ablate=args.ablate, tolerance=args.tolerance, only_dtype=args.only_dtype, peft_dir=args.peft_dir,
        verify=not args.no_verify, base_dir=args.base_dir, fp8_recipe=args.fp8_recipe,
        fp8_filter=parse_filter("--fp8-filter", args.fp8_filter))
    # The report folder is an output like any other (docs/outputs.md): its lock is taken and the folder checked
    # (new, or an earlier report replaced with --force) before the run, and it is published whole at the end.
    inputs = (args.hf_dir, args.mcore_dir, args.hf_dir_2, args.peft_dir, args.base_dir, args.text_file)
    if args.report_dir:
        make_parent_folders(args.report_dir, inputs=inputs, what="--report-dir")
    with atomic_output_dir(args.report_dir, args.force, tool="mpatch align", inputs=inputs, what="--report-dir") \
            if args.report_dir else contextlib.nullcontext() as partial:
        try:
            result = run_alignment(settings, log=None if not args.quiet else (lambda msg: None))
        except IntegrityError as exc:
            raise naming_the_switch(exc, "--no-verify") from None
        print_summary(result)
        if partial is not None:
            write_report(result, partial, command_line(args))
    if args.report_dir:
        report = Path(args.report_dir)
        print(f"report: {report / 'report.md'} (+ report.json, {PLOT_NAME})")
    return 0 if result["verdict"]["aligned"] else 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "align", help="layer-by-layer precision alignment of HF and Megatron-Core, with a verdict",
        description="Run the HF model and its Megatron-Core twin (a converted checkpoint, or the HF folder mapped in "
                    "memory) on the same inputs, capture every layer (embedding, attention and MLP outputs, layer "
                    f"outputs, final norm, logits) and judge them. fp32: logits rel_l2 <= {FP32_REL_L2:g} and KL <= "
                    f"{FP32_KL:g} and every point rel_l2 <= {FP32_REL_L2:g} (over it, judged again against HF fp32's "
                    "own error from HF fp64: within the larger of the fixed bound and --tolerance times it). "
                    "bf16/fp16: HF's own error in that dtype (vs HF fp32) is the noise "
                    "floor, and each point's error must stay within --tolerance times it. The first point over the "
                    "line is named. The tested side runs in fp32 first, which certifies the conversion (bf16 rounding "
                    "hides faults such as a 0.1% norm scale), then in --dtype; one verdict says which run decided it. "
                    "Exit 0 aligned, 1 not aligned, 2 bad input, 3 internal error.")
    p.add_argument("--hf-dir", required=True, help="Hugging Face model folder: the reference (run in fp32) and floor")
    p.add_argument("--mcore-dir", default=None,
                   help="a Megatron-Core checkpoint (torch_dist or legacy): written by 'mpatch convert hf2mcore' or "
                        "a run, or by another tool, whose tensors are then read as the model of --hf-dir (default: "
                        "map --hf-dir in memory)")
    p.add_argument("--hf-dir-2", default=None,
                   help="a second HF folder to test instead of MCore (e.g. an mcore2hf round trip)")
    add_layout_args(p)
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "fp8"], default="bf16",
                   help="the training dtype whose precision is judged after the fp32 run (default bf16); fp8: "
                        "torchao's float8 GEMMs in MCore, against the HF model after torchao's "
                        "convert_to_float8_training (docs/fp8.md)")
    p.add_argument("--fp8-recipe", choices=RECIPES, default=None,
                   help=f"--dtype fp8: torchao's recipe (default {DEFAULT_FP8_RECIPE})")
    p.add_argument("--fp8-filter", default=None,
                   help=f"--dtype fp8: the GEMMs in float8 on both sides: auto (torchao's filter), all, or kinds out of "
                        f"{','.join(KINDS)} (default {DEFAULT_FP8_FILTER})")
    p.add_argument("--only-dtype", action="store_true",
                   help="run only --dtype, without the fp32 run that certifies the conversion: faster, and its verdict "
                        "says what it cannot resolve")
    p.add_argument("--peft-dir", default=None,
                   help="a peft LoRA adapter of --hf-dir: the reference is peft's model with it, MCore carries the same "
                        "adapters (from --mcore-dir when it holds adapters, else from this folder)")
    p.add_argument("--base-dir", default=None, metavar="DIR",
                   help="the base checkpoint a LoRA run in --mcore-dir was trained on, where it is no longer where the "
                        "run recorded it (checked by digest, as mpatch eval's and mcore2hf --merge-lora's)")
    p.add_argument("--no-verify", action="store_true",
                   help="do not check --mcore-dir's files against its mpatch_manifest.json (checked by default, where it "
                        "has one): for a checkpoint edited on purpose")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    p.add_argument("--seed", type=int, default=0, help=f"seed of the random tokens ({SEED_RANGE}, default 0)")
    p.add_argument("--text-file", default=None, help="real text, tokenized with the tokenizer in --hf-dir")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"bf16/fp16: allowed multiple of HF's own rounding error per point (default {DEFAULT_TOLERANCE:g})")
    p.add_argument("--ablate", action="store_true",
                   help="also run each known source of HF/MCore difference switched on and off")
    p.add_argument("--report-dir", default=None,
                   help="write report.json, report.md and error_by_layer.png into this new folder (with a manifest)")
    p.add_argument("--force", action="store_true",
                   help="replace the --report-dir of an earlier mpatch align; folders mpatch did not write are never "
                        "replaced")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.set_defaults(run=run)

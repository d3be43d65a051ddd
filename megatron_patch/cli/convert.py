"""`mpatch convert`: HF folders <-> Megatron-Core checkpoints (legacy or torch_dist), streaming and strict."""

from __future__ import annotations

import argparse
import functools
import sys
import warnings

from megatron_patch.checkpoint.foreign import iteration_before
from megatron_patch.checkpoint_files.manifest import IntegrityError, naming_the_switch
from megatron_patch.cli.common import add_layout_args, layout_from_args, sigterm_as_interrupt
from megatron_patch.convert.checkpoint import DEFAULT_WORKERS, hf_to_mcore, mcore_to_hf
from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import families
from megatron_patch.outputs.full_disk import full_disk_is_bad_input

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.
# So are the modules a subcommand runs (cli/__init__.py): convert.lora_io, and cli.pai_convert's converters.


QUIET_HELP = "no progress output (a note on what was chosen for you still goes to stderr)"


def _quiet_imports() -> None:

    # megatron-core warns at import about optional GPU packages; conversion never needs them.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")


def _writes_save_dir(run):
    """A full disk while --save-dir is written is one line and exit 2; the partial output is gone by then."""
    @functools.wraps(run)
    def wrapped(args) -> int:
        with full_disk_is_bad_input(args.save_dir, "--save-dir"):
            return run(args)
    return wrapped


@_writes_save_dir
@sigterm_as_interrupt
def run_hf2mcore(args) -> int:
    _quiet_imports()
    adapter = None
    if args.peft_dir:
        from megatron_patch.convert.lora_io import read_peft_import

        adapter = read_peft_import(args.peft_dir, args.hf_dir)
    sidecar = hf_to_mcore(args.hf_dir, args.save_dir, layout_from_args(args), fmt=args.format, dtype=args.dtype,
                          force=args.force, progress=False if args.quiet else None, mtp={None: False, "keep": True}.get(args.mtp, args.mtp),
                          workers=args.workers, adapter=adapter)
    if adapter is not None:
        print(f"with the LoRA adapters of {args.peft_dir}: {adapter.spec.describe()}")
    print(f"wrote {args.save_dir}: {sidecar.family} {sidecar.checkpoint_format} {sidecar.parallel_layout} "
          f"{sidecar.dtype}, {sidecar.num_tensors} tensors, {sidecar.num_bytes / 2**30:.2f} GiB")
    return 0


def _names_no_verify(run):
    """A checkpoint whose files no longer match its manifest is refused in one line that names --no-verify."""
    @functools.wraps(run)
    def wrapped(args) -> int:
        try:
            return run(args)
        except IntegrityError as exc:
            raise naming_the_switch(exc, "--no-verify") from None
    return wrapped


@_writes_save_dir
@_names_no_verify
@sigterm_as_interrupt
def run_mcore2hf(args) -> int:
    _quiet_imports()
    if args.lora_adapter and args.merge_lora:
        raise UserError("--lora-adapter and --merge-lora write different things: choose one")
    if args.base_dir and not args.merge_lora:
        raise UserError("--base-dir names the base model --merge-lora merges into: pass --merge-lora")
    if (args.lora_adapter or args.merge_lora) and (args.hf_config or args.family):
        raise UserError("a LoRA checkpoint written here describes itself: drop --hf-config / --family")
    if args.lora_adapter:
        from megatron_patch.convert.lora_io import export_adapter

        export_adapter(args.load_dir, args.save_dir, dtype=args.dtype, force=args.force, iteration=args.iteration,
                       verify=not args.no_verify)
        print(f"wrote the peft adapter {args.save_dir}")
        return 0
    if args.merge_lora:
        from megatron_patch.convert.lora_io import merge_adapter

        merge_adapter(args.load_dir, args.save_dir, base_dir=args.base_dir, dtype=args.dtype, force=args.force,
                      iteration=args.iteration, progress=False if args.quiet else None, workers=args.workers,
                      max_shard_size=args.max_shard_size, verify=not args.no_verify)
        print(f"wrote {args.save_dir} (LoRA merged)")
        return 0
    _newest_sound_iteration(args, lambda iteration: mcore_to_hf(
        args.load_dir, args.save_dir, dtype=args.dtype, max_shard_size=args.max_shard_size, force=args.force,
        progress=False if args.quiet else None, hf_config=args.hf_config, family=args.family, iteration=iteration,
        workers=args.workers, verify=not args.no_verify))
    print(f"wrote {args.save_dir}")
    return 0


def _newest_sound_iteration(args, convert) -> None:
    """``convert(iteration)`` of --load-dir; for a run's checkpoint folder without --iteration, an iteration whose
    bytes fail their manifest while they are converted (the look that chose it hashes the small files only) is
    skipped for the previous complete one with a warning, as a resume skips it. Its partial output is gone."""
    iteration = args.iteration
    while True:
        try:
            convert(iteration)
            return
        except IntegrityError as exc:
            # --iteration or an iteration folder named: that one, or nothing
            before = iteration_before(args.load_dir, iteration) if args.iteration is None else None
            if before is None:
                raise
            damaged, iteration = before
            print(f"warning: {damaged} is damaged ({exc}); converting iteration {iteration}, the newest complete "
                  "one before it", file=sys.stderr, flush=True)


MAX_WORKERS = 256  # copying threads: far past what any disk serves at once, and short of exhausting threads


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_WORKERS}, not {text!r}")
    return n


def _add_workers(parser) -> None:
    parser.add_argument("--workers", type=_workers, default=DEFAULT_WORKERS, metavar="N",
                        help="threads that copy bytes, several output files and tensors at once "
                             f"(default {DEFAULT_WORKERS}: one per core, at most 8; more help on fast disks)")


FORCE_HELP = ("replace an earlier output of mpatch convert in --save-dir (a folder whose mpatch_manifest.json lists "
              "every file in it), in one step once the new one is complete; anything else, a folder without a "
              "manifest included, is refused (docs/outputs.md)")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert checkpoints between Hugging Face and Megatron-Core",
        description="Convert checkpoints between a Hugging Face model folder and a Megatron-Core checkpoint. "
                    "Streaming (bytes go file to file; only row-parallel slices and dtype changes pass through memory, "
                    "a band of rows at a time), exact (bit-identical round trips), strict (every tensor accounted "
                    "for) and atomic (output appears only when complete).")
    sub = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)

    h = sub.add_parser(
        "hf2mcore", help="HF folder -> Megatron-Core checkpoint",
        description="Convert a Hugging Face model folder (config.json + safetensors) into a Megatron-Core checkpoint "
                    "for a TP/PP/EP layout. torch_dist output loads at any layout; legacy output is one "
                    "model_optim_rng.pt per rank at exactly this layout. Tokenizer and generation files are carried "
                    "along, and mpatch_checkpoint.json records everything mcore2hf needs.")
    h.add_argument("--hf-dir", required=True, help="Hugging Face model folder: config.json and *.safetensors (+ index)")
    h.add_argument("--save-dir", required=True, help="output checkpoint folder (must be new or empty unless --force)")
    add_layout_args(h)
    h.add_argument("--format", choices=["torch_dist", "legacy"], default="torch_dist",
                   help="torch_dist: megatron dist_checkpointing, loadable at any TP/PP/EP (default); "
                        "legacy: release/mp_rank_*/model_optim_rng.pt for exactly this layout")
    h.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="dtype of the MCore weights (default: the HF tensors' own dtype; required for FP8 hub "
                        "checkpoints, whose block-scaled weights are dequantized on the fly)")
    h.add_argument("--mtp", nargs="?", const="keep", choices=["keep", "auto"], default=None,
                   help="keep the multi-token-prediction layers (DeepSeek-V3's) in megatron-core's MTP block, for "
                        "training to train them (refused when config.json declares none; '--mtp auto': where it "
                        "declares some); without it they are dropped, with a count printed and a note in the sidecar")
    h.add_argument("--peft-dir", default=None,
                   help="a peft LoRA adapter folder of this model: its adapters are stored beside the weights "
                        "(torch_dist), for training to continue them or mcore2hf to export or merge them")
    h.add_argument("--force", action="store_true", help=FORCE_HELP)
    _add_workers(h)
    h.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    h.set_defaults(run=run_hf2mcore)

    m = sub.add_parser(
        "mcore2hf", help="Megatron-Core checkpoint -> HF folder",
        description="Convert a Megatron-Core checkpoint (torch_dist or legacy; written here, by Megatron-LM, "
                    "NeMo / Megatron-Bridge or Pai-Megatron-Patch) into a Hugging Face model folder (sharded "
                    "safetensors + index, config.json, tokenizer files) that transformers.AutoModelForCausalLM."
                    "from_pretrained loads. The architecture comes from this project's sidecar "
                    "mpatch_checkpoint.json if there is one, else from --hf-config (checked against every tensor), "
                    "else from the checkpoint's saved Megatron-LM arguments read as --family; disagreements are "
                    "named, vocabulary padding is dropped, optimizer state is skipped.")
    m.add_argument("--load-dir", required=True,
                   help="checkpoint folder: its root (the iteration named by latest_checkpointed_iteration.txt, or "
                        "release, is read) or one iter_XXXXXXX / release folder")
    m.add_argument("--hf-config", default=None,
                   help="HF config.json (or the folder holding it) of the model the checkpoint holds: needed when the "
                        "checkpoint has no mpatch_checkpoint.json and no saved Megatron-LM arguments")
    m.add_argument("--family", default=None, choices=sorted(families()),
                   help="read the checkpoint's saved Megatron-LM arguments as this family's model")
    m.add_argument("--iteration", type=int, default=None,
                   help="convert this iteration instead of the newest complete one")
    m.add_argument("--save-dir", required=True, help="output HF folder (must be new or empty unless --force)")
    m.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="dtype of the HF weights (default: the checkpoint's dtype)")
    m.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors shard, e.g. 5GB, 500MB, 2GiB (default 5GB)")
    m.add_argument("--lora-adapter", action="store_true",
                   help="a LoRA checkpoint (a LoRA run's final/ or iteration, or hf2mcore --peft-dir): write its adapters "
                        "as a peft folder (adapter_config.json, adapter_model.safetensors)")
    m.add_argument("--merge-lora", action="store_true",
                   help="a LoRA checkpoint: write the whole HF model with its adapters merged in (float32, then --dtype)")
    m.add_argument("--base-dir", default=None,
                   help="--merge-lora: the base model's checkpoint (default: the one the LoRA checkpoint names, checked "
                        "by digest)")
    m.add_argument("--force", action="store_true", help=FORCE_HELP)
    m.add_argument("--no-verify", action="store_true",
                   help="do not check the checkpoint's files against its mpatch_manifest.json (checked by default, "
                        "beside the copy, where the checkpoint has one)")
    _add_workers(m)
    m.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    m.set_defaults(run=run_mcore2hf)

    from megatron_patch.cli.pai_convert import register as register_pai

    register_pai(sub)

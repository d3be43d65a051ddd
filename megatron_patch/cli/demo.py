"""`mpatch demo`: tiny models of every family, HF vs MCore logit parity at each family's test layouts."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from megatron_patch.checkpoint.outputs import atomic_output_dir
from megatron_patch.cli.common import SEED_RANGE, check_seed, print_table
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.runtime.distributed import ParallelLayout

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.
# So are the modules a subcommand runs (cli/__init__.py): align.parity, description.tiny.

# Extra layouts a user can ask for instead of each family's own (--layouts).
LAYOUTS = {
    "tp1": ParallelLayout(),
    "tp2": ParallelLayout(tp=2),
    "pp2": ParallelLayout(pp=2),
    "ep2": ParallelLayout(ep=2),
}


def run(args) -> int:
    from transformers.utils import logging as hf_logging

    from megatron_patch.align.parity import FP32_KL, FP32_REL_L2, check_parity
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    check_seed(args.seed)
    hf_logging.disable_progress_bar()  # per-model load bars drown the table
    registered = families()
    # --work-dir is an output like any other (docs/outputs.md): the tiny models were saved into DIR/<family> over
    # whatever was there, a downloaded model's shards deleted (the outputs audit)
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="mpatch-demo-"))
    rows, failed = [], 0
    with atomic_output_dir(work, args.force, tool="mpatch demo", what="--work-dir") if args.work_dir \
            else contextlib.nullcontext(work) as writing:
        for name in args.families or list(registered):
            family = registered[name]
            hf_dir = make_tiny_hf_checkpoint(name, writing / name, seed=args.seed)
            layouts = [LAYOUTS[k] for k in args.layouts] if args.layouts else list(family.test_layouts.parity)
            for layout in layouts:
                if layout.ep > 1 and not parse_arch(hf_dir).is_moe:
                    continue  # expert parallelism applies to MoE families only
                m = check_parity(hf_dir, layout, seed=args.seed)
                failed += not m["passed"]
                rows.append({"family": name, "layout": str(layout), "rel_l2": f"{m['rel_l2']:.1e}",
                             "kl": f"{m['kl']:.1e}", "max_abs": f"{m['max_abs']:.1e}", "top1": f"{m['top1']:.3f}",
                             "verdict": "PASS" if m["passed"] else "FAIL"})
                print(f"  {name:<12} {str(layout):<22} {rows[-1]['verdict']}", flush=True)
    print()
    print_table(rows, ["family", "layout", "rel_l2", "kl", "max_abs", "top1", "verdict"])
    print(f"\n{len(rows) - failed}/{len(rows)} passed (fp32 bounds: rel_l2 <= {FP32_REL_L2:g}, KL <= {FP32_KL:g}); "
          f"tiny models in {work}")
    return 1 if failed else 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="tiny model of each family: HF vs MCore parity",
        description="Make a tiny random HF checkpoint of each supported family locally, build its MCore model "
                    "with this package, map the weights, and compare fp32 logits at the parallel layouts each "
                    "family is tested at.")
    p.add_argument("--families", nargs="+", choices=list(families()), help="families to run (default: all)")
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=None,
                   help="layouts to check instead of each family's own (ep2 applies to MoE families only)")
    p.add_argument("--work-dir", help="a new folder for the tiny checkpoints, one folder per family (default: a new "
                                      "temporary folder)")
    p.add_argument("--force", action="store_true", help="replace an earlier --work-dir of mpatch demo")
    p.add_argument("--seed", type=int, default=0,
                   help=f"seed of the tiny models' weights and of the random tokens ({SEED_RANGE}, default 0)")
    p.set_defaults(run=run)

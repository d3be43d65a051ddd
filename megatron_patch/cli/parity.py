"""`mpatch parity`: HF logits vs the MCore model built and mapped by this package, at a layout."""

from __future__ import annotations

import json

from megatron_patch.align.bounds import FP32_FLOOR_TOLERANCE, FP32_KL, FP32_REL_L2
from megatron_patch.checkpoint.hf_reader import checked_arch
from megatron_patch.cli.common import SEED_RANGE, add_layout_args, check_seed, layout_from_args, sigterm_as_interrupt
from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import validate_layout
from megatron_patch.runtime.progress_bars import bars_wanted, hide_transformers_bars

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch` and the launcher's checks start without them, its dry run
# with torch alone (to see the machine).
# So are the modules a subcommand runs (cli/__init__.py): align.alignment, align.parity.


@sigterm_as_interrupt
def run(args) -> int:
    from megatron_patch.align.alignment import check_run_fits
    from megatron_patch.align.parity import check_parity
    layout = layout_from_args(args)
    check_seed(args.seed)
    if not bars_wanted(quiet=False):
        hide_transformers_bars()
    if args.seq_len < 1 or args.batch < 1:
        raise UserError(f"--seq-len and --batch must be at least 1 (got {args.seq_len}, {args.batch})")
    arch = checked_arch(args.hf_dir, shapes=True)
    validate_layout(arch, layout, uneven_pipelines=False)  # refuse before starting any process
    check_run_fits(arch, args.batch, args.seq_len, "parity")
    metrics = check_parity(args.hf_dir, layout, seed=args.seed, batch=args.batch, seq=args.seq_len)
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        floor = (f" (over the fixed bounds: judged against transformers' own fp32 error from fp64, rel_l2="
                 f"{metrics['floor_rel_l2']:.2e} kl={metrics['floor_kl']:.2e}: limits rel_l2 "
                 f"{metrics['limit_rel_l2']:.2e}, kl {metrics['limit_kl']:.2e})" if "floor_rel_l2" in metrics else
                 f" (over the fixed bounds; transformers' own fp32 rounding was not measured: "
                 f"{metrics['floor_not_measured']})" if "floor_not_measured" in metrics else "")
        print(f"{layout}: rel_l2={metrics['rel_l2']:.2e} kl={metrics['kl']:.2e} max_abs={metrics['max_abs']:.2e} "
              f"top1={metrics['top1']:.3f}{floor} -> {'PASS' if metrics['passed'] else 'FAIL'}")
    return 0 if metrics["passed"] else 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "parity", help="fp32 logit parity of an HF model and its MCore twin",
        description="Build the MCore model for an HF folder at a TP/PP/EP layout (in local processes), map the "
                    "weights in memory, and compare fp32 logits with transformers on random tokens. "
                    f"Passes at relative L2 error <= {FP32_REL_L2:g} and KL <= {FP32_KL:g}, or, over them, within "
                    f"{FP32_FLOOR_TOLERANCE:g}x (KL: {FP32_FLOOR_TOLERANCE ** 2:g}x) transformers' own fp32 error from "
                    "its fp64 run (fp32 rounding adds up with depth); exit 0 pass, 1 fail, 2 bad input, "
                    "3 internal error.")
    p.add_argument("--hf-dir", required=True, help="Hugging Face model folder (config.json + safetensors)")
    add_layout_args(p)
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--batch", type=int, default=2, help="sequences (default 2)")
    p.add_argument("--seed", type=int, default=0, help=f"seed of the random tokens ({SEED_RANGE}, default 0)")
    p.add_argument("--json", action="store_true", help="print every metric as JSON")
    p.set_defaults(run=run)

"""`mpatch inspect DIR`: what a checkpoint folder is (format, layout, iterations, model, who wrote it)."""

from __future__ import annotations

import json
import warnings

from megatron_patch.checkpoint.inspect import describe_checkpoint, format_summary


def run_inspect(args) -> int:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

    info = describe_checkpoint(args.dir, args.iteration)
    print(json.dumps(info, indent=2, default=str) if args.json else format_summary(info))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect", help="say what a Megatron-Core checkpoint folder holds",
        description="Describe a checkpoint folder on one screen without reading its weights: format (torch_dist or "
                    "legacy), layout, iteration(s), the tool that wrote it when the files tell, the model's family "
                    "and architecture when known, dtype, tensor count and size, whether optimizer state is present, "
                    "and what 'mpatch convert mcore2hf' would still need. Exit 2 when it is not a checkpoint.")
    p.add_argument("dir", metavar="DIR", help="checkpoint folder: its root, or one iter_XXXXXXX / release folder")
    p.add_argument("--iteration", type=int, default=None, help="describe this iteration instead of the newest")
    p.add_argument("--json", action="store_true", help="print the description as JSON")
    p.set_defaults(run=run_inspect)

"""`mpatch`: one entry point, one module per subcommand (each exposes ``register(subparsers)``).

The subcommand modules import the library inside their ``run`` functions, not at the top: ``mpatch convert``
starts without torch or megatron-core (0.3-0.6 s with the model's shape cached, docs/performance.md), and
``--help`` of any subcommand should not pay for the others' imports. Library modules import at the top.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_patch import __version__
from megatron_patch.errors import UserError

SUBCOMMANDS = ["info", "families", "demo", "parity", "convert", "inspect", "preprocess", "train", "align"]


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of ``only`` that one (its module's imports are all that run:
    some subcommands import torch at import time, which ``mpatch convert`` does not need)."""
    parser = argparse.ArgumentParser(
        prog="mpatch", description="Llama-3.1, Qwen2 and MoE models on Megatron-Core: conversion, alignment, training.")
    parser.add_argument("--version", action="version", version=f"megatron_patch {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS if only not in SUBCOMMANDS else [only]:
        importlib.import_module(f"megatron_patch.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(only=argv[0] if argv else None).parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except UserError as exc:
        print(f"mpatch {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mpatch {args.command}: interrupted", file=sys.stderr)
        return 130

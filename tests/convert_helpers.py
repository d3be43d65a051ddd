"""Helpers of the conversion tests."""

from __future__ import annotations

from pathlib import Path

from megatron_patch.cli import main


def leftovers(target: Path) -> list[str]:
    """Temporary siblings a conversion into ``target`` left behind."""
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


def run_cli(capsys, *argv) -> tuple[int, str]:
    """``mpatch argv`` in this process: its exit code and what it wrote to stderr."""
    rc = main(list(argv))
    return rc, capsys.readouterr().err

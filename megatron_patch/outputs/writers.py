"""Every command that writes an output, in one list. Each follows the one rule of docs/outputs.md: its output
is new, or an earlier output of mpatch that it replaces with --force (a training run resumes it instead),
under the output's lock, published only whole, with a manifest.

docs/outputs.md's table has a row for each, and tests/test_writers.py drives each one through the rule;
a writer added here without a row, or without a driver there, fails that test. So does a lock taken in
the code for an option no writer here names.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Writer:
    command: str  # as the user types it
    option: str   # where the output is named (the lock's ``what``)

    @property
    def name(self) -> str:
        """How the docs table's first column names it."""
        return f"{self.command} {self.option}"


WRITERS = (
    Writer("mpatch convert hf2mcore", "--save-dir"),
    Writer("mpatch convert mcore2hf", "--save-dir"),
    Writer("mpatch preprocess", "--output-prefix"),
    Writer("mpatch train", "OUTPUT_BASEPATH"),
    Writer("mpatch align", "--report-dir"),
    Writer("mpatch eval", "--output-dir"),
    Writer("mpatch demo", "--work-dir"),
)

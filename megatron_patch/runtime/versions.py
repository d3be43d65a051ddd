"""The combinations of Python, megatron-core, torch and transformers this project is tested with.

`mpatch info` says whether the running combination is one of them. A combination is matched by release
line: the Python and torch minor versions, megatron-core's minor and transformers' minor.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

from megatron_patch.runtime.machine import installed_version


@dataclass(frozen=True)
class Combination:
    python: str
    megatron_core: str
    torch: str
    transformers: str
    how: str  # where it is tested

    def matches(self, found: dict[str, str | None]) -> bool:
        return all(_line(found.get(key)) == _line(getattr(self, key))
                   for key in ("python", "megatron_core", "torch", "transformers"))


# What pip resolves today from the README's commands, and the 4.x line checked by hand.
TESTED = (
    Combination("3.11", "0.16.1", "2.13.0", "5.25.0", "CI: the whole suite (.ci/run, fresh venv)"),
    Combination("3.12", "0.19.2", "2.13.0", "5.25.0",
                "CI: the quick subset and checkpoints across releases; every conversion and checkpoint test and a "
                "resume of another schedule one day in three (.ci/run's turns); by hand (2026-12-05): the slow "
                "tests, 598 passed, 1 failed (a resume with another LR, fixed in 4ad0986), 1 GPU-only skip"),
    Combination("3.13", "0.19.2", "2.13.0", "5.25.0",
                "CI: the quick subset one day in three (where pyenv has 3.13); by hand (2026-11-26, transformers "
                "5.24): the whole suite, 976 passed, 8 GPU-only skips"),
    Combination("3.10", "0.16.1", "2.13.0", "5.20.2",
                "CI: the quick subset one day in three (where pyenv has 3.10); by hand (2026-11-26): the whole suite, "
                "976 passed, 8 GPU-only skips"),
    Combination("3.11", "0.16.1", "2.15.0", "5.25.0",
                "by hand (2026-12-03, pip's CUDA build, on the CPU): the whole suite, 1931 passed, 8 GPU-only skips"),
    Combination("3.11", "0.16.1", "2.14.1", "5.25.0",
                "by hand (2026-12-03, pip's CUDA build, on the CPU): the whole suite, 1931 passed, 8 GPU-only skips"),
    Combination("3.11", "0.16.1", "2.13.0", "5.24.0",
                "CI until 2026-12-02, what pip resolved then: the whole suite"),
    Combination("3.11", "0.16.1", "2.13.0", "4.57.6",
                "by hand: the tests that read transformers (models, deepseek, convert, align, families, foreign)"),
)


def _line(version: str | None) -> tuple[str, ...] | None:
    """'2.13.0+cpu' -> ('2', '13'): the release line a combination is matched on."""
    if version is None:
        return None
    return tuple(version.split("+")[0].split(".")[:2])


def installed() -> dict[str, str | None]:
    return {"python": platform.python_version(), "megatron_core": installed_version("megatron-core"),
            "torch": installed_version("torch"), "transformers": installed_version("transformers")}


def tested_combination(found: dict[str, str | None] | None = None) -> Combination | None:
    """The tested combination the installed versions belong to, or None."""
    found = installed() if found is None else found
    return next((c for c in TESTED if c.matches(found)), None)

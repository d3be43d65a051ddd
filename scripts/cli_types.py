"""argparse types the benchmark scripts share: a bad value is refused in one line with exit 2, before any work
(the perf audit: tracebacks, and a misspelt model name measured as another model)."""

from __future__ import annotations

import argparse
from typing import Callable, Iterable


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def comma_list(allowed: Iterable[str] | None = None, item: Callable = str) -> Callable[[str], list]:
    """A comma-separated list of ``item`` values, each one of ``allowed`` where given."""
    allowed = None if allowed is None else sorted(allowed)

    def parse(text: str) -> list:
        values = [item(part) for part in text.split(",")]
        wrong = [v for v in values if allowed is not None and v not in allowed]
        if wrong:
            raise argparse.ArgumentTypeError(f"{', '.join(map(str, wrong))}: choose from {', '.join(allowed)}")
        return values
    return parse

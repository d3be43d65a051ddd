#!/usr/bin/env python
"""Regenerate the docs' generated tables: the model families (from the registry, `mpatch families`), the
launcher options (megatron_patch/training/launcher_options.py) and the tested version combinations
(megatron_patch/runtime/versions.py).

Each table sits between `<!-- families:NAME -->` and `<!-- /families:NAME -->` (or `options:NAME`,
`versions:tested`) in a docs file.
`--check` exits 1 (naming the file) when a table is out of date; tests/test_docs.py runs it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's registry, whatever copy is installed
FILES = ["README.md", "examples/README.md", "docs/lora.md", "docs/coming-from-pai.md"]


def versions_table() -> str:
    from megatron_patch.runtime.versions import TESTED

    rows = ["| Python | megatron-core | torch | transformers | how it is tested |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| {c.python} | {c.megatron_core} | {c.torch} | {c.transformers} | {c.how} |" for c in TESTED]
    return "\n".join(rows) + "\n"


def updated(text: str) -> str:
    from megatron_patch.cli import families
    from megatron_patch.training import launcher_options

    tables = {"families": families.markdown, "options": launcher_options.markdown, "versions": lambda _: versions_table()}

    def fill(m: re.Match) -> str:
        return f"{m.group(1)}\n{tables[m.group(2)](m.group(3))}{m.group(4)}"

    return re.sub(r"(<!-- (families|options|versions):(\w+) -->)\n.*?(<!-- /\2:\3 -->)", fill, text, flags=re.S)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a table is out of date")
    args = parser.parse_args()
    stale = []
    for name in FILES:
        path = ROOT / name
        text = path.read_text()
        new = updated(text)
        if new != text:
            stale.append(name)
            if not args.check:
                path.write_text(new)
    if stale and args.check:
        print(f"out of date: {', '.join(stale)}: run scripts/update_docs_tables.py", file=sys.stderr)
        return 1
    print(("updated: " + ", ".join(stale)) if stale else "the docs' generated tables are current")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The docs' tables of model families are generated from the registry and must be current, and every file and
test the docs name exists."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from megatron_patch.models.description.registry import families

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_family_tables_in_the_docs_are_current():
    proc = subprocess.run([sys.executable, "scripts/update_docs_tables.py", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    readme = open(os.path.join(REPO, "README.md")).read()
    launchers = open(os.path.join(REPO, "examples", "README.md")).read()
    for name, family in families().items():
        assert f"| `{name}` |" in readme
        assert f"| `{family.launcher}` |" in launchers


# Paths the docs name in another project (Pai-Megatron-Patch's own helper, which its SFT loss is read from).
OTHER_PROJECTS_FILES = {"megatron_patch/template/helper.py"}


def test_every_file_and_test_the_docs_name_exists():
    """A doc that cites a test or a file that is not there (docs/cpu-runtime.md named a MLA gradient test that never
    existed): each ``tests/..., scripts/..., megatron_patch/..., examples/..., toolkits/...`` path the README and
    docs name is a file here, and each ``FILE.py::name`` a function or class in it."""
    root = Path(REPO)
    docs = [root / "README.md", root / "examples" / "README.md", *sorted((root / "docs").glob("*.md")),
            *sorted((root / "toolkits").glob("**/*.md"))]
    cited = re.compile(r"(?<![\w/.])((?:tests|scripts|megatron_patch|examples|toolkits)/[\w./-]+?\.(?:py|sh|md|json|txt))"
                       r"(?:::(\w+))?")
    missing, count = [], 0
    for doc in docs:
        for path, name in cited.findall(doc.read_text()):
            count += 1
            file = root / path
            if path in OTHER_PROJECTS_FILES:
                continue
            if not file.is_file():
                missing.append(f"{doc.name}: {path}")
            elif name and name not in {node.name for node in ast.walk(ast.parse(file.read_text()))
                                       if isinstance(node, (ast.FunctionDef, ast.ClassDef))}:
                missing.append(f"{doc.name}: {path}::{name}")
    assert count > 200 and missing == [], missing

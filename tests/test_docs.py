"""The docs' tables of model families are generated from the registry and must be current."""

from __future__ import annotations

import os
import subprocess
import sys

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

"""The tested version combinations: what `mpatch info` reports, and setup.py admitting exactly those lines."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement

from megatron_patch.cli import main
from megatron_patch.runtime import versions
from megatron_patch.runtime.versions import TESTED, installed

REPO = Path(__file__).resolve().parents[1]


def _requirement(name: str) -> Requirement:
    text = (REPO / "setup.py").read_text()
    return Requirement(re.search(rf'"({re.escape(name)}[^"]*)"', text).group(1))


def test_combinations_match_by_release_line():
    found = {"python": "3.11.9", "megatron_core": "0.16.1", "torch": "2.13.0+cpu", "transformers": "5.25.1"}
    assert versions.tested_combination(found) is TESTED[0]
    assert versions.tested_combination({**found, "transformers": "5.24.0"}).transformers == "5.24.0"
    assert versions.tested_combination({**found, "python": "3.12.1", "megatron_core": "0.19.0"}) is TESTED[1]
    assert versions.tested_combination({**found, "megatron_core": "0.17.0"}) is None
    assert versions.tested_combination({**found, "transformers": "5.23.0"}) is None
    assert versions.tested_combination({**found, "torch": None}) is None


def test_setup_admits_the_tested_megatron_core_lines_and_no_unaudited_one():
    mcore = _requirement("megatron-core")
    for c in TESTED:
        assert mcore.specifier.contains(c.megatron_core), c
    for unaudited in ("0.15.3", "0.17.1", "0.18.2", "0.20.0"):
        assert not mcore.specifier.contains(unaudited), unaudited
    transformers = _requirement("transformers")
    assert all(transformers.specifier.contains(c.transformers) for c in TESTED)
    assert not transformers.specifier.contains("6.0.0")


def test_info_says_whether_this_combination_is_tested(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("tested_combination"))
    assert ("yes" in line) == (versions.tested_combination(installed()) is not None), line
    assert installed()["megatron_core"] in out

"""The session's set-up, and fixtures shared by the training test modules."""

from __future__ import annotations

import compileall
import re
from pathlib import Path

import pytest

from megatron_patch.runtime.deferred_compile import defer_megatron_compile

# The tests run the project's code in this process too: with megatron-core imported as every `mpatch` process and
# rank imports it (runtime/deferred_compile.py), so that they run what those processes run. First, before any
# import of megatron-core.
defer_megatron_compile()

from tests.training_helpers import make_corpus  # noqa: E402 - after the line above

REPO = Path(__file__).resolve().parents[1]


def pytest_sessionstart(session):
    """Byte-compile the project once, before any test starts a process. The suite starts several hundred Python
    processes (each rank of a launch, each `mpatch` command), and each imports much of the project; where nothing
    writes bytecode caches (PYTHONDONTWRITEBYTECODE=1, as on this project's development machines) each compiled it
    from source again: 0.25 s for a rank's imports against 0.09 s from the caches (scripts/bench_imports.py, "the
    project" lines). compileall writes the caches whatever that variable says; a process reads them as usual, and
    a module edited since is compiled anew."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller has done it
        return
    for folder in ("megatron_patch", "tests"):
        compileall.compile_dir(REPO / folder, quiet=2, rx=re.compile(r"/\.|__pycache__"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """2000 documents of the toy grammar, tokenized, with their tokenizer: built once for the whole run."""
    return make_corpus(tmp_path_factory.mktemp("corpus"), 2000, seed=0)

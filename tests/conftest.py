"""Fixtures shared by the training test modules."""

from __future__ import annotations

import pytest

from tests.training_helpers import make_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """2000 documents of the toy grammar, tokenized, with their tokenizer: built once for the whole run."""
    return make_corpus(tmp_path_factory.mktemp("corpus"), 2000, seed=0)

"""What DeepSeek-V4's model and converter tests share (tests/test_deepseek_v4_model.py, test_deepseek_v4_hub.py):
the tiny model as transformers saves it, a round trip through megatron-core, and its logits against
transformers'."""

from __future__ import annotations

import pytest
import torch

from megatron_patch.runtime.distributed import ParallelLayout
from tests.convert_helpers import checkpoint_logits_worker

SEQ = 32  # past the sliding window (8), four CSA windows' worth of compressed entries, four HCA ones


@pytest.fixture
def v4():
    from megatron_patch.models.description.registry import get_family

    return get_family("deepseek_v4")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint("deepseek_v4", tmp_path_factory.mktemp("v4") / "hf", seed=3)


def round_trip(hf_dir, out, fmt: str, layout: ParallelLayout):
    """hf2mcore at ``layout`` then mcore2hf; the converted checkpoint folder and the HF folder it came back to."""
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf

    name = f"{fmt}-{layout.tp}-{layout.pp}-{layout.ep}"
    ckpt, back = out / name, out / f"back-{name}"
    hf_to_mcore(hf_dir, ckpt, layout, fmt=fmt, dtype="fp32", progress=False)
    mcore_to_hf(ckpt, back, progress=False)
    return ckpt, back


def assert_same_tensors(got_dir, want_dir, extra=()):
    """``got_dir`` holds ``want_dir``'s tensors bit for bit (dtype included), and ``extra`` beside them."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    got, want = HFCheckpointReader(got_dir), HFCheckpointReader(want_dir)
    assert sorted(got.keys()) == sorted([*want.keys(), *extra])
    for name in want.keys():
        a, b = got.get(name), want.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


def checkpoint_against_transformers(hf_dir, ckpt, layout: ParallelLayout = ParallelLayout()):
    """rel_l2 and kl of the MCore checkpoint's logits against transformers' of ``hf_dir``."""
    from megatron_patch.align.parity import compare_logits, hf_logits, random_tokens
    from megatron_patch.runtime.launch import run_local

    tokens = random_tokens(300, batch=2, seq=SEQ, seed=1)
    results = run_local(checkpoint_logits_worker, layout.world_size, str(ckpt), layout, tokens)
    return compare_logits(hf_logits(hf_dir, tokens), next(r for r in results if r is not None))

"""DeepSeek-V4's weight table on the files as they come: ``tid2eid`` in whichever integer dtype the file holds
(int64 as transformers writes it, int32 in ports of the hub's checkpoint), converted and written back in it, bit for
bit. The family is not registered yet: each test registers it for its length."""

from __future__ import annotations

import shutil

import pytest
import torch

from megatron_patch.runtime.distributed import ParallelLayout
from tests.test_deepseek_v4_model import assert_same_tensors, hf_dir, round_trip, transformers_and_ours, v4  # noqa: F401


def rewritten(src, dst, change):
    """A copy of HF folder ``src`` at ``dst`` with its tensors passed through ``change`` (a dict -> dict)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    path = dst / "model.safetensors"
    save_file(change(load_file(path)), path, metadata={"format": "pt"})
    return dst


def with_tables_in(dtype):
    return lambda tensors: {n: t.to(dtype) if n.endswith("tid2eid") else t for n, t in tensors.items()}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_tid2eid_converts_in_the_integer_dtype_its_file_holds(v4, hf_dir, tmp_path, dtype):
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    src = rewritten(hf_dir, tmp_path / "hf", with_tables_in(dtype))
    assert HFCheckpointReader(src).dtype("model.layers.0.ffn.gate.tid2eid") == str(dtype).removeprefix("torch.")
    for fmt in ("legacy", "torch_dist"):
        _, back = round_trip(src, tmp_path, fmt, ParallelLayout())
        assert_same_tensors(back, src)


def test_an_int32_tid2eid_checkpoint_loads_with_transformers_logits(v4, hf_dir, tmp_path):
    from megatron_patch.align.parity import FP32_KL, FP32_REL_L2

    src = rewritten(hf_dir, tmp_path / "hf", with_tables_in(torch.int32))
    ckpt, _ = round_trip(src, tmp_path, "torch_dist", ParallelLayout())
    metrics = transformers_and_ours(hf_dir, ParallelLayout(), source=ckpt, from_mcore=True)
    assert metrics["rel_l2"] <= FP32_REL_L2 and metrics["kl"] <= FP32_KL, metrics

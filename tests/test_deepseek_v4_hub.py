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


def hub_named(tensors):
    """transformers' save names turned back into DeepSeek's own (hub_names.py's renaming, inverted)."""
    return {saved_to_hub(n): t for n, t in tensors.items()}


def saved_to_hub(name: str) -> str:
    from megatron_patch.models.deepseek_v4.hub_names import IN_LAYER, TOP_LEVEL

    top = {saved: hub for hub, saved in TOP_LEVEL.items()}
    if name in top:
        return top[name]
    name = name.removeprefix("model.")
    layer, _, rest = name.partition(".")[2].partition(".")
    return f"layers.{layer}.{ {v: k for k, v in IN_LAYER.items()}.get(rest, rest)}"


def release_files(ckpt):
    """The checkpoint's files under its release folder, name -> bytes (the sidecar, which names its source, aside)."""
    return {str(p.relative_to(ckpt)): p.read_bytes() for p in sorted((ckpt / "release").rglob("*")) if p.is_file()}


def test_the_hub_names_convert_to_the_same_checkpoint_as_transformers_names(v4, hf_dir, tmp_path):
    """A folder in DeepSeek's own names (embed.weight, layers.0.attn.kv_norm.weight, hc_head_fn, head.weight; no
    model. prefix) converts to the same MCore checkpoint, byte for byte, as transformers' save of the same weights,
    and back to transformers' names."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.convert.checkpoint import hf_to_mcore

    hub = rewritten(hf_dir, tmp_path / "hub", hub_named)
    names = set(HFCheckpointReader(hub).keys())
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.attn.kv_norm.weight",
            "layers.0.attn.wq_a.weight", "layers.1.attn.compressor.norm.weight", "layers.0.ffn.gate.tid2eid",
            "layers.0.hc_attn_fn"} <= names and not any(n.startswith("model.") for n in names)
    for fmt in ("legacy", "torch_dist"):
        want, got = tmp_path / f"want-{fmt}", tmp_path / f"got-{fmt}"
        hf_to_mcore(hf_dir, want, ParallelLayout(), fmt=fmt, dtype="fp32", progress=False)
        hf_to_mcore(hub, got, ParallelLayout(), fmt=fmt, dtype="fp32", progress=False)
        assert release_files(want) and release_files(got) == release_files(want)
    _, back = round_trip(hub, tmp_path, "torch_dist", ParallelLayout(ep=2))
    assert_same_tensors(back, hf_dir)


def test_a_folder_mixing_the_two_namings_is_refused(v4, hf_dir, tmp_path):
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.errors import UserError

    mixed = rewritten(hf_dir, tmp_path / "mixed", lambda t: {(saved_to_hub(n) if n == "model.norm.weight" else n): v
                                                             for n, v in t.items()})
    with pytest.raises(UserError, match="mixes DeepSeek's own tensor names .norm.weight. with transformers'"):
        hf_to_mcore(mixed, tmp_path / "out", ParallelLayout(), dtype="fp32", progress=False)

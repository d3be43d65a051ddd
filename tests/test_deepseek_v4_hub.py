"""DeepSeek-V4's weight table on the files as they come: ``tid2eid`` in whichever integer dtype the file holds
(int64 as transformers writes it, int32 in ports of the hub's checkpoint), converted and written back in it, bit for
bit. The family is not registered yet: each test registers it for its length."""

from __future__ import annotations

import json
import re
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


FP8_WEIGHTS = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight")
FP4_WEIGHTS = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128]}


def quantized_as_the_hub(hf_dir, hub_dir, want_dir):
    """The tiny model in DeepSeek's names and formats (hub_dir): attention and shared-expert weights FP8 (e4m3, a
    ue8m0 scale per 128 x 128), routed experts FP4 (int8, two e2m1 values a byte, a ue8m0 scale per row and 32),
    the rest as saved, config.json's quantization_config as the hub's; its codes drawn at random. want_dir: the same
    weights in transformers' names as transformers 5.24 dequantizes them (``Fp8Dequantize``), in float32."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(5)
    saved = load_file(hf_dir / "model.safetensors")
    hub, want = {}, {}
    for name, tensor in saved.items():
        hub_name = saved_to_hub(name)
        rows, cols = tensor.shape if tensor.dim() == 2 else (0, 0)
        if FP8_WEIGHTS.fullmatch(hub_name):
            codes = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0x7E  # not e4m3's NaN
            weight = codes.view(torch.float8_e4m3fn)
            scale = torch.randint(120, 134, (-(-rows // 128), -(-cols // 128)), generator=g, dtype=torch.uint8)
        elif FP4_WEIGHTS.fullmatch(hub_name):
            weight = torch.randint(-128, 128, (rows, cols // 2), generator=g, dtype=torch.int8)
            scale = torch.randint(120, 134, (rows, cols // 32), generator=g, dtype=torch.uint8)
        else:
            hub[hub_name], want[name] = tensor, tensor
            continue
        scale = scale.view(torch.float8_e8m0fnu)
        hub[hub_name], hub[hub_name.removesuffix(".weight") + ".scale"] = weight, scale
        want[name] = Fp8Dequantize(None)._dequantize_one(weight, scale, torch.float32)
    for folder, tensors in ((hub_dir, hub), (want_dir, want)):
        shutil.copytree(hf_dir, folder)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (hub_dir / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION}))
    return hub_dir, want_dir


def test_the_hubs_fp8_and_fp4_weights_dequantize_as_transformers_dequantizes_them(v4, hf_dir, tmp_path):
    """The hub's quantized files convert to the same MCore checkpoint, byte for byte, as the weights transformers
    dequantizes from them, and come back as those weights."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.convert.checkpoint import hf_to_mcore

    hub, want = quantized_as_the_hub(hf_dir, tmp_path / "hub", tmp_path / "want")
    reader = HFCheckpointReader(hub)
    assert reader.dtype("layers.0.ffn.experts.3.w2.weight") == "int8"
    assert reader.dtype("layers.0.ffn.experts.3.w2.scale") == "float8_e8m0fnu"
    assert reader.dtype("layers.1.attn.wq_b.weight") == "float8_e4m3fn"
    for fmt in ("legacy", "torch_dist"):
        hf_to_mcore(want, tmp_path / f"want-{fmt}", ParallelLayout(), fmt=fmt, dtype="fp32", progress=False)
        hf_to_mcore(hub, tmp_path / f"got-{fmt}", ParallelLayout(), fmt=fmt, dtype="fp32", progress=False)
        assert release_files(tmp_path / f"want-{fmt}") == release_files(tmp_path / f"got-{fmt}")
    _, back = round_trip(hub, tmp_path, "torch_dist", ParallelLayout(ep=2))
    assert_same_tensors(back, want)

"""DeepSeek-V4's weight table on the files as they come: ``tid2eid`` in whichever integer dtype the file holds
(int64 as transformers writes it, int32 in ports of the hub's checkpoint), and the float32 parameters in whichever
float dtype (float32 as transformers saves a bf16 model, bf16 on the hub), converted and written back in it, bit for
bit."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from megatron_patch.runtime.distributed import ParallelLayout
from tests.deepseek_v4_helpers import assert_same_tensors, checkpoint_against_transformers, hf_dir, round_trip, v4  # noqa: F401


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
    metrics = checkpoint_against_transformers(hf_dir, ckpt)
    assert metrics["rel_l2"] <= FP32_REL_L2 and metrics["kl"] <= FP32_KL, metrics


def test_a_bf16_checkpoint_transformers_saved_keeps_its_float32_tensors_both_ways(v4, hf_dir, tmp_path):
    """transformers saves a bf16 V4 with its sinks, position biases and norms in float32 (its
    _keep_in_fp32_modules_strict): hf2mcore wrote them in bf16, rounded, though the model holds them in float32, and
    the round trip changed 31 tensors (the dsa audit). They keep the float dtype their file holds, both ways."""
    import transformers

    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf

    src = tmp_path / "bf16"
    transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).save_pretrained(src)
    reader = HFCheckpointReader(src)
    assert reader.dtype("model.layers.0.attn.attn_sink") == reader.dtype("model.norm.weight") == "float32"
    assert reader.dtype("model.layers.0.attn.wq_a.weight") == "bfloat16"
    for fmt, layout in (("torch_dist", ParallelLayout()), ("legacy", ParallelLayout(tp=2, pp=2))):
        ckpt, back = tmp_path / fmt, tmp_path / f"back-{fmt}"
        assert hf_to_mcore(src, ckpt, layout, fmt=fmt, progress=False).dtype == "bf16"
        mcore_to_hf(ckpt, back, progress=False)
        assert_same_tensors(back, src)


def test_a_float32_parameter_stored_as_integers_is_refused(v4, hf_dir, tmp_path):
    """Kept in the dtype its file holds, a sink is still a float weight: stored as integers it would be cast by
    value into the model, so it is refused as any weight is."""
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.errors import UserError

    src = rewritten(hf_dir, tmp_path / "hf", lambda ts: {n: t.to(torch.int32) if n.endswith("1.attn.attn_sink") else t
                                                         for n, t in ts.items()})
    with pytest.raises(UserError, match=r"^model.layers.1.attn.attn_sink in .* is stored as int32, not a floating"):
        hf_to_mcore(src, tmp_path / "mc", ParallelLayout(), progress=False)


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


FP8_WEIGHTS = re.compile(r"(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                         r"|e_proj|h_proj)\.weight")
FP4_WEIGHTS = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128]}


def quantized_as_the_hub(hf_dir, hub_dir, want_dir):
    """The tiny model with an MTP layer in DeepSeek's names and formats (hub_dir): attention, shared-expert and MTP
    projection weights FP8 (e4m3, a ue8m0 scale per 128 x 128), routed experts FP4 (int8, two e2m1 values a byte, a
    ue8m0 scale per row and 32), the rest as saved, config.json's quantization_config as the hub's; its codes drawn
    at random. want_dir: the same weights in transformers' names as transformers 5.24 dequantizes them
    (``Fp8Dequantize``), in float32."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from megatron_patch.models.deepseek_v4.hub_names import hub_to_saved

    g = torch.Generator().manual_seed(5)
    hub, want = {}, {}
    for hub_name, tensor in with_an_mtp_layer()(load_file(hf_dir / "model.safetensors")).items():
        name = hub_to_saved(hub_name)
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
        declaring_mtp(folder)
    config = json.loads((hub_dir / "config.json").read_text())
    (hub_dir / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION}))
    return hub_dir, want_dir


def test_the_hubs_fp8_and_fp4_weights_dequantize_as_transformers_dequantizes_them(v4, hf_dir, tmp_path):
    """The hub's quantized files convert to the same MCore checkpoint, byte for byte (its MTP layer, carried, too),
    as the weights transformers dequantizes from them, and come back as those weights."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.convert.carried import CARRIED_TENSORS
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf

    hub, want = quantized_as_the_hub(hf_dir, tmp_path / "hub", tmp_path / "want")
    reader = HFCheckpointReader(hub)
    assert reader.dtype("layers.0.ffn.experts.3.w2.weight") == "int8"
    assert reader.dtype("layers.0.ffn.experts.3.w2.scale") == "float8_e8m0fnu"
    assert reader.dtype("layers.1.attn.wq_b.weight") == "float8_e4m3fn"
    assert reader.dtype("mtp.0.e_proj.weight") == "float8_e4m3fn" and "mtp.0.ffn.experts.0.w1.scale" in reader
    for fmt in ("legacy", "torch_dist"):
        got, expected = tmp_path / f"got-{fmt}", tmp_path / f"want-{fmt}"
        hf_to_mcore(want, expected, ParallelLayout(), fmt=fmt, dtype="fp32", progress=False, mtp=True)
        hf_to_mcore(hub, got, ParallelLayout(), fmt=fmt, dtype="fp32", progress=False, mtp=True)
        assert release_files(expected) == release_files(got)
        assert (got / CARRIED_TENSORS).read_bytes() == (expected / CARRIED_TENSORS).read_bytes()
    ckpt, back = tmp_path / "ep2", tmp_path / "back"
    hf_to_mcore(hub, ckpt, ParallelLayout(ep=2), dtype="fp32", progress=False, mtp=True)
    mcore_to_hf(ckpt, back, progress=False)
    assert_same_tensors(back, want)


def with_an_mtp_layer(hidden: int = 64, hc: int = 4):
    """The tensors in DeepSeek's names with one multi-token-prediction layer as the hub lays it out (``mtp.0.``: a
    sliding-attention, top-k MoE block, e_proj, h_proj, enorm, hnorm, norm and an hc_head of its own), drawn at
    random; config.json then declares it."""
    def change(tensors):
        tensors = hub_named(tensors)
        g = torch.Generator().manual_seed(7)
        block = {n.removeprefix("layers.0."): t for n, t in tensors.items()
                 if n.startswith("layers.0.") and ".ffn." not in n}
        block |= {n.removeprefix("layers.2."): t for n, t in tensors.items() if n.startswith("layers.2.ffn.")}
        block |= {"e_proj.weight": torch.empty(hidden, hidden), "h_proj.weight": torch.empty(hidden, hidden),
                  "enorm.weight": torch.empty(hidden), "hnorm.weight": torch.empty(hidden),
                  "norm.weight": torch.empty(hidden), "hc_head_fn": torch.empty(hc, hc * hidden),
                  "hc_head_base": torch.empty(hc), "hc_head_scale": torch.empty(1)}
        mtp = {f"mtp.0.{n}": (torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t)
               for n, t in block.items()}
        return tensors | mtp
    return change


def declaring_mtp(folder, count: int = 1):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": count}))
    return folder


def test_the_mtp_layer_travels_beside_the_checkpoint_and_comes_back_bit_exact(v4, hf_dir, tmp_path):
    """--mtp on the hub's files: the MCore model is the one without MTP (its weights byte-identical), the mtp.0.*
    tensors are carried beside it and written back unchanged; without --mtp they are left out, saying so; --mtp on
    transformers' save (which holds no MTP tensors) is refused."""
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.convert.carried import CARRIED_TENSORS
    from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf
    from megatron_patch.errors import UserError

    hub = declaring_mtp(rewritten(hf_dir, tmp_path / "hub", with_an_mtp_layer()))
    mtp = sorted(n for n in HFCheckpointReader(hub).keys() if n.startswith("mtp.0."))
    assert {"mtp.0.e_proj.weight", "mtp.0.hc_head_fn", "mtp.0.attn.wq_a.weight", "mtp.0.ffn.gate.bias",
            "mtp.0.ffn.experts.7.w2.weight"} <= set(mtp)
    want = tmp_path / "want"
    hf_to_mcore(hf_dir, want, ParallelLayout(), dtype="fp32", progress=False)
    for fmt, layout in (("torch_dist", ParallelLayout()), ("legacy", ParallelLayout(ep=2))):
        ckpt, back = tmp_path / f"mtp-{fmt}", tmp_path / f"back-{fmt}"
        hf_to_mcore(hub, ckpt, layout, fmt=fmt, dtype="fp32", progress=False, mtp=True)
        assert _carried_names(ckpt / CARRIED_TENSORS) == mtp
        if fmt == "torch_dist":
            assert release_files(ckpt) == release_files(want)
        mcore_to_hf(ckpt, back, progress=False)
        got, source = HFCheckpointReader(back), HFCheckpointReader(hub)
        assert sorted(n for n in got.keys() if n.startswith("mtp.")) == mtp
        for n in mtp:
            assert got.dtype(n) == source.dtype(n) and got.read_bytes(n) == source.read_bytes(n), n
        assert_same_tensors(back, hf_dir, mtp)
    dropped = tmp_path / "dropped"
    hf_to_mcore(hub, dropped, ParallelLayout(), dtype="fp32", progress=False)
    assert not (dropped / CARRIED_TENSORS).exists() and release_files(dropped) == release_files(want)
    with pytest.raises(UserError, match="holds none of their tensors"):
        hf_to_mcore(declaring_mtp(rewritten(hf_dir, tmp_path / "saved", dict)), tmp_path / "out", ParallelLayout(),
                    dtype="fp32", progress=False, mtp=True)


def _carried_names(path):
    from megatron_patch.checkpoint.hf_reader import read_safetensors_header

    return sorted(read_safetensors_header(path))

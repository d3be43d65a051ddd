"""`mpatch convert`: HF <-> MCore checkpoints, exact round trips, loading at other layouts, failures.

Conversions run in this process (they need no ranks); loading a checkpoint into a model at a
TP/PP/EP layout runs that many gloo processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_patch.align.metrics import compare_logits
from megatron_patch.align.parity import FP32_KL, FP32_REL_L2, hf_logits, random_tokens
from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
from megatron_patch.checkpoint.sidecar import SIDECAR_NAME, read_sidecar
from megatron_patch.checkpoint_files.layout import PARTIAL_TAG
from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME
from megatron_patch.checkpoint_files.torch_dist import COMMON_STATE_OBJECT, TorchDistReader
from megatron_patch.cli import main
from megatron_patch.convert.checkpoint import hf_to_mcore, mcore_to_hf
from megatron_patch.convert.copier import Copier
from megatron_patch.dtypes import Precision
from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import families
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.runtime import ParallelLayout
from tests.convert_helpers import leftovers, run_cli

FAMILIES = list(families())
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module", autouse=True)
def fresh_skeleton_cache(tmp_path_factory):
    """An empty model-skeleton cache, as on a new machine: each family's skeleton is derived, or, for a
    family the derivation does not describe, asked of megatron-core (in its helper process) once."""
    from megatron_patch.models.shape import skeleton

    old = os.environ.get("MPATCH_CACHE_DIR")
    os.environ["MPATCH_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    skeleton._describe_cached.cache_clear()
    skeleton._derived.cache_clear()
    yield
    skeleton._describe_cached.cache_clear()
    skeleton._derived.cache_clear()
    if old is None:
        os.environ.pop("MPATCH_CACHE_DIR", None)
    else:
        os.environ["MPATCH_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {f: make_tiny_hf_checkpoint(f, root / f, seed=3) for f in FAMILIES}
    # Four key/value heads, so that TP=4 divides them.
    dirs["llama3_1_kv4"] = make_tiny_hf_checkpoint("llama3_1", root / "llama3_1_kv4", seed=4, num_key_value_heads=4)
    # An MoE model whose layers 0-2 are dense (megatron keys a mixed model's layers by number).
    dirs["qwen2_moe_mixed"] = make_tiny_hf_checkpoint("qwen2_moe", root / "qwen2_moe_mixed", seed=5,
                                                      decoder_sparse_step=2, mlp_only_layers=[1])
    for d in dirs.values():  # side files that must travel both ways
        (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
        (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    return dirs


def tensors(folder) -> dict[str, torch.Tensor]:
    reader = HFCheckpointReader(folder)
    return {k: reader.get(k) for k in reader.keys()}


# --- exact round trips ---------------------------------------------------------------------------

# Each family's own round trips (test_layouts.round_trips), plus TP=4 on a Llama with four KV heads.
ROUND_TRIPS = [(name, fmt, layout, dtype) for name, f in families().items()
               for fmt, layout, dtype in f.test_layouts.round_trips] + [
    ("llama3_1_kv4", "legacy", ParallelLayout(tp=4), "fp32"),
    ("llama3_1_kv4", "torch_dist", ParallelLayout(tp=4, pp=4), "bf16"),
    ("qwen2_moe_mixed", "torch_dist", ParallelLayout(tp=2, ep=2), "fp32"),
    ("qwen2_moe_mixed", "legacy", ParallelLayout(pp=2, ep=4), "bf16"),
]


@pytest.mark.parametrize("family,fmt,layout,dtype", ROUND_TRIPS,
                         ids=[f"{f}-{fmt}-{str(l).replace(' ', '')}-{d}" for f, fmt, l, d in ROUND_TRIPS])
@pytest.mark.slow
def test_round_trip_is_bit_identical(hf_dirs, tmp_path, family, fmt, layout, dtype):
    src = hf_dirs[family]
    ckpt, back = tmp_path / "mcore", tmp_path / "hf"
    sidecar = hf_to_mcore(src, ckpt, layout, fmt=fmt, dtype=dtype, progress=False)
    assert (sidecar.checkpoint_format, sidecar.dtype, sidecar.parallel_layout) == (fmt, dtype, layout)
    mcore_to_hf(ckpt, back, max_shard_size="100KB", progress=False)

    # Tensors the family keeps in a dtype of their own (DeepSeek's fp32 router bias) stay in it.
    from megatron_patch.checkpoint.engine import plan
    from megatron_patch.models.description.registry import get_family, parse_arch
    from megatron_patch.models.mapping.rules import KEPT_AS_STORED

    arch = parse_arch(src)
    fam = get_family(arch.family)
    # (KEPT_AS_STORED: in the dtype the file holds them in, DeepSeek-V4's integer hash tables and float32 parameters)
    stored = tensors(src)
    kept = {n: stored[n].dtype if t.dtype in KEPT_AS_STORED else getattr(torch, t.dtype)
            for t in plan(fam, arch, ParallelLayout()) for n in t.hf_names if t.dtype}
    # tensors carried beside the model (Qwen3.5's vision tower) come back as they were
    want = {k: v if fam.is_carried(k) else v.to(kept.get(k, DTYPES[dtype])) for k, v in stored.items()}
    got = tensors(back)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    # Sharded with an index, config and side files carried both ways, vocabulary padding gone.
    assert (back / "model.safetensors.index.json").exists()
    config = json.loads((back / "config.json").read_text())
    source_config = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in config.items() if "dtype" not in k} == {k: v for k, v in source_config.items() if "dtype" not in k}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (ckpt / name).read_bytes() == (src / name).read_bytes() == (back / name).read_bytes()
    assert not leftovers(ckpt) and not leftovers(back)


def test_processor_files_and_remote_code_travel_both_ways(hf_dirs, tmp_path):
    """An export is the HF folder again: a multimodal model's processor files (AutoProcessor failed on the export),
    Kimi-K2's remote code and tiktoken file, which its config.json's auto_map names (the export kept auto_map,
    dropped the files, and loaded neither with nor without trust_remote_code), and the weights' licence files
    (Llama's licence asks that a copy travel with the weights)."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(hf_dirs["llama3_1"], src)
    side = {"processor_config.json": '{"image_seq_length": 4}', "video_preprocessor_config.json": "{}",
            "tiktoken.model": "IQ== 0\n", "configuration_deepseek.py": "# remote code, carried as bytes\n",
            "tokenization_kimi.py": "# remote code\n", "LICENSE": "Llama 3.1 Community License",
            "USE_POLICY.md": "# Acceptable use", "LICENSE-MODEL": "DeepSeek's model licence"}
    # and transformers 5's named chat templates, one folder down (both converters dropped the folder: the conv audit)
    side["additional_chat_templates/tool_use.jinja"] = "TOOLS {{ messages[0]['content'] }}"
    (src / "additional_chat_templates").mkdir()
    for name, text in side.items():
        (src / name).write_text(text)
    hf_to_mcore(src, tmp_path / "mcore", ParallelLayout(), progress=False)
    assert "additional_chat_templates/tool_use.jinja" in read_sidecar(tmp_path / "mcore").carried_files
    assert main(["verify", str(tmp_path / "mcore")]) == 0
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    for name, text in side.items():
        assert (tmp_path / "back" / name).read_text() == text, name
    # a folder of that name that leads out of the model is refused, not copied from
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.jinja").write_text("not the model's")
    shutil.rmtree(src / "additional_chat_templates")
    (src / "additional_chat_templates").symlink_to(outside)
    with pytest.raises(UserError, match="additional_chat_templates"):
        hf_to_mcore(src, tmp_path / "mcore2", ParallelLayout(), progress=False)


def test_a_carried_tensor_the_model_exports_or_the_family_does_not_carry_is_refused(hf_dirs, tmp_path, capsys):
    """A checkpoint's carried_tensors.safetensors that names a tensor of the model (a hand edit, another tool's
    file) was planned twice under one name: an export no safetensors reader opens, published with exit 0 under
    --no-verify (the conv audit). One line, nothing written."""
    from megatron_patch.convert.hf_writer import plan_safetensors

    hf_to_mcore(hf_dirs["llama3_1"], tmp_path / "ck", ParallelLayout(), progress=False)
    sidecar = json.loads((tmp_path / "ck" / SIDECAR_NAME).read_text())
    (tmp_path / "ck" / SIDECAR_NAME).write_text(json.dumps(
        {**sidecar, "carried_files": [*sidecar["carried_files"], "carried_tensors.safetensors"]}))
    for name, why in (("model.norm.weight", "a tensor of the model itself"),
                      ("model.visual.patch_embed.weight", "not one the llama3_1 family carries")):
        save_file({name: torch.zeros(64)}, str(tmp_path / "ck" / "carried_tensors.safetensors"))
        rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(tmp_path / "ck"), "--save-dir",
                          str(tmp_path / "back"), "--no-verify")
        assert rc == 2 and f"carried_tensors.safetensors holds '{name}', {why}" in err, err
        assert not (tmp_path / "back").exists()
    # listed but not there, or not a file: the export was written without them, exit 0 (the hostile audit)
    carried = tmp_path / "ck" / "carried_tensors.safetensors"
    for make, said in ((lambda: None, "not found"), (lambda: os.mkfifo(carried), "FIFO"),
                       (lambda: carried.mkdir(), "folder")):
        carried.unlink(missing_ok=True) if not carried.is_dir() else carried.rmdir()
        make()
        rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(tmp_path / "ck"), "--save-dir",
                          str(tmp_path / "back"), "--no-verify")
        assert rc == 2 and "carried_tensors.safetensors" in err and said in err and "\n" not in err.strip(), err
        assert not (tmp_path / "back").exists()
    with pytest.raises(ValueError, match="tensor names planned twice"):  # the writer's own guard
        plan_safetensors(tmp_path, [("a", (2,), "float32"), ("a", (2,), "float32")], 1 << 30)


# Families whose hub checkpoints carry multi-token-prediction layers (DeepSeek's own tests,
# tests/test_deepseek.py, also check their logits).
# (DeepSeek-V4 carries its MTP layers unbuilt, in the hub's names: tests/test_deepseek_v4_hub.py)
MTP_FAMILIES = [name for name, f in families().items() if f.builds_mtp and name != "deepseek_v3"]


@pytest.mark.slow
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_layers_convert_both_ways_bit_exact(hf_dirs, tmp_path, family):
    from megatron_patch.models.description.registry import get_family
    from tests.convert_helpers import with_mtp_layer

    src = with_mtp_layer(hf_dirs[family], tmp_path / "hf")
    want = tensors(src)
    _, layout, _ = get_family(family).test_layouts.round_trips[0]
    hf_to_mcore(src, tmp_path / "mcore", layout, fmt="legacy", mtp=True, progress=False)
    assert read_sidecar(tmp_path / "mcore").mtp_layers == 1
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False)
    got = tensors(tmp_path / "back")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], t) for n, t in want.items())


@pytest.mark.slow
def test_legacy_layout_matches_megatron(hf_dirs, tmp_path):
    """File names, checkpoint version, stage-local layer numbers, padded vocabulary shards."""
    ckpt = tmp_path / "ckpt"
    hf_to_mcore(hf_dirs["qwen2_moe"], ckpt, ParallelLayout(tp=2, pp=2, ep=2), fmt="legacy", progress=False)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "release"
    names = sorted(p.name for p in (ckpt / "release").iterdir())
    assert names == [f"mp_rank_{t:02d}_{p:03d}_{e:03d}" for t in range(2) for p in range(2) for e in range(2)]
    first = torch.load(ckpt / "release/mp_rank_01_000_001/model_optim_rng.pt", weights_only=True)
    last = torch.load(ckpt / "release/mp_rank_00_001_000/model_optim_rng.pt", weights_only=True)
    assert first["checkpoint_version"] == 3.0 and first["iteration"] == 0
    emb = first["model"]["embedding.word_embeddings.weight"]
    assert emb.shape == (128, 64)                   # vocab 200 padded to 256, split over TP=2
    assert torch.count_nonzero(emb[200 - 128:]) == 0  # rank 1 holds rows 128..255: 200.. are padding
    layers = {k.split(".")[2] for k in last["model"] if k.startswith("decoder.layers.")}
    assert layers == {"0", "1"}                     # layers 2 and 3 renumbered on stage 1
    experts = {k for k in first["model"] if ".mlp.experts.linear_fc2" in k}
    assert experts == {f"decoder.layers.{i}.mlp.experts.linear_fc2.weight{j}" for i in range(2) for j in range(2)}
    assert "output_layer.weight" in last["model"] and "output_layer.weight" not in first["model"]

    one_stage = tmp_path / "pp1"
    hf_to_mcore(hf_dirs["llama3_1"], one_stage, ParallelLayout(tp=2), fmt="legacy", progress=False)
    assert sorted(p.name for p in (one_stage / "release").iterdir()) == ["mp_rank_00", "mp_rank_01"]


def _bytes_read_per_tensor(reads, reader) -> dict[str, tuple[int, bool]]:
    """For each HF tensor: bytes read from its range (summed over reads), and whether reads cover it."""
    out = {}
    for name in reader.keys():
        s = reader.stored(name)
        lo, hi = s.offset, s.offset + s.nbytes
        spans = sorted((max(lo, o), min(hi, o + n)) for p, o, n in reads if p == s.path and o < hi and o + n > lo)
        covered, end = True, lo
        for a, b in spans:
            covered &= a <= end
            end = max(end, b)
        out[name] = (sum(b - a for a, b in spans), covered and end == hi)
    return out


@pytest.mark.slow
def test_each_hf_byte_is_read_once_per_copy_written(hf_dirs, tmp_path):
    """A TP shard reads its own rows, not the whole tensor; a row-parallel weight is read a band at a time
    once for all its shards; only what is written several times (a norm on every TP rank, the last
    stage's copy of a tied embedding) is read as many times, and every tensor is read whole."""
    for family, layout, fmt, tp in (("qwen2", ParallelLayout(tp=2, pp=2), "legacy", 2),
                                    ("mixtral", ParallelLayout(tp=2, ep=2), "torch_dist", 1),
                                    ("llama3_1_kv4", ParallelLayout(tp=4), "legacy", 4)):
        copier = Copier(2, trace=True)
        hf_to_mcore(hf_dirs[family], tmp_path / family, layout, fmt=fmt, progress=False, copier=copier)
        reader = HFCheckpointReader(hf_dirs[family])
        got = _bytes_read_per_tensor(copier.stats.source_reads, reader)
        copies = {n: tp if "norm" in n else 2 if family == "qwen2" and n == "model.embed_tokens.weight" else 1
                  for n in reader.keys()}
        want = {n: (reader.nbytes(n) * copies[n], True) for n in reader.keys()}
        assert got == want, {n: (got[n], want[n]) for n in want if got[n] != want[n]}


@pytest.mark.slow
def test_exported_folder_loads_in_transformers(hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    src = hf_dirs["qwen2"]  # tied embeddings: lm_head must come back as HF expects
    hf_to_mcore(src, tmp_path / "ck", ParallelLayout(pp=2), fmt="legacy", progress=False)
    mcore_to_hf(tmp_path / "ck", tmp_path / "hf", progress=False)
    # eager attention, as the reference hf_logits loads it (sdpa's kernel differs in the last bits on some machines)
    model, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True,
                                                       attn_implementation="eager")
    assert not any(info.values()), info
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
    tokens = random_tokens(250)
    assert torch.equal(model(tokens).logits, hf_logits(src, tokens))


def megatron_save_worker(hf_dir: str, out: str) -> dict:
    """Runs in a helper process: megatron's own torch_dist save of the model, and its metadata."""
    from megatron.core import dist_checkpointing

    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import init_model_parallel

    init_model_parallel(ParallelLayout())
    model = build_model(parse_arch(hf_dir), ParallelLayout(), use_te=False)
    dist_checkpointing.save(model.sharded_state_dict(), out)
    return describe_torch_dist(out)


def describe_torch_dist(folder) -> dict:
    """Every stored item but megatron's common state (common.pt up to megatron-core 0.16, from 0.19 the
    ``common_state`` object; the converter writes common.pt, which both releases read)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), v.properties.dtype) if hasattr(v, "size") else "bytes" for k, v in md.items()
            if k != COMMON_STATE_OBJECT}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen2"])
def test_torch_dist_matches_megatrons_own_save(hf_dirs, tmp_path, family):
    """Keys, global shapes and dtypes are exactly what dist_checkpointing.save writes for the model."""
    from megatron_patch.runtime.launch import run_local

    ours = tmp_path / "ours"
    hf_to_mcore(hf_dirs[family], ours, ParallelLayout(), fmt="torch_dist", progress=False)
    theirs = tmp_path / "megatron"
    theirs.mkdir()
    assert describe_torch_dist(ours / "release") == run_local(megatron_save_worker, 1, str(hf_dirs[family]), str(theirs))[0]
    # What megatron writes into metadata.json we write too (0.16 also names the common backend, 0.19 does not).
    ours_config = json.loads((ours / "release/metadata.json").read_text())
    assert json.loads((theirs / "metadata.json").read_text()).items() <= ours_config.items()
    assert TorchDistReader(ours / "release").common_state() is not None
    assert TorchDistReader(theirs).common_state() is not None


# --- loading at a layout, logits ------------------------------------------------------------------

LOADS = [
    # family, format, converted at (TP, PP, EP), loaded at (TP, PP, EP); two ranks each keeps this quick
    ("llama3_1", "torch_dist", (1, 2, 1), (2, 1, 1)),
    ("qwen2", "torch_dist", (2, 1, 1), (1, 2, 1)),     # tied embeddings split across stages on load
    ("qwen2_moe", "torch_dist", (1, 1, 4), (1, 1, 2)),
    ("mixtral", "legacy", (1, 1, 2), (1, 1, 2)),
    ("minimax_m2", "torch_dist", (2, 1, 2), (1, 2, 1)),  # whole-width q/k norms read at another TP
]


@pytest.mark.slow
@pytest.mark.parametrize("family,fmt,converted,loaded", LOADS, ids=[f"{f}-{fmt}-to-tp{l[0]}pp{l[1]}ep{l[2]}" for f, fmt, _, l in LOADS])
def test_checkpoint_loads_at_layout_with_hf_logits(hf_dirs, tmp_path, family, fmt, converted, loaded):
    from tests.convert_helpers import checkpoint_logits_worker
    from megatron_patch.runtime.launch import run_local

    src = hf_dirs[family]
    ckpt = tmp_path / "ckpt"
    hf_to_mcore(src, ckpt, ParallelLayout(*converted), fmt=fmt, progress=False)
    layout = ParallelLayout(*loaded)
    tokens = random_tokens(200, batch=2, seq=16)
    results = run_local(checkpoint_logits_worker, layout.world_size, str(ckpt), layout, tokens)
    metrics = compare_logits(hf_logits(src, tokens), next(r for r in results if r is not None))
    assert metrics["rel_l2"] <= FP32_REL_L2 and metrics["kl"] <= FP32_KL, metrics


def test_a_conversion_checks_its_layout_once(hf_dirs, tmp_path, monkeypatch):
    """hf2mcore and mcore2hf check the layout they convert at against the model once, and plan with it: each
    checked it twice before."""
    import megatron_patch.checkpoint.engine as engine
    import megatron_patch.convert.checkpoint as converter

    checked, real = [], engine.validate_layout

    def counting(arch, layout, **kwargs):
        checked.append(layout)
        return real(arch, layout, **kwargs)

    for module in (engine, converter):
        monkeypatch.setattr(module, "validate_layout", counting)
    hf_to_mcore(hf_dirs["llama3_1"], tmp_path / "ck", ParallelLayout(tp=2, pp=2), fmt="legacy", progress=False)
    assert [(x.tp, x.pp) for x in checked].count((2, 2)) == 1
    checked.clear()
    mcore_to_hf(tmp_path / "ck", tmp_path / "back", progress=False)
    assert [(x.tp, x.pp) for x in checked].count((2, 2)) == 1


def test_legacy_checkpoint_refuses_another_layout(hf_dirs, tmp_path):
    from megatron_patch.checkpoint.loading import load_legacy

    hf_to_mcore(hf_dirs["llama3_1"], tmp_path / "ck", ParallelLayout(tp=2), fmt="legacy", progress=False)
    with pytest.raises(UserError, match="torch_dist"):
        load_legacy(None, tmp_path / "ck", read_sidecar(tmp_path / "ck"), ParallelLayout(pp=2))


# --- failures: one line, exit 2, nothing left behind ----------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _break_config(d: Path, how: str) -> None:
    if how == "missing":
        (d / "config.json").unlink()
    elif how == "malformed":
        (d / "config.json").write_text('{"model_type": "llama", ')
    elif how == "unsupported":
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))


def _break_weights(d: Path, how: str) -> None:
    path = d / "model.safetensors"
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - 1000])
    elif how == "corrupt_header":
        data = bytearray(path.read_bytes())
        data[8:40] = b"\x00" * 32
        path.write_bytes(bytes(data))
    elif how == "shape":
        sd = load_file(path)
        name = "model.layers.1.self_attn.o_proj.weight"
        sd[name] = sd[name][:, :32].contiguous()
        save_file(sd, path, metadata={"format": "pt"})
    elif how == "missing_tensor":
        sd = load_file(path)
        del sd["model.layers.2.mlp.down_proj.weight"]
        save_file(sd, path, metadata={"format": "pt"})
    elif how == "extra_tensor":
        sd = load_file(path)
        sd["model.layers.9.mlp.down_proj.weight"] = torch.zeros(2, 2)
        save_file(sd, path, metadata={"format": "pt"})
    elif how == "integer_weight":  # would be cast by value into the float checkpoint
        sd = load_file(path)
        name = "model.layers.0.self_attn.q_proj.weight"
        sd[name] = (sd[name] * 100).to(torch.int32)
        save_file(sd, path, metadata={"format": "pt"})


BAD_INPUTS = [
    ("missing", "not found"), ("malformed", "not valid JSON"), ("unsupported", "gpt2"),
    ("truncated", "truncated or corrupt"), ("corrupt_header", "corrupt"), ("shape", "o_proj.weight has shape"),
    ("missing_tensor", "lacks 1 tensor"), ("extra_tensor", "no llama3_1 mapping rule consumes"),
    ("integer_weight", "q_proj.weight in "),
]


@pytest.mark.parametrize("how,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_fails_in_one_line_leaving_nothing(hf_dirs, tmp_path, capsys, how, message):
    bad = _copy(hf_dirs["llama3_1"], tmp_path / "bad")
    (_break_config if how in ("missing", "malformed", "unsupported") else _break_weights)(bad, how)
    target = tmp_path / "out"
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(bad), "--save-dir", str(target), "--tp", "2",
                      "--format", "legacy")
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith("mpatch convert: error:") and message in err, err
    assert not target.exists() and not leftovers(target)
    if how == "integer_weight":
        assert f"{bad / 'model.safetensors'} is stored as int32, not a floating-point dtype" in err, err


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "TP=3 does not divide"),
    (["--pp", "3"], "PP=3 does not divide"),
    (["--ep", "2"], "dense model: EP and ETP apply only to MoE models (EP=2), set EP=1"),
    (["--tp", "2", "--etp", "1", "--format", "legacy"], "ETP"),
    # named by what was given: it said "set EP=1" (the tools audit)
    (["--etp", "2"], "dense model: EP and ETP apply only to MoE models (ETP=2), give ETP=1 (the TP) or none"),
], ids=["tp3", "pp3", "ep-on-dense", "legacy-etp", "etp-on-dense"])
def test_impossible_layout_is_refused(hf_dirs, tmp_path, capsys, args, message):
    family = "qwen2_moe" if "--format" in args else "llama3_1"
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf_dirs[family]), "--save-dir", str(tmp_path / "o"), *args)
    assert rc == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


def test_non_empty_target_needs_force(hf_dirs, tmp_path, capsys):
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    argv = ["convert", "hf2mcore", "--hf-dir", str(hf_dirs["llama3_1"]), "--save-dir", str(target), "--quiet"]
    rc, err = run_cli(capsys, *argv)
    assert rc == 2 and "--force" in err and (target / "keep.txt").exists()
    # --force replaces only an earlier output of mpatch: a folder holding anything else is kept, saying why.
    rc, err = run_cli(capsys, *argv, "--force")
    assert rc == 2 and "keep.txt" in err and "only an earlier output" in err and err.count("\n") == 1, err
    assert (target / "keep.txt").read_text() == "precious" and not leftovers(target)
    (target / "keep.txt").unlink()
    rc, _ = run_cli(capsys, *argv)
    assert rc == 0 and (target / SIDECAR_NAME).exists()
    rc, _ = run_cli(capsys, *argv, "--force", "--format", "legacy")
    assert rc == 0 and read_sidecar(target).checkpoint_format == "legacy" and not leftovers(target)
    # The input folder itself is never a valid target, --force or not.
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf_dirs["llama3_1"]), "--save-dir",
                      str(hf_dirs["llama3_1"]), "--force")
    assert rc == 2 and "overlaps the input" in err


def test_a_symlinked_save_dir_is_refused_before_any_work(hf_dirs, tmp_path, capsys, monkeypatch):
    """A --save-dir that was a link to an empty folder: without --force the whole conversion ran and then failed
    ('exists: nothing was replaced'); with --force the link was replaced by a folder, though no output of mpatch."""
    ckpt = tmp_path / "ckpt"
    hf_to_mcore(hf_dirs["llama3_1"], ckpt, ParallelLayout(), progress=False)
    pointed = tmp_path / "pointed"
    pointed.mkdir()
    link = tmp_path / "link"
    link.symlink_to(pointed)

    def started(*args, **kwargs):
        raise AssertionError("the conversion started")

    monkeypatch.setattr("megatron_patch.convert.checkpoint.atomic_output_dir", started)
    for argv in (["hf2mcore", "--hf-dir", str(hf_dirs["llama3_1"])], ["mcore2hf", "--load-dir", str(ckpt)]):
        for force in ([], ["--force"]):
            rc, err = run_cli(capsys, "convert", *argv, "--save-dir", str(link), "--quiet", *force)
            assert rc == 2 and err.count("\n") == 1 and f"{link} is a symbolic link (to {pointed})" in err, err
            assert link.is_symlink() and list(pointed.iterdir()) == [] and not leftovers(link)


def test_damaged_mcore_checkpoint_fails_cleanly(hf_dirs, tmp_path, capsys):
    for fmt, victim in (("legacy", "release/mp_rank_01/model_optim_rng.pt"), ("torch_dist", "release/__0_0.distcp")):
        ckpt = tmp_path / fmt
        hf_to_mcore(hf_dirs["llama3_1"], ckpt, ParallelLayout(tp=2), fmt=fmt, progress=False)
        data = (ckpt / victim).read_bytes()
        (ckpt / victim).write_bytes(data[: len(data) // 2])
        rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / f"{fmt}-hf"),
                          "--quiet")
        # the manifest names the file cut short (without one, the reader: "half-written, truncated or corrupt")
        assert rc == 2 and err.count("\n") == 1 and f"{ckpt / victim} is " in err and "truncated" in err, err
        assert not (tmp_path / f"{fmt}-hf").exists() and not leftovers(tmp_path / f"{fmt}-hf")
    # An intact checkpoint without its sidecar: what to give instead is named (docs/foreign-checkpoints.md).
    hf_to_mcore(hf_dirs["llama3_1"], tmp_path / "intact", ParallelLayout(tp=2), fmt="legacy", progress=False)
    (tmp_path / "intact" / SIDECAR_NAME).unlink()
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(tmp_path / "intact"), "--save-dir", str(tmp_path / "x"))
    assert rc == 2 and SIDECAR_NAME in err and "--hf-config" in err and not (tmp_path / "x").exists()


def _with_integer_weight(ckpt: Path, fmt: str, name: str) -> str:
    """``ckpt`` rewritten (as another tool would: no manifest of ours) with the MCore weight ``name`` of its second
    TP rank (legacy) or its only copy (torch_dist) stored as int32: the file that then holds it."""
    from megatron_patch.checkpoint_files.torch_dist import ChunkItem
    from tests.convert_helpers import read_torch_dist_release, write_torch_dist_chunks

    (ckpt / MANIFEST_NAME).unlink()
    release = ckpt / "release"
    if fmt == "legacy":
        path = release / "mp_rank_01" / "model_optim_rng.pt"
        state = torch.load(path, weights_only=True)
        state["model"][name] = state["model"][name].to(torch.int32)
        torch.save(state, path)
        return str(path)
    _, full, objects = read_torch_dist_release(release)
    full[name] = full[name].to(torch.int32)
    items = [ChunkItem(k, tuple(v.shape), (0,) * v.dim(), tuple(v.shape), str(v.dtype).removeprefix("torch."))
             for k, v in full.items()]
    shutil.rmtree(release)
    write_torch_dist_chunks(release, items, objects, {(k, (0,) * v.dim()): v for k, v in full.items()})
    return str(release)


@pytest.mark.parametrize("fmt,name", [("legacy", "decoder.layers.0.self_attention.linear_proj.weight"),
                                      ("torch_dist", "decoder.layers.mlp.linear_fc2.weight")])
def test_a_checkpoint_weight_stored_as_integers_is_refused_not_cast(hf_dirs, tmp_path, capsys, fmt, name):
    """One rank's shard (or a torch_dist tensor) of a float weight stored as integers: its values would be cast
    into the export (zeros, where the fractions were truncated), so the file and tensor are named instead."""
    ckpt = tmp_path / fmt
    hf_to_mcore(hf_dirs["llama3_1"], ckpt, ParallelLayout(tp=2), fmt=fmt, progress=False)
    where = _with_integer_weight(ckpt, fmt, name)
    target = tmp_path / "hf"
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(target), "--quiet")
    assert rc == 2 and err.count("\n") == 1 and f"{name} is stored as int32" in err and where in err, err
    assert ("TP=1" in err) == (fmt == "legacy"), err
    assert not target.exists() and not leftovers(target)


def test_fp16_refuses_values_past_its_range_instead_of_making_them_inf(hf_dirs, tmp_path, capsys, monkeypatch):
    """--dtype fp16 from a wider dtype: a finite value fp16 cannot hold is named with its magnitude, both ways, on
    the byte path and through torch; an inf stored stays inf; nothing is left behind."""
    from megatron_patch.models.mapping.splits import Row

    hf = _copy(hf_dirs["llama3_1"], tmp_path / "big")
    sd = load_file(hf / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"  # a Row split: dim-1 slices, converted a band at a time
    sd[name][3, 5] = -70000.0
    sd["model.layers.0.mlp.down_proj.weight"][0, 0] = float("inf")
    save_file(sd, hf / "model.safetensors", metadata={"format": "pt"})
    hf2mcore = ["convert", "hf2mcore", "--hf-dir", str(hf), "--tp", "2", "--quiet"]
    want = f"{name} holds a value of magnitude 70000, past fp16's largest (65504)"
    for through_torch in (False, True):
        with monkeypatch.context() as m:
            if through_torch:
                m.setattr(Row, "blocks", lambda self, *a: None)
            for fmt in ("legacy", "torch_dist"):
                target = tmp_path / f"{fmt}-{through_torch}"
                rc, err = run_cli(capsys, *hf2mcore, "--save-dir", str(target), "--format", fmt, "--dtype", "fp16")
                assert rc == 2 and err.count("\n") == 1 and want in err and "--dtype bf16 or fp32" in err, err
                assert not target.exists() and not leftovers(target)
    ckpt = tmp_path / "fp32"
    rc, _ = run_cli(capsys, *hf2mcore, "--save-dir", str(ckpt), "--dtype", "fp32")
    assert rc == 0
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "out"),
                      "--dtype", "fp16", "--quiet")
    assert rc == 2 and err.count("\n") == 1 and want in err, err
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path / "out")
    sd[name][3, 5] = 0.0
    save_file(sd, hf / "model.safetensors", metadata={"format": "pt"})
    rc, err = run_cli(capsys, *hf2mcore, "--save-dir", str(tmp_path / "ok"), "--dtype", "fp16")
    assert rc == 0, err


_SLOW_CONVERT = """
import pathlib, sys, threading, time
from megatron_patch.convert import copier
original = copier.Copier._run_one
count, lock = [0], threading.Lock()
def slow_task(self, task):
    with lock:
        count[0] += 1
        mine = count[0]
    if mine == 6:  # mid-conversion: some rank files are half written
        pathlib.Path(sys.argv[1]).touch()
        time.sleep(120)
    return original(self, task)
copier.Copier._run_one = slow_task
from megatron_patch.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _clean_env() -> dict:
    # This process may already be a world of one; the child must start its own.
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_interrupted_conversion_leaves_nothing_that_looks_complete(hf_dirs, tmp_path, sig):
    target, flag = tmp_path / "out", tmp_path / "flag"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERT, str(flag), "convert", "hf2mcore", "--hf-dir", str(hf_dirs["qwen2_moe"]),
         "--save-dir", str(target), "--tp", "2", "--pp", "2", "--format", "legacy", "--quiet"],
        env=_clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not flag.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.1)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    assert not target.exists()
    with pytest.raises(UserError):
        read_sidecar(target)
    if sig == signal.SIGTERM:
        assert proc.returncode == 130 and not leftovers(target)
    else:
        # Only a hidden folder that says it is partial, and the lock of the killed run; the next run clears both.
        assert sorted(name.split(PARTIAL_TAG)[0] for name in leftovers(target)) == [".out", ".out.mpatch-lock"]
        hf_to_mcore(hf_dirs["qwen2_moe"], target, ParallelLayout(tp=2), fmt="legacy", progress=False)
        assert read_sidecar(target).family == "qwen2_moe" and not leftovers(target)


# --- CLI and progress -----------------------------------------------------------------------------

def test_help_documents_every_option(capsys):
    for direction, options in (("hf2mcore", ["--hf-dir", "--save-dir", "--tp", "--pp", "--ep", "--etp", "--format",
                                             "--dtype", "--force", "--workers"]),
                               ("mcore2hf", ["--load-dir", "--save-dir", "--dtype", "--max-shard-size", "--force",
                                             "--workers"])):
        with pytest.raises(SystemExit) as exit_:
            main(["convert", direction, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert all(o in out for o in options), out


def test_progress_bar_and_quiet_logs():
    import io

    from megatron_patch.convert.progress import Progress

    bar_out = io.StringIO()
    bar = Progress("convert", 2048, 2, enabled=True, stream=bar_out)
    bar.update(1024)
    bar.update(1024)
    bar.close()
    assert "tensors=2/2" in bar_out.getvalue() and "2.00k" in bar_out.getvalue()
    log_out = io.StringIO()
    log = Progress("convert", 2048, 2, stream=log_out)  # not a terminal: two lines
    log.update(2048, 2)
    log.close()
    lines = log_out.getvalue().splitlines()
    assert len(lines) == 2 and "2 tensors" in lines[1] and "MiB/s" in lines[1]


# --- mcore2hf from training checkpoints -----------------------------------------------------------

def _training_checkpoint_worker(hf_dir: str, converted: str, root: str) -> list[str]:
    """Start from a converted checkpoint, take one optimizer step that leaves the weights as they are
    (zero gradients, no weight decay), and save with the training loop's own ``checkpointing.save``:
    model + distributed-optimizer state + scheduler + RNG, as a run writes them."""
    import types

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_patch.checkpoint.loading import load_checkpoint_into_model
    from megatron_patch.models.blocks.builder import build_model
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.training import checkpointing

    layout = ParallelLayout()
    init_model_parallel(layout, seed=1)
    arch = parse_arch(Path(hf_dir))
    model = build_model(arch, layout, torch.bfloat16)
    load_checkpoint_into_model(model, converted, layout)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                              grad_reduce_in_fp32=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, bf16=True,
                                                       use_distributed_optimizer=True), [ddp])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=1,
                                        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=10, wd_incr_style="constant")
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    optimizer.step()  # creates the Adam state that a checkpoint of a real run holds
    cfg = types.SimpleNamespace(checkpoint_dir=Path(root), overlap_param_gather=False, global_batch_size=8,
                                family=arch.family, hf_config=arch.hf_config, to_dict=lambda: {},
                                arch=arch, layout=layout, precision=Precision.BF16, lora=None,
                                dataset_path=[], dataset_type="mmap", dataset_weights=None, sft=False,
                                tokenizer=None, split=None)
    checkpointing.save(cfg, 5, [ddp], optimizer, scheduler)
    return sorted(p.name for p in Path(root).iterdir())


@pytest.fixture(scope="module")
def training_ckpt(hf_dirs, tmp_path_factory):
    from megatron_patch.runtime.launch import run_local

    root = tmp_path_factory.mktemp("train")
    hf_to_mcore(hf_dirs["llama3_1"], root / "converted", ParallelLayout(), dtype="bf16", progress=False)
    run_local(_training_checkpoint_worker, 1, str(hf_dirs["llama3_1"]), str(root / "converted"), str(root / "checkpoint"))
    return root / "checkpoint"


@pytest.mark.slow
def test_training_checkpoint_without_sidecar_fails_naming_it(training_ckpt, tmp_path, capsys):
    root = tmp_path / "checkpoint"
    shutil.copytree(training_ckpt, root)
    iter_dir = root / "iter_0000005"
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    # a checkpoint written by another tool: no sidecar, and no manifest (one that lists the sidecar says the folder
    # is damaged, and the look at a run's checkpoint folder skips it: below)
    (iter_dir / SIDECAR_NAME).unlink()
    manifest = (iter_dir / MANIFEST_NAME).read_bytes()
    (iter_dir / MANIFEST_NAME).unlink()
    for load in (root, iter_dir):
        rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(load), "--save-dir", str(tmp_path / "hf"))
        assert rc == 2 and err.count("\n") == 1, err
        assert f"{iter_dir} has no {SIDECAR_NAME}" in err and "--hf-config" in err and "final" in err, err
        assert not (tmp_path / "hf").exists() and not leftovers(tmp_path / "hf")
    (iter_dir / MANIFEST_NAME).write_bytes(manifest)
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(root), "--save-dir", str(tmp_path / "hf"))
    assert rc == 2 and f"{iter_dir} is incomplete or damaged: {iter_dir / SIDECAR_NAME} is missing: " \
                       f"{MANIFEST_NAME} lists it" in err, err


@pytest.mark.slow
def test_mcore2hf_reads_the_weights_of_a_training_checkpoint(training_ckpt, hf_dirs, tmp_path, capsys, monkeypatch):
    from megatron_patch.convert import checkpoint as ckpt_mod

    root = tmp_path / "checkpoint"
    shutil.copytree(training_ckpt, root)
    iter_dir = root / "iter_0000005"
    assert read_sidecar(iter_dir, release=False).family == "llama3_1"  # written by the training save itself
    stored = TorchDistReader(iter_dir).tensor_keys()
    assert any(k.startswith("optimizer.state.exp_avg.") for k in stored)  # the optimizer state really is there
    # A later iteration that was never marked as the latest must not be taken.
    shutil.copytree(iter_dir, root / "iter_0000009")
    (root / "iter_0000009" / ".metadata").unlink()
    want = {k: v.to(torch.bfloat16) for k, v in tensors(hf_dirs["llama3_1"]).items()}
    for name, load in (("root", root), ("iter", iter_dir)):
        rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(load), "--save-dir", str(tmp_path / name),
                          "--quiet")
        assert rc == 0, err
        got = tensors(tmp_path / name)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert {config.get(k) for k in ("dtype", "torch_dtype")} - {None} == {"bfloat16"}
    # Only the known training-state prefixes are skipped: any other stored tensor is still refused.
    monkeypatch.setattr(ckpt_mod, "is_training_state", lambda key: False)
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(root), "--save-dir", str(tmp_path / "strict"))
    assert rc == 2 and "the model does not" in err and "optimizer.state" in err, err
    assert not (tmp_path / "strict").exists()
    # The marker names an iteration that is gone: the newest complete one is converted, as training would
    # resume from it (checkpoint_files.layout.latest_complete_iteration), with a warning naming what was skipped.
    monkeypatch.undo()
    (root / "latest_checkpointed_iteration.txt").write_text("7\n")
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(root), "--save-dir", str(tmp_path / "gone"),
                      "--quiet")
    assert rc == 0 and "warning:" in err and "names iteration 7, but iter_0000007 is missing" in err, err
    assert all(torch.equal(tensors(tmp_path / "gone")[k], want[k]) for k in want)
    # None complete: refused in one line, nothing written.
    (iter_dir / "metadata.json").unlink()
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(root), "--save-dir", str(tmp_path / "none"))
    assert rc == 2 and err.count("\n") == 1 and f"no complete checkpoint in {root}" in err, err
    assert "metadata.json is missing" in err and not (tmp_path / "none").exists()



def test_training_state_is_known_by_megatron_cores_prefixes_chained_optimizers_included():
    """An MoE run's optimizer is a ChainedOptimizer (dense and expert parameters apart), whose torch_dist keys start
    "chained_N.optimizer.": mcore2hf of an EP-trained Gemma 4 refused them as tensors the model lacks."""
    from megatron_patch.checkpoint.foreign import is_training_state

    for key in ("optimizer.state.exp_avg.decoder.final_layernorm.weight", "optimizer.distributed.dp_group_idx_0",
                "chained_0.optimizer.state.exp_avg.decoder.layers.0.mlp.router.weight",
                "chained_12.optimizer.state.fp32_param.embedding.word_embeddings.weight"):
        assert is_training_state(key), key
    for key in ("decoder.layers.0.mlp.router.weight", "chained_0.decoder.final_layernorm.weight",
                "xoptimizer.state", "decoder.optimizer.weight"):
        assert not is_training_state(key), key


@pytest.mark.parametrize("layout, rank_dir", [(ParallelLayout(tp=2), "mp_rank_01"),
                                              (ParallelLayout(ep=2), "mp_rank_00_001")])
def test_copies_of_a_dense_parameter_that_disagree_between_rank_files_are_refused(tmp_path, layout, rank_dir):
    """A legacy MoE checkpoint whose second rank file holds another final norm and router: between TP ranks it was
    refused, between expert-parallel ranks EP rank 0's copy was exported without a word (the conv audit), though a
    run at that layout gives each EP rank its own file's. Both are refused now; agreeing copies export exactly."""
    hf = make_tiny_hf_checkpoint("qwen3_moe", tmp_path / "hf", seed=3)
    hf_to_mcore(hf, tmp_path / "ck", layout, fmt="legacy", progress=False)
    mcore_to_hf(tmp_path / "ck", tmp_path / "back", progress=False)
    assert all(torch.equal(t, load_file(hf / "model.safetensors")[k])
               for k, t in load_file(tmp_path / "back" / "model.safetensors").items())
    path = tmp_path / "ck" / "release" / rank_dir / "model_optim_rng.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    state["model"]["decoder.final_layernorm.weight"].mul_(1.5)
    torch.save(state, path)
    with pytest.raises(UserError, match=r"decoder.final_layernorm.weight: (replica 1 differs from replica 0|the copy "
                                        r"in expert-parallel rank 1's file differs)"):
        mcore_to_hf(tmp_path / "ck", tmp_path / "again", progress=False, verify=False)

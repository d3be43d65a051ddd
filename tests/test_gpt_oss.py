"""gpt-oss beyond what the registry-driven tests run for every family: the tiny model really exercises
its sinks, sliding window and SwiGLU clamp (so the parity tests judge them), MXFP4 hub weights convert
to exactly what transformers dequantizes, and what megatron-core cannot run is refused in one line.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_patch.align.parity import hf_logits, random_tokens
from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
from megatron_patch.convert.mxfp4 import dequantize
from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import validate_layout
from megatron_patch.models.description.registry import parse_arch
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint, tiny_config
from megatron_patch.runtime import ParallelLayout


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss") / "hf", seed=2)


def test_parity_inputs_reach_the_window_the_sinks_and_the_clamp(tiny, tmp_path):
    """The parity and alignment tests' 32-token inputs would not notice a missing feature if the tiny model
    never used it: each changed alone moves transformers' own logits far beyond the parity bound."""
    tokens = random_tokens(200, seed=3)
    base = hf_logits(tiny, tokens)
    changes = {"no window": {"sliding_window": 1000}, "no clamp": {"swiglu_limit": 1000.0}}
    for name, over in changes.items():
        folder = tmp_path / name.replace(" ", "_")
        shutil.copytree(tiny, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **over}))
        other = hf_logits(folder, tokens)
        assert (other - base).norm() / base.norm() > 1e-3, name
    from safetensors.torch import save_file

    folder = tmp_path / "no_sinks"
    shutil.copytree(tiny, folder)
    reader = HFCheckpointReader(tiny)
    tensors = {n: reader.get(n) for n in reader.keys()}
    tensors.update({n: torch.full_like(t, -1e4) for n, t in tensors.items() if n.endswith("self_attn.sinks")})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    other = hf_logits(folder, tokens)
    assert (other - base).norm() / base.norm() > 1e-3


def test_rope_defaults_are_what_transformers_fills_in():
    """A config.json without RoPE fields gets transformers' YaRN (factor 32) on rope_theta 150000."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_patch.models.blocks import rope

    raw = {k: v for k, v in tiny_config("gpt_oss").items() if k not in ("rope_scaling", "rope_theta")}
    arch = parse_arch(raw)
    assert arch.rope_theta == 150000.0 and arch.rope_scaling["factor"] == 32.0
    hf_rotary = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw)).model.rotary_emb
    ours, factor = rope.inv_freq_and_attention_factor(arch)
    torch.testing.assert_close(ours, hf_rotary.inv_freq.float(), rtol=0, atol=0)
    assert factor == pytest.approx(hf_rotary.attention_scaling, rel=1e-12)


def test_mxfp4_dequantization_is_transformers_bit_for_bit():
    """Every byte of codes against every scale exponent (zeros, subnormals, infinities and NaNs included),
    in float32 and as transformers dequantizes into bf16."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1).reshape(256, 16, 16)  # [rows, groups, 16]
    scales = torch.arange(256, dtype=torch.uint8).reshape(256, 1).repeat(1, 16)
    for band in (1024, 7):  # one band and many, with a short last one
        ours = dequantize(codes, scales, band_rows=band)
        for dtype in (torch.float32, torch.bfloat16):
            theirs = convert_moe_packed_tensors(codes[None], scales[None], dtype=dtype)[0]
            got = ours.to(dtype)
            assert got.shape == theirs.shape == (16 * 32, 256)
            assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               theirs.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (band, dtype)
    with pytest.raises(UserError, match="need scales of shape"):
        dequantize(codes, scales[:, :8])


def mxfp4_checkpoint(src, out, seed=0):
    """``src`` as gpt-oss's hub checkpoints store it: experts in MXFP4 (random codes, scales near 2^0), the
    rest in bf16, config.json's quantization_config."""
    from safetensors.torch import save_file

    shutil.copytree(src, out)
    reader = HFCheckpointReader(src)
    tensors = {n: reader.get(n).to(torch.bfloat16) for n in reader.keys()}
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors.pop(name).shape
        tensors[name + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        tensors[name + "_scales"] = torch.randint(118, 128, (experts, rows, cols // 32), dtype=torch.uint8, generator=g)
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config.pop("dtype", None)  # the hub's config.json, written by transformers 4.x, names it torch_dtype
    config.update(torch_dtype="bfloat16", quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.slow
def test_mxfp4_checkpoint_converts_to_what_transformers_loads(tiny, tmp_path, capsys):
    """hf2mcore dequantizes the MXFP4 experts; the bf16 export is, tensor for tensor and bit for bit, the
    model transformers itself loads from the MXFP4 folder (it dequantizes on a CPU)."""
    from transformers import AutoModelForCausalLM

    from megatron_patch.checkpoint.sidecar import read_sidecar
    from megatron_patch.cli import main

    src = mxfp4_checkpoint(tiny, tmp_path / "mxfp4")
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert main(["convert", "hf2mcore", "--hf-dir", str(src), "--save-dir", str(mcore), "--ep", "2", "--pp", "2",
                 "--format", "legacy", "--dtype", "bf16", "--quiet"]) == 0
    assert any("dequantized from MXFP4" in n for n in read_sidecar(mcore).notes)
    assert main(["convert", "mcore2hf", "--load-dir", str(mcore), "--save-dir", str(back), "--quiet"]) == 0
    reference = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).state_dict()
    out = HFCheckpointReader(back)
    assert sorted(out.keys()) == sorted(reference)
    for name, tensor in reference.items():
        assert out.dtype(name) == "bfloat16" and torch.equal(out.get(name), tensor), name
    config = json.loads((back / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("over, fragment", [
    ({"swiglu_alpha": 1.5}, "swiglu_alpha=1.5"),
    ({"attention_bias": False}, "attention_bias=false is not supported for gpt-oss"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "each full_attention or sliding_attention"),
    ({"sliding_window": None}, "sliding_window=None"),
])
def test_what_megatron_core_computes_otherwise_is_refused(over, fragment):
    with pytest.raises(UserError) as err:
        parse_arch(tiny_config("gpt_oss", **over))
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("layout, fragment", [
    (ParallelLayout(cp=2), "does not split attention sinks"),
    (ParallelLayout(tp=2, ep=2), "ETP=2: megatron-core's experts take biases"),
])
def test_layouts_megatron_core_cannot_run_are_refused(layout, fragment):
    with pytest.raises(UserError) as err:
        validate_layout(parse_arch(tiny_config("gpt_oss")), layout)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_hub_mxfp4_folder_converts_without_dtype_at_tp2_ep2(tiny, tmp_path, capsys):
    """gpt-oss as the hub ships it (MXFP4 experts, config.json naming bfloat16), converted at TP=2 EP=2 with
    neither --dtype nor --etp: the dtype config.json names, and the one ETP the family supports, each said in
    one line."""
    from megatron_patch.checkpoint.sidecar import read_sidecar
    from megatron_patch.cli import main

    src = mxfp4_checkpoint(tiny, tmp_path / "mxfp4")
    mcore = tmp_path / "mcore"
    assert main(["convert", "hf2mcore", "--hf-dir", str(src), "--save-dir", str(mcore), "--tp", "2", "--ep", "2",
                 "--quiet"]) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "writing bfloat16, the dtype config.json names" in err
    assert "ETP=1, not TP=2: gpt_oss's experts take their biases only unsplit" in err
    sidecar = read_sidecar(mcore)
    assert sidecar.dtype == "bf16" and sidecar.layout == {"tp": 2, "pp": 1, "ep": 2, "etp": 1}
    # without a float dtype in config.json the choice stays the user's
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in ("torch_dtype", "dtype")}))
    assert main(["convert", "hf2mcore", "--hf-dir", str(src), "--save-dir", str(tmp_path / "x"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "config.json names no float dtype they share: pass --dtype bf16" in err and err.count("\n") == 1


def test_eval_at_tp2_takes_the_expert_layout_hf2mcore_takes(tiny, tmp_path):
    """hf2mcore --tp 2 chose ETP=1 by itself, and align took it too; mpatch eval --tp 2 of what it wrote still
    refused ETP=2 ('experts take biases only unsplit: set ETP=1'). It takes ETP=1 now, and says so."""
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.evaluation.loading import open_for_evaluation
    from megatron_patch.runtime.distributed import ParallelLayout

    mcore = tmp_path / "mcore"
    hf_to_mcore(tiny, mcore, ParallelLayout(tp=2), progress=False)
    checkpoint = open_for_evaluation(mcore, ParallelLayout(tp=2), tokenizer=None if (mcore / "tokenizer.json").is_file()
                                     else _tokenizer_folder(tmp_path))
    assert checkpoint.layout == ParallelLayout(tp=2, etp=1)
    assert checkpoint.layout_note == "ETP=1, not TP=2: gpt_oss's experts take their biases only unsplit (--etp sets it)"
    with pytest.raises(UserError, match="ETP=2"):  # asked for, it is still refused
        open_for_evaluation(mcore, ParallelLayout(tp=2, etp=2), tokenizer=checkpoint.tokenizer_dir)


def _tokenizer_folder(tmp_path):
    from megatron_patch.demo_data import make_texts, make_tokenizer

    return make_tokenizer(tmp_path / "tok", make_texts(50, seed=0), vocab_size=100)


@pytest.mark.slow
def test_align_at_tp2_takes_the_expert_layout_hf2mcore_takes(tiny, tmp_path, capsys):
    """hf2mcore --tp 2 chose ETP=1 by itself; align --tp 2 of what it wrote refused ETP=2 for the same default.
    Both take ETP=1 now, and say so."""
    from megatron_patch.cli import main

    mcore = tmp_path / "mcore"
    assert main(["convert", "hf2mcore", "--hf-dir", str(tiny), "--save-dir", str(mcore), "--tp", "2", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["align", "--hf-dir", str(tiny), "--mcore-dir", str(mcore), "--tp", "2", "--dtype", "fp32",
                 "--quiet"]) == 0, capsys.readouterr().err
    assert "align: ETP=1, not TP=2: gpt_oss's experts take their biases only unsplit" in capsys.readouterr().err


def test_the_least_weight_bound_fits_the_hubs_mxfp4_files():
    """gpt-oss-120b's hub files hold its experts in MXFP4 (16 bytes of codes and a byte of scale per 32 values) and
    the rest in bf16: 65 GB for 77 billion expert weights, which the bound of one byte per element refused (the
    perf audit: bench_mxfp4.py's gpt-oss-20b layer failed so). Where config.json names a quantization, half a byte
    per element; an unquantized folder of the same bytes is still refused."""
    from megatron_patch.models.description.config_checks import check_weights_fit
    from megatron_patch.models.description.registry import get_family

    config = dict(get_family("gpt_oss").presets["120B-A5.1B"], quantization_config={"quant_method": "mxfp4"})
    arch = parse_arch(config)
    h, layers, experts, width = arch.hidden_size, arch.num_layers, arch.num_experts, arch.moe_ffn_hidden_size
    expert_bytes = layers * experts * 3 * width * h * 17 // 32
    hub_bytes = expert_bytes + 2 * (2 * arch.vocab_size * h + layers * 2 * arch.num_heads * arch.head_dim * h)
    check_weights_fit(arch, hub_bytes, "the hub's files")
    with pytest.raises(UserError, match="the config and the weights do not belong together"):
        check_weights_fit(arch, hub_bytes // 3, "a third of them")
    unquantized = parse_arch({k: v for k, v in config.items() if k != "quantization_config"})
    with pytest.raises(UserError, match="the config and the weights do not belong together"):
        check_weights_fit(unquantized, hub_bytes, "the same bytes, unquantized")


def test_mxfp4_without_scales_is_refused(tiny, tmp_path, capsys):
    from safetensors.torch import save_file

    from megatron_patch.cli import main

    src = mxfp4_checkpoint(tiny, tmp_path / "mxfp4")
    reader = HFCheckpointReader(src)
    tensors = {n: reader.get(n) for n in reader.keys() if n != "model.layers.1.mlp.experts.down_proj_scales"}
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    assert main(["convert", "hf2mcore", "--hf-dir", str(src), "--save-dir", str(tmp_path / "out"), "--dtype", "bf16",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "down_proj_blocks but no model.layers.1.mlp.experts.down_proj_scales" in err and err.count("\n") == 1


@pytest.mark.slow
def test_tp2_with_its_experts_spread_over_ep2_trains_as_tp1(corpus, tmp_path):
    """gpt-oss's one TP>1 layout (its biased experts split only at ETP=1, and ETP=1 at EP=1 is refused): TP=2 SP EP=2.
    megatron-core marked each expert's output bias sequence-parallel, so the finalize step summed it with the other
    TP rank's (another expert's) bias gradient, 100% off; unmarked, the gradient norm then counted TP rank 0's only.
    The iteration-1 grad norm was 3.0260 (then 2.9822) against TP=1's 3.0065; now the losses and grad norms agree."""
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from tests.training_helpers import read_metrics, train_converted

    runs = {}
    for name, over, env in (("tp1", {}, {}), ("tp2ep2", dict(TP="2", SP="true", EP="2", ETP="1"),
                                              {"MP_TP_COMM_OVERLAP": "false"})):
        hf = make_tiny_hf_checkpoint("gpt_oss", tmp_path / name / "hf", seed=1)
        proc, _ = train_converted("gpt_oss", hf, corpus, tmp_path / name, None, env=env, iters=4, **over)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[name] = [(m["loss"], m["grad_norm"]) for m in read_metrics(tmp_path / name / "out")]
    for (loss, norm), (loss_tp1, norm_tp1) in zip(runs["tp2ep2"], runs["tp1"]):
        assert abs(norm - norm_tp1) <= 1e-5 * norm_tp1 and abs(loss - loss_tp1) <= 1e-5 * loss_tp1, runs

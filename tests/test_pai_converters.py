"""Pai-Megatron-Patch's conversion lines, as its READMEs print them (sizes scaled to the tiny models, paths to
temporary folders laid out as the READMEs lay them out), run through the wrappers under toolkits/ with Pai's
paths: HF -> Megatron-Core -> HF is bit-exact, tokenizer files included, under `sh` (dash) one way and `bash` the
other; every wrapper answers --help under both shells.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_patch.cli.pai_convert import SCRIPTS, find_script, plan
from megatron_patch.errors import UserError
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

REPO = Path(__file__).resolve().parent.parent
SIDE_FILES = {"tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
              "tokenizer_config.json": '{"model_max_length": 256, "chat_template": "{{ messages }}"}\n',
              "merges.txt": "#version: 0.2\nt h\n"}


def hub_model(family: str, folder: Path, dtype: torch.dtype, seed: int = 0, **overrides) -> Path:
    """A tiny model of ``family`` stored in ``dtype`` as hub checkpoints are (a router's score-correction bias
    stays fp32), with config.json naming it and a tokenizer beside it."""
    make_tiny_hf_checkpoint(family, folder, seed=seed, **overrides)
    tensors = load_file(folder / "model.safetensors")
    tensors = {n: t if n.endswith("e_score_correction_bias") else t.to(dtype) for n, t in tensors.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    config.update({k: name for k in ("dtype", "torch_dtype") if k in config} or {"torch_dtype": name})
    (folder / "config.json").write_text(json.dumps(config))
    for file, text in SIDE_FILES.items():
        (folder / file).write_text(text)
    return folder


def run_line(shell: str, script: str, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cd`` to the script's folder and run it by its name with ``shell``, as Pai's READMEs do."""
    path = REPO / script
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run([shell, path.name, *map(str, args)], cwd=path.parent, env=full_env, capture_output=True,
                          text=True, timeout=600)


def assert_ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stderr


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def assert_bit_exact(src: Path, back: Path, as_stored: bool = True) -> None:
    """Every tensor of ``src`` in ``back`` with the same bytes (``as_stored=False``: an export into a wider dtype,
    compared after casting back), and every side file carried."""
    a, b = tensors_of(src), tensors_of(back)
    assert sorted(a) == sorted(b)
    for name, t in a.items():
        got = b[name] if as_stored else b[name].to(t.dtype)
        assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
    for file, text in SIDE_FILES.items():
        assert (back / file).read_text() == text, file


@pytest.fixture(scope="module")
def mnt(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mnt")


# --- each README's lines --------------------------------------------------------------------------------------

LLAMA = "toolkits/model_checkpoints_convertor/llama/hf2mcore_convertor_llama3_1.sh"


@pytest.mark.slow
def test_llama3_1_readme_lines(mnt):
    """examples/llama3_1/README.md (TP=4 PP=2 scaled to TP=2, which align runs in two processes): the checkpoint
    inside the HF folder (mcore-tp4-pp2), CHECK=true both ways (`mpatch align`), and back into another folder
    inside it."""
    src = hub_model("llama3_1", mnt / "llama3-ckpts" / "Meta-Llama-3.1-8B", torch.bfloat16)
    mcore, back = src / "mcore-tp4-pp2", src / "hf-from-mg"
    err = assert_ok(run_line("sh", LLAMA, "8B", src, mcore, 2, 1, "false", "true", "false", "bf16"))
    assert "ignored here: MODEL_SIZE=8B (the model is the one config.json describes)" in err
    assert "mpatch align --hf-dir" in err and (mcore / "tokenizer.json").is_file()
    err = assert_ok(run_line("bash", LLAMA, "8B", mcore, back, 2, 1, "true", "true", "false", "bf16", src))
    assert "mpatch convert mcore2hf" in err and "mpatch align --hf-dir" in err
    assert_bit_exact(src, back)


QWEN2 = "toolkits/model_checkpoints_convertor/qwen/hf2mcore_qwen2_convertor.sh"


def test_qwen2_readme_lines(mnt):
    """examples/qwen2/README.md: dense (bash both ways in the README: sh here one way), fp32."""
    src = hub_model("qwen2", mnt / "qwen-ckpts" / "Qwen2-0.5B", torch.float32)
    mcore, back = mnt / "qwen-ckpts" / "Qwen2-0.5B-hf-to-mcore-te-tp1-pp1", mnt / "qwen-ckpts" / "Qwen2-0.5B-mcore-te-to-hf"
    err = assert_ok(run_line("sh", QWEN2, "0.5B", src, mcore, 1, 1, 1, "fp32", "true", "false"))
    assert "USE_TE=true (checkpoints hold transformer-engine's names" in err
    assert_ok(run_line("bash", QWEN2, "0.5B", mcore, back, 1, 1, 1, "fp32", "true", "true", src))
    assert_bit_exact(src, back)


@pytest.mark.slow
def test_qwen2_moe_through_the_dense_script_readme_line(mnt):
    """examples/qwen2/README.md's MoE line (`sh`, A14B TP=4 EP=4 scaled to TP=2 EP=2), and back."""
    src = hub_model("qwen2_moe", mnt / "qwen-ckpts" / "Qwen2-57B-A14B", torch.float32, seed=1)
    mcore, back = mnt / "qwen-ckpts" / "Qwen2-57B-A14B-hf-to-mcore-te-tp4-pp1-ep4", mnt / "qwen-ckpts" / "a14b-back"
    assert_ok(run_line("sh", QWEN2, "A14B", src, mcore, 2, 1, 2, "fp32", "true", "false"))
    assert json.loads((mcore / "mpatch_checkpoint.json").read_text())["layout"] == {"tp": 2, "pp": 1, "ep": 2,
                                                                                    "etp": None}
    assert_ok(run_line("bash", QWEN2, "A14B", mcore, back, 2, 1, 2, "fp32", "true", "true", src))
    assert_bit_exact(src, back)


QWEN2_MOE = "toolkits/model_checkpoints_convertor/qwen/hf2mcore_qwen2_moe_convertor.sh"


@pytest.mark.slow
def test_qwen2_moe_readme_lines(mnt):
    """examples/qwen2/README_moe.md: TP=4 PP=2 ETP=4 EP=4 scaled to 2 2 2 2, bf16."""
    src = hub_model("qwen2_moe", mnt / "qwen-ckpts" / "Qwen2-57B-A14B-moe", torch.bfloat16, seed=2)
    mcore, back = mnt / "qwen-ckpts" / "Qwen2-57B-A14B-tp4-pp2-etp4-ep4", mnt / "qwen-ckpts" / "Qwen2-57B-A14B-mcore-te-to-hf"
    assert_ok(run_line("bash", QWEN2_MOE, "A14B", src, mcore, 2, 2, 2, 2, "bf16", "false"))
    assert_ok(run_line("sh", QWEN2_MOE, "A14B", mcore, back, 2, 2, 2, 2, "bf16", "true", src))
    assert_bit_exact(src, back)


DIST = "toolkits/distributed_checkpoints_convertor"


def test_qwen2_5_readme_lines(mnt):
    """examples/qwen2_5/README.md: run_8xH20.sh one way, hf2mcore_qwen2.5_convertor.sh back (both run from the
    distributed converter's folder, as the README does)."""
    src = hub_model("qwen2", mnt / "qwen-ckpts" / "Qwen2.5-0.5B-Instruct", torch.bfloat16, seed=3)
    mcore, back = mnt / "qwen-ckpts" / "Qwen2.5-0.5B-Instruct-to-mcore", mnt / "qwen-ckpts" / "Qwen2.5-0.5B-Instruct-back"
    err = assert_ok(run_line("sh", f"{DIST}/scripts/qwen2_5/run_8xH20.sh", "0.5B", src, mcore, "false", "true", "bf16"))
    assert "USE_CUDA=true (the bytes move on the CPU, no GPU needed)" in err
    assert_ok(run_line("bash", f"{DIST}/hf2mcore_qwen2.5_convertor.sh", "0.5B", mcore, back, 1, 1, "bf16", "true",
                       "true", src))
    assert_bit_exact(src, back)


@pytest.mark.slow
def test_qwen3_readme_lines(mnt):
    """examples/qwen3/README.md: A3B both ways through run_8xH20.sh."""
    script = f"{DIST}/scripts/qwen3/run_8xH20.sh"
    src = hub_model("qwen3_moe", mnt / "qwen-ckpts" / "Qwen3-30B-A3B", torch.bfloat16, seed=4)
    mcore, back = mnt / "qwen-ckpts" / "Qwen3-30B-A3B-to-mcore", mnt / "qwen-ckpts" / "Qwen3-30B-A3B-mcore-to-hf"
    assert_ok(run_line("bash", script, "A3B", src, mcore, "false", "true", "bf16"))
    assert_ok(run_line("sh", script, "A3B", mcore, back, "true", "true", "bf16", src))
    assert_bit_exact(src, back)


@pytest.mark.slow
def test_qwen3_next_readme_line(mnt):
    """examples/qwen3_next/README.md: A3B through run_8xH20.sh (the README prints no way back; the script's is run)."""
    script = f"{DIST}/scripts/qwen3_next/run_8xH20.sh"
    src = hub_model("qwen3_next", mnt / "ckpts" / "huggingface" / "Qwen3-Next-80B-A3B-Instruct", torch.bfloat16, seed=5)
    mcore, back = mnt / "ckpts" / "mcore" / "Qwen3-Next-80B-A3B-Instruct-to-mcore", mnt / "ckpts" / "qwen3-next-back"
    mcore.parent.mkdir(parents=True)
    assert_ok(run_line("sh", script, "A3B", src, mcore, "false", "true", "bf16"))
    assert_ok(run_line("bash", script, "A3B", mcore, back, "true", "true", "bf16", src))
    assert_bit_exact(src, back)


DEEPSEEK = "toolkits/model_checkpoints_convertor/deepseek/hf2mcore_deepseek_v3_moe_convertor.sh"


@pytest.mark.slow
def test_deepseek_v3_readme_lines(mnt):
    """examples/deepseek_v3/README.md: `python fp8_cast_bf16.py` on the FP8 hub folder (the same bf16 weights
    hf2mcore dequantizes itself), then MP_PP0_LAYERS=5 with TP=8 PP=8 ETP=1 EP=16 (scaled: 1 with 2 2 1 2) on
    the bf16 folder with its multi-token-prediction layer, which is kept; back in fp32, as the README does."""
    from tests.convert_helpers import with_mtp_layer, write_fp8_checkpoint

    plain = hub_model("deepseek_v3", mnt / "v3-plain", torch.float32, seed=6)
    fp8 = write_fp8_checkpoint(with_mtp_layer(plain, mnt / "v3-mtp"), mnt / "deepseek-ckpts" / "DeepSeek-V3",
                               ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                                "up_proj", "down_proj"), (16, 16))
    src = mnt / "deepseek-ckpts" / "DeepSeek-V3-bf16"
    proc = subprocess.run([sys.executable, "fp8_cast_bf16.py", "--input-fp8-hf-path", str(fp8), "--output-bf16-hf-path",
                           str(src)], cwd=REPO / Path(DEEPSEEK).parent, capture_output=True, text=True, timeout=600)
    assert "not needed here (hf2mcore dequantizes" in assert_ok(proc)
    assert "quantization_config" not in json.loads((src / "config.json").read_text())
    reference, via = mnt / "v3-fp8-mcore", mnt / "v3-fp8-back"  # hf2mcore's own dequantization, exported
    assert_ok(subprocess.run([sys.executable, "-m", "megatron_patch", "convert", "hf2mcore", "--hf-dir", str(fp8),
                              "--save-dir", str(reference), "--dtype", "bf16", "--mtp", "--quiet"], capture_output=True,
                             text=True))
    assert_ok(subprocess.run([sys.executable, "-m", "megatron_patch", "convert", "mcore2hf", "--load-dir",
                              str(reference), "--save-dir", str(via), "--quiet"], capture_output=True, text=True))
    assert_bit_exact(via, src)

    mcore = mnt / "deepseek-ckpts" / "DeepSeek-V3-to-mcore-tp8-pp8-etp1-ep16"
    back = mnt / "deepseek-ckpts" / "DeepSeek-V3-mcore-to-hf"
    err = assert_ok(run_line("bash", DEEPSEEK, "A37B", src, mcore, 2, 2, 1, 2, "bf16", "false",
                             env={"MP_PP0_LAYERS": "1"}))
    assert "--mtp auto" in err and json.loads((mcore / "mpatch_checkpoint.json").read_text())["mtp_layers"] == 1
    assert_ok(run_line("sh", DEEPSEEK, "A37B", mcore, back, 2, 2, 1, 2, "fp32", "true", src))
    assert_bit_exact(src, back, as_stored=False)


MISTRAL = "toolkits/model_checkpoints_convertor/mistral/hf2mcore_convertor.sh"


def test_mistral_7b_readme_lines(mnt):
    """examples/mistral/README.md: Mistral-7B (sliding window 4096, as transformers' MistralConfig writes it) in,
    and back through the Megatron-LM converter's line from the release folder."""
    import transformers

    src = mnt / "mistral-ckpts" / "Mistral-7B-v0.1"
    config = transformers.MistralConfig(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        sliding_window=4096)
    assert config.to_dict()["sliding_window"] == 4096
    hub_model("llama3_1", src, torch.bfloat16, seed=7, **{k: v for k, v in config.to_dict().items()
                                                         if k not in ("transformers_version", "dtype")})
    assert json.loads((src / "config.json").read_text())["model_type"] == "mistral"
    mcore = mnt / "mistral-ckpts" / "Mistral-7B-v0.1-to-mcore-tp4-pp1"
    back = mnt / "mistral-ckpts" / "Mistral-7B-v0.1-megatron-to-hf"
    assert_ok(run_line("sh", MISTRAL, "7B", src, "../../../", src, mcore, 2, 1, 0, 0, 0, 0, "false"))
    assert_ok(run_line("bash", "toolkits/model_checkpoints_convertor/mistral/hf2megatron_convertor.sh", "../../../",
                       mcore / "release", back, 2, 1, "mistral-7b", 0, "true"))
    assert_bit_exact(src, back)


@pytest.mark.slow
def test_mixtral_readme_line(mnt):
    """examples/mistral/README.md's Mixtral-8x7B line (TP=4 EP=4, 8 experts top-2, WS=16, scaled: TP=2 EP=2), and
    back through the same script."""
    src = hub_model("mixtral", mnt / "mistral-ckpts" / "Mixtral-8x7B-v0.1", torch.bfloat16, seed=8)
    mcore = mnt / "mistral-ckpts" / "Mixtral-8x7B-v0.1-to-mcore-tp4-pp1-ep4-exp8-ws16"
    back = mnt / "mistral-ckpts" / "Mixtral-8x7B-v0.1-back"
    err = assert_ok(run_line("sh", MISTRAL, "8x7B", src, "../../../", src, mcore, 2, 1, 0, 8, 2, 2, "false", 16))
    for ignored in ("MEGATRON_PATH=../../../", "EXTRA_VOCAB_SIZE=0", "NUM_EXPERTS=8", "EXPERTS_TOPK=2", "WS=16"):
        assert ignored in err, ignored
    assert_ok(run_line("bash", MISTRAL, "8x7B", src, "../../../", mcore, back, 2, 1, 0, 8, 2, 2, "true", 16))
    assert_bit_exact(src, back)


# --- every wrapper, both shells; counts; the plan --------------------------------------------------------------

ALL_PATHS = [p for s in SCRIPTS.values() for p in s.paths]


def test_every_wrapper_runs_under_sh_and_bash(tmp_path):
    """Each wrapper is POSIX sh: dash runs it as bash does (what its README says to run it with), with this
    repository first on PYTHONPATH and its own path and arguments passed on. Checked with a stand-in for python
    that prints what it was given (the round trips above run the real one); one wrapper asks the real one."""
    stand_in = tmp_path / "python"
    stand_in.write_text('#!/bin/sh\necho "$PYTHONPATH"\necho "$@"\n')
    stand_in.chmod(0o755)
    for path in ALL_PATHS:
        for shell in ("sh", "bash"):
            proc = run_line(shell, path, "a b", "--help", env={"PYTHON": str(stand_in), "PYTHONPATH": "/elsewhere"})
            assert proc.returncode == 0, (path, shell, proc.stderr)
            assert proc.stdout.splitlines() == [f"{REPO}:/elsewhere", f"{REPO}/mpatch.py convert pai {path} a b --help"]
    listed = {p.relative_to(REPO).as_posix() for p in (REPO / "toolkits").glob("*_checkpoints_convertor/**/*.sh")}
    assert listed == set(ALL_PATHS)
    proc = run_line("sh", QWEN2_MOE, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {Path(QWEN2_MOE).name} MODEL_SIZE "), proc.stderr
    assert " 9 MG2HF             false: HF -> Megatron-Core ('mpatch convert hf2mcore')" in proc.stdout


def test_a_missing_or_extra_position_is_named(tmp_path):
    proc = run_line("sh", LLAMA, "8B", tmp_path / "a", tmp_path / "b", 4, 2, "false", "true", "false")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "takes 9 to 10 arguments" in proc.stderr and "got 8: position 9, PR, is missing" in proc.stderr
    script = find_script(f"{DIST}/scripts/qwen3/run_8xH20.sh")
    with pytest.raises(UserError, match=r"got 8: position 8, 'x', is one too many"):
        plan(script, ["A3B", "a", "b", "false", "true", "bf16", "hf", "x"], {})
    with pytest.raises(UserError, match=r"position 4, MG2HF, is missing"):
        plan(script, ["A3B", "a", "b"], {})
    with pytest.raises(UserError, match="MG2HF must be true or false, got 'True'"):
        plan(script, ["A3B", "a", "b", "True", "true", "bf16"], {})


@pytest.mark.slow
def test_mg2hf_of_a_checkpoint_without_a_record_asks_for_its_position(tmp_path):
    """Pai's line back to HF without HF_CKPT_PATH, for a Pai checkpoint (no record of its model): refused asking for
    mcore2hf's --family or --hf-config, which this positional line has no place for (the pdoc audit). It names the
    position, and the config.json Pai's converter left beside the weights (with it, the line exports:
    test_llama3_1_readme_lines)."""
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from tests import foreign_checkpoints as fc

    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf", seed=3)
    pai = fc.pai_megatron_patch_legacy(hf, tmp_path / "pai")
    proc = run_line("sh", LLAMA, "8B", pai, tmp_path / "back", 2, 1, "true", "false", "false", "fp32")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        f"{pai} does not say what model it holds: give the HF folder it came from as HF_CKPT_PATH (position 10) "
        f"({pai / 'config.json'} lies beside the weights)"), proc.stderr


def test_a_size_that_is_not_ascii_digits_is_refused_in_one_line():
    """'²' is a digit to str.isdigit but not to int(): refused as any other bad size, not an internal error."""
    args = ["8B", "hf", "mc", "4", "2", "false", "true", "false", "bf16"]
    for position, name in ((3, "TP"), (4, "PP")):
        for bad in ("²", "٣", "0", "-1", "+2", " 2"):
            with pytest.raises(UserError, match=re.escape(f"{name} must be a whole number of at least 1, got '{bad}'")):
                plan(find_script(LLAMA), args[:position] + [bad] + args[position + 1:], {})


def test_what_each_line_runs():
    """The conversion each form runs, and the check Pai's CHECK / CHECK_ONLY asks for."""
    llama = plan(find_script(LLAMA), ["8B", "hf", "mc", "4", "2", "false", "true", "false", "bf16"], {})
    assert llama.convert == ["convert", "hf2mcore", "--hf-dir", "hf", "--save-dir", "mc", "--tp", "4", "--pp", "2",
                             "--format", "torch_dist", "--force", "--dtype", "bf16"]
    assert llama.align == ["align", "--hf-dir", "hf", "--mcore-dir", "mc", "--tp", "4", "--pp", "2", "--dtype", "bf16"]
    only = plan(find_script(LLAMA), ["8B", "mc", "out", "4", "2", "true", "false", "true", "bf16", "hf"], {})
    assert only.convert is None and only.align[:5] == ["align", "--hf-dir", "out", "--mcore-dir", "mc"]
    back = plan(find_script(QWEN2_MOE), ["A14B", "mc", "out", "4", "2", "4", "4", "bf16", "true", "hf"], {})
    assert back.convert == ["convert", "mcore2hf", "--load-dir", "mc", "--save-dir", "out", "--force", "--hf-config",
                            "hf", "--dtype", "bf16"]
    assert back.align is None and "TP=4 (the checkpoint records its layout)" in back.ignored
    assert find_script("hf2mcore_qwen2.5_convertor.sh") is find_script(f"{DIST}/hf2mcore_qwen2.5_convertor.sh")


def test_an_output_may_be_a_new_folder_inside_the_hf_folder_it_reads(tmp_path):
    """Pai's Llama README converts Meta-Llama-3.1-8B into Meta-Llama-3.1-8B/mcore-tp4-pp2: an HF folder is read
    for its top-level files only, so it may hold the output, unless it is an output of mpatch (its manifest would
    no longer list what it holds). The output never holds an input, nor lies inside the checkpoint read."""
    from megatron_patch.checkpoint.outputs import TopLevelInput, check_target

    hf = tmp_path / "Meta-Llama-3.1-8B"
    hf.mkdir()
    check_target(hf / "mcore-tp4-pp2", False, inputs=(TopLevelInput(hf),))
    for target, inputs in ((hf, (TopLevelInput(hf),)), (tmp_path, (TopLevelInput(hf),)),
                           (hf / "mcore-tp4-pp2", (hf,))):
        with pytest.raises(UserError, match="overlaps the input"):
            check_target(target, False, inputs=inputs)
    (hf / "mpatch_manifest.json").write_text("{}")
    with pytest.raises(UserError, match="overlaps the input"):
        check_target(hf / "mcore-tp4-pp2", False, inputs=(TopLevelInput(hf),))


def test_an_export_takes_the_tokenizer_of_the_hf_folder_when_the_checkpoint_carries_none(tmp_path, capsys):
    """Pai's HF_CKPT_PATH (mcore2hf's --hf-config): a checkpoint without tokenizer files (another tool's, or an
    iteration saved before runs carried them) exports with those of the HF folder it came from."""
    from megatron_patch.cli import main

    bare = make_tiny_hf_checkpoint("llama3_1", tmp_path / "bare", seed=9)
    (bare / "generation_config.json").unlink(missing_ok=True)
    mcore = tmp_path / "mcore"
    assert main(["convert", "hf2mcore", "--hf-dir", str(bare), "--save-dir", str(mcore), "--quiet"]) == 0
    assert main(["convert", "mcore2hf", "--load-dir", str(mcore), "--save-dir", str(tmp_path / "a"), "--quiet"]) == 0
    assert "the export has no tokenizer files, as the checkpoint carries none: --hf-config HF_DIR" in \
        capsys.readouterr().err
    hf = tmp_path / "hf"
    shutil.copytree(bare, hf)
    for file, text in SIDE_FILES.items():
        (hf / file).write_text(text)
    assert main(["convert", "mcore2hf", "--load-dir", str(mcore), "--save-dir", str(tmp_path / "b"), "--hf-config",
                 str(hf), "--quiet"]) == 0
    assert f"the checkpoint carries no tokenizer files: 3 taken from {hf}" in capsys.readouterr().err
    assert all((tmp_path / "b" / file).read_text() == text for file, text in SIDE_FILES.items())


@pytest.mark.slow
def test_only_the_converter_pai_keeps_mtp_layers_with_keeps_them():
    """Pai's DeepSeek-V3 converter keeps the multi-token-prediction layers; its Qwen3-Next converter (and every other)
    drops them, and Pai's launcher then trains none: here every Pai line kept them, and the Qwen3-Next run trained an
    MTP layer and its loss (the pai2 audit)."""
    keeping = {name for name, script in SCRIPTS.items() if script.keeps_mtp}
    assert keeping == {"toolkits/model_checkpoints_convertor/deepseek/hf2mcore_deepseek_v3_moe_convertor.sh"}
    v3 = plan(find_script("hf2mcore_deepseek_v3_moe_convertor.sh"),
              ["A37B", "hf", "mc", "1", "1", "1", "1", "bf16", "false"], {})
    nxt = plan(find_script(f"{DIST}/scripts/qwen3_next/run_8xH20.sh"), ["A3B", "hf", "mc", "false", "true", "bf16"], {})
    assert "--mtp" in v3.convert and "--mtp" not in nxt.convert


def test_hf2mcore_sh_keeps_the_mtp_layers_config_json_declares(tmp_path):
    """toolkits/checkpoint/hf2mcore.sh keeps DeepSeek-V3's multi-token-prediction layer (MTP=auto, its default),
    as Pai's converter does, so that training trains it; MTP=false drops it."""
    from tests.convert_helpers import with_mtp_layer

    src = with_mtp_layer(make_tiny_hf_checkpoint("deepseek_v3", tmp_path / "plain", seed=10), tmp_path / "hf")
    script = "toolkits/checkpoint/hf2mcore.sh"
    for mtp, layers in ((None, 1), ("false", 0)):
        out = tmp_path / f"mcore-{mtp}"
        extra = [] if mtp is None else ["1", "none", "torch_dist", "auto", "false", mtp]
        assert_ok(run_line("bash", script, src, out, 1, 1, *extra))
        assert json.loads((out / "mpatch_checkpoint.json").read_text())["mtp_layers"] == layers

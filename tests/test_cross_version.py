"""Checkpoints cross megatron-core releases: 0.16.x (Python 3.10/3.11) and 0.19.x (Python 3.12/3.13).

A user trains on one cluster image and resumes or converts on another. Both directions, each against a
run that never changed version:
- a torch_dist training checkpoint (TP=2, sequence parallel, distributed optimizer) saved under one
  release resumes under the other, and every later loss and grad norm equals the uninterrupted run's,
  bit for bit;
- an HF model converted to torch_dist under one release exports back to HF under the other, bit-exact,
  and trains there from the weights that arrived (its first loss is transformers' on the same batch).

The other release runs in a second venv: ``MP_CROSS_VERSION_PYTHON`` (what .ci/run passes: its 3.12
venv's python), or one built here once per test session from pyenv's Python 3.12 with the README's
set-up (a few minutes). Skipped, with one line, where neither is found.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_patch.checkpoint_files.layout import iteration_dir, write_tracker
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from tests.training_helpers import hf_loss_on_first_batch, launch, launcher_args, read_metrics

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ITERS, SAVE, GBS, SEQ = 8, 4, 8, 64


def _mcore_version(python: str) -> str:
    return subprocess.run([python, "-c", "from megatron.core import package_info; print(package_info.__version__)"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _pyenv_python(version: str) -> str | None:
    root = subprocess.run(["pyenv", "root"], capture_output=True, text=True).stdout.strip() if shutil.which("pyenv") \
        else os.path.expanduser("~/.pyenv")
    found = sorted(Path(root, "versions").glob(f"{version}.*/bin/python{version}")) if root else []
    return str(found[-1]) if found else None


@pytest.fixture(scope="session")
def other_python(tmp_path_factory) -> str:
    """A python whose megatron-core is the other supported release line."""
    given = os.environ.get("MP_CROSS_VERSION_PYTHON")
    if given:
        return given
    want = "3.11" if sys.version_info >= (3, 12) else "3.12"
    base = _pyenv_python(want)
    if base is None:
        pytest.skip(f"no Python {want} found (MP_CROSS_VERSION_PYTHON unset, none under pyenv): "
                    "the other megatron-core release cannot run here")
    venv = tmp_path_factory.mktemp("other-venv") / "venv"
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)
    subprocess.run(pip + ["-e", str(REPO)], check=True)
    return str(venv / "bin" / "python")


@pytest.fixture(scope="session")
def versions(other_python) -> dict[str, str]:
    """``this`` and ``other``: python executables with different megatron-core release lines."""
    this, other = _mcore_version(sys.executable), _mcore_version(other_python)
    assert this.split(".")[:2] != other.split(".")[:2], f"both pythons have megatron-core {this} / {other}"
    return {"this": sys.executable, "other": other_python}


def _args(corpus, out: Path, **over) -> list[str]:
    args = dict(DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out), LR="3e-3", MIN_LR="3e-4",
                GLOBAL_BATCH_SIZE=str(GBS), SEQ_LEN=str(SEQ), TP="2", SP="true", DO="true",
                TRAIN_TOKENS_OR_ITERS=str(ITERS * GBS * SEQ), WARMUP_TOKENS_OR_ITERS=str(2 * GBS * SEQ),
                SAVE_INTERVAL=str(SAVE))
    return launcher_args("llama3_1", **{**args, **over})


def _train(python: str, args: list[str]) -> subprocess.CompletedProcess:
    proc = launch(args, {"PYTHON": python, "MP_TP_COMM_OVERLAP": "false"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _by_iteration(out: Path) -> dict[int, dict]:
    return {m["iteration"]: m for m in read_metrics(out)}


@pytest.fixture(scope="session")
def full_runs(versions, corpus, tmp_path_factory) -> dict[str, Path]:
    """One uninterrupted run under each release, checkpoints at SAVE and ITERS."""
    root = tmp_path_factory.mktemp("cross-runs")
    outs = {}
    for side, python in versions.items():
        outs[side] = root / side
        _train(python, _args(corpus, outs[side]))
    return outs


@pytest.mark.parametrize("saved_by,resumed_by", [("this", "other"), ("other", "this")])
def test_training_checkpoint_resumes_under_the_other_release(full_runs, versions, corpus, tmp_path, saved_by,
                                                             resumed_by):
    out = tmp_path / "out"
    shutil.copytree(iteration_dir(full_runs[saved_by] / "checkpoint", SAVE), iteration_dir(out / "checkpoint", SAVE))
    write_tracker(out / "checkpoint", SAVE)
    proc = _train(versions[resumed_by], _args(corpus, out))
    assert "resumed from" in proc.stdout and f"iter_{SAVE:07d}" in proc.stdout
    got, want = _by_iteration(out), _by_iteration(full_runs[saved_by])
    assert sorted(got) == list(range(SAVE + 1, ITERS + 1))
    for i in got:  # bit for bit: the same floats, not merely close ones
        assert (got[i]["loss"], got[i]["grad_norm"]) == (want[i]["loss"], want[i]["grad_norm"]), i


def _convert(python: str, *argv: str) -> None:
    proc = subprocess.run([python, "-m", "megatron_patch", "convert", *argv, "--quiet"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("converted_by,exported_by", [("this", "other"), ("other", "this")])
def test_converted_checkpoint_crosses_the_release(versions, corpus, tmp_path, converted_by, exported_by):
    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf", seed=5)
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    _convert(versions[converted_by], "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(mcore), "--tp", "2",
             "--format", "torch_dist")
    _convert(versions[exported_by], "mcore2hf", "--load-dir", str(mcore), "--save-dir", str(back))
    want = load_file(str(hf / "model.safetensors"))
    got = {}
    for f in sorted(back.glob("*.safetensors")):
        got.update(load_file(str(f)))
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)

    # And the other release trains from it: its first loss is transformers' loss of the original model.
    out = tmp_path / "train"
    args = _args(corpus, out, MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(mcore),
                 TRAIN_TOKENS_OR_ITERS=str(2 * GBS * SEQ), WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ))
    assert "loaded pretrained weights" in _train(versions[exported_by], args).stdout
    first = read_metrics(out)[0]["loss"]
    assert abs(first - hf_loss_on_first_batch(hf, "llama3_1", args)) < 1e-4

"""bf16 and fp16 training on CPU (ENV=cpu): the precision users train in, end to end.

- bf16 with the distributed optimizer: the loss falls; a run killed (SIGKILL) after its checkpoint and
  launched again gives the uninterrupted run's losses, grad norms and learning rates bit for bit, and
  the same final weights; final/ holds the trained weights in bf16 (equal to bf16 of the optimizer's
  fp32 master weights) and `mpatch convert mcore2hf` exports them as bf16;
- fp16 without the distributed optimizer (megatron's Float16Optimizer): the dynamic loss scale doubles
  after MP_LOSS_SCALE_WINDOW good steps, and injected inf gradients (MP_INJECT_FAULT=overflow@N) skip
  the step, are logged, and halve the scale once the hysteresis (2) is used up; killed and launched
  again, the run repeats all of that bit for bit (the scaler's state is in the checkpoint).
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from megatron_patch.cli import main
from tests.training_helpers import GBS, SEQ, read_tensors
from tests.training_helpers import launch, read_metrics

ITERS = 6


def _args(corpus, out, **over):
    from tests.training_helpers import launcher_args

    base = dict(DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out), LR="3e-3", MIN_LR="3e-4", PR="bf16",
                DO="true", GLOBAL_BATCH_SIZE=str(GBS), SEQ_LEN=str(SEQ), TRAIN_TOKENS_OR_ITERS=str(ITERS * GBS * SEQ),
                WARMUP_TOKENS_OR_ITERS=str(2 * GBS * SEQ), SAVE_INTERVAL="3")
    base.update(over)
    return launcher_args("llama3_1", **base)


def _last_per_iteration(out) -> dict[int, dict]:
    """A killed run logged some iterations twice (before the kill and after the resume): the last wins."""
    return {m["iteration"]: m for m in read_metrics(out)}


def _killed_and_resumed(corpus, out, **over):
    """Launch with kill@5 (after the checkpoint at 3), then launch again; returns the second run's stdout."""
    args = _args(corpus, out, **over)
    killed = launch(args, {"MP_INJECT_FAULT": "kill@5"})
    assert killed.returncode != 0, "the injected SIGKILL did not stop the run"
    assert (out / "checkpoint" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert not (out / "final").exists()
    logged = [m["iteration"] for m in read_metrics(out)]
    assert logged == [1, 2, 3, 4], logged  # killed as iteration 5 started
    resumed = launch(args)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "iter_0000003" in resumed.stdout
    return resumed.stdout


def _assert_same_run(a_out, b_out):
    a, b = _last_per_iteration(a_out), _last_per_iteration(b_out)
    assert sorted(a) == sorted(b) == list(range(1, ITERS + 1))
    for i in a:
        for key in ("loss", "grad_norm", "lr"):
            assert a[i][key] == b[i][key], (i, key, a[i][key], b[i][key])
    fa, fb = read_tensors(a_out / "final" / "release"), read_tensors(b_out / "final" / "release")
    assert fa.keys() == fb.keys()
    assert all(torch.equal(fa[k], fb[k]) for k in fa)


@pytest.fixture(scope="module")
def bf16_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "out"
    proc = launch(_args(corpus, out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_bf16_loss_falls_and_final_holds_the_trained_bf16_weights(bf16_run, tmp_path):
    losses = [m["loss"] for m in read_metrics(bf16_run)]
    assert len(losses) == ITERS and 5.0 < losses[0] < 6.0
    assert losses[-1] < losses[0] - 0.5, losses
    assert all("loss_scale" not in m for m in read_metrics(bf16_run))  # bf16 trains unscaled

    final = read_tensors(bf16_run / "final" / "release")
    assert final and {t.dtype for t in final.values()} == {torch.bfloat16}, {k: t.dtype for k, t in final.items()}
    assert json.loads((bf16_run / "final" / "mpatch_checkpoint.json").read_text())["dtype"] == "bf16"
    # The trained weights: bf16 of the optimizer's fp32 master weights in the last checkpoint.
    ckpt = read_tensors(bf16_run / "checkpoint" / f"iter_{ITERS:07d}")
    for key, weight in final.items():
        master = ckpt[f"optimizer.state.param.{key}"]
        assert master.dtype == torch.float32
        assert torch.equal(weight, master.to(torch.bfloat16)), key
        assert torch.equal(weight, ckpt[key]), key
    # ... and they moved from where training started.
    first = read_tensors(bf16_run / "checkpoint" / "iter_0000003")
    assert not torch.equal(first["decoder.layers.mlp.linear_fc1.weight"], final["decoder.layers.mlp.linear_fc1.weight"])

    hf = tmp_path / "hf"
    assert main(["convert", "mcore2hf", "--load-dir", str(bf16_run / "final"), "--save-dir", str(hf), "--quiet"]) == 0
    assert json.loads((hf / "config.json").read_text())["torch_dtype"] == "bfloat16"
    from safetensors.torch import load_file

    exported = load_file(hf / "model.safetensors")
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    vocab = exported["model.embed_tokens.weight"].shape[0]
    assert torch.equal(exported["model.embed_tokens.weight"], final["embedding.word_embeddings.weight"][:vocab])
    assert torch.equal(exported["lm_head.weight"], final["output_layer.weight"][:vocab])
    assert torch.equal(exported["model.norm.weight"], final["decoder.final_layernorm.weight"])
    assert torch.equal(exported["model.layers.2.post_attention_layernorm.weight"],
                      final["decoder.layers.mlp.linear_fc1.layer_norm_weight"][2])


@pytest.mark.slow
def test_bf16_distributed_optimizer_resumes_after_a_kill_bit_for_bit(bf16_run, corpus, tmp_path):
    out = tmp_path / "out"
    _killed_and_resumed(corpus, out)
    _assert_same_run(bf16_run, out)


FP16_FAULTS = {"MP_LOSS_SCALE_WINDOW": "3", "MP_INJECT_FAULT": "overflow@7,overflow@8"}


def _fp16_args(corpus, out):
    # Without the distributed optimizer: megatron's Float16OptimizerWithFloat16Params.
    return _args(corpus, out, PR="fp16", DO="false", TRAIN_TOKENS_OR_ITERS=str(10 * GBS * SEQ), SAVE_INTERVAL="5")


@pytest.fixture(scope="module")
def fp16_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp16") / "out"
    proc = launch(_fp16_args(corpus, out), FP16_FAULTS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"out": out, "stdout": proc.stdout}


@pytest.mark.slow
def test_fp16_loss_scale_grows_and_backs_off_on_overflow(fp16_run):
    m, stdout = read_metrics(fp16_run["out"]), fp16_run["stdout"]
    scales = [x["loss_scale"] for x in m]
    # 2^16 to start; doubled after each 3 good steps; the first overflow uses up the hysteresis (2),
    # the second halves the scale.
    assert scales == [2.0**16] * 3 + [2.0**17] * 3 + [2.0**18] * 2 + [2.0**17] * 2, scales
    assert [x["skipped"] for x in m] == [False] * 6 + [True, True] + [False] * 2
    assert [x["grad_norm"] is None for x in m] == [x["skipped"] for x in m]
    # no scheduler step for a skipped update: the iteration after the two skipped ones runs at their rate
    assert m[6]["lr"] == m[7]["lr"] == m[8]["lr"] != m[5]["lr"]
    assert m[9]["lr"] != m[8]["lr"]
    assert "iteration 7: inf/nan gradients, step skipped (loss scale 262144 -> 262144)" in stdout
    assert "iteration 8: inf/nan gradients, step skipped (loss scale 262144 -> 131072)" in stdout
    # each iteration's console line says the scale it ran with, as metrics.jsonl does (examples/README.md, Logs)
    lines = [line for line in stdout.splitlines() if line.startswith("iter ")]
    assert [float(re.search(r"\| loss scale (\S+) \|", line)[1]) for line in lines] == scales, lines
    losses = [x["loss"] for x in m]
    assert losses[5] < losses[0] - 0.5, losses


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_inf_gradients_without_a_loss_scaler_skip_or_stop_before_the_update(corpus, tmp_path, precision):
    """bf16 and fp32 have no loss scaler to find inf gradients: the step was taken (clipping an infinite norm
    multiplies by 0), every weight became NaN, MP_NAN_POLICY=skip then exported them with status 0, and the stop
    policy stopped one iteration later, after a checkpoint of NaN weights."""
    out = tmp_path / "skip"
    args = _args(corpus, out, PR=precision, DO="false", TRAIN_TOKENS_OR_ITERS=str(5 * GBS * SEQ), SAVE_INTERVAL="2")
    proc = launch(args, {"MP_INJECT_FAULT": "overflow@2", "MP_NAN_POLICY": "skip"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = read_metrics(out)
    assert [x["skipped"] for x in m] == [False, True, False, False, False]
    assert all(math.isfinite(x["loss"]) for x in m) and m[2]["lr"] == m[1]["lr"] != m[0]["lr"]
    assert "iteration 2: the gradients hold inf/nan (loss " in proc.stdout
    assert all(torch.isfinite(t).all() for t in read_tensors(out / "final" / "release").values())

    stopped = tmp_path / "stop"
    proc = launch(_args(corpus, stopped, PR=precision, DO="false", TRAIN_TOKENS_OR_ITERS=str(5 * GBS * SEQ),
                        SAVE_INTERVAL="2"), {"MP_INJECT_FAULT": "overflow@3"})
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert "the gradients hold inf/nan" in err and "at iteration 3: training stopped before its update (the last " \
           f"checkpoint is {stopped / 'checkpoint' / 'iter_0000002'})" in err, err
    assert all(torch.isfinite(t).all() for t in read_tensors(stopped / "checkpoint" / "iter_0000002").values())


@pytest.mark.slow
def test_fp16_without_distributed_optimizer_resumes_after_a_kill_bit_for_bit(fp16_run, corpus, tmp_path):
    """Killed at iteration 7 after the checkpoint at 5: the resumed run must also restore the loss
    scaler (growth and hysteresis trackers), or its scale and skipped steps would differ."""
    out = tmp_path / "out"
    args = _fp16_args(corpus, out)
    killed = launch(args, {**FP16_FAULTS, "MP_INJECT_FAULT": "kill@7"})
    assert killed.returncode != 0
    assert [m["iteration"] for m in read_metrics(out)] == [1, 2, 3, 4, 5, 6]
    resumed = launch(args, FP16_FAULTS)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "iter_0000005" in resumed.stdout
    a, b = _last_per_iteration(fp16_run["out"]), _last_per_iteration(out)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for i in a:
        for key in ("loss", "grad_norm", "lr", "loss_scale", "skipped"):
            assert a[i][key] == b[i][key], (i, key, a[i][key], b[i][key])
    fa, fb = read_tensors(fp16_run["out"] / "final" / "release"), read_tensors(out / "final" / "release")
    assert {t.dtype for t in fa.values()} == {torch.float16}
    assert all(torch.equal(fa[k], fb[k]) for k in fa)


@pytest.mark.slow
@pytest.mark.parametrize("do", ["false", "true"])
def test_a_checkpoint_before_the_first_successful_step_resumes(corpus, tmp_path, do):
    """fp16's first steps overflow (its scale starts at 2^16); a checkpoint then held no Adam state (torch makes it at
    the first step taken): without the distributed optimizer the resume refused it as "not written for this model",
    with it the save was an internal error (the equiv2 audit). The killed and resumed run logs the whole run's steps."""
    def args(out):
        return _args(corpus, out, PR="fp16", DO=do, TRAIN_TOKENS_OR_ITERS=str(4 * GBS * SEQ),
                     WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ), SAVE_INTERVAL="1")

    whole = launch(args(tmp_path / "whole"), {"MP_INJECT_FAULT": "overflow@1"})
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    killed = launch(args(tmp_path / "killed"), {"MP_INJECT_FAULT": "overflow@1,kill@2"})
    assert killed.returncode != 0 and (tmp_path / "killed" / "checkpoint" / "iter_0000001").is_dir()
    resumed = launch(args(tmp_path / "killed"), {})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    a, b = _last_per_iteration(tmp_path / "whole"), _last_per_iteration(tmp_path / "killed")
    assert a[1]["skipped"] and sorted(a) == sorted(b) == [1, 2, 3, 4]
    for i in a:
        for key in ("loss", "grad_norm", "loss_scale", "skipped"):
            assert a[i][key] == b[i][key], (i, key, a[i][key], b[i][key])

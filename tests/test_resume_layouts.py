"""Through the real launcher (ENV=cpu, torchrun, gloo): a run starts from a checkpoint Megatron-LM
wrote, and its training checkpoints resume at another TP, PP and DP.

- The start: PRETRAIN_CHECKPOINT_PATH is a Megatron-LM torch_dist checkpoint (TP=2, vocabulary padded
  to 512 rows, optimizer state, TE extra state; tests/foreign_checkpoints.py) with MODEL_SIZE=auto and
  MP_HF_CONFIG: the first loss is transformers' loss on the same first batch.
- The resume: the uninterrupted run (TP=2, DP=1, 12 iterations, a checkpoint every 4) against the
  same run stopped at 4 (TP=2), resumed at PP=2 until 8, then at DP=2 (TP=1, two processes) until 12.
  Model, distributed optimizer, scheduler and data position come from the checkpoint (the random
  state starts afresh when the process count changes, and nothing in this model draws from it), so
  every iteration sees the same samples and the losses agree up to fp32 reduction order.
"""

from __future__ import annotations

import pytest

from tests import foreign_checkpoints as fc
from tests.training_helpers import GBS, SEQ
from tests.training_helpers import pretrain_args as _pretrain_args
from tests.training_helpers import hf_loss_on_first_batch, launch, read_metrics

ITERS = 12
# Different TP/PP/DP sum in another order; measured differences are about 2e-7.
LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def start(tmp_path_factory, corpus):
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("resume")
    hf = make_tiny_hf_checkpoint("llama3_1", root / "hf", seed=4)
    return {"corpus": corpus, "hf": hf,
            "ckpt": fc.megatron_lm_torch_dist(hf, root / "megatron_lm", tp=2, padded=512)}


def _args(start, out, **layout):
    return _pretrain_args(start["corpus"], out, MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(start["ckpt"]),
                          LR="1e-3", SAVE_INTERVAL="4", TRAIN_TOKENS_OR_ITERS=str(ITERS * GBS * SEQ),
                          WARMUP_TOKENS_OR_ITERS=str(2 * GBS * SEQ), DO="true", **layout)


def _run(start, args, **env):
    proc = launch(args, {"MP_TP_COMM_OVERLAP": "false", "MP_HF_CONFIG": str(start["hf"]), **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def uninterrupted(start, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "out"
    args = _args(start, out, TP="2", SP="true")
    return {"out": out, "args": args, "stdout": _run(start, args)}


@pytest.mark.slow
def test_a_run_starts_from_a_megatron_lm_checkpoint(start, uninterrupted):
    assert f"loaded pretrained weights from {start['ckpt']}" in uninterrupted["stdout"]
    first = read_metrics(uninterrupted["out"])[0]["loss"]
    expected = hf_loss_on_first_batch(start["hf"], "llama3_1", uninterrupted["args"])
    assert abs(first - expected) < 1e-4, (first, expected)  # the weights, padded vocabulary and all, arrived


@pytest.mark.slow
def test_resume_at_another_tp_pp_and_dp_repeats_the_run(start, uninterrupted, tmp_path):
    out = tmp_path / "out"
    _run(start, _args(start, out, TP="2", SP="true"), MP_EXIT_INTERVAL="4")
    at_pp2 = _run(start, _args(start, out, PP="2"), MP_EXIT_INTERVAL="8")
    assert "resumed from" in at_pp2 and "iter_0000004" in at_pp2
    at_dp2 = _run(start, _args(start, out), MP_NPROC="2")
    assert "resumed from" in at_dp2 and "iter_0000008" in at_dp2
    resumed, reference = read_metrics(out), read_metrics(uninterrupted["out"])
    assert [x["iteration"] for x in resumed] == list(range(1, ITERS + 1))
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(resumed, reference)]
    print(f"largest loss difference after resuming at PP=2 and DP=2: {max(diffs):.3g}")
    assert max(diffs) < LOSS_TOLERANCE, list(zip(resumed, reference))
    for a, b in zip(resumed, reference):
        assert abs(a["lr"] - b["lr"]) < 1e-12, a["iteration"]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer,elsewhere", [
    ({"DO": "false"}, None), ({"DO": "true"}, None), ({"DO": "true", "OPTIMIZER_OFFLOAD": "static"}, None),
    # resumed at PP=1, where no stage lacks experts: the checkpoint reads the same whichever layout wrote it
    ({"DO": "false"}, ({"PP": "1"}, {"MP_NPROC": "2"}))],
    ids=["optimizer", "distributed", "offload", "optimizer-at-pp1"])
def test_a_pipeline_stage_without_experts_saves_and_resumes_exactly(corpus, tmp_path, optimizer, elsewhere):
    """An MoE model at PP=2 x EP=2 whose first stage holds only its dense layer (MP_PP0_LAYERS=1, which the launcher
    advises for DeepSeek-V3's tiny model): megatron-core gives that stage an experts' optimizer of empty groups,
    which has no step of torch's Adam to save. The distributed optimizer failed at the first save, the other one at
    the resume (rank 0, on that stage, wrote no step for the ranks with experts), the offloaded one before its first
    step. Each now repeats the whole run from its checkpoint."""
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from tests.training_helpers import assert_a_killed_run_resumes_as_the_whole

    hf = make_tiny_hf_checkpoint("qwen3_moe", tmp_path / "hf", seed=0)
    assert_a_killed_run_resumes_as_the_whole("qwen3_moe", hf, corpus, tmp_path, {"MP_NPROC": "4", "MP_PP0_LAYERS": "1"},
                                             elsewhere, PR="bf16", PP="2", EP="2", LR="1e-3", MIN_LR="1e-4", **optimizer)

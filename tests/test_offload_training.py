"""Optimizer offload in training (ENV=cpu, DP=2, bf16, the distributed optimizer's bucket shards).

On CPU the "device" tier is host memory tagged as the device, so the chunks, their moves, the staging
copies and the auto policy all run. A scripted memory probe (MP_OFFLOAD_PROBE_SCRIPT) forces the
layout to change mid-run: a drop at iteration 3, a rise at 7, an oscillation over 9-11.

- OPTIMIZER_OFFLOAD=auto under that script gives the losses, grad norms, learning rates and final
  weights of OPTIMIZER_OFFLOAD=false (megatron's own optimizer), bit for bit, and the schedule of
  evictions and promotions the policy promises (patience, cooldown);
- MP_OFFLOAD_NUMERICS=exact: the same schedule gives the bits of exact numerics without offload;
- a checkpoint written under one layout resumes under another as if uninterrupted: offload's
  checkpoint without offload, and the plain optimizer's checkpoint under OPTIMIZER_OFFLOAD=0.5;
- the per-step metrics reach log/metrics.jsonl and TensorBoard.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from tests.training_helpers import GBS, SEQ, read_tensors
from tests.training_helpers import launch, launcher_args, read_metrics

ITERS, SAVE = 14, 7
SCRIPT = {"device_fraction": {"1": 1.0, "3": 0.4, "7": 1.0, "9": 0.3, "10": 1.0, "11": 0.3, "12": 1.0}}
POLICY = {"MP_OFFLOAD_PATIENCE": "2", "MP_OFFLOAD_COOLDOWN": "2"}


def _args(corpus, out, offload="false"):
    return launcher_args("llama3_1", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out), LR="3e-3", MIN_LR="3e-4",
                         PR="bf16", DO="true", OPTIMIZER_OFFLOAD=offload, GLOBAL_BATCH_SIZE=str(GBS), SEQ_LEN=str(SEQ),
                         TRAIN_TOKENS_OR_ITERS=str(ITERS * GBS * SEQ), WARMUP_TOKENS_OR_ITERS=str(2 * GBS * SEQ),
                         SAVE_INTERVAL=str(SAVE))


def _run(corpus, out, offload="false", env=None):
    proc = launch(_args(corpus, out, offload), {"MP_NPROC": "2", **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _same_run(a_out, b_out, iterations=range(1, ITERS + 1)):
    a = {m["iteration"]: m for m in read_metrics(a_out)}
    b = {m["iteration"]: m for m in read_metrics(b_out)}
    for i in iterations:
        for key in ("loss", "grad_norm", "lr"):
            assert a[i][key] == b[i][key], (i, key, a[i][key], b[i][key])
    fa, fb = read_tensors(a_out / "final" / "release"), read_tensors(b_out / "final" / "release")
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def _stopped_after_checkpoint(src, dst, iteration: int):
    """A copy of a finished run as it was when its checkpoint at ``iteration`` had just been written."""
    shutil.copytree(src, dst)
    ckpt = dst / "checkpoint"
    for d in ckpt.glob("iter_*"):
        if int(d.name[len("iter_"):]) > iteration:
            shutil.rmtree(d)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    shutil.rmtree(dst / "final")
    lines = (dst / "log" / "metrics.jsonl").read_text().splitlines()
    (dst / "log" / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["iteration"] <= iteration))


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "script.json"
    path.write_text(json.dumps(SCRIPT))
    return str(path)


@pytest.fixture(scope="module")
def plain(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "out"
    _run(corpus, out)
    return out


@pytest.fixture(scope="module")
def auto(corpus, script, tmp_path_factory):
    out = tmp_path_factory.mktemp("auto") / "out"
    stdout = _run(corpus, out, "auto", {"MP_OFFLOAD_PROBE_SCRIPT": script, **POLICY})
    return {"out": out, "stdout": stdout}


@pytest.mark.slow
def test_auto_schedule_under_the_scripted_probe(auto):
    m = read_metrics(auto["out"])
    actions = [x["offload_action"] for x in m]
    # 3: room for 40% -> evict; 7: room again, patience 2 -> promote at 8; 9: 30% -> evict; 10 room, 11 tight
    # (streak broken), 12-13 room, cooldown long over -> promote at 13.
    assert actions == ["hold", "hold", "evict", "hold", "hold", "hold", "hold", "promote", "evict", "hold", "hold",
                       "hold", "promote", "hold"], actions
    shares = [x["offload_share"] for x in m]
    assert shares[:2] == [0.0, 0.0] and shares[7] == 0.0 and shares[12:] == [0.0, 0.0]
    assert all(s > 0.5 for s in shares[2:7] + shares[8:12]), shares
    assert m[2]["offload_budget_bytes"] < 0 and m[8]["offload_budget_bytes"] < 0
    moved = [x["offload_moved_bytes"] for x in m]
    assert [i + 1 for i, b in enumerate(moved) if b] == [3, 8, 9, 13]
    # a step with chunks on the host (moved there after the previous step) stages their grads in and params out
    staged = [x["offload_staged_bytes"] > 0 for x in m]
    assert staged == [False] + [s > 0 for s in shares[:-1]], staged
    assert "optimizer offload auto (margin 2 GiB, patience 2, cooldown 2)" in auto["stdout"]
    assert "| offload " in auto["stdout"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((auto["out"] / "tensorboard").glob("events.*"))))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"offload_share", "offload_moved_bytes", "offload_budget_bytes", "offload_peak_non_model_bytes"} <= tags
    assert [e.value for e in events.Scalars("offload_moved_bytes")] == moved


@pytest.mark.slow
def test_auto_gives_the_plain_optimizers_run_bit_for_bit(auto, plain):
    _same_run(plain, auto["out"])


@pytest.mark.slow
def test_exact_numerics_any_schedule_equals_no_offload(corpus, script, tmp_path):
    exact = {"MP_OFFLOAD_NUMERICS": "exact"}
    off, moved = tmp_path / "off", tmp_path / "moved"
    assert "optimizer offload off (exact numerics only)" in _run(corpus, off, "false", exact)
    _run(corpus, moved, "auto", {**exact, "MP_OFFLOAD_PROBE_SCRIPT": script, **POLICY})
    assert sum(x["offload_moved_bytes"] > 0 for x in read_metrics(moved)) == 4
    _same_run(off, moved)


@pytest.mark.slow
def test_offload_checkpoint_resumes_without_offload(auto, plain, tmp_path):
    out = tmp_path / "out"
    _stopped_after_checkpoint(auto["out"], out, SAVE)
    proc = launch(_args_from(out, "false"), {"MP_NPROC": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"iter_{SAVE:07d}" in proc.stdout and "optimizer offload" not in proc.stdout
    _same_run(plain, out)


@pytest.mark.slow
def test_plain_checkpoint_resumes_with_offload(plain, tmp_path):
    out = tmp_path / "out"
    _stopped_after_checkpoint(plain, out, SAVE)
    proc = launch(_args_from(out, "0.5"), {"MP_NPROC": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"iter_{SAVE:07d}" in proc.stdout
    m = read_metrics(out)
    resumed = [x for x in m if x["iteration"] > SAVE]
    # static 0.5: half the state on the host, to within one chunk, the whole time
    assert len({x["offload_share"] for x in resumed}) == 1 and abs(resumed[0]["offload_share"] - 0.5) < 0.2
    assert all(x["offload_action"] == "hold" and x["offload_moved_bytes"] == 0 for x in resumed)
    _same_run(plain, out)


def _args_from(out, offload):
    """The arguments a finished run in ``out`` was launched with, OPTIMIZER_OFFLOAD changed."""
    state = json.loads(next((out / "checkpoint").glob("iter_*/train_state.json")).read_text())["config"]
    return _args({"prefix": state["dataset_path"][0]}, out, offload)


@pytest.mark.slow
def test_auto_starts_from_the_share_the_dry_run_states(corpus, tmp_path):
    """OPTIMIZER_OFFLOAD=auto at DP=2 with a device too small for the whole state: the dry run said "starts with 50%"
    (the most any rank needs) and checked the device at that share, while each rank started from its stage's own
    share (41%), a chunk more on the device than the plan that passed the check (the dryrun audit)."""
    from megatron_patch.training.memory_plan import auto_share, plan_memory
    from megatron_patch.training.validation import resolve

    out = tmp_path / "out"
    args = _args(corpus, out, "auto")
    for tenths_of_mb in range(40, 53):  # a device size where the ranks' own shares differ by more than a chunk
        env = {"MP_NPROC": "2", "MP_GPU_MEMORY_GB": str(tenths_of_mb / 10000), "MP_OFFLOAD_MARGIN_GB": "0"}
        plan = plan_memory(resolve("llama3_1", args, env=env))
        stage = plan.stage(0)
        if plan.offload_share - auto_share(stage, plan.capacity, plan.margin) > 1 / len(stage.chunks):
            break
    else:
        pytest.fail("no device size found where the ranks' own shares differ: the premise of this test is gone")
    dry = launch(args, {**env, "MP_DRY_RUN": "json"})
    assert dry.returncode == 0, dry.stderr[-2000:]
    said = json.loads(dry.stdout)["memory_plan"]["offload_share"]
    assert said == pytest.approx(plan.offload_share)
    stdout = _run(corpus, out, "auto", env)
    # where the run starts (its first step may move chunks at once: the policy then measures the CPU's memory)
    started = float(re.search(r"on the host \(([\d.]+)% of the state\)", stdout).group(1)) / 100
    assert abs(started - said) <= 1 / len(stage.chunks), (started, said, env)


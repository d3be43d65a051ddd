"""Task evaluation during training (issue 38): a launcher run with MP_EVAL_TASKS evaluates its live model at the
training layout every MP_EVAL_TASKS_INTERVAL iterations; the results are in the log, TensorBoard and
eval/results.jsonl, and equal `mpatch eval` on the checkpoint the run saved at the same iteration. Then
`mpatch eval --all-iterations` over the run's checkpoints. Each launches ranks: slow."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_patch.cli import main
from tests.training_helpers import launch, make_corpus, pretrain_args

pytestmark = pytest.mark.slow

GBS, SEQ, ITERS = 8, 64, 4
TASKS = "mpatch_perplexity,mpatch_arithmetic_choice,mpatch_arithmetic"
LIMIT = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """Four iterations of a tiny Llama at TP=2 with sequence parallelism on the demo corpus, checkpoints at 2 and 4,
    the three shipped tasks evaluated after iterations 2 and 4 on 6 documents each. (Under SP the live model's
    requests are padded to a multiple of TP: its first evaluation failed in megatron-core's split before.)"""
    root = tmp_path_factory.mktemp("train_eval")
    corpus = make_corpus(root / "corpus", 300)
    out = root / "out"
    args = pretrain_args(corpus, out, TP="2", SP="true", TRAIN_TOKENS_OR_ITERS=str(ITERS * GBS * SEQ),
                         WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ), SAVE_INTERVAL="2")
    proc = launch(args, {"MP_NPROC": "2", "MP_TOKENIZER": str(corpus["tok"]), "MP_EVAL_TASKS": TASKS,
                         "MP_EVAL_TASKS_INTERVAL": "2", "MP_EVAL_TASKS_LIMIT": str(LIMIT),
                         "MP_TP_COMM_OVERLAP": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"out": out, "stdout": proc.stdout, "corpus": corpus}


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "eval" / "results.jsonl").read_text().splitlines()]


def test_the_live_model_is_evaluated_at_the_interval_into_the_log_tensorboard_and_json(run):
    records = _records(run["out"])
    assert [r["iteration"] for r in records] == [2, 4]
    names = {"mpatch_perplexity/word_perplexity", "mpatch_perplexity/byte_perplexity",
             "mpatch_perplexity/bits_per_byte", "mpatch_arithmetic_choice/acc", "mpatch_arithmetic_choice/acc_norm", "mpatch_arithmetic/exact_match"}
    for record in records:
        assert set(record["metrics"]) == names, record["metrics"]
        assert record["results"]["n-samples"]["mpatch_arithmetic"]["effective"] == LIMIT
        assert all(math.isfinite(v) for v in record["metrics"].values())
        for name, value in record["metrics"].items():
            task, metric = name.split("/", 1)
            assert f"evaluation at iter {record['iteration']}: {task} {metric} {value:.4f}" in run["stdout"]
    # the model trained between the two evaluations
    assert records[0]["metrics"]["mpatch_perplexity/bits_per_byte"] != records[1]["metrics"][
        "mpatch_perplexity/bits_per_byte"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((run["out"] / "tensorboard").glob("events.*"))))
    events.Reload()
    for name in names:
        scalars = events.Scalars(f"eval/{name}")
        assert [e.step for e in scalars] == [2, 4]
        assert [e.value for e in scalars] == pytest.approx([r["metrics"][name] for r in records], rel=1e-6)


def test_the_live_results_equal_mpatch_eval_on_the_checkpoint_of_the_same_iteration(run, tmp_path, capsys):
    live = _records(run["out"])[1]
    code = main(["eval", "--load-dir", str(run["out"] / "checkpoint" / "iter_0000004"), "--tasks", TASKS,
                 "--limit", str(LIMIT), "--tp", "2", "--output-dir", str(tmp_path / "eval"), "--quiet"])
    assert code == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]
    # standard errors, as lm-eval's own command line gives them (they were all "N/A": no bootstrap at all)
    assert isinstance(saved["mpatch_arithmetic_choice"]["acc_stderr,none"], float)
    for task, values in live["results"]["results"].items():
        for key, value in values.items():
            if isinstance(value, float):
                assert saved[task][key] == pytest.approx(value, rel=1e-5), (task, key)
            else:
                assert saved[task][key] == value, (task, key)


def test_all_iterations_evaluates_every_saved_iteration_and_draws_it_next_to_the_loss(run, tmp_path, capsys):
    out = tmp_path / "all"
    code = main(["eval", "--load-dir", str(run["out"] / "checkpoint"), "--all-iterations", "--tasks", TASKS,
                 "--limit", str(LIMIT), "--tp", "2", "--output-dir", str(out), "--quiet"])
    said = capsys.readouterr()
    assert code == 0, said.err
    summary = json.loads((out / "all_iterations.json").read_text())
    assert [p["iteration"] for p in summary["iterations"]] == [2, 4]
    assert summary["training_loss"] is not None
    live = {r["iteration"]: r["metrics"] for r in _records(run["out"])}
    for point in summary["iterations"]:
        assert point["metrics"] == pytest.approx(live[point["iteration"]], rel=1e-5)
        folder = out / f"iter_{point['iteration']:07d}"
        assert json.loads((folder / "results.json").read_text())["n-samples"]["mpatch_arithmetic"]["effective"] == LIMIT
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "mpatch_manifest.json").is_file()
    assert "metrics.png" in said.out


def test_training_goes_on_as_without_the_evaluations(run, tmp_path):
    """The same run without MP_EVAL_TASKS logs the same losses, bit for bit: evaluating took no training data and
    changed no weight (the tiny model has no dropout, so this does not show the random generators' restore)."""
    from tests.training_helpers import read_metrics

    args = pretrain_args(run["corpus"], tmp_path / "out", TP="2", TRAIN_TOKENS_OR_ITERS=str(ITERS * GBS * SEQ),
                         WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ), SAVE_INTERVAL="2")
    proc = launch(args, {"MP_NPROC": "2", "MP_TOKENIZER": str(run["corpus"]["tok"])})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [m["loss"] for m in read_metrics(tmp_path / "out")] == [m["loss"] for m in read_metrics(run["out"])]


def test_a_pr_fp8_runs_live_results_are_its_bf16_models_as_mpatch_eval_computes_them(tmp_path, capsys):
    """PR=fp8 with every decoder GEMM in float8 (MP_FP8_FILTER=all): the live evaluation ran the float8 GEMMs, numbers
    no `mpatch eval` of the saved checkpoint gives. It evaluates the bf16 model the run saves and exports: equal to
    `mpatch eval --dtype bf16` of that iteration."""
    pytest.importorskip("torchao")
    corpus = make_corpus(tmp_path / "corpus", 300)
    out = tmp_path / "out"
    args = pretrain_args(corpus, out, PR="fp8", TRAIN_TOKENS_OR_ITERS=str(2 * GBS * SEQ),
                         WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ), SAVE_INTERVAL="2")
    proc = launch(args, {"MP_TOKENIZER": str(corpus["tok"]), "MP_EVAL_TASKS": "mpatch_perplexity",
                         "MP_EVAL_TASKS_INTERVAL": "2", "MP_EVAL_TASKS_LIMIT": str(LIMIT), "MP_FP8_FILTER": "all"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "this rank's decoder GEMMs in float8 by kind: proj 4/4, qkv 12/12, fc1 8/8, fc2 4/4" in proc.stdout, proc.stdout[-3000:]
    live = _records(out)[0]["results"]["results"]["mpatch_perplexity"]
    code = main(["eval", "--load-dir", str(out / "checkpoint" / "iter_0000002"), "--tasks", "mpatch_perplexity",
                 "--limit", str(LIMIT), "--dtype", "bf16", "--output-dir", str(tmp_path / "eval"), "--quiet"])
    assert code == 0, capsys.readouterr().err
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]["mpatch_perplexity"]
    for key in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert saved[key] == pytest.approx(live[key], rel=1e-6), key

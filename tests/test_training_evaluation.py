"""Task evaluation during training (issue 38, MP_EVAL_TASKS): the options checked in one line before any rank
starts; `mpatch eval --all-iterations`'s refusals, its reading of the run's loss and its plot. The end-to-end
runs (the live model's results in the log, TensorBoard and eval/results.jsonl, equal to `mpatch eval` on the
checkpoint of the same iteration; --all-iterations over a run) are tests/test_training_evaluation_run.py's."""

from __future__ import annotations

import pytest

from megatron_patch.cli import main
from megatron_patch.errors import UserError
from megatron_patch.training import evaluation_run
from megatron_patch.training.validation import resolve
from tests.training_helpers import launcher_args, make_texts, make_tokenizer


@pytest.fixture()
def data(tmp_path):
    """Files the path checks accept (their content is not read by resolve)."""
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{suffix}").write_bytes(b"")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    return {"prefix": str(tmp_path / "corpus_text_document"), "tok": str(tok), "out": str(tmp_path / "out"),
            "missing": str(tmp_path / "missing")}


def _args(data, **over):
    return launcher_args("llama3_1", DATASET_PATH=data["prefix"], OUTPUT_BASEPATH=data["out"], **over)


BAD = [
    (dict(), {"MP_EVAL_TASKS": " , "}, "MP_EVAL_TASKS names no task"),
    (dict(), {"MP_EVAL_TASKS_INTERVAL": "5"}, "MP_EVAL_TASKS_INTERVAL applies to MP_EVAL_TASKS, which is not set"),
    (dict(), {"MP_EVAL_TASKS_LIMIT": "5"}, "MP_EVAL_TASKS_LIMIT applies to MP_EVAL_TASKS"),
    (dict(), {"MP_EVAL_TASKS": "mpatch_arithmetic", "MP_TOKENIZER": "TOK", "MP_EVAL_TASKS_LIMIT": "0"},
     "MP_EVAL_TASKS_LIMIT must be > 0"),
    (dict(), {"MP_EVAL_TASKS": "mpatch_arithmetic", "MP_TOKENIZER": "TOK", "MP_EVAL_TASKS_INTERVAL": "0"},
     "MP_EVAL_TASKS_INTERVAL must be >= 1"),
    (dict(), {"MP_EVAL_TASKS": "mpatch_arithmetic", "MP_TOKENIZER": "TOK", "MP_EVAL_INTERVAL": "0"},
     "MP_EVAL_TASKS needs an interval: MP_EVAL_INTERVAL=0"),
    (dict(PP="2"), {"MP_EVAL_TASKS": "mpatch_arithmetic", "MP_TOKENIZER": "TOK", "MP_VP_CHUNKS": "2"},
     "MP_EVAL_TASKS with MP_VP_CHUNKS=2 is not supported"),
    (dict(), {"MP_EVAL_TASKS": "mpatch_arithmetic"}, "MP_EVAL_TASKS needs the model's HF tokenizer"),
    (dict(), {"MP_EVAL_TASKS": "mpatch_arithmetic", "MP_TOKENIZER": "TOK", "MP_EVAL_INCLUDE_PATH": "MISSING"},
     "MP_EVAL_INCLUDE_PATH MISSING is not a folder"),
]


@pytest.mark.parametrize("over,env,message", BAD, ids=[m[:40] for *_, m in BAD])
def test_bad_evaluation_options_are_refused_in_one_line(data, over, env, message, monkeypatch, capsys):
    named = {"TOK": data["tok"], "MISSING": data["missing"]}
    for key, value in env.items():
        monkeypatch.setenv(key, named.get(value, value))
    code = main(["train", "llama3_1", *_args(data, **over)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message.replace("MISSING", data["missing"]) in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.slow
def test_an_unknown_task_is_refused_before_any_rank_starts(data, monkeypatch, capsys):
    """lm-eval indexes its 14,000 tasks to say a name is none of them (10-30 s): slow."""
    monkeypatch.setenv("MP_EVAL_TASKS", "mpatch_arithmetic,no_such_task")
    monkeypatch.setenv("MP_TOKENIZER", data["tok"])
    monkeypatch.setenv("MP_DRY_RUN", "1")
    code = main(["train", "llama3_1", *_args(data)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "unknown task no_such_task" in err and "MP_EVAL_INCLUDE_PATH" in err, err


def test_what_the_live_evaluation_cannot_split_is_refused(data):
    """Context parallelism would give each CP rank whole requests; sequence parallelism pads each request to a
    multiple of TP, which moves DeepSeek sparse attention's scores. Before, neither was checked."""
    import dataclasses

    from megatron_patch.models.description.tiny import tiny_config

    cfg = resolve("llama3_1", _args(data), env={"MP_EVAL_TASKS": "mpatch_arithmetic", "MP_TOKENIZER": data["tok"]},
                  check_paths=False)
    evaluation_run.check_evaluation(dataclasses.replace(cfg, tp=2, sequence_parallel=True))  # padded, evaluated
    with pytest.raises(UserError, match="MP_EVAL_TASKS with CP=2 is not supported"):
        evaluation_run.check_evaluation(dataclasses.replace(cfg, cp=2))
    sparse = dataclasses.replace(cfg, tp=2, sequence_parallel=True, hf_config=tiny_config("deepseek_v32"))
    with pytest.raises(UserError, match="MP_EVAL_TASKS with SP=true is not supported for deepseek_v32"):
        evaluation_run.check_evaluation(sparse)
    evaluation_run.check_evaluation(dataclasses.replace(sparse, sequence_parallel=False))


def test_the_live_evaluation_draws_as_mpatch_eval_whatever_mp_seed_says(data):
    """The few-shot examples were drawn with MP_SEED: the logged numbers were not mpatch eval's of the checkpoint."""
    from megatron_patch.evaluation.evaluate import EvalSettings

    cfg = resolve("llama3_1", _args(data), env={"MP_EVAL_TASKS": "mpatch_arithmetic", "MP_TOKENIZER": data["tok"],
                                                 "MP_SEED": "7"}, check_paths=False)
    assert cfg.seed == 7 and evaluation_run.settings(cfg).seed == EvalSettings(tasks=()).seed == 1234


def test_tasks_are_evaluated_at_the_interval_and_after_the_last_iteration(data):
    """As the validation loss: a run shorter than the interval (by default MP_EVAL_INTERVAL's 10000) evaluated its
    tasks never, and said nothing."""
    env = {"MP_EVAL_TASKS": "mpatch_arithmetic", "MP_TOKENIZER": data["tok"]}
    cfg = resolve("llama3_1", _args(data), env=env, check_paths=False)
    assert cfg.eval_tasks_interval == 10000 > cfg.train_iters
    assert [i for i in range(1, cfg.train_iters + 1) if evaluation_run.due(cfg, i)] == [cfg.train_iters]
    cfg = resolve("llama3_1", _args(data), env={**env, "MP_EVAL_TASKS_INTERVAL": "3"}, check_paths=False)
    assert [i for i in range(1, cfg.train_iters + 1) if evaluation_run.due(cfg, i)] == sorted(
        {*range(3, cfg.train_iters + 1, 3), cfg.train_iters})
    assert not any(evaluation_run.due(resolve("llama3_1", _args(data), env={}, check_paths=False), i)
                   for i in range(1, cfg.train_iters + 1))


def test_the_task_interval_defaults_to_the_validation_interval(data):
    env = {"MP_EVAL_TASKS": "mpatch_arithmetic, mpatch_perplexity", "MP_TOKENIZER": data["tok"],
           "MP_EVAL_INTERVAL": "6"}
    cfg = resolve("llama3_1", _args(data), env=env, check_paths=False)
    assert (cfg.eval_tasks, cfg.eval_tasks_interval, cfg.eval_tasks_limit) == (
        ["mpatch_arithmetic", "mpatch_perplexity"], 6, None)
    cfg = resolve("llama3_1", _args(data), env={**env, "MP_EVAL_TASKS_INTERVAL": "4", "MP_EVAL_TASKS_LIMIT": "3"},
                  check_paths=False)
    assert (cfg.eval_interval, cfg.eval_tasks_interval, cfg.eval_tasks_limit) == (6, 4, 3)
    assert resolve("llama3_1", _args(data), env={**env, "MP_EVAL_TASKS_LIMIT": "0.25"},
                   check_paths=False).eval_tasks_limit == 0.25
    assert resolve("llama3_1", _args(data), env={}, check_paths=False).eval_tasks is None


@pytest.mark.parametrize("extra,message", [
    ([], "--all-iterations writes each iteration's results and the plot into --output-dir: give one"),
    (["--output-dir", "OUT"], "holds no saved iteration (iter_XXXXXXX): give a training run's checkpoint/ folder"),
])
def test_all_iterations_refuses_bad_input_in_one_line(tmp_path, capsys, extra, message):
    (tmp_path / "checkpoint").mkdir()
    extra = [str(tmp_path / "out") if value == "OUT" else value for value in extra]
    code = main(["eval", "--load-dir", str(tmp_path / "checkpoint"), "--all-iterations", "--tasks",
                 "mpatch_arithmetic", *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_the_training_loss_is_read_from_the_run_log_and_drawn_beside_each_metric(tmp_path):
    from megatron_patch.evaluation.iterations import plot, training_losses

    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "metrics.jsonl").write_text(
        '{"iteration": 1, "loss": 5.0}\n{"iteration": 2, "loss": 4.5}\nnot json\n{"iteration": 2, "valid_loss": 4.0}\n'
        '{"iteration": 2, "loss": 4.25}\n[1]\n')
    losses = training_losses(tmp_path / "checkpoint")
    assert losses == {1: 5.0, 2: 4.25}  # a resumed iteration's later record wins
    assert training_losses(tmp_path / "elsewhere" / "checkpoint") == {}
    plot([{"iteration": 1, "metrics": {"t/acc": 0.5, "t/ppl": 9.0}}, {"iteration": 2, "metrics": {"t/acc": 0.75}}],
         losses, tmp_path / "metrics.png")
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_each_rank_refuses_a_tokenizer_the_model_cannot_score(data, tmp_path):
    """What `mpatch eval` refuses, a run's ranks refuse as they start, before training: a tokenizer with ids beyond
    the model's vocabulary (the tiny model has 200; their scores would come from padding rows, or an index error at
    the first evaluation, hours in). The model's own tokenizer passes."""
    texts = make_texts(300)
    env = {"MP_EVAL_TASKS": "mpatch_arithmetic", "MP_TOKENIZER": data["tok"]}
    cfg = resolve("llama3_1", _args(data), env=env, check_paths=False)
    assert cfg.arch.vocab_size == 200
    wide = make_tokenizer(tmp_path / "wide", texts, vocab_size=320)
    with pytest.raises(UserError, match=r"MP_EVAL_TASKS: the tokenizer in .*wide yields ids beyond the model's "
                                        r"vocabulary \(200\): it has 2\d\d ids; give the model's own tokenizer "
                                        r"\(MP_TOKENIZER, or a PRETRAIN_CHECKPOINT_PATH that carries it\)"):
        evaluation_run.load_tokenizer(wide, cfg)
    own = make_tokenizer(tmp_path / "own", texts)
    assert evaluation_run.load_tokenizer(own, cfg).get_vocab()

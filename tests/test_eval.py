"""`mpatch eval` (issue 38): its input checked in one line before any rank starts, the package's place in the
import order, and mpatch starting without lm-eval. What the evaluation computes is tests/test_eval_equality.py's."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patch.convert.checkpoint import hf_to_mcore
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.demo_data import make_texts, make_tokenizer
from tests.convert_helpers import run_cli

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """A tiny Llama with a tokenizer, converted (the tokenizer carried), and converted again without one."""
    root = tmp_path_factory.mktemp("eval")
    hf = make_tiny_hf_checkpoint("llama3_1", root / "hf")
    hf_to_mcore(hf, root / "no_tokenizer", ParallelLayout(), progress=False)
    make_tokenizer(hf, make_texts(200, seed=0))
    hf_to_mcore(hf, root / "ckpt", ParallelLayout(), progress=False)
    return {"root": root, "hf": hf, "ckpt": root / "ckpt", "no_tokenizer": root / "no_tokenizer"}


def _one_line(rc: int, err: str, *words: str) -> None:
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)


def test_a_checkpoint_without_a_tokenizer_needs_one(checkpoints, capsys):
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["no_tokenizer"]), "--tasks", "mpatch_arithmetic")
    _one_line(rc, err, "carries no tokenizer", "--tokenizer")


def test_a_layout_the_model_does_not_divide_is_refused(checkpoints, capsys):
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_arithmetic",
                      "--pp", "3")
    _one_line(rc, err, "PP=3 does not divide")
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_arithmetic",
                      "--ep", "2")
    _one_line(rc, err, "dense model", "set EP=1")


def test_a_task_whose_data_file_is_missing_is_named(checkpoints, tmp_path, capsys):
    missing = tmp_path / "gone.jsonl"
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mine.yaml").write_text(
        "task: my_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(missing) + "\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n")
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "my_task",
                      "--include-path", str(tmp_path / "tasks"), "--output-dir", str(tmp_path / "out"))
    _one_line(rc, err, "task my_task", str(missing), "missing")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # indexing lm-eval's own 14,000 tasks to look for the name takes 10-30 s
def test_an_unknown_task_is_refused(checkpoints, capsys):
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_arithmetic,nonesuch")
    _one_line(rc, err, "unknown task nonesuch")


def test_the_project_tasks_are_local_yaml_with_generated_data(tmp_path):
    """The shipped tasks read their data from local JSON lines (what a user's offline task does too), the same
    documents every time."""
    import yaml

    from megatron_patch.evaluation.tasks import PROJECT_TASKS, write_project_tasks

    first = write_project_tasks(tmp_path / "a")
    again = write_project_tasks(tmp_path / "b")
    for name in PROJECT_TASKS:
        config = yaml.safe_load((first / f"{name}.yaml").read_text())
        assert config["task"] == name and config["dataset_path"] == "json"
        files = config["dataset_kwargs"]["data_files"]
        assert all(Path(f).is_file() and Path(f).parent == first for f in files.values())
    assert sorted(p.read_bytes() for p in first.glob("*.jsonl")) == sorted(p.read_bytes() for p in again.glob("*.jsonl"))
    questions = [json.loads(line) for line in (first / "arithmetic_test.jsonl").read_text().splitlines()]
    assert all(q["choices"][q["label"]] == q["answer"] == str(eval(q["question"][8:-1])) for q in questions)


@pytest.mark.slow  # a fresh interpreter that imports the CLI and converts: 5-15 s
def test_mpatch_and_the_converter_start_without_lm_eval(checkpoints):
    """lm-eval is an optional extra: with it missing, `mpatch --help`, `mpatch eval --help` and a conversion work,
    and `mpatch eval` says in one line what to install (one process, each command's exit status printed)."""
    target = checkpoints["root"] / "converted_without_lm_eval"
    script = f"""
import contextlib, importlib.util, io, sys
sys.modules['lm_eval'] = None  # `import lm_eval` fails, as if it were not installed
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *args: None if name == 'lm_eval' else find_spec(name, *args)
from megatron_patch.cli import main
def status(*argv):
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return main(list(argv))
    except SystemExit as exc:
        return exc.code
print(status('--help'), status('eval', '--help'),
      status('convert', 'hf2mcore', '--hf-dir', {str(checkpoints["hf"])!r}, '--save-dir', {str(target)!r}, '--quiet'),
      status('eval', '--load-dir', {str(checkpoints["ckpt"])!r}, '--tasks', 'mpatch_arithmetic'))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.split() == ["0", "0", "0", "2"], (done.stdout, done.stderr)
    assert (target / "mpatch_manifest.json").is_file()
    refusal = [line for line in done.stderr.splitlines() if line.startswith("mpatch eval:")]
    assert len(refusal) == 1 and "pip install 'megatron_patch[eval]'" in refusal[0] and "lm-eval==0.4.13" in refusal[0]


def test_only_the_cli_and_training_import_the_evaluation_package():
    """evaluation/ sits above models/, the checkpoint loaders and runtime/: nothing there imports it back (training
    evaluates its live model with it, MP_EVAL_TASKS)."""
    upward = []
    for path in sorted((REPO / "megatron_patch").rglob("*.py")):
        if path.parent.name in ("cli", "evaluation", "training"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(n == "megatron_patch.evaluation" or n.startswith("megatron_patch.evaluation.") for n in names):
                upward.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not upward, f"modules below the evaluation package importing it: {upward}"


def test_token_log_likelihoods_over_a_large_vocabulary_stay_near_the_float64_answer():
    """docs/evaluation.md: on SmolLM2's 49152 words, `mpatch eval`'s fp32 log-softmax (maximum, sum of exponentials,
    log) stays within a few 1e-6 of the float64 answer (1.9e-6 here, where torch's fused fp32 kernel, lm-eval's HF
    backend's default, is 7.4e-6 off: the order of its sums depends on the CPU, so only ours is bounded). One rank,
    no process group needed."""
    import torch

    from megatron_patch.evaluation.runner import ModelRunner

    runner = object.__new__(ModelRunner)
    runner.tp_rank, runner.tp_size, runner.vocab_size = 0, 1, 49152
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 64, 49152, generator=generator) * 4
    target = torch.randint(0, 49152, (2, 64), generator=generator)
    ours, greedy = runner._token_logprobs(logits, target)
    exact = torch.log_softmax(logits.double(), -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    assert (ours.double() - exact).abs().max() < 5e-6
    assert torch.equal(greedy, logits.argmax(-1) == target)


def test_a_batch_holds_up_to_its_size_of_distinct_model_inputs():
    """Requests that share their input (a question's one-token choices) count once toward the batch size: the runner
    runs them as one row. Order is kept and every request is in exactly one batch."""
    pytest.importorskip("lm_eval")
    from megatron_patch.evaluation.harness import _batches_of_distinct_inputs

    question = [1, 2, 3]
    requests = [(None, question, [c]) for c in (7, 8, 9)] + [(None, [4, 5], [6, 7]), (None, [4, 5, 6], [8]),
                                                             (None, [9], [9])]
    # [4, 5] + [6, 7] and [4, 5, 6] + [8] both run [4, 5, 6]: one row
    assert list(_batches_of_distinct_inputs(requests, 2)) == [requests[:5], requests[5:]]
    assert list(_batches_of_distinct_inputs(requests, 1)) == [requests[:3], requests[3:5], requests[5:]]
    assert list(_batches_of_distinct_inputs([], 4)) == []


def test_data_parallel_replicas_share_the_scoring_and_give_every_rank_the_same_answers(checkpoints):
    """Two ranks at TP=1 PP=1 are two replicas of the model: each forwards its share of the requests (2 and 3 of
    5 distinct inputs), and both return the answers one process gives for all five. A request too long for the
    model is refused on every rank, whichever share holds it."""
    from megatron_patch.evaluation.loading import open_for_evaluation
    from megatron_patch.runtime.launch import run_local
    from tests.eval_helpers import shared_scoring_worker

    checkpoint = open_for_evaluation(checkpoints["ckpt"], ParallelLayout())
    pairs = [([5, 17, 33, 8], [90]), ([44, 3], [150, 27]), ([7, 7, 120], [3]), ([9, 12, 40, 41, 2], [6, 6]),
             ([11], [12, 13, 14])]
    (alone,) = run_local(shared_scoring_worker, 1, checkpoint, pairs)
    shared = run_local(shared_scoring_worker, 2, checkpoint, pairs)
    assert alone["rows"] == [5] and [r["rows"] for r in shared] == [[2], [3]]
    for rank in shared:
        assert len(rank["answers"]) == 5
        for (ours, greedy), (theirs, their_greedy) in zip(rank["answers"], alone["answers"]):
            assert abs(ours - theirs) <= 1e-5 * max(1.0, abs(theirs)) and greedy == their_greedy
        assert rank["too_long"] and "longer than the model's" in rank["too_long"]



def test_data_parallel_replicas_share_the_generations_and_give_every_rank_the_same_tokens(checkpoints):
    """Two replicas generate 1 and 2 of 3 prompts (one stopped after two tokens by the caller's ``finished``, so
    the replicas' shares end at different steps) and both return what one process generates for all three:
    greedy, and sampled (each prompt draws from its own generator, so the share does not change a draw; another
    seed draws otherwise)."""
    from megatron_patch.evaluation.loading import open_for_evaluation
    from megatron_patch.runtime.launch import run_local
    from tests.eval_helpers import shared_generation_worker

    checkpoint = open_for_evaluation(checkpoints["ckpt"], ParallelLayout())
    prompts = [[5, 17, 33, 8, 90], [44, 3, 150, 27, 9], [7, 7, 120, 3, 66]]
    (alone,) = run_local(shared_generation_worker, 1, checkpoint, prompts, 6)
    shared = run_local(shared_generation_worker, 2, checkpoint, prompts, 6)
    assert set(alone["rows"]) == {3} and [set(r["rows"]) for r in shared] == [{1}, {2}]
    assert len(alone["greedy"][0]) == 2 and [len(t) for t in alone["greedy"][1:]] == [6, 6]
    assert alone["sampled"][0] != alone["sampled"][1]
    for rank in shared:
        assert rank["greedy"] == alone["greedy"] and rank["sampled"] == alone["sampled"]

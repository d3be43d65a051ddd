"""`mpatch eval` (issue 38): its input checked in one line before any rank starts, the package's place in the
import order, and mpatch starting without lm-eval. What the evaluation computes is tests/test_eval_equality.py's."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patch.convert.checkpoint import hf_to_mcore
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.runtime import scratch
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.demo_data import make_texts, make_tokenizer
from megatron_patch.cli import main
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


def test_a_refused_output_dir_leaves_nothing_inside_the_checkpoint(checkpoints, tmp_path, capsys):
    """eval made --output-dir's parent folders before its overlap check: a refused ck/results/r1 left ck/results/ in
    the checkpoint, which then failed its manifest check (the outputs audit)."""
    work = tmp_path / "ck"
    shutil.copytree(checkpoints["ckpt"], work)
    rc, err = run_cli(capsys, "eval", "--load-dir", str(work), "--tasks", "mpatch_arithmetic", "--output-dir",
                      str(work / "results" / "r1"))
    _one_line(rc, err, "overlaps the input", "--output-dir")
    assert not (work / "results").exists()
    assert run_cli(capsys, "verify", str(work))[0] == 0


def test_a_layout_the_model_does_not_divide_is_refused(checkpoints, capsys):
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_arithmetic",
                      "--pp", "3")
    _one_line(rc, err, "PP=3 does not divide")
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_arithmetic",
                      "--ep", "2")
    _one_line(rc, err, "dense model", "set EP=1")


def _local_task(folder: Path, name: str, lines: list[dict], extra: str, *, fewshot: list[dict] | None = None) -> Path:
    """A local YAML task over JSON lines (its few-shot split another file where given)."""
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    files = f"    test: {folder / (name + '.jsonl')}\n"
    if fewshot is not None:
        (folder / f"{name}-shots.jsonl").write_text("".join(json.dumps(line) + "\n" for line in fewshot))
        files += f"    train: {folder / (name + '-shots.jsonl')}\n"
    (folder / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n{files}"
                                         f"test_split: test\n{extra}")
    return folder


GENERATE = ("output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
            "metric_list:\n  - metric: exact_match\n")
QA = [{"question": f"What is {i} plus {i}?", "answer": str(2 * i)} for i in range(4)]


def test_generation_settings_it_would_not_apply_are_refused_before_the_ranks_start(checkpoints, tmp_path, capsys):
    """A generation task's repetition_penalty (num_beams, min_new_tokens, ...) was dropped without a word: plain
    greedy text, every generation other than the HF backend's (the eval audit). Refused in one line; num_beams 1,
    greedy search, is what runs."""
    from megatron_patch.evaluation.tasks import unsupported_generation_settings

    tasks = _local_task(tmp_path / "tasks", "penalised", QA, GENERATE + "generation_kwargs:\n  until: ['\\n']\n"
                        "  repetition_penalty: 3.0\n  num_beams: 1\n  do_sample: false\n")
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "penalised",
                      "--include-path", str(tasks), "--output-dir", str(tmp_path / "out"))
    _one_line(rc, err, "task penalised: its generation_kwargs repetition_penalty are not supported")
    assert not (tmp_path / "out").exists()
    assert unsupported_generation_settings({"until": ["\n"], "max_new_tokens": 4, "num_beams": 1, "top_p": 0.9}) == []
    assert unsupported_generation_settings({"num_beams": 4, "min_new_tokens": 2}) == ["min_new_tokens", "num_beams"]


@pytest.mark.parametrize("case", ["fewshot", "description"])
def test_few_shot_documents_and_the_description_are_rendered_before_the_ranks_start(case, checkpoints, tmp_path,
                                                                                    capsys):
    """A few-shot document with a null field its template reads, or a description naming a field the documents lack,
    was an internal error in every rank (in training, after the first checkpoints): the eval audit."""
    if case == "fewshot":
        extra = GENERATE.replace("{{question}}", "{{question.strip()}}") + "fewshot_split: train\nnum_fewshot: 2\n"
        tasks = _local_task(tmp_path / "tasks", "shots", QA, extra, fewshot=[QA[0], {"question": None, "answer": "1"}])
        said = "few-shot document 2 cannot be rendered"
    else:
        tasks = _local_task(tmp_path / "tasks", "shots", QA, GENERATE + "description: 'About {{ topic.name }}: '\n")
        said = "document 1 cannot be rendered"
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "shots",
                      "--include-path", str(tasks))
    _one_line(rc, err, f"task shots: {said}")


def test_a_task_name_that_is_no_file_name_keeps_its_samples(tmp_path):
    """lm-eval takes a task named qa/v1: writing samples_qa/v1.jsonl failed after the whole evaluation, an internal
    error that lost its results (the eval audit)."""
    from megatron_patch.evaluation.evaluate import EvalResults, write_results

    samples = {"qa/v1": [{"doc_id": 0}], "qa_v1": [{"doc_id": 1}], "plain": [{"doc_id": 2}]}
    write_results(EvalResults({"results": {}}, samples), tmp_path, "mpatch eval")
    written = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("samples_*.jsonl")}
    assert written == {"samples_qa_v1-1.jsonl": {"doc_id": 0}, "samples_qa_v1-2.jsonl": {"doc_id": 1},
                       "samples_plain.jsonl": {"doc_id": 2}}


def test_a_chat_template_that_refuses_a_system_message_is_applied_without_it(checkpoints, capsys):
    """A task's description goes into a system message, which Mistral-Instruct's and Gemma 2's templates refuse: an
    internal error in every rank, where the HF backend leaves the system message out (the eval audit)."""
    from transformers import AutoTokenizer

    from megatron_patch.errors import UserError
    from megatron_patch.evaluation.harness import MpatchLM

    tokenizer = AutoTokenizer.from_pretrained(checkpoints["hf"])
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}"
                               "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    lm = MpatchLM.__new__(MpatchLM)
    lm.tokenizer, lm._system_dropped_said = tokenizer, False
    history = [{"role": "system", "content": "About arithmetic."}, {"role": "user", "content": "1 plus 1?"}]
    assert lm.apply_chat_template(history) == "[user] 1 plus 1?\n"
    assert "refuses a system message" in capsys.readouterr().err
    tokenizer.chat_template = "{{ raise_exception('no template for you') }}"
    with pytest.raises(UserError, match="chat template fails on this task's prompts"):
        lm.apply_chat_template(history)
    # an expression that fails in jinja's sandbox: an internal error in every rank (the hostile audit)
    tokenizer.chat_template = "{{ (1 / 0) }}"
    with pytest.raises(UserError, match=r"fails on this task's prompts \(ZeroDivisionError: division by zero\)"):
        lm.apply_chat_template(history)


def test_a_chat_template_that_fails_is_refused_before_the_model_loads(checkpoints, tmp_path, capsys):
    """--apply-chat-template with a template that fails on any chat: the ranks loaded the model and failed at its
    first prompt (an internal error); it is rendered once before they start (the hostile audit)."""
    import shutil

    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoints["hf"] / name, tokenizer / name)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ (1 / 0) }}"}))
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_arithmetic_choice",
                      "--output-dir", str(tmp_path / "out"), "--tokenizer", str(tokenizer), "--apply-chat-template")
    _one_line(rc, err, "fails on a one-question chat (ZeroDivisionError: division by zero)")
    assert not (tmp_path / "out").exists()


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
    assert len(refusal) == 1 and "pip install -e \".[eval]\" in megatron_patch's repository" in refusal[0] \
        and "lm-eval==0.4.13" in refusal[0], refusal


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


@pytest.fixture(scope="module")
def tokenizers(checkpoints) -> dict:
    """Tokenizer folders other than the tiny model's own (200 ids): a larger vocabulary; its tokenizer.json alone
    (no bos/eos named, "</s>" in its vocabulary); and a tokenizer.json without any end-of-document token."""
    from tokenizers import Tokenizer, models, trainers

    root = checkpoints["root"] / "tokenizers"
    larger = make_tokenizer(root / "larger", make_texts(400, seed=3), vocab_size=240)
    bare = root / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((checkpoints["ckpt"] / "tokenizer.json").read_bytes())
    no_end = root / "no_end"
    no_end.mkdir()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.train_from_iterator(make_texts(50, seed=1), trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>"]))
    tok.save(str(no_end / "tokenizer.json"))
    return {"larger": larger, "bare": bare, "no_end": no_end}


def test_a_tokenizer_beyond_the_models_vocabulary_is_refused(checkpoints, tokenizers, capsys):
    """Ids 200-239 would be scored on megatron's padding rows (perplexity inf, exit 0), ids past them crash a rank."""
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_perplexity",
                      "--tokenizer", str(tokenizers["larger"]))
    _one_line(rc, err, "yields ids beyond the model's vocabulary (200)", "240 ids", "--tokenizer")


def test_a_tokenizer_naming_no_eos_ends_texts_with_its_end_of_document_token(tokenizers):
    """tokenizer.json alone names no bos or eos: the harness's prefix and end of text are the end-of-document token
    the project's tokenizer finds ("</s>"), not None (a TypeError in every rank)."""
    pytest.importorskip("lm_eval")
    from megatron_patch.evaluation.harness import MpatchLM
    from megatron_patch.evaluation.loading import load_hf_tokenizer

    tokenizer = load_hf_tokenizer(tokenizers["bare"])
    assert tokenizer.bos_token_id is None and tokenizer.eos_token_id is None
    lm = MpatchLM(object(), tokenizer)
    end = tokenizer.convert_tokens_to_ids("</s>")
    assert lm.prefix_token_id == lm.eot_token_id == end and end in lm.stop_ids


def test_one_tokenizer_folder_encodes_alike_in_preprocessing_training_and_evaluation(tmp_path):
    """A Qwen3 model's config picks transformers' Qwen2Tokenizer, whose pipeline is not a bare tokenizer.json's:
    evaluation applied the checkpoint's model config to a --tokenizer folder of its own, which preprocessing reads by
    its files alone (other ids for the same text); and training from a converted checkpoint's carried tokenizer read
    it without the model config its HF folder had. Each folder now gives one pipeline wherever it is used."""
    from megatron_patch.evaluation.loading import open_for_evaluation
    from megatron_patch.tokenizer import load_tokenizer

    hf = make_tiny_hf_checkpoint("qwen3", tmp_path / "hf")
    # 190 ids: Qwen2Tokenizer adds <|endoftext|>, which the file lacks, at 190, inside the model's 200
    make_tokenizer(hf, make_texts(200, seed=0), vocab_size=190)
    hf_to_mcore(hf, tmp_path / "ckpt", ParallelLayout(), progress=False)
    own = tmp_path / "tok"
    own.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (own / name).write_bytes((hf / name).read_bytes())
    text = "The cat sat on the mat. A dog ran."
    for folder in (own, tmp_path / "ckpt"):
        evaluated = open_for_evaluation(tmp_path / "ckpt", ParallelLayout(), tokenizer=folder).load_tokenizer()
        assert load_tokenizer(folder).encode(text) == evaluated.encode(text, add_special_tokens=False), folder
    assert load_tokenizer(tmp_path / "ckpt").encode(text) == load_tokenizer(hf).encode(text)
    assert load_tokenizer(own).encode(text) != load_tokenizer(hf).encode(text)  # the two pipelines differ here
    # the tokenizer module names the checkpoint's record without importing the package above it: the same file
    from megatron_patch.checkpoint.sidecar import SIDECAR_NAME
    from megatron_patch.tokenizer import CHECKPOINT_RECORD

    assert CHECKPOINT_RECORD == SIDECAR_NAME


def test_a_tokenizer_without_an_end_of_text_token_is_refused(checkpoints, tokenizers, capsys):
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_perplexity",
                      "--tokenizer", str(tokenizers["no_end"]))
    _one_line(rc, err, "names no end-of-text token", "eos_token")


def test_a_tokenizer_file_linking_outside_its_folder_is_refused(checkpoints, tmp_path, capsys):
    """transformers' AutoTokenizer followed the link and read the outside file (exit 0), whether the folder was
    --tokenizer DIR or the checkpoint's own (another tool's: no manifest to refuse the link)."""
    import shutil

    outside = tmp_path / "elsewhere" / "tokenizer.json"
    outside.parent.mkdir()
    outside.write_bytes((checkpoints["ckpt"] / "tokenizer.json").read_bytes())
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(checkpoints["ckpt"] / "tokenizer_config.json", folder)
    (folder / "tokenizer.json").symlink_to(outside)
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_perplexity",
                      "--tokenizer", str(folder))
    _one_line(rc, err, "'tokenizer.json', which leads outside the folder")
    ckpt = shutil.copytree(checkpoints["ckpt"], tmp_path / "ckpt")
    (ckpt / "mpatch_manifest.json").unlink()
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "tokenizer.json").symlink_to(outside)
    rc, err = run_cli(capsys, "eval", "--load-dir", str(ckpt), "--tasks", "mpatch_perplexity")
    _one_line(rc, err, "'tokenizer.json', which leads outside the folder")



def test_lm_evals_hf_backend_gets_no_folder_whose_files_lead_outside(checkpoints, tmp_path):
    """scripts/eval_vs_hf.py's reference run handed the folder to lm-eval, whose transformers followed the link."""
    import shutil

    pytest.importorskip("lm_eval")
    from megatron_patch.errors import UserError
    from megatron_patch.evaluation.equality import evaluate_hf_backend
    from megatron_patch.evaluation.evaluate import EvalSettings

    hf = shutil.copytree(checkpoints["hf"], tmp_path / "hf")
    (tmp_path / "tokenizer.json").write_bytes((hf / "tokenizer.json").read_bytes())
    (hf / "tokenizer.json").unlink()
    (hf / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    with pytest.raises(UserError, match="'tokenizer.json', which leads outside the folder"):
        evaluate_hf_backend(str(hf), EvalSettings(tasks=("mpatch_perplexity",), limit=1), [])


def test_a_document_limit_past_any_count_is_every_document():
    """--limit 1e30 (or MP_EVAL_TASKS_LIMIT) passed the check and stopped every rank in lm-eval's islice, in training
    at the first evaluation (the tools audit)."""
    import sys

    from megatron_patch.evaluation import document_limit

    assert document_limit("--limit", 1e30) == sys.maxsize and document_limit("--limit", 2.0 ** 70) == sys.maxsize
    assert document_limit("--limit", 12.0) == 12 and document_limit("--limit", 0.25) == 0.25


@pytest.mark.parametrize("flags,message", [
    (["--limit", "nan"], "--limit must be > 0"),
    (["--limit", "inf"], "--limit must be a whole number of documents, or a fraction below 1"),
    (["--limit", "1.5"], "--limit must be a whole number of documents, or a fraction below 1"),
    (["--seed", "-1"], "--seed must be in 0..4294967295"),
    (["--seed", str(2 ** 32)], "--seed must be in 0..4294967295"),
    (["--num-fewshot", "-1"], "--num-fewshot must be >= 0"),
    (["--bootstrap-iters", "-1"], "--bootstrap-iters must be >= 0"),
    (["--fewshot-as-multiturn"], "it needs --apply-chat-template"),
    (["--include-path", "FILE"], "is not a folder"),
    (["--apply-chat-template"], "has no chat template"),
    (["--num-fewshot", "100000"], "task mpatch_arithmetic_choice: --num-fewshot 100000, but it has 40 few-shot"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_arguments_lm_eval_cannot_run_are_refused_in_one_line(checkpoints, tmp_path, capsys, flags, message):
    """Each crashed after the model loaded (or ran something else than asked: --limit 1.5 ran 1 document,
    --fewshot-as-multiturn without a chat did nothing) instead of exit 2 before any rank starts."""
    (tmp_path / "tasks.yaml").write_text("")
    flags = [str(tmp_path / "tasks.yaml") if f == "FILE" else f for f in flags]
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_arithmetic_choice",
                      "--output-dir", str(tmp_path / "out"), *flags)
    _one_line(rc, err, message)
    assert not (tmp_path / "out").exists()


BROKEN_TASKS = {
    # name: (data lines, doc_to_target, metric, what the refusal says); each was an internal error, exit 1
    "t_empty": ([], "{{cont}}", "acc", "is empty"),
    "t_unknown_metric": ([{"ctx": "a ", "cont": "b"}] * 3, "{{cont}}", "acc_typo", "cannot build it"),
    "t_missing_field": ([{"ctx": "a ", "cont": "b"}] * 3, "{{answer}}", "acc", "'answer' is undefined"),
    "t_third_document": ([{"ctx": "a ", "cont": "b"}] * 2 + [{"ctx": "a "}], "{{cont.upper()}}", "acc",
                         "document 3 cannot be rendered"),  # (the datasets library gives it cont: None)
    # with target_delimiter '' (below), an empty answer scored log-likelihood 0 over no tokens: acc 1.0, exit 0
    "t_empty_continuation": ([{"ctx": "a ", "cont": "b"}, {"ctx": "a ", "cont": ""}], "{{cont}}", "acc",
                             "document 2's continuation is empty"),
}


@pytest.mark.parametrize("task", list(BROKEN_TASKS))
def test_a_broken_task_of_the_users_is_bad_input_named_before_any_rank(checkpoints, tmp_path, capsys, task):
    import json

    lines, target, metric, message = BROKEN_TASKS[task]
    (tmp_path / "tasks").mkdir()
    data = tmp_path / "tasks" / "data.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "tasks" / f"{task}.yaml").write_text(
        f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        f"output_type: loglikelihood\ndoc_to_text: '{{{{ctx}}}}'\ndoc_to_target: '{target}'\n"
        f"target_delimiter: ''\nmetric_list:\n  - metric: {metric}\n")
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", task,
                      "--include-path", str(tmp_path / "tasks"))
    _one_line(rc, err, f"task {task}", message)


def test_seed_draws_the_sampled_generations(checkpoints, tmp_path, capsys):
    """A sampled task (do_sample, temperature 1) drew from a generator seeded by the task's own seed or 1234, not
    by --seed: --seed 1 and --seed 2 gave the same texts. Now they differ, and --seed 1 again gives --seed 1's."""
    pytest.importorskip("lm_eval")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "data.jsonl").write_text("".join(json.dumps({"q": q}) + "\n" for q in
                                              ("Her brother paints a quiet", "The old man", "A small dog", "They sing")))
    (tasks / "t_sampled.yaml").write_text(
        f"task: t_sampled\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'data.jsonl'}\n"
        "test_split: test\noutput_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: 'x'\n"
        "generation_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 8\n  do_sample: true\n  temperature: 1.0\n"
        "metric_list:\n  - metric: exact_match\n")

    def generations(seed: int, out: str) -> list[str]:
        rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "t_sampled",
                          "--include-path", str(tasks), "--seed", str(seed), "--output-dir", str(tmp_path / out),
                          "--log-samples", "--quiet")
        assert rc == 0, err
        samples = (tmp_path / out / "samples_t_sampled.jsonl").read_text().splitlines()
        return [json.loads(line)["resps"][0][0] for line in samples]

    first, second, again = generations(1, "a"), generations(2, "b"), generations(1, "c")
    assert first != second and first == again, (first, second)


def test_a_log_gets_no_progress_bars_quiet_or_not(checkpoints, capfd):
    """lm-eval's bars (a request bar per task, "Tokenizing inputs"; tqdm frames joined by carriage returns) went to
    stderr under --quiet ("no progress messages") and into every batch log: a bar is drawn on a terminal only."""
    pytest.importorskip("lm_eval")
    for quiet in (["--quiet"], []):
        assert main(["eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_arithmetic_choice",
                     "--limit", "4", *quiet]) == 0
        err = capfd.readouterr().err  # the ranks' stderr too: they write to the file descriptor they inherit
        assert "\r" not in err and "it/s" not in err, (quiet, err)


def test_generation_stops_where_the_models_own_generation_config_says(tmp_path, tokenizers):
    """lm-eval's HF backend stops at the eos ids of the model's generation_config.json, else of its config.json:
    mpatch eval read generation_config.json from the tokenizer's folder alone, and went on past the model's eos
    where its ids were in config.json only, or where --tokenizer named a folder of the tokenizer alone."""
    import json

    pytest.importorskip("lm_eval")
    from megatron_patch.evaluation.harness import MpatchLM
    from megatron_patch.evaluation.loading import generation_stop_ids, load_hf_tokenizer

    assert generation_stop_ids({"eos_token_id": [5, 6]}, tmp_path) == {5, 6}
    assert generation_stop_ids({"text_config": {"eos_token_id": 7}}, None) == {7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert generation_stop_ids({"eos_token_id": [5, 6]}, tmp_path) == {9}
    lm = MpatchLM(object(), load_hf_tokenizer(tokenizers["bare"]), model_stop_ids=frozenset({9}))
    assert 9 in lm.stop_ids and lm.eot_token_id in lm.stop_ids


def test_few_shot_examples_are_drawn_from_what_a_task_has(tmp_path):
    """The shipped tasks hold 40 training documents: 40 shots are drawn, 41 are refused before any rank starts."""
    pytest.importorskip("lm_eval")
    from megatron_patch.errors import UserError
    from megatron_patch.evaluation.evaluate import EvalSettings, prepare_tasks
    from megatron_patch.evaluation.tasks import CHOICE

    prepare_tasks(EvalSettings(tasks=(CHOICE,), num_fewshot=40), tmp_path / "a")
    with pytest.raises(UserError, match="--num-fewshot 41, but it has 40 few-shot examples"):
        prepare_tasks(EvalSettings(tasks=(CHOICE,), num_fewshot=41), tmp_path / "b")


def test_an_hf_config_the_checkpoint_ignores_is_said(checkpoints, tmp_path, capsys):
    """--hf-config describing another model than the checkpoint's sidecar is ignored: said as a warning, as `mpatch
    convert` says it (here before the refusal of an --output-dir mpatch did not write, which ends the run early)."""
    config = json.loads((checkpoints["hf"] / "config.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(
        {**config, "num_attention_heads": 8, "head_dim": 8, "num_key_value_heads": 4}))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("not mpatch's")
    rc, err = run_cli(capsys, "eval", "--load-dir", str(checkpoints["ckpt"]), "--tasks", "mpatch_arithmetic_choice",
                      "--hf-config", str(tmp_path / "other" / "config.json"), "--output-dir", str(tmp_path / "out"))
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert rc == 2 and len(warnings) == 1 and "--output-dir" in err.splitlines()[-1], err
    assert "is ignored" in warnings[0] and "num_heads: config 8, sidecar 4" in warnings[0], err


@pytest.mark.slow  # two evaluations in a fresh interpreter (the datasets cache is read once, at import): 20-40 s
def test_the_project_tasks_leave_nothing_in_the_datasets_cache(checkpoints, tmp_path):
    """Each evaluation writes the shipped tasks into a new folder, so their data's cache key was new every time: the
    user's datasets cache grew an entry per run, never read again. Two runs leave it as it was."""
    cache = tmp_path / "hf" / "datasets"
    script = f"""
from megatron_patch.cli import main
for _ in range(2):
    print(main(['eval', '--load-dir', {str(checkpoints["ckpt"])!r}, '--tasks', 'mpatch_arithmetic_choice',
                '--limit', '1', '--quiet']))
"""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_DATASETS_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env)
    assert [line for line in done.stdout.splitlines() if line in ("0", "1", "2")] == ["0", "0"], done.stderr
    assert not cache.exists() or not any(cache.iterdir()), sorted(p.name for p in cache.iterdir())


def test_sigterm_stops_an_evaluation_as_ctrl_c_does_leaving_nothing(checkpoints, tmp_path):
    """SIGTERM (a time limit, a cancelled job) killed `mpatch eval` by the signal, without a word, leaving its
    generated task data in TMPDIR each time; it now unwinds as Ctrl-C does: 130, one line, nothing left."""
    import signal
    import time

    tmp, out = tmp_path / "tmp", tmp_path / "results"
    tmp.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "megatron_patch", "eval", "--load-dir", str(checkpoints["ckpt"]),
                             # generation too: the whole run long enough (10 s without it, idle) that the signal
                             # lands inside it, not after the results are out (then the default SIGTERM ends it)
                             "--tasks", "mpatch_perplexity,mpatch_arithmetic_choice,mpatch_arithmetic",
                             "--limit", "200", "--output-dir", str(out)], cwd=REPO,
                            env={**os.environ, "TMPDIR": str(tmp)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    start = time.time()
    # a loaded CI machine takes minutes to import and read the checkpoint
    tasks = f"{scratch.PREFIX}eval-tasks-"
    while not any(p.name.startswith(tasks) for p in tmp.iterdir()) and time.time() < start + 600:
        assert proc.poll() is None, f"the evaluation ended (rc {proc.returncode}) before its tasks folder was seen"
        time.sleep(0.2)
    time.sleep(0.5)  # into the evaluation
    waited = time.time() - start
    assert proc.poll() is None, f"the evaluation ended (rc {proc.returncode}) {waited:.0f} s in, before it was stopped"
    os.killpg(proc.pid, signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "mpatch eval: interrupted", err[-2000:]
    assert not any(p.name.startswith(scratch.PREFIX) for p in tmp.iterdir()), sorted(tmp.iterdir())
    assert not out.exists()


def test_sigterm_inside_code_run_from_a_string_still_exits_130(tmp_path):
    """The test above sometimes saw the process die by SIGINT (rc -2) after its "interrupted" line: when the
    signal's KeyboardInterrupt passed through code run from a string (a dataclass made by a late import), CPython
    remembered it as unhandled and, under ``python -m``, re-raised SIGINT at exit. Here the signal lands there
    every time."""
    _sigterm_stops_it(tmp_path, """
import os, signal, sys

def run():
    exec("os.kill(os.getpid(), signal.SIGTERM)\\nwhile True: pass")
""")


def test_sigterm_inside_a_finalizer_still_stops_the_command(tmp_path):
    """A SIGTERM whose Terminated was raised inside a finalizer (seen in `mpatch align`, inside regex's
    Group.__del__) was printed as 'Exception ignored' and dropped: the command ran to the end, wrote its report and
    exited 0. The signal is taken again once the finalizer is left; here it lands in one every time."""
    _sigterm_stops_it(tmp_path, """
import os, signal, sys, time

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100000):  # the handler runs here, inside the finalizer
            pass

def run():
    Finalized()  # collected at once
    end = time.time() + 30
    while time.time() < end:  # the command's work goes on
        pass
    print("ran to the end", file=sys.stderr)
""")


def _sigterm_stops_it(tmp_path, command: str) -> None:
    """``command`` (a module source defining ``run``, which sends itself SIGTERM) run with ``python -m`` under
    ``sigterm_as_interrupt`` and caught as megatron_patch.cli.main catches it: exit 130 and the one line."""
    (tmp_path / "sigterm_probe.py").write_text("from megatron_patch.cli.common import sigterm_as_interrupt\n" + command
                                               + """
try:
    sigterm_as_interrupt(run)()
except KeyboardInterrupt:  # as megatron_patch.cli.main takes it
    print("interrupted", file=sys.stderr)
    sys.exit(130)
""")
    done = subprocess.run([sys.executable, "-m", "sigterm_probe"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 130 and done.stderr.strip() == "interrupted", (done.returncode, done.stderr[-2000:])


def _fake_results(iteration: int):
    from megatron_patch.evaluation.evaluate import EvalResults

    return EvalResults({"results": {"t": {"alias": "t", "acc,none": 0.25 * iteration}}}, {})


@pytest.mark.parametrize("log,said", [
    # the only losses matplotlib would draw: its ticks fail ("arange: cannot compute length")
    ('{"iteration": 15, "loss": 1e308}\n{"iteration": 20, "loss": Infinity}\n',
     "note: the plot leaves out the training loss at iteration 15, 20"),
    (None, "warning: no plot: drawing metrics.png failed (RuntimeError: drawn badly)"),
])
def test_all_iterations_publishes_the_results_whatever_the_plot_meets(tmp_path, capsys, monkeypatch, log, said):
    """The run's log/metrics.jsonl is untrusted: losses matplotlib cannot draw are left out of the plot, said in
    a note; and a plot that fails all the same is one warning, never the loss of every iteration's results."""
    pytest.importorskip("lm_eval")
    import types

    from megatron_patch.cli import eval as eval_cli
    from megatron_patch.evaluation import iterations, loading

    run = tmp_path / "run"
    for name in ("iter_0000001", "iter_0000002"):
        (run / "checkpoint" / name).mkdir(parents=True)
    (run / "log").mkdir()
    (run / "log" / "metrics.jsonl").write_text(log or '{"iteration": 1, "loss": 5.0}\n')
    # the rank jobs are not what is under test: each iteration "evaluates" to a number of its own
    monkeypatch.setattr(loading, "open_for_evaluation", lambda folder, layout, *a, **k: types.SimpleNamespace(
        load_dir=str(folder), notes=(), layout=layout, layout_note=None))
    monkeypatch.setattr(eval_cli, "_evaluate", lambda args, layout, settings, checkpoint: _fake_results(
        int(Path(checkpoint.load_dir).name[5:])))
    if log is None:
        def failing(*args):
            raise RuntimeError("drawn badly")
        monkeypatch.setattr(iterations, "plot", failing)
    out = tmp_path / "out"
    rc, err = run_cli(capsys, "eval", "--load-dir", str(run / "checkpoint"), "--all-iterations", "--tasks", "t",
                      "--output-dir", str(out), "--quiet")
    assert rc == 0 and said in err, err
    summary = json.loads((out / "all_iterations.json").read_text())
    assert [p["metrics"] for p in summary["iterations"]] == [{"t/acc": 0.25}, {"t/acc": 0.5}]
    assert (out / "iter_0000002" / "results.json").is_file() and (out / "metrics.png").exists() == bool(log)


@pytest.mark.parametrize("target", ["outside", "sibling"])
def test_all_iterations_refuses_an_iteration_that_is_a_symlink(tmp_path, capsys, monkeypatch, target):
    """A run folder is untrusted: checkpoint/iter_0000006 linking to a folder outside the run (or to another of its
    iterations) was evaluated and plotted as the run's iteration 6, where `mpatch verify` refuses the link. Refused
    in one line before any checkpoint is opened."""
    pytest.importorskip("lm_eval")
    from megatron_patch.evaluation import loading

    run = tmp_path / "run" / "checkpoint"
    (run / "iter_0000002").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere" / "iter"
    elsewhere.mkdir(parents=True)
    (run / "iter_0000006").symlink_to(elsewhere if target == "outside" else run / "iter_0000002")
    opened = []
    monkeypatch.setattr(loading, "open_for_evaluation", lambda folder, *a, **k: opened.append(folder))
    rc, err = run_cli(capsys, "eval", "--load-dir", str(run), "--all-iterations", "--tasks", "t",
                      "--output-dir", str(tmp_path / "out"), "--quiet")
    _one_line(rc, err, f"{run / 'iter_0000006'} is a symlink")
    assert not opened and not (tmp_path / "out").exists()


def test_the_recorded_command_reproduces_every_option_as_given():
    """results.json's command is the evaluation to rerun: it wrote `--limit 4.0` for `--limit 4` and dropped
    `--bootstrap-iters`, so the rerun computed other standard errors. Parsed again, it gives the same options."""
    import shlex

    from megatron_patch.cli import build_parser
    from megatron_patch.cli.eval import command_line

    parser = build_parser("eval")
    given = ["eval", "--load-dir", "ckpt dir", "--tasks", "a,b", "--include-path", "tasks", "--limit", "4",
             "--num-fewshot", "2", "--batch-size", "3", "--tp", "2", "--pp", "2", "--ep", "1", "--dtype", "bf16",
             "--tokenizer", "tok", "--hf-config", "config.json", "--base-dir", "base", "--output-dir", "out",
             "--seed", "7",
             "--bootstrap-iters", "0", "--log-samples", "--apply-chat-template", "--fewshot-as-multiturn",
             "--no-kv-cache", "--no-verify", "--force", "--all-iterations"]
    args = parser.parse_args(given)
    recorded = command_line(args)
    assert "--limit 4 " in recorded, recorded
    assert vars(parser.parse_args(shlex.split(recorded)[1:])) == vars(args), recorded
    assert "--limit 0.25 " in command_line(parser.parse_args(["eval", "--load-dir", "c", "--tasks", "a",
                                                               "--limit", "0.25"]))

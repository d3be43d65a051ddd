"""The tasks an evaluation runs: lm-eval's own, local YAML under ``--include-path``, and the three this project
ships for the quick start and the tests, all read without network (``HF_DATASETS_OFFLINE=1``).

The shipped tasks are local YAML tasks like any a user writes (``dataset_path: json`` with ``data_files``), whose
data is generated here, deterministically, from the demo corpus's grammar and from arithmetic:

- ``mpatch_perplexity``: held-out documents of the demo grammar, scored by ``loglikelihood_rolling`` (word and
  byte perplexity, bits per byte);
- ``mpatch_arithmetic_choice``: "What is a + b?" with four numbers to choose from (multiple choice: acc, acc_norm);
- ``mpatch_arithmetic``: the same questions answered by greedy generation (exact match).

They are written, with absolute ``data_files``, into a folder the evaluation owns (``write_project_tasks``), since
lm-eval reads a relative ``data_files`` from the current folder, not from the YAML's.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path

from megatron_patch.errors import UserError
from megatron_patch.demo_data import make_texts

# lm-eval (1-2 s to import, an optional extra) and its datasets are imported inside the functions that use them:
# `mpatch eval --help` and the package's other users start without it.

PERPLEXITY, CHOICE, GENERATION = "mpatch_perplexity", "mpatch_arithmetic_choice", "mpatch_arithmetic"
PROJECT_TASKS = (PERPLEXITY, CHOICE, GENERATION)
_HELD_OUT_SEED = 7919  # the demo corpus is make_texts(..., seed=0): these documents are not in it
_DOCUMENTS = 40
_QUESTIONS = 40


def offline() -> None:
    """Never reach for the network: every dataset is read from local files (set before `datasets` is imported,
    which reads it once)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"  # a bar per split of every task: lm-eval's own bars show progress


def _arithmetic(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    questions = []
    for _ in range(count):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        answer = a + b
        wrong = rng.sample([answer + d for d in (-11, -10, -2, -1, 1, 2, 10, 11) if answer + d > 0], 3)
        choices = [str(answer)] + [str(w) for w in wrong]
        rng.shuffle(choices)
        questions.append({"question": f"What is {a} + {b}?", "choices": choices, "label": choices.index(str(answer)),
                          "answer": str(answer)})
    return questions


def _write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_project_tasks(folder: str | Path) -> Path:
    """The shipped tasks' YAML and data in ``folder`` (made if missing); returns it, for the include path."""
    # yaml: imported only when the shipped tasks are written
    import yaml

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    texts = make_texts(2 * _DOCUMENTS, seed=_HELD_OUT_SEED)
    documents = {"train": _write_jsonl(folder / "perplexity_train.jsonl", [{"text": t} for t in texts[:_DOCUMENTS]]),
                 "test": _write_jsonl(folder / "perplexity_test.jsonl", [{"text": t} for t in texts[_DOCUMENTS:]])}
    questions = {"train": _write_jsonl(folder / "arithmetic_train.jsonl", _arithmetic(1, _QUESTIONS)),
                 "test": _write_jsonl(folder / "arithmetic_test.jsonl", _arithmetic(2, _QUESTIONS))}
    common = {"dataset_path": "json", "training_split": "train", "test_split": "test", "fewshot_split": "train",
              "metadata": {"version": 1.0}}
    # The data files' paths are the cache's key, and they change with every folder: an entry in the user's cache
    # (HF_DATASETS_CACHE) would never be read again, so the cache goes away with the folder.
    cache = {"cache_dir": str(folder.absolute() / "datasets_cache")}
    configs = {
        PERPLEXITY: {**common, "dataset_kwargs": {"data_files": documents, **cache},
                     "output_type": "loglikelihood_rolling",
                     "doc_to_text": "", "doc_to_target": "{{text}}",
                     "metric_list": [{"metric": m, "aggregation": a, "higher_is_better": False} for m, a in (
                         ("word_perplexity", "weighted_perplexity"), ("byte_perplexity", "weighted_perplexity"),
                         ("bits_per_byte", "bits_per_byte"))]},
        CHOICE: {**common, "dataset_kwargs": {"data_files": questions, **cache}, "output_type": "multiple_choice",
                 "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_choice": "choices", "doc_to_target": "label",
                 "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                                 {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]},
        GENERATION: {**common, "dataset_kwargs": {"data_files": questions, **cache}, "output_type": "generate_until",
                     "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_target": " {{answer}}",
                     "generation_kwargs": {"until": ["\n", "Question:"], "max_gen_toks": 8, "do_sample": False},
                     "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                                      "ignore_case": True, "regexes_to_ignore": [" "]}]},
    }
    for name, config in configs.items():
        (folder / f"{name}.yaml").write_text(yaml.safe_dump({"task": name, **config}, sort_keys=False))
    return folder


def task_manager(include_paths: list[str | Path], names: list[str]):
    """lm-eval's TaskManager over ``include_paths`` (each a folder of YAML that must exist), and lm-eval's own
    tasks unless those folders hold every task of ``names``: indexing lm-eval's 14,000 tasks takes 10-30 s."""
    from lm_eval.tasks import TaskManager

    for path in include_paths:
        check_include_path(path)
    local = TaskManager(include_path=[str(p) for p in include_paths], include_defaults=False)
    if all(name in local.all_tasks for name in names):
        return local
    return TaskManager(include_path=[str(p) for p in include_paths])


def check_include_path(path: str | Path) -> None:
    """An include path is a folder: lm-eval walks a file given there as an empty folder, without a word."""
    if not Path(path).is_dir():
        what = "is not a folder" if Path(path).exists() else "does not exist"
        raise UserError(f"--include-path {path} {what}: give a folder of lm-eval task YAML files")


def check_tasks(names: list[str], manager) -> None:
    """Refuse, in one line, a task lm-eval does not know or one whose local data file is missing (named)."""
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserError(f"unknown task {', '.join(unknown)}: lm-eval knows {len(known)} tasks and groups (`lm_eval "
                        "ls tasks` lists them); local YAML tasks need --include-path DIR (in training: "
                        "MP_EVAL_INCLUDE_PATH)")
    for name in names:
        entry = manager.task_index.get(name)
        for path in _data_files((entry.cfg or {}) if entry is not None else {}):
            if not Path(path).exists():
                raise UserError(f"task {name}: its data file {path} is missing")
            if Path(path).is_file() and Path(path).stat().st_size == 0:  # the datasets library fails on it
                raise UserError(f"task {name}: its data file {path} is empty")


def _data_files(config: dict) -> list[str]:
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        files = [f for v in files.values() for f in (v if isinstance(v, list) else [v])]
    elif isinstance(files, str):
        files = [files]
    return [f for f in files or [] if isinstance(f, str) and not any(c in f for c in "*?[")]


def load_tasks(names: list[str], manager) -> dict:
    """lm-eval's task dict for ``names``, their data read now: a dataset that cannot be read offline is one line."""
    from lm_eval.tasks import get_task_dict

    try:
        return get_task_dict(names, manager)
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as exc:
        first = _first_line(exc) or type(exc).__name__
        raise UserError(f"tasks {', '.join(names)}: their data could not be read here, offline ({first}): give the "
                        "data as local files (dataset_path: json, data_files) under --include-path (in "
                        "training: MP_EVAL_INCLUDE_PATH)")
    except Exception as exc:  # noqa: BLE001 - lm-eval builds a task from its YAML and fails on a wrong one any way
        failing = next((n for n in names if _fails_to_load(n, manager)), ", ".join(names))
        raise UserError(f"task {failing}: lm-eval cannot build it from its definition ({type(exc).__name__}: "
                        f"{_first_line(exc)}): check its metric_list and fields against lm-eval's task guide") from None


def _fails_to_load(name: str, manager) -> bool:
    from lm_eval.tasks import get_task_dict

    try:
        get_task_dict([name], manager)
    except Exception:  # noqa: BLE001 - as above
        return True
    return False


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


# A task's documents rendered before any rank starts, at most this many: a field a template names and a document
# lacks fails there in one line, not in every rank as an internal error.
DOCUMENTS_CHECKED = 1000


def check_documents(task_dict: dict) -> None:
    """Refuse, in one line, a task (of ``load_tasks``' dict) without documents to evaluate, or whose templates
    (doc_to_text, doc_to_target, doc_to_choice, its description) fail on one of its first ``DOCUMENTS_CHECKED``
    documents (its few-shot documents: ``check_fewshot``)."""
    for name, task in _leaf_tasks(task_dict):
        docs = list(itertools.islice(task.eval_docs, DOCUMENTS_CHECKED))
        if not docs:
            raise UserError(f"task {name}: it has no documents to evaluate")
        for number, doc in enumerate(docs, 1):
            try:
                task.doc_to_text(doc)
                target = task.doc_to_target(doc)
                continuations = [target] if task.OUTPUT_TYPE == "loglikelihood" else \
                    task.doc_to_choice(doc) if task.OUTPUT_TYPE == "multiple_choice" else []
                task.resolve_field(doc, task.config.description)  # the system message lm-eval builds of it
            except Exception as exc:  # noqa: BLE001 - jinja, a user's Python function: anything at all
                raise UserError(f"task {name}: document {number} cannot be rendered ({type(exc).__name__}: "
                                f"{_first_line(exc)}): fix the task's doc_to_text/doc_to_target/doc_to_choice/"
                                "description or its data") from None
            # lm-eval scores target_delimiter + each continuation: an empty one has no tokens, log-likelihood 0 and
            # a perfect score (the HF backend fails an assertion on it)
            if any(isinstance(c, str) and not task.config.target_delimiter + c for c in continuations):
                raise UserError(f"task {name}: document {number}'s continuation is empty (its target or a choice "
                                "renders to '' and target_delimiter is ''): nothing to score; fix the task's "
                                "doc_to_target/doc_to_choice or its data")


def _check_fewshot_documents(name: str, task) -> None:
    """The few-shot documents a task draws from, rendered as lm-eval renders them into every prompt: one that fails
    was an internal error in every rank, or in a training run after its first checkpoints (the eval audit)."""
    sampler = getattr(task, "sampler", None)
    docs = list(itertools.islice(sampler.fewshot_docs(), DOCUMENTS_CHECKED)) if sampler is not None else []
    cfg = task.fewshot_cfg
    for number, doc in enumerate(docs, 1):
        try:
            task.doc_to_text(doc, cfg.doc_to_text)
            task.doc_to_target(doc, cfg.doc_to_target)
            if cfg.doc_to_choice:
                task.doc_to_choice(doc, cfg.doc_to_choice)
        except Exception as exc:  # noqa: BLE001 - as in check_documents
            raise UserError(f"task {name}: few-shot document {number} cannot be rendered ({type(exc).__name__}: "
                            f"{_first_line(exc)}): fix the task's templates or its few-shot split's data") from None


# The generation settings of a task (its generation_kwargs) that mpatch eval runs as the HF backend does: the
# stop sequences, the length (any of lm-eval's aliases), greedy or sampled with temperature, top-k, top-p and a seed.
GENERATION_SETTINGS = frozenset({"until", "max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens",
                                 "do_sample", "temperature", "top_k", "top_p", "seed"})


def unsupported_generation_settings(gen_kwargs: dict) -> list[str]:
    """The settings of ``gen_kwargs`` that mpatch eval would not apply (num_beams 1 is greedy search: applied)."""
    return sorted(k for k, v in gen_kwargs.items()
                  if k not in GENERATION_SETTINGS and not (k == "num_beams" and v == 1))


def check_generation_settings(task_dict: dict) -> None:
    """Refuse, in one line, a generation task asking for what mpatch eval does not do (beam search, a repetition
    penalty, min_new_tokens, ...): each was dropped without a word, and the text differed from the HF backend's."""
    for name, task in _leaf_tasks(task_dict):
        if task.OUTPUT_TYPE != "generate_until":
            continue
        unsupported = unsupported_generation_settings(dict(task.config.generation_kwargs or {}))
        if unsupported:
            raise UserError(f"task {name}: its generation_kwargs {', '.join(unsupported)} are not supported by mpatch "
                            f"eval (it generates with {', '.join(sorted(GENERATION_SETTINGS))}): remove them from the "
                            "task, or evaluate it with lm-eval's HF backend on an export")


def check_fewshot(task_dict: dict, num_fewshot: int | None) -> None:
    """Refuse, in one line, a task of lm-eval's ``task_dict`` (``load_tasks``) asked for more few-shot examples than
    it has to draw from (lm-eval's sampler would fail on every rank: "Sample larger than population").
    ``num_fewshot``: --num-fewshot, which overrides a task's own number unless the task sets 0."""
    for name, task in _leaf_tasks(task_dict):
        own = task.get_config("num_fewshot")
        wanted = num_fewshot if num_fewshot is not None and own != 0 else own or 0
        if wanted == 0:
            continue
        _check_fewshot_documents(name, task)
        sampler = getattr(task, "sampler", None)  # lm-eval makes none for a task without few-shot documents
        pool = len(sampler.fewshot_docs()) if sampler is not None else 0
        # examples drawn from the test split leave out the document they are for: one fewer to draw from
        most = max(0, pool - 1) if task.fewshot_cfg.split == task.config.test_split else pool
        if wanted > most:
            asked = f"--num-fewshot {wanted}" if num_fewshot is not None else f"its num_fewshot {wanted}"
            raise UserError(f"task {name}: {asked}, but it has {most} few-shot examples to draw from: give "
                            f"--num-fewshot {most}" + (" or fewer" if most else ""))


def _leaf_tasks(task_dict: dict):
    """(name, task) of every task in lm-eval's task dict, whose groups hold dicts of their tasks."""
    for key, value in task_dict.items():
        if isinstance(value, dict):
            yield from _leaf_tasks(value)
        else:
            yield str(key), value

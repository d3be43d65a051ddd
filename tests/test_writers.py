"""One rule for every writer (issue 34): each writer that megatron_patch/outputs/writers.py lists, and
docs/outputs.md's table names, refuses what mpatch did not write at its output (--force or not) and a
lock that is not a plain file, leaving both as they were, and takes an earlier output of its own: replaced
with --force, resumed for a training run."""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME
from megatron_patch.convert.checkpoint import hf_to_mcore
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.outputs.lock import lock_path
from megatron_patch.outputs.writers import WRITERS
from megatron_patch.runtime.distributed import ParallelLayout
from tests.convert_helpers import run_cli
from tests.training_helpers import launcher_args, make_tiktoken_file

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    """What the writers read, in a folder of its own: a tiny HF model, its MCore checkpoint, a JSONL file with
    a tokenizer, and data files the launcher's checks accept."""
    root = tmp_path_factory.mktemp("inputs")
    from megatron_patch.demo_data import make_texts, make_tokenizer

    hf = make_tiny_hf_checkpoint("llama3_1", root / "hf", seed=1)
    make_tokenizer(hf, make_texts(100, seed=1))  # a real one: eval loads it before any rank starts
    ckpt = root / "ckpt"
    hf_to_mcore(hf, ckpt, ParallelLayout(), progress=False)
    jsonl = root / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)))
    import numpy
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(root / "corpus_text_document.bin"), dtype=numpy.uint16)
    builder.add_document(numpy.arange(1, 9, dtype=numpy.uint16), [8])
    builder.finalize(str(root / "corpus_text_document.idx"))
    return {"hf": hf, "ckpt": ckpt, "jsonl": jsonl, "tok": make_tiktoken_file(root / "tok.tiktoken", []),
            "corpus": root / "corpus_text_document"}


class Folder:
    """A writer whose output is a folder it publishes whole; ``argv(out)`` runs it into ``out``."""
    resumes = False

    def __init__(self, argv):
        self.argv = argv

    def target(self, root: Path) -> Path:
        return root / "out"

    def plant(self, target: Path) -> None:
        target.mkdir()
        (target / "precious.txt").write_text("keep me")

    def run(self, capsys, target: Path, force: bool) -> tuple[int, str]:
        return run_cli(capsys, *self.argv(target), "--quiet", *(["--force"] if force else []))

    def earlier(self, capsys, target: Path) -> None:
        rc, err = self.run(capsys, target, force=False)
        assert rc == 0, err

    def taken(self, target: Path, before: dict) -> None:
        """The earlier output was replaced: a manifest that lists every file there is again."""
        manifest = json.loads((target / MANIFEST_NAME).read_text())
        assert set(manifest["files"]) == {p.relative_to(target).as_posix() for p in target.rglob("*")
                                          if p.is_file() and p.name != MANIFEST_NAME}


class Align(Folder):
    """The alignment itself is replaced by the result of docs/alignment-sample (a real run's): what is checked
    here is how the report is written, and a real run takes seconds (tests/test_align.py runs them)."""

    def __init__(self, argv, monkeypatch):
        import megatron_patch.align.alignment as alignment

        super().__init__(argv)
        result = json.loads((REPO / "docs" / "alignment-sample" / "report.json").read_text())
        result.pop("command")
        monkeypatch.setattr(alignment, "run_alignment", lambda settings, log=None: result)

    def plant(self, target: Path) -> None:
        target.mkdir()
        (target / "report.md").write_text("my notes on this model")


class Eval(Folder):
    """The evaluation itself is replaced by a result of lm-eval's shape: what is checked here is how the results
    are written (tests/test_eval_equality.py runs real evaluations, which take tens of seconds)."""

    def __init__(self, argv, monkeypatch):
        import megatron_patch.evaluation.evaluate as evaluate

        super().__init__(argv)
        result = evaluate.EvalResults({"results": {"mpatch_arithmetic": {"exact_match,none": 0.5}}}, {})
        monkeypatch.setattr(evaluate, "evaluate_checkpoint", lambda *args, **kwargs: result)

    def plant(self, target: Path) -> None:
        target.mkdir()
        (target / "results.json").write_text("{}")


class Demo(Folder):
    """The parity runs are replaced by a passing measurement: what is checked here is how the tiny models are
    written (tests/test_models.py runs the parity)."""

    def __init__(self, argv, monkeypatch):
        import megatron_patch.align.parity as parity

        super().__init__(argv)
        passed = {"passed": True, "rel_l2": 0.0, "kl": 0.0, "max_abs": 0.0, "top1": 1.0}
        monkeypatch.setattr(parity, "check_parity", lambda *args, **kwargs: passed)

    def run(self, capsys, target: Path, force: bool) -> tuple[int, str]:
        return run_cli(capsys, *self.argv(target), *(["--force"] if force else []))

    def plant(self, target: Path) -> None:
        """A model the user downloaded, in the folder of the family the demo makes: its shards were deleted."""
        (target / "llama3_1").mkdir(parents=True)
        (target / "llama3_1" / "config.json").write_text('{"model_type": "llama"}')
        (target / "llama3_1" / "model-00001-of-00002.safetensors").write_bytes(b"weights")


class Preprocess(Folder):
    def target(self, root: Path) -> Path:
        return root / "p_text_document"  # the name the lock goes beside

    def plant(self, target: Path) -> None:
        for suffix in (".bin", ".idx"):
            Path(f"{target}{suffix}").write_bytes(b"not mpatch's " + suffix.encode())

    def taken(self, target: Path, before: dict) -> None:
        manifest = Path(f"{target}.{MANIFEST_NAME}")
        assert set(json.loads(manifest.read_text())["files"]) == {"p_text_document.bin", "p_text_document.idx"}


class Train(Folder):
    """The launcher, up to the point where it would start torchrun (``_launch``, replaced by a stub that
    records the call): everything the one output rule decides for a run is decided before it."""
    resumes = True

    def __init__(self, corpus: Path, monkeypatch):
        import megatron_patch.cli.train as train_cli

        self.corpus, self.launched = corpus, []
        monkeypatch.setattr(train_cli, "_launch", lambda cfg, command, argv, needed, *_: self.launched.append(cfg) or 0)

    def run(self, capsys, target: Path, force: bool) -> tuple[int, str]:
        return run_cli(capsys, "train", "llama3_1", *launcher_args(DATASET_PATH=str(self.corpus),
                                                                   OUTPUT_BASEPATH=str(target)))

    def earlier(self, capsys, target: Path) -> None:
        """A run's folder as an unfinished run leaves it (no run is started here: that takes a minute)."""
        (target / "checkpoint").mkdir(parents=True)
        (target / "log").mkdir()
        (target / "log" / "metrics.jsonl").write_text('{"iteration": 1, "loss": 5.0}\n')

    def taken(self, target: Path, before: dict) -> None:
        assert len(self.launched) == 1 and _tree(target.parent) == before  # resumed: launched, nothing replaced


def _drivers(inputs, monkeypatch) -> dict:
    """How to drive each writer, by its name in the list (each made only when its case runs)."""
    return {
        "mpatch convert hf2mcore --save-dir": lambda: Folder(
            lambda out: ["convert", "hf2mcore", "--hf-dir", str(inputs["hf"]), "--save-dir", str(out)]),
        "mpatch convert mcore2hf --save-dir": lambda: Folder(
            lambda out: ["convert", "mcore2hf", "--load-dir", str(inputs["ckpt"]), "--save-dir", str(out)]),
        "mpatch preprocess --output-prefix": lambda: Preprocess(
            lambda out: ["preprocess", "--input", str(inputs["jsonl"]), "--tokenizer", str(inputs["tok"]),
                         "--output-prefix", str(out).removesuffix("_text_document")]),
        "mpatch train OUTPUT_BASEPATH": lambda: Train(inputs["corpus"], monkeypatch),
        "mpatch align --report-dir": lambda: Align(
            lambda out: ["align", "--hf-dir", str(inputs["hf"]), "--report-dir", str(out)], monkeypatch),
        "mpatch demo --work-dir": lambda: Demo(
            lambda out: ["demo", "--families", "llama3_1", "--layouts", "tp1", "--work-dir", str(out)], monkeypatch),
        "mpatch eval --output-dir": lambda: Eval(
            lambda out: ["eval", "--load-dir", str(inputs["ckpt"]), "--tasks", "mpatch_arithmetic", "--output-dir",
                         str(out)], monkeypatch),
    }


def _tree(root: Path) -> dict:
    """Every name under ``root`` (symlinks not followed) with what it holds."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = ("link", str(p.readlink())) if p.is_symlink() else ("dir",) if p.is_dir() else p.read_bytes()
    return out


def _one_line_refusal(rc: int, err: str, *words: str) -> None:
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


@pytest.mark.parametrize("writer", [w.name for w in WRITERS])
def test_every_writer_follows_the_one_output_rule(writer, inputs, tmp_path, capsys, monkeypatch):
    drivers = _drivers(inputs, monkeypatch)
    assert writer in drivers, f"{writer} has no driver here: add one, so that the rule is checked for it"
    drive = drivers[writer]()

    # Something mpatch did not write at the output: refused (with --force too), all of it left as it was.
    root = tmp_path / "foreign"
    root.mkdir()
    target = drive.target(root)
    drive.plant(target)
    before = _tree(root)
    rc, err = drive.run(capsys, target, force=True)
    _one_line_refusal(rc, err)
    assert _tree(root) == before

    # A lock that is a symlink: refused, and nothing written through it.
    root = tmp_path / "lock"
    root.mkdir()
    target = drive.target(root)
    victim = root / "victim.txt"
    victim.write_text("precious")
    lock_path(target).symlink_to(victim)
    before = _tree(root)
    rc, err = drive.run(capsys, target, force=False)
    _one_line_refusal(rc, err, "is a symlink", "not a plain file")
    assert _tree(root) == before and victim.read_text() == "precious"

    # An earlier output of its own: replaced with --force, only with it (resumed, for a training run).
    root = tmp_path / "earlier"
    root.mkdir()
    target = drive.target(root)
    drive.earlier(capsys, target)
    if not drive.resumes:
        rc, err = drive.run(capsys, target, force=False)
        _one_line_refusal(rc, err, "--force")
    before = _tree(root)
    rc, err = drive.run(capsys, target, force=True)
    assert rc == 0, err
    drive.taken(target, before)
    assert not [p for p in root.iterdir() if ".mpatch-" in p.name]  # no lock or partial left behind


def _docs_table() -> list[list[str]]:
    text = (REPO / "docs" / "outputs.md").read_text()
    section = text.split("## Every writer", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]


def test_the_docs_table_has_a_row_for_every_writer_and_no_other():
    rows = _docs_table()
    assert all(len(r) == 6 and all(r) for r in rows), rows  # writer, output, lock, publish, --force, manifest
    assert sorted(r[0].strip("`") for r in rows) == sorted(w.name for w in WRITERS)


# The calls that take an output's lock, with the position of their ``what`` parameter (None: keyword only).
_LOCKING = {"OutputLock": 1, "locked": 1, "atomic_dir": None, "atomic_output_dir": None}


def test_every_lock_the_code_takes_is_for_a_listed_writer():
    """A writer added to the code names its output option when it takes the lock (``what``): that option must
    be one of a listed writer, so a new writer cannot skip the list (and so the table and the test above)."""
    from megatron_patch.checkpoint.outputs import atomic_output_dir
    from megatron_patch.outputs.folders import atomic_dir
    from megatron_patch.outputs.lock import OutputLock, locked

    defaults = {f.__name__: inspect.signature(f).parameters["what"].default
                for f in (OutputLock, locked, atomic_dir, atomic_output_dir)}
    options = {w.option for w in WRITERS}
    unlisted, calls = [], 0
    for path in sorted((REPO / "megatron_patch").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(getattr(node, "func", None), "id", None) or getattr(getattr(node, "func", None), "attr", None)
            if not isinstance(node, ast.Call) or name not in _LOCKING:
                continue
            calls += 1
            given = next((k.value for k in node.keywords if k.arg == "what"), None)
            if given is None and _LOCKING[name] is not None and len(node.args) > _LOCKING[name]:
                given = node.args[_LOCKING[name]]
            if isinstance(given, ast.Name) and given.id == "what":
                continue  # handed on from a caller, whose own call is checked
            what = given.value if isinstance(given, ast.Constant) else defaults[name] if given is None else None
            if what not in options:
                unlisted.append(f"{path.relative_to(REPO)}:{node.lineno} ({ast.unparse(node)[:80]})")
    assert calls >= 5 and not unlisted, f"locks for outputs that megatron_patch/outputs/writers.py does not list: {unlisted}"

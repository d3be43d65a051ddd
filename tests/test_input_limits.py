"""Inputs with a size are bounded before they are read, and what goes wrong is one line (issue 34):

- preprocess: a line over the ceiling (``--max-line-mb``) is refused naming its line, without being read whole;
  ``--workers`` has a ceiling; a line that is not UTF-8 is named by its own number;
- the launcher's token and iteration counts have ceilings, refused before any rank starts;
- a full disk in hf2mcore, mcore2hf and preprocess is one line and exit 2, the output as it was before;
- a fuzzed contract (hypothesis) over preprocess's JSONL lines and the launcher's counts and environment
  extras: a result, or a one-line ``UserError``; never a traceback or a hang.

All in process, through the CLI's ``main`` where a user would type the command.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_patch.errors import UserError
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from tests.convert_helpers import leftovers, run_cli
from tests.training_helpers import launcher_args, make_texts, make_tokenizer, write_jsonl


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tok", make_texts(200, seed=3))


def _one_line(rc: int, err: str, *words: str, code: int = 2) -> None:
    assert rc == code and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def _preprocess(capsys, tok: Path, data: Path, prefix: Path, *extra: str) -> tuple[int, str]:
    return run_cli(capsys, "preprocess", "--input", str(data), "--output-prefix", str(prefix), "--tokenizer",
                   str(tok), "--quiet", *extra)


def _outputs(prefix: Path) -> list[str]:
    """Every file of the output folder that belongs to ``prefix``'s output, partial files and lock included."""
    return sorted(p.name for p in prefix.parent.iterdir() if f"{prefix.name}_" in p.name)


def _sparse_line(path: Path, first: str, length: int) -> Path:
    """``first`` as line 1, then a line of ``length`` bytes that takes no disk space (a hole: NUL bytes)."""
    with open(path, "wb") as f:
        f.write(first.encode() + b"\n" + b'{"text": "')
        f.truncate(f.tell() + length)
        f.seek(0, os.SEEK_END)
        f.write(b'"}\n')
    return path


# --- preprocess: lines, workers, UTF-8 ----------------------------------------------------------------------

def test_a_line_over_the_default_ceiling_is_refused_naming_its_line(tok, tmp_path, capsys):
    """A 64 MiB line (a hole in a sparse file) against the default 8 MiB: refused at line 2 after reading 8 MiB
    of it. Before, the whole line was read and decoded into memory (a 100 MB line took 20 GB to tokenize)."""
    data = _sparse_line(tmp_path / "in.jsonl", json.dumps({"text": "a short document"}), 64 * 2**20)
    rc, err = _preprocess(capsys, tok, data, tmp_path / "p")
    _one_line(rc, err, "in.jsonl line 2 is longer than 8 MiB", "--max-line-mb")
    assert _outputs(tmp_path / "p") == []


def test_the_line_ceiling_is_an_option(tok, tmp_path, capsys):
    texts = ["x" * 3000, "y" * 100]
    write_jsonl(tmp_path / "in.jsonl", [{"text": texts[1]}, {"text": texts[1]}, {"text": texts[0]}])
    rc, err = _preprocess(capsys, tok, tmp_path / "in.jsonl", tmp_path / "p", "--max-line-mb", "0.002")
    _one_line(rc, err, "in.jsonl line 3 is longer than 0.00199986 MiB")
    rc, err = _preprocess(capsys, tok, tmp_path / "in.jsonl", tmp_path / "p", "--max-line-mb", "0.003")
    assert rc == 0, err
    for bad in ("0", "-1", "nan", "inf", "x"):
        with pytest.raises(SystemExit) as exc:  # argparse: usage and one error line
            _preprocess(capsys, tok, tmp_path / "in.jsonl", tmp_path / "p", "--max-line-mb", bad)
        assert exc.value.code == 2 and "--max-line-mb: must be a number of MiB > 0" in capsys.readouterr().err


def test_workers_have_a_ceiling(tok, tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"text": "one document"}])
    most = 4 * len(os.sched_getaffinity(0))
    for workers in (most + 1, 100000):  # 100000 used to start (or try to) 100000 processes: a hang
        rc, err = _preprocess(capsys, tok, tmp_path / "in.jsonl", tmp_path / "p", "--workers", str(workers))
        _one_line(rc, err, f"--workers {workers} is more than this machine takes: at most {most} (4 per CPU core")
    assert _outputs(tmp_path / "p") == []


@pytest.mark.parametrize("bad_line", [3, 700])
def test_invalid_utf8_names_its_own_line(tok, tmp_path, capsys, bad_line):
    """Read as text, the file was decoded in 8 KiB blocks ahead of the lines: any bad byte in the first block
    was reported on line 1 (and a later one on the first line of its block)."""
    lines = [json.dumps({"text": f"document {i}"}).encode() for i in range(1, 1001)]
    lines[bad_line - 1] = b'{"text": "caf\xe9"}'  # latin-1
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    rc, err = _preprocess(capsys, tok, tmp_path / "in.jsonl", tmp_path / "p")
    _one_line(rc, err, f"in.jsonl line {bad_line} is not UTF-8 (invalid continuation byte at byte 14 of the line)")


def test_lines_no_tokenizer_takes_are_skipped_by_line(tok, tmp_path, capsys):
    """Found by test_fuzz_preprocess_lines: a JSON escape of a lone surrogate gave a str HF tokenizers refuse
    (TypeError: an internal error), a number of 5000 digits a ValueError, deep nesting a RecursionError."""
    write_jsonl(tmp_path / "in.jsonl", ['{"text": "a\\ud800b"}', '{"text": 1' + "0" * 5000 + "}", "[" * 100000,
                                        {"text": "fine"}])
    rc, err = _preprocess(capsys, tok, tmp_path / "in.jsonl", tmp_path / "p", "--workers", "2")
    assert rc == 0, err
    assert "in.jsonl:1: skipped: 'text' holds an unpaired surrogate ('\\ud800'), not text" in err
    # Python 3.10 words it "Exceeds the limit (4300) for integer string conversion", 3.11 on "(4300 digits)"
    assert "in.jsonl:2: skipped: not readable JSON (Exceeds the limit (4300" in err
    assert "in.jsonl:3: skipped: not readable JSON (nested too deeply)" in err


def test_bad_lines_are_counted_and_only_the_first_are_kept(tok, tmp_path, capsys):
    """A file of nothing but bad lines held every one of them (line number and message) in memory."""
    from megatron_patch.training.preprocess import BAD_LINES_KEPT, preprocess

    write_jsonl(tmp_path / "in.jsonl", [{"text": "good"}] + [{"other": i} for i in range(BAD_LINES_KEPT + 5)])
    report = preprocess(tmp_path / "in.jsonl", str(tmp_path / "p"), tok, progress=False)
    assert report.documents == 1 and report.skipped == BAD_LINES_KEPT + 5
    assert [n for _, n, _ in report.bad_lines] == list(range(2, BAD_LINES_KEPT + 2))
    rc, err = _preprocess(capsys, tok, tmp_path / "in.jsonl", tmp_path / "q")
    assert rc == 0 and err.count(": skipped: no 'text' field") == BAD_LINES_KEPT and "... and 5 more skipped lines" in err


def test_workers_write_every_document_in_order(tok, tmp_path, capsys):
    """Batches of bounded size go to the workers (a long line alone), and come back in input order."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_patch.tokenizer import load_tokenizer
    from megatron_patch.training import preprocess as pre

    texts = make_texts(300, seed=5) + ["z" * 5000] + make_texts(20, seed=6)
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    long, short = (1, "", pre.BATCH_BYTES, "text", True), (2, "", 10, "text", True)
    assert [len(b) for b in pre._batches([short, long, long] + [short] * 200)] == [2, 1, 64, 64, 64, 8]
    rc, err = _preprocess(capsys, tok, tmp_path / "in.jsonl", tmp_path / "p", "--workers", "2")
    assert rc == 0, err
    ds, t = IndexedDataset(str(tmp_path / "p_text_document")), load_tokenizer(tok)
    assert [t.decode(ds[i][:-1]) for i in range(len(texts))] == texts


# --- a full disk --------------------------------------------------------------------------------------------

def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return make_tiny_hf_checkpoint("llama3_1", tmp_path_factory.mktemp("hf") / "llama", seed=4)


def _full_disk_for_the_copier(monkeypatch) -> None:
    """The tensor bytes the converters' copier writes fail as on a full disk: its file-to-file copies and its
    writes from memory (the lock's few bytes, written before, still fit)."""
    from megatron_patch.convert import copier

    monkeypatch.setattr(os, "copy_file_range", _no_space)
    monkeypatch.setattr(os, "pwritev", _no_space)
    monkeypatch.setattr(copier, "write_all", _no_space)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_full_disk_in_hf2mcore_is_one_line_and_the_earlier_output_stays(hf, tmp_path, capsys, monkeypatch):
    out = tmp_path / "ckpt"
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(out), "--quiet")
    assert rc == 0, err
    before = _tree(out)
    _full_disk_for_the_copier(monkeypatch)
    for target, force in ((tmp_path / "new", ()), (out, ("--force",))):
        rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(target), "--quiet",
                          *force)
        _one_line(rc, err, f"mpatch convert: error: writing {target} failed: [Errno 28] No space left on device",
                  "MiB free there", f"{target} is as it was before this run and no partial file is left",
                  "free space (or choose another --save-dir) and rerun")
        assert not leftovers(target)
    assert not (tmp_path / "new").exists() and _tree(out) == before


def test_a_full_disk_in_mcore2hf_is_one_line(hf, tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(ckpt), "--quiet")
    assert rc == 0, err
    _full_disk_for_the_copier(monkeypatch)
    out = tmp_path / "hf_out"
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(out), "--quiet")
    _one_line(rc, err, f"writing {out} failed: [Errno 28] No space left on device", "--save-dir")
    assert not out.exists() and not leftovers(out)


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_a_full_disk_in_preprocess_is_one_line(tok, tmp_path, capsys, monkeypatch, where):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_patch.training import preprocess as pre

    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in make_texts(50, seed=1)])
    if where == "data":
        monkeypatch.setattr(IndexedDatasetBuilder, "add_document", _no_space)
    else:  # the last file written; before, the .bin/.idx had already replaced the earlier output's
        monkeypatch.setattr(pre, "write_manifest", _no_space)
    rc, err = _preprocess(capsys, tok, tmp_path / "in.jsonl", tmp_path / "p")
    _one_line(rc, err, f"mpatch preprocess: error: writing {tmp_path}/p_text_document.bin/.idx failed: [Errno 28] "
                       "No space left on device", "free space (or choose another --output-prefix) and rerun")
    assert _outputs(tmp_path / "p") == []


def test_an_edquot_is_a_full_disk_too_and_other_errors_are_not():
    from megatron_patch.outputs.full_disk import full_disk_error, full_disk_is_bad_input

    quota = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/x/y")
    try:
        raise RuntimeError("a writer's own wrapper") from quota
    except RuntimeError as exc:
        assert full_disk_error(exc) is quota
    with pytest.raises(UserError, match=r"\[Errno 122\] Disk quota exceeded \(/x/y\)"):
        with full_disk_is_bad_input("/x", "--save-dir"):
            raise quota
    with pytest.raises(PermissionError):
        with full_disk_is_bad_input("/x", "--save-dir"):
            raise PermissionError(errno.EACCES, "denied")


# --- the launcher's counts ----------------------------------------------------------------------------------

@pytest.mark.parametrize("over, message", [
    (dict(TRAIN_TOKENS_OR_ITERS="1e30"), "TRAIN_TOKENS_OR_ITERS=1e30 is more than 1000000000000000 tokens, the most a run takes"),
    (dict(WARMUP_TOKENS_OR_ITERS="1e16"), "WARMUP_TOKENS_OR_ITERS=1e16 is more than 1000000000000000 tokens"),
    (dict(TRAIN_TOKENS_OR_ITERS="1e15"), "TRAIN_TOKENS_OR_ITERS=1e15 tokens make 1953125000000 iterations of "
                                         "GLOBAL_BATCH_SIZE*SEQ_LEN = 512 tokens, and at most 100000000"),
    (dict(SFT="true", DATASET_PATH="x.jsonl", TRAIN_TOKENS_OR_ITERS="200000000"),
     "TRAIN_TOKENS_OR_ITERS=200000000 is more than 100000000 iterations, the most a run takes"),
    (dict(GLOBAL_BATCH_SIZE="10000000000", TRAIN_TOKENS_OR_ITERS="1e15"),
     "GLOBAL_BATCH_SIZE must be at most 1000000, got 10000000000"),
])
def test_token_and_iteration_counts_have_ceilings(over, message):
    """1e30 tokens used to be accepted: megatron-core then built a dataset index for 1e27 samples and the run
    hung without a word."""
    env = {"MP_TOKENIZER": "tok"} if over.get("SFT") else {}
    with pytest.raises(UserError) as exc:
        from megatron_patch.training.validation import resolve

        resolve("llama3_1", launcher_args(**over), env=env, check_paths=False)
    assert message in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_local_processes_and_copy_workers_have_ceilings(tmp_path, capsys):
    """MP_NPROC=100000 (ENV=cpu) started that many gloo ranks, and a converter's --workers 100000 that many
    threads: each is refused in one line before anything starts."""
    from megatron_patch.training.validation import resolve

    with pytest.raises(UserError, match="MP_NPROC must be at most 256"):
        resolve("llama3_1", launcher_args(ENV="cpu"), env={"MP_NPROC": "100000"}, check_paths=False)
    from megatron_patch.cli import main

    with pytest.raises(SystemExit) as exit_:  # argparse's own refusal: usage, then the one line
        main(["convert", "hf2mcore", "--hf-dir", str(tmp_path), "--save-dir", str(tmp_path / "o"), "--workers",
              "100000"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--workers: must be a whole number from 1 to 256, not '100000'" in err, err
    assert not (tmp_path / "o").exists()


def test_validation_iterations_have_a_ceiling():
    from megatron_patch.training.validation import resolve

    with pytest.raises(UserError, match="MP_EVAL_ITERS must be at most 100000000"):
        resolve("llama3_1", launcher_args(), env={"MP_EVAL_ITERS": "1000000000000"}, check_paths=False)


def test_a_count_over_the_ceiling_is_refused_before_any_rank_starts(tmp_path, capsys):
    rc, err = run_cli(capsys, "train", "llama3_1", *launcher_args(TRAIN_TOKENS_OR_ITERS="1e30",
                                                                  OUTPUT_BASEPATH=str(tmp_path / "out")))
    _one_line(rc, err, "TRAIN_TOKENS_OR_ITERS=1e30 is more than 1000000000000000 tokens, the most a run takes")
    assert not (tmp_path / "out").exists()


# --- the fuzzed contract ------------------------------------------------------------------------------------

FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=6)
LINE = st.one_of(
    st.builds(lambda t: json.dumps({"text": t}), st.text(max_size=40)),           # a document
    st.builds(lambda t: json.dumps({"text": t}, ensure_ascii=False), st.text(max_size=40)),
    st.builds(json.dumps, JSON_VALUES),                                          # any JSON: missing keys, non-objects
    st.builds(lambda v: json.dumps({"text": v}), JSON_VALUES),                   # a non-string text
    st.sampled_from(['{"text": "a\\ud800"}', '{"text": 1' + "0" * 5000 + "}", "[" * 5000, "", " ", "\r",
                     '{"text": "x"', "\x00", '{"text": "' + "w " * 600 + '"}', "\ufeff{}"]),
    st.text(max_size=20),
).map(str.encode)
RAW_LINE = st.one_of(LINE, st.binary(max_size=12))  # bytes that may not be UTF-8


@FUZZ
@given(lines=st.lists(RAW_LINE, min_size=1, max_size=8), workers=st.sampled_from([1, 1, 2]),
       strict=st.booleans(), ending=st.sampled_from([b"\n", b"\r\n", b""]))
@example(lines=[b'{"text": "ok"}', b'{"text": "a\\ud800"}'], workers=1, strict=False, ending=b"\n")
def test_fuzz_preprocess_lines(tok, capsys, lines, workers, strict, ending):
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp, "in.jsonl")
        data.write_bytes(b"\n".join(lines) + ending)
        rc, err = _preprocess(capsys, tok, data, Path(tmp, "p"), "--workers", str(workers), "--max-line-mb", "0.001",
                              *(["--strict"] if strict else []))
        if rc == 0:
            from megatron.core.datasets.indexed_dataset import IndexedDataset

            assert len(IndexedDataset(str(Path(tmp, "p_text_document")))) >= 1
            assert all(": skipped: " in line for line in err.splitlines()), err
        else:
            _one_line(rc, err)
        assert not list(Path(tmp).glob("*partial*"))


COUNT_TEXT = st.one_of(st.sampled_from(["1e30", "1e15", "1e16", "1e400", "1e308", "9" * 40, "1T", "1000000T",
                                        "0.5", "-1", "nan", "inf", "1e-3", "10B", "5M", "", " 7", "²", "0x10"]),
                       st.integers(0, 10**20).map(str), st.text(max_size=6))
COUNTED = ["TRAIN_TOKENS_OR_ITERS", "WARMUP_TOKENS_OR_ITERS", "GLOBAL_BATCH_SIZE", "BATCH_SIZE", "SAVE_INTERVAL",
           "SEQ_LEN"]
EXTRAS = ["MP_EVAL_ITERS", "MP_EVAL_INTERVAL", "MP_LOG_INTERVAL", "MP_EXIT_INTERVAL", "MP_NPROC", "MP_AC_LAYERS",
          "MP_DIST_TIMEOUT_MIN", "MP_MAX_RESTARTS", "MP_SEED", "MP_OFFLOAD_CHUNK_MB", "MP_INJECT_FAULT"]


@FUZZ
@given(data=st.data())
@example(data=None)
def test_fuzz_launcher_counts_and_extras(data):
    """Counts anywhere in the launcher's arguments or environment: refused in one line, or a run whose sizes are
    within the ceilings. (tests/test_bad_input.py fuzzes the other positional arguments.)"""
    from megatron_patch.training.launcher_args import MAX_GLOBAL_BATCH, MAX_ITERATIONS
    from megatron_patch.training.validation import resolve

    if data is None:  # the case
        over, env = {"TRAIN_TOKENS_OR_ITERS": "1e30"}, {}
    else:
        over = {name: data.draw(COUNT_TEXT) for name in data.draw(st.lists(st.sampled_from(COUNTED), max_size=3))}
        if data.draw(st.booleans()):
            over.update(SFT="true", DATASET_PATH="x.jsonl")
        env = {name: data.draw(COUNT_TEXT) for name in data.draw(st.lists(st.sampled_from(EXTRAS), max_size=3))}
    env.setdefault("MP_TOKENIZER", "tok")
    try:
        cfg = resolve("llama3_1", launcher_args(**over), env=env, check_paths=False)
    except UserError as exc:
        assert "\n" not in str(exc)
        return
    assert 1 <= cfg.train_iters <= MAX_ITERATIONS and 0 <= cfg.warmup_iters < cfg.train_iters
    assert cfg.eval_iters <= MAX_ITERATIONS and cfg.global_batch_size <= MAX_GLOBAL_BATCH

"""Inputs with a size are bounded before they are read, and what goes wrong is one line (issue 34):

- preprocess: a line over the ceiling (``--max-line-mb``) is refused naming its line, without being read whole;
  ``--workers`` has a ceiling; a line that is not UTF-8 is named by its own number;
- a full disk in hf2mcore, mcore2hf and preprocess is one line and exit 2, the output as it was before.

All in process, through the CLI's ``main`` where a user would type the command.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from megatron_patch.errors import UserError
from megatron_patch.models.tiny import make_tiny_hf_checkpoint
from tests.convert_helpers import leftovers, run_cli
from tests.training_helpers import make_texts, make_tokenizer, write_jsonl


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
    assert "in.jsonl:2: skipped: not readable JSON (Exceeds the limit (4300 digits)" in err
    assert "in.jsonl:3: skipped: not readable JSON (nested too deeply)" in err


def test_workers_write_every_document_in_order(tok, tmp_path, capsys):
    """Batches of bounded size go to the workers (a long line alone), and come back in input order."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_patch.training import preprocess as pre
    from megatron_patch.training.tokenizer import load_tokenizer

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

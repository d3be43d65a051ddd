"""`mpatch preprocess` takes what Pai-Megatron-Patch's pretraining preprocessing takes (issue 35): a folder of
``.jsonl`` or ``.jsonl.zst`` files (its README's input) and its flag names; the bounds and line checks of issue 34
hold for compressed files too. All in process, through the CLI's ``main`` as a user types the command.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import zstandard

from megatron_patch.cli import main
from megatron_patch.errors import UserError
from megatron_patch.tokenizer import load_tokenizer
from megatron_patch.training import preprocess as pre
from tests.convert_helpers import run_cli
from tests.training_helpers import make_texts, make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tok", make_texts(200, seed=3))


def _jsonl(texts: list[str], key: str = "text") -> bytes:
    return "".join(json.dumps({key: t}) + "\n" for t in texts).encode()


def _documents(prefix: Path, tok: Path) -> list[str]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds, t = IndexedDataset(str(prefix)), load_tokenizer(tok)
    return [t.decode(ds[i][:-1]) for i in range(len(ds))]


def _one_line(rc: int, err: str, *words: str) -> None:
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def _folder(root: Path, texts: list[str]) -> Path:
    """Pai's README input: the corpus split into numbered pieces, zstd-compressed (one gzip, one plain here)."""
    root.mkdir()
    thirds = [texts[:30], texts[30:60], texts[60:]]
    (root / "00.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(thirds[0])))
    (root / "01.jsonl").write_bytes(_jsonl(thirds[1]))
    (root / "02.jsonl.gz").write_bytes(gzip.compress(_jsonl(thirds[2])))
    (root / ".hidden").write_text("not read")
    return root


def test_a_folder_of_jsonl_and_zst_files_is_one_corpus_in_name_order(tok, tmp_path, capsys):
    """Before: 'input ... not found: give a JSONL file' for a folder, and 'line 1 is not UTF-8' for a .zst file."""
    texts = make_texts(90, seed=8)
    rc, err = run_cli(capsys, "preprocess", "--input", str(_folder(tmp_path / "in", texts)), "--output-prefix",
                      str(tmp_path / "p"), "--tokenizer", str(tok), "--quiet")
    assert rc == 0, err
    assert _documents(tmp_path / "p_text_document", tok) == texts
    # One .zst file as the input, and several frames in it (zstd -z of concatenated pieces).
    frames = zstandard.ZstdCompressor().compress(_jsonl(texts[:5])) + zstandard.ZstdCompressor().compress(_jsonl(texts[5:9]))
    (tmp_path / "one.jsonl.zst").write_bytes(frames)
    rc, err = run_cli(capsys, "preprocess", "--input", str(tmp_path / "one.jsonl.zst"), "--output-prefix",
                      str(tmp_path / "q"), "--tokenizer", str(tok), "--quiet")
    assert rc == 0, err
    assert _documents(tmp_path / "q_text_document", tok) == texts[:9]


def test_pai_flags_are_taken_and_what_is_ignored_is_said(tok, tmp_path, capsys, monkeypatch):
    """Pai's run_make_pretraining_dataset_megatron.sh line, as it types it. Before: 'unrecognized arguments'."""
    texts = make_texts(40, seed=9)
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "00.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": t, "content": t.upper()}) + "\n" for t in texts).encode()))
    rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", str(tmp_path / "mmap_qwen3_datasets"),
                      "--patch-tokenizer-type", "Qwen3Tokenizer", "--json-keys", "text", "content", "--load", str(tok),
                      "--workers", "1", "--partitions", "1", "--keep-sequential-samples", "--append-eod", "--quiet")
    assert rc == 0, err
    assert err.splitlines() == ["note: ignored here: --patch-tokenizer-type (the tokenizer is the --load/--tokenizer "
                                "folder's); --partitions (the workers share the input, no partition files are "
                                "written); --keep-sequential-samples (documents always keep the input's order)"]
    assert _documents(tmp_path / "mmap_qwen3_datasets_text_document", tok) == texts
    assert len(_documents(tmp_path / "mmap_qwen3_datasets_content_document", tok)) == len(texts)  # one pair a key
    # The older preprocess_data.py's flags.
    rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", str(tmp_path / "wudao"),
                      "--dataset-impl", "mmap", "--jsonl-keys", "text", "--load", str(tok), "--quiet")
    assert rc == 0 and err == "", err
    rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", f"{tmp_path}/", "--load", str(tok))
    assert rc == 2 and "is a folder: give a prefix of file names in it" in err and err.count("\n") == 1, err
    assert not list(tmp_path.glob("_*_document*"))
    # '.' wrote hidden ._text_document.bin/.idx into the folder, '' (an unset shell variable) into the working one
    rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", f"{tmp_path}/.", "--load", str(tok))
    assert rc == 2 and "is a folder: give a prefix of file names in it" in err and err.count("\n") == 1, err
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", "", "--load", str(tok))
    assert rc == 2 and "--output-prefix is an empty path" in err and err.count("\n") == 1, err
    assert not list(tmp_path.glob("._*")) and not any((tmp_path / "cwd").iterdir())
    monkeypatch.undo()
    for extra, message in ((["--dataset-impl", "lazy"], "--dataset-impl lazy is not written here"),
                           (["--split-sentences"], "--split-sentences is not supported")):
        rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", str(tmp_path / "x"),
                          "--load", str(tok), *extra)
        _one_line(rc, err, message)
    rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", str(tmp_path / "x"))
    _one_line(rc, err, "preprocess needs a tokenizer: --tokenizer (or Pai's --load)")


def test_line_checks_and_bounds_hold_inside_compressed_files(tok, tmp_path, capsys):
    """Issue 34's ceiling on a line, its UTF-8 check naming the line, bad lines named by file and line: the same
    for a line inside a .zst file, which is decompressed in pieces, never whole."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "00.jsonl").write_bytes(_jsonl(["fine"]))
    # 64 MiB of one byte on line 2, in 2 kB of zstd: refused after reading past the 8 MiB ceiling, not all of it.
    huge = b'{"text": "ok"}\n{"text": "' + b"a" * (64 * 2**20) + b'"}\n'
    (folder / "01.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=1).compress(huge))
    del huge
    # a first run imports what preprocessing imports before the count starts, as the file's earlier tests do
    assert run_cli(capsys, "preprocess", "--input", str(folder / "00.jsonl"), "--output-prefix",
                   str(tmp_path / "warm"), "--tokenizer", str(tok), "--quiet")[0] == 0
    tracemalloc.start()
    try:
        rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", str(tmp_path / "p"),
                          "--tokenizer", str(tok), "--quiet")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    _one_line(rc, err, f"{folder / '01.jsonl.zst'} line 2 is longer than 8 MiB", "--max-line-mb")
    assert peak < 40 * 2**20, peak  # the line is 64 MiB
    (folder / "01.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "a"}\n{"text": "caf\xe9"}\n'))
    rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(tok), "--quiet")
    _one_line(rc, err, f"{folder / '01.jsonl.zst'} line 2 is not UTF-8 (invalid continuation byte at byte 14")
    (folder / "01.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "a"}\n{"other": 1}\n'))
    rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(tok), "--quiet")
    assert rc == 0 and err == f"{folder / '01.jsonl.zst'}:2: skipped: no 'text' field (fields: 'other')\n", err


def test_damaged_compressed_files_are_one_line(tok, tmp_path, capsys):
    whole = zstandard.ZstdCompressor().compress(_jsonl(make_texts(200, seed=4)))
    for name, data, message in (
            ("cut.jsonl.zst", whole[:len(whole) // 2], "ends inside a zstd frame: the file was cut short"),
            ("junk.jsonl.zst", b"not zstd at all" * 10, "is not a readable zstd file"),
            ("cut.jsonl.gz", gzip.compress(_jsonl(make_texts(200, seed=4)))[:500], "cannot be decompressed")):
        (tmp_path / name).write_bytes(data)
        rc, err = run_cli(capsys, "preprocess", "--input", str(tmp_path / name), "--output-prefix",
                          str(tmp_path / "p"), "--tokenizer", str(tok), "--quiet")
        _one_line(rc, err, str(tmp_path / name), message)
        assert not list(tmp_path.glob("p_*")), name


def test_without_zstandard_a_zst_input_says_what_to_install(tok, tmp_path, capsys, monkeypatch):
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(["x"])))
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if it were not installed
    rc, err = run_cli(capsys, "preprocess", "--input", str(tmp_path / "a.jsonl.zst"), "--output-prefix",
                      str(tmp_path / "p"), "--tokenizer", str(tok), "--quiet")
    _one_line(rc, err, "is zstd-compressed, and reading it needs the zstandard package: pip install zstandard")


def test_a_worker_ended_halfway_through_its_result_does_not_hang_the_stop(tok):
    """SIGTERM to `mpatch preprocess --workers 2` hung in about one try in six: a worker ended while it wrote a
    result left half a message in the result pipe, and the pool's manager thread, which the shutdown joins, waited
    for the rest forever. Here the half message is written on purpose, then the pool is stopped as a stopped run
    stops it."""
    import struct
    import threading

    import numpy as np

    from megatron_patch.training import preprocess

    pool = preprocess._start_workers(2, tok, np.uint16)
    assert pool.submit(int, "7").result(timeout=120) == 7  # the workers are up, the manager thread reads results
    writer = pool._result_queue._writer
    os.write(writer.fileno(), struct.pack("!i", 1000) + b"half")  # a 1000-byte result's first 4 bytes
    stopping = threading.Thread(target=preprocess._stop_workers, args=(pool,), daemon=True)
    stopping.start()
    stopping.join(timeout=60)
    hung = stopping.is_alive()
    if hung:  # let the thread go, so the test's process can still exit
        writer.close()
    assert not hung, "stopping the pool waited on the half-written result"


def test_a_folder_holding_anything_else_is_refused(tok, tmp_path, capsys):
    folder = tmp_path / "in"
    folder.mkdir()
    rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(tok))
    _one_line(rc, err, f"input folder {folder} holds no files")
    (folder / "00.jsonl").write_bytes(_jsonl(["x"]))
    for stray in ("notes.txt", "sub"):
        (folder / stray).mkdir() if stray == "sub" else (folder / stray).write_text("x")
        rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", str(tmp_path / "p"),
                          "--tokenizer", str(tok))
        _one_line(rc, err, f"{folder / stray} is not a .jsonl or .json file", "move it away")
        (folder / stray).rmdir() if stray == "sub" else (folder / stray).unlink()
    assert pre.input_files(folder) == [folder / "00.jsonl"]
    # an input that is neither (a FIFO) said "not found" (the tools audit)
    os.mkfifo(tmp_path / "fifo")
    rc, err = run_cli(capsys, "preprocess", "--input", str(tmp_path / "fifo"), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(tok))
    _one_line(rc, err, f"input {tmp_path / 'fifo'} is a FIFO: give a JSONL file")


def test_a_byte_order_mark_opening_a_file_is_not_part_of_its_first_line(tok, tmp_path, capsys):
    """Before: a file saved with a UTF-8 BOM (Windows editors) lost its first document, 'not valid JSON
    (Unexpected UTF-8 BOM)', plain, .gz or .zst alike."""
    texts = make_texts(9, seed=13)
    bom = b"\xef\xbb\xbf"
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "00.jsonl").write_bytes(bom + _jsonl(texts[:3]))
    (folder / "01.jsonl.gz").write_bytes(gzip.compress(bom + _jsonl(texts[3:6])))
    (folder / "02.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(bom + _jsonl(texts[6:])))
    rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(tok), "--quiet")
    assert rc == 0 and err == "", err
    assert _documents(tmp_path / "p_text_document", tok) == texts


def test_a_json_array_file_is_refused_in_one_line_and_nothing_is_written(tok, tmp_path, capsys):
    """Before: a .json holding a JSON array, one element a line, skipped every element but the last (each ends in a
    comma) and wrote 1 document of 100, exit 0; indented, it said only that every line lacked a 'text' field."""
    texts = make_texts(20, seed=14)
    elements = [json.dumps({"text": t}) for t in texts]
    layouts = {"lines.json": "[\n" + ",\n".join(elements) + "\n]\n",
               "indented.json": "\n" + json.dumps([{"text": t} for t in texts], indent=1),
               "one_line.json": json.dumps([{"text": t} for t in texts]) + "\n"}
    for name, text in layouts.items():
        (tmp_path / name).write_text(text)
        rc, err = run_cli(capsys, "preprocess", "--input", str(tmp_path / name), "--output-prefix",
                          str(tmp_path / name[:-5]), "--tokenizer", str(tok), "--quiet")
        _one_line(rc, err, f"{tmp_path / name} holds a JSON array, not JSON Lines", f"jq -c '.[]' {name} >")
        assert not list(tmp_path.glob(f"{name[:-5]}_*")), name
    # In a folder, compressed: the same line; a JSON line of an object list further down is a bad line, skipped.
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "00.jsonl").write_bytes(_jsonl(texts[:2]) + b'[{"text": "a list"}]\n')
    (folder / "01.json.gz").write_bytes(gzip.compress(layouts["lines.json"].encode()))
    rc, err = run_cli(capsys, "preprocess", "--input", str(folder), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(tok), "--quiet")
    # its hint decompresses first (jq reads no gzip: it failed on the file it named and left an empty output)
    _one_line(rc, err, f"{folder / '01.json.gz'} holds a JSON array, not JSON Lines",
              "e.g. zcat 01.json.gz | jq -c '.[]' > 01.jsonl")


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_a_compressed_file_named_as_plain_is_named_for_what_it_is(tok, tmp_path, capsys, kind):
    """preprocess said 'line 1 is not UTF-8 ...: re-encode the file', which sent the user the wrong way; the SFT
    reader already said what the file is."""
    import zstandard

    data = _jsonl(make_texts(5, seed=2))
    (tmp_path / "a.jsonl").write_bytes(gzip.compress(data) if kind == "gzip" else
                                       zstandard.ZstdCompressor().compress(data))
    rc, err = run_cli(capsys, "preprocess", "--input", str(tmp_path / "a.jsonl"), "--output-prefix",
                      str(tmp_path / "p"), "--tokenizer", str(tok), "--quiet")
    suffix = "gz" if kind == "gzip" else "zst"
    _one_line(rc, err, f"a.jsonl is {kind}-compressed (by its first bytes), and its name does not end in .{suffix}")


def test_several_json_keys_are_one_set_published_together_or_not_at_all(tok, tmp_path, capsys):
    """Before: with --json-keys text meta nosuch, the text and meta pairs were published, then the missing key
    failed (exit 2, a half-done set); --json-keys text text wrote the pair and then failed on its own output."""
    data = tmp_path / "in.jsonl"
    texts = make_texts(20, seed=14)
    data.write_bytes("".join(json.dumps({"text": t, "meta": t.upper()}) + "\n" for t in texts).encode())

    def preprocess(*keys: str) -> tuple[int, str]:
        return run_cli(capsys, "preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "p"),
                       "--tokenizer", str(tok), "--quiet", "--json-keys", *keys)

    _one_line(*preprocess("text", "meta", "nosuch"), "has no usable line", "'nosuch'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no pair, partial folder or lock
    _one_line(*preprocess("text", "meta", "text"), "--json-keys names 'text' more than once")
    # Every key's prefix is checked before any is written.
    (tmp_path / "p_meta_document.bin").write_bytes(b"someone's")
    _one_line(*preprocess("text", "meta"), "p_meta_document.bin exists and mpatch did not write it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "p_meta_document.bin"]
    (tmp_path / "p_meta_document.bin").unlink()
    rc, err = preprocess("text", "meta")
    assert rc == 0, err
    assert _documents(tmp_path / "p_text_document", tok) == texts
    assert len(_documents(tmp_path / "p_meta_document", tok)) == len(texts)


def test_the_line_ceiling_option_has_a_ceiling_of_its_own(tok, tmp_path, capsys):
    """Before: --max-line-mb 1e13 was taken, and the reader stopped with an internal OverflowError (exit 1)."""
    (tmp_path / "in.jsonl").write_bytes(_jsonl(["a document"]))
    argv = ["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "p"),
            "--tokenizer", str(tok), "--quiet", "--max-line-mb"]
    for too_much in ("1e13", str(pre.MAX_LINE_MB + 1)):
        with pytest.raises(SystemExit) as exc:  # argparse: usage and one error line
            run_cli(capsys, *argv, too_much)
        err = capsys.readouterr().err
        assert exc.value.code == 2, err
        assert f"--max-line-mb: must be a number of MiB > 0 and at most {pre.MAX_LINE_MB}, not '{too_much}'" in err
    with pytest.raises(UserError, match=f"--max-line-mb must be > 0 and at most {pre.MAX_LINE_MB}"):
        pre.preprocess(tmp_path / "in.jsonl", str(tmp_path / "p"), tok, progress=False, max_line_bytes=10**19)
    assert run_cli(capsys, *argv, str(pre.MAX_LINE_MB))[0] == 0


def test_without_a_terminal_progress_is_a_plain_line_now_and_then(tok, tmp_path, capsys, monkeypatch):
    """Before: progress was a bar on a terminal and nothing otherwise, so a batch job logging to a file said
    nothing until the end. capsys's stderr is no terminal."""
    (tmp_path / "in.jsonl").write_bytes(_jsonl(make_texts(50, seed=15)))
    monkeypatch.setattr(pre, "PROGRESS_LOG_SECONDS", 0.0)  # 30 s by default: every line here
    argv = ["preprocess", "--input", str(tmp_path / "in.jsonl"), "--tokenizer", str(tok)]
    rc, err = run_cli(capsys, *argv, "--output-prefix", str(tmp_path / "p"))
    assert rc == 0, err
    line = re.compile(r"preprocess text: [\d,]+ documents, [\d.,]+ MB read \(\d+%\); [\d,]+ documents/s, [\d.,]+ MB/s")
    assert err and all(line.fullmatch(x) for x in err.splitlines()), err
    rc, err = run_cli(capsys, *argv, "--output-prefix", str(tmp_path / "q"), "--quiet")
    assert rc == 0 and err == "", err


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state_and_parent = stat.read_text().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError):
            continue
        if int(state_and_parent[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_a_stopped_run_takes_its_workers_with_it(tok, tmp_path, sig):
    """Before: SIGTERM ended a --workers 2 run with -15, its spawned workers and multiprocessing's resource tracker
    ran on for good holding the caller's stdout/stderr, and the partial folder and the lock stayed. SIGTERM now
    unwinds as Ctrl-C does (exit 130, nothing left); SIGKILL cannot be unwound, but the workers end with it."""
    data = tmp_path / "big.jsonl"
    data.write_bytes(_jsonl([f"document number {i} of a long corpus" for i in range(400_000)]))  # minutes to tokenize
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_patch", "preprocess", "--input", str(data),
                             "--output-prefix", str(tmp_path / "p"), "--tokenizer", str(tok), "--workers", "2",
                             "--quiet"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    children = []
    try:
        deadline = time.monotonic() + 120
        while len(children) < 3:  # both workers and the resource tracker
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.2)
            children = _children(proc.pid)
        time.sleep(1)  # into the tokenizing
        assert proc.poll() is None, "the run ended before it was stopped: give it more input"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)  # before, no end of file came while a worker held the pipes
        deadline = time.monotonic() + 30
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in children if _alive(pid)], "processes outlived the run"
    finally:
        proc.kill()
        for pid in children:  # only on failure: nothing to leave running
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    if sig == signal.SIGTERM:
        # the one line of mpatch's, and nothing else of the run's (a library's import-time log may come before it)
        lines = err.decode().splitlines()
        assert proc.returncode == 130 and lines[-1] == "mpatch preprocess: interrupted", (proc.returncode, err)
        assert not any(w in err.decode() for w in ("Traceback", "leaked", "resource_tracker")), err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big.jsonl"]
    else:
        assert proc.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_pais_preprocessing_script_runs_unchanged_under_sh(tok, tmp_path):
    """Pai's README line for its megatron preprocessing script, by its path and positional arguments, under sh."""
    texts = make_texts(20, seed=12)
    folder = _folder(tmp_path / "cleaned_zst", texts)
    script = Path(__file__).resolve().parents[1] / "toolkits" / "pretrain_data_preprocessing" / \
        "run_make_pretraining_dataset_megatron.sh"
    proc = subprocess.run(["sh", str(script), str(folder), "Qwen3Tokenizer", "text", str(tmp_path), str(tok)],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _documents(tmp_path / "mmap_qwen3_datasets_text_document", tok) == texts
    # a rerun replaces the pair it wrote, as Pai's script does (it was refused: 'pass --force', which the
    # wrapper takes no way to pass); a pair no manifest lists is still refused
    fewer = _folder(tmp_path / "fewer", texts[:5])
    proc = subprocess.run(["sh", str(script), str(fewer), "Qwen3Tokenizer", "text", str(tmp_path), str(tok)],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _documents(tmp_path / "mmap_qwen3_datasets_text_document", tok) == texts[:5]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    for suffix in (".bin", ".idx"):
        (foreign / f"mmap_qwen3_datasets_text_document{suffix}").write_bytes(b"theirs")
    proc = subprocess.run(["sh", str(script), str(fewer), "Qwen3Tokenizer", "text", str(foreign), str(tok)],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert (foreign / "mmap_qwen3_datasets_text_document.bin").read_bytes() == b"theirs"
    proc = subprocess.run(["sh", str(script), str(folder), "BertTokenizer", "text", str(tmp_path), str(tok)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "TOKENIZER must be one of" in proc.stderr
    proc = subprocess.run(["sh", str(script), str(folder), "Qwen3Tokenizer"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "got 2 argument(s)" in proc.stderr and proc.stderr.count("\n") == 1
    proc = subprocess.run(["sh", str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("Pai-Megatron-Patch's run_make_pretraining_dataset_megatron.sh")


def test_an_empty_document_adds_no_token_and_no_eod(tok, tmp_path, capsys):
    """A record whose text is "" (or a list of empty sentences) was written as a document of one EOD: runs of lone
    EOD tokens in training and an inflated token count. Megatron-LM's and Pai's preprocessing append the EOD only
    to a document that has tokens; the summary says how many were left out."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = make_texts(3, seed=4)
    lines = [{"text": texts[0]}, {"text": ""}, {"text": texts[1]}, {"text": ["", ""]}, {"text": ["", texts[2]]}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rc = main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "p"),
               "--tokenizer", str(tok), "--quiet"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    t = load_tokenizer(tok)
    tokens = sum(len(t.encode(x)) + 1 for x in texts)
    assert f"3 documents, {tokens} tokens, 2 empty documents left out" in out.out, out
    assert _documents(tmp_path / "p_text_document", tok) == texts
    assert len(IndexedDataset(str(tmp_path / "p_text_document")).index.sequence_lengths) == 3
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": [""]}\n')
    _one_line(*run_cli(capsys, "preprocess", "--input", str(tmp_path / "empty.jsonl"), "--output-prefix",
                       str(tmp_path / "q"), "--tokenizer", str(tok)), "has no usable line (every 'text' is empty)")

"""Inputs are checked before they are read (issue 34): config.json and tokenizer files are regular files inside
their folder, of a sane size (a FIFO, ``/dev/zero``, a link out of the folder are refused in one line); tiktoken
files are read by their content, never from tiktoken's cache of their path; a garbage tokenizer is bad input;
no tokenizer code from a folder runs."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patch.errors import UserError
from megatron_patch.input_files import MAX_INPUT_BYTES
from megatron_patch.models.tiny import make_tiny_hf_checkpoint
from tests.convert_helpers import run_cli
from tests.training_helpers import make_tiktoken_file, write_jsonl

REPO = Path(__file__).resolve().parents[1]


class Hung(Exception):
    """A read that blocked (not an OSError, which a library could take for a missing file)."""


@pytest.fixture
def no_hang():
    """Fails a test whose reader blocks on a FIFO, instead of hanging the suite."""
    def hung(*_):
        raise Hung("the reader blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return make_tiny_hf_checkpoint("llama3_1", tmp_path_factory.mktemp("hf") / "llama", seed=3)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    from megatron_patch.training.demo_data import make_texts, make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tok", make_texts(200, seed=1), vocab_size=200)


def _linked_copy(src: Path, folder: Path, skip: tuple[str, ...] = ()) -> Path:
    """``folder``, holding hard links to ``src``'s files (but ``skip``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name not in skip:
            os.link(p, folder / p.name)
    return folder


def _one_line(rc: int, err: str, *words: str) -> None:
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def _plant(path: Path, kind: str, good: Path) -> str:
    """Put ``kind`` at ``path`` in place of the file ``good``; the words its refusal names."""
    if kind == "fifo":
        os.mkfifo(path)
        return "is a FIFO"
    if kind == "link out of the folder":
        outside = path.parent.parent / f"elsewhere-{path.name}"
        outside.write_bytes(good.read_bytes())
        path.symlink_to(outside)
        return "leads outside the folder"
    if kind == "folder":
        path.mkdir()
        return "is a folder"
    with open(path, "wb") as f:  # sparse: no disk, and a reader that does not check would hold it all
        f.truncate(MAX_INPUT_BYTES + 1)
    return "more than"


KINDS = ["fifo", "link out of the folder", "folder", "too large"]


# --- N9: config.json and tokenizer files are regular files inside the folder, of a sane size ------------------

@pytest.mark.parametrize("kind", KINDS)
def test_config_json_must_be_a_regular_file_inside_hf_dir(hf, tmp_path, capsys, no_hang, kind):
    folder = _linked_copy(hf, tmp_path / "hf", skip=("config.json",))
    words = _plant(folder / "config.json", kind, hf / "config.json")
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(folder), "--save-dir", str(tmp_path / "o"))
    _one_line(rc, err, "config.json", words)
    assert not (tmp_path / "o").exists()


def test_config_json_linked_to_dev_zero_is_refused_without_reading_it(hf, tmp_path):
    """In a process of its own, its memory capped: a reader that followed the link would never stop reading."""
    folder = _linked_copy(hf, tmp_path / "hf", skip=("config.json",))
    (folder / "config.json").symlink_to("/dev/zero")
    cap = 3 * 2**30

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "megatron_patch", "convert", "hf2mcore", "--hf-dir", str(folder),
                           "--save-dir", str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
                          preexec_fn=limit_memory, env=env)
    _one_line(proc.returncode, proc.stderr, "config.json", "leads outside the folder", "/dev/zero")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_files_must_be_regular_files_inside_the_folder(tokenizer, tmp_path, capsys, no_hang, kind, name):
    folder = _linked_copy(tokenizer, tmp_path / "tok", skip=(name,))
    words = _plant(folder / name, kind, tokenizer / name)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c"}])
    rc, err = run_cli(capsys, "preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(folder), "--quiet")
    _one_line(rc, err, name, words)


def test_a_tiktoken_file_that_is_a_fifo_is_refused(tmp_path, capsys, no_hang):
    os.mkfifo(tmp_path / "tok.tiktoken")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c"}])
    rc, err = run_cli(capsys, "preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(tmp_path / "tok.tiktoken"), "--quiet")
    _one_line(rc, err, "tok.tiktoken", "is a FIFO")


def test_transformers_reads_no_file_of_the_folder_that_was_not_checked(hf, tmp_path, no_hang):
    """align and parity's HF side: transformers opens generation_config.json (and the tokenizer files) itself."""
    import torch

    from megatron_patch.models.hf_model import load_causal_lm

    folder = _linked_copy(hf, tmp_path / "hf", skip=("generation_config.json",))
    os.mkfifo(folder / "generation_config.json")
    with pytest.raises(UserError, match="generation_config.json is a FIFO"):
        load_causal_lm(folder, torch.float32)


# --- N15: a garbage tokenizer is bad input ---------------------------------------------------------------------

@pytest.mark.parametrize("name, content, words", [
    ("tokenizer.json", b"{\"model\": 42}", "is not a tokenizer the tokenizers library reads"),
    ("tokenizer.json", b"\xff\xfe garbage", "is not UTF-8 text"),
    ("tokenizer_config.json", b"{not json", "is not valid JSON"),
    ("tokenizer_config.json", b"[" * 100_000, "nests its JSON too deeply"),
])
def test_a_garbage_tokenizer_file_is_one_line_and_exit_2(tokenizer, tmp_path, capsys, name, content, words):
    folder = _linked_copy(tokenizer, tmp_path / "tok", skip=(name,))
    (folder / name).write_bytes(content)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c"}])
    rc, err = run_cli(capsys, "preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(folder), "--quiet")
    _one_line(rc, err, name, words)


@pytest.mark.parametrize("content, words", [
    (b"YQ== 0\nnot-base64! 1\n", "line 2 is not 'base64-token rank'"),
    (b"YQ== 0\nYg== 0\n", "two tokens the same rank"),
    (b"\n\n", "holds no tokens"),
])
def test_a_garbage_tiktoken_file_is_one_line_and_exit_2(tmp_path, capsys, content, words):
    (tmp_path / "tok.tiktoken").write_bytes(content)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c"}])
    rc, err = run_cli(capsys, "preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(tmp_path / "tok.tiktoken"), "--quiet")
    _one_line(rc, err, "tok.tiktoken", words)


# --- N5: tiktoken files are read by their content ------------------------------------------------------------

def test_tiktoken_files_are_read_by_their_content_never_from_a_cache_of_their_path(tmp_path, monkeypatch):
    """tiktoken's own loader keeps a file under its path string in its cache folder: another folder's file at the
    same relative path, or the same file edited, would tokenize with the vocabulary read first."""
    from megatron_patch.training.tokenizer import load_tokenizer

    cache = tmp_path / "cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    make_tiktoken_file(tmp_path / "a" / "tok.tiktoken", [])
    make_tiktoken_file(tmp_path / "b" / "tok.tiktoken", [b"ab"])
    monkeypatch.chdir(tmp_path / "a")
    assert load_tokenizer("tok.tiktoken").encode("ab") == [97, 98]
    monkeypatch.chdir(tmp_path / "b")
    other = load_tokenizer("tok.tiktoken")
    assert other.encode("ab") == [256] and other.vocab_size == 258
    make_tiktoken_file(tmp_path / "b" / "tok.tiktoken", [b"ab", b"abab"])  # edited in place
    assert load_tokenizer(tmp_path / "b" / "tok.tiktoken").encode("abab") == [257]
    assert not cache.exists()


# --- N16: no tokenizer code from a folder runs ---------------------------------------------------------------

def test_align_text_file_never_runs_the_folders_tokenizer_code(hf, tokenizer, tmp_path, monkeypatch):
    import transformers.dynamic_module_utils

    from megatron_patch.align.alignment import AlignSettings, make_tokens

    folder = _linked_copy(hf, tmp_path / "hf")
    os.link(tokenizer / "tokenizer.json", folder / "tokenizer.json")
    marker = tmp_path / "ran"
    (folder / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('the folder code ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]},
        "eos_token": "<|endoftext|>"}))
    # As if transformers' "Do you wish to run the custom code?" had been answered yes.
    monkeypatch.setattr("builtins.input", lambda *_: "y")
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat " * 40)
    settings = AlignSettings(hf_dir=str(folder), text_file=str(text), seq_len=16, batch=2)
    try:
        tokens, _ = make_tokens(settings, vocab_size=256)
    finally:
        assert not marker.exists(), "the folder's tokenizer code ran"
    assert tokens.shape == (2, 16)

"""Inputs are checked before they are read (issue 34): config.json and tokenizer files are regular files inside
their folder, of a sane size (a FIFO, ``/dev/zero``, a link out of the folder are refused in one line); tiktoken
files are read by their content, never from tiktoken's cache of their path; a garbage tokenizer is bad input;
no tokenizer code from a folder runs; ``--hf-config`` / ``MP_HF_CONFIG`` that name nothing, a non-float
``torch_dtype`` and data paths with spaces. The manifest's rules (``mpatch verify``) are in test_manifest_rules.py."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patch.errors import UserError
from megatron_patch.input_files import MAX_INPUT_BYTES, check_folder_inputs
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from tests.convert_helpers import run_cli
from tests.training_helpers import launcher_args, make_tiktoken_file, write_jsonl

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
    from megatron_patch.demo_data import make_texts, make_tokenizer

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


def test_a_side_file_that_is_a_fifo_is_refused_not_left_out(hf, tmp_path, capsys, no_hang):
    """The converters carry the tokenizer files along: one that is not a regular file was silently not copied."""
    folder = _linked_copy(hf, tmp_path / "hf")
    os.mkfifo(folder / "tokenizer.json")
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(folder), "--save-dir", str(tmp_path / "o"))
    _one_line(rc, err, "tokenizer.json is a FIFO")
    assert not (tmp_path / "o").exists()


def test_a_tiktoken_file_that_is_a_fifo_is_refused(tmp_path, capsys, no_hang):
    os.mkfifo(tmp_path / "tok.tiktoken")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c"}])
    rc, err = run_cli(capsys, "preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(tmp_path / "tok.tiktoken"), "--quiet")
    _one_line(rc, err, "tok.tiktoken", "is a FIFO")


def test_transformers_reads_no_file_of_the_folder_that_was_not_checked(hf, tmp_path, no_hang):
    """align and parity's HF side: transformers opens generation_config.json (and the tokenizer files) itself."""
    import torch

    from megatron_patch.models.description.hf_model import load_causal_lm

    folder = _linked_copy(hf, tmp_path / "hf", skip=("generation_config.json",))
    os.mkfifo(folder / "generation_config.json")
    with pytest.raises(UserError, match="generation_config.json is a FIFO"):
        load_causal_lm(folder, torch.float32)
    (folder / "generation_config.json").unlink()
    (folder / "tokenizer").mkdir()  # a folder whose name a side file's pattern matches is no side file
    check_folder_inputs(folder)


def _tokenizer_from_elsewhere(root: Path) -> Path:
    """A word-level tokenizer.json outside any tokenizer folder, under a name no pattern checks."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    (root / "elsewhere").mkdir()
    other = Tokenizer(models.WordLevel({"</s>": 0, "a": 1, "[UNK]": 2}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    other.save(str(root / "elsewhere" / "data"))
    return root / "elsewhere" / "data"


@pytest.mark.parametrize("how", ["fast_tokenizer_files", "additional_chat_templates"])
def test_what_transformers_opens_by_a_name_in_a_file_or_a_subfolder_stays_inside_the_folder(tokenizer, tmp_path,
                                                                                             capsys, how):
    """transformers opens the tokenizer.json tokenizer_config.json's ``fast_tokenizer_files`` picks (by version) and
    every additional_chat_templates/*.jinja: a name through a sub-folder (``tokenizer.1.json/../../x``) or a link
    there read a file outside the folder, unchecked, and preprocessing wrote another tokenizer's ids, exit 0."""
    folder = _linked_copy(tokenizer, tmp_path / "tok", skip=("tokenizer_config.json",))
    outside = _tokenizer_from_elsewhere(tmp_path)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    if how == "fast_tokenizer_files":
        (folder / "tokenizer.1.json").mkdir()
        config["fast_tokenizer_files"] = ["tokenizer.1.json/../../elsewhere/data"]
    else:
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "x.jinja").symlink_to(outside)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c"}])
    rc, err = run_cli(capsys, "preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(folder), "--quiet")
    _one_line(rc, err, "which leads outside the folder", str(outside))
    assert not list(tmp_path.glob("p*"))


def test_a_fast_tokenizer_files_entry_inside_the_folder_is_read_as_before(tokenizer, tmp_path, capsys):
    from megatron_patch.tokenizer import load_tokenizer

    folder = _linked_copy(tokenizer, tmp_path / "tok", skip=("tokenizer_config.json",))
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "fast_tokenizer_files": ["tokenizer.json"]}))
    assert load_tokenizer(folder).encode("a b c") == load_tokenizer(tokenizer).encode("a b c")
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "fast_tokenizer_files": "tokenizer.json"}))
    with pytest.raises(UserError, match="'fast_tokenizer_files' must be a list of file names"):
        check_folder_inputs(folder)


# --- N15: a garbage tokenizer is bad input ---------------------------------------------------------------------

@pytest.mark.parametrize("name, content, words", [
    ("tokenizer.json", b"{\"model\": 42}", "is not a tokenizer the tokenizers library reads"),
    ("tokenizer.json", b"\xff\xfe garbage", "is not UTF-8 text"),
    ("tokenizer_config.json", b"{not json", "is not valid JSON"),
    ("tokenizer_config.json", b"[" * 100_000, "nests its JSON too deeply"),
    # more digits than Python's int() reads: an internal error (the hostile audit)
    ("tokenizer_config.json", b'{"model_max_length": ' + b"9" * 5000 + b"}", "is not readable JSON (a number of more than 4300 digits"),
])
def test_a_garbage_tokenizer_file_is_one_line_and_exit_2(tokenizer, tmp_path, capsys, name, content, words):
    folder = _linked_copy(tokenizer, tmp_path / "tok", skip=(name,))
    (folder / name).write_bytes(content)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c"}])
    rc, err = run_cli(capsys, "preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "p"),
                      "--tokenizer", str(folder), "--quiet")
    _one_line(rc, err, name, words)


def _without_end_of_document_names(tokenizer, folder):
    """A copy of ``tokenizer``'s tokenizer.json in ``folder``, its special tokens named none of EOD_CANDIDATES."""
    spec = json.loads((tokenizer / "tokenizer.json").read_text())
    renamed = {t["content"]: f"[{i}]" for i, t in enumerate(spec["added_tokens"])}
    for token in spec["added_tokens"]:
        token["content"] = renamed[token["content"]]
    spec["model"]["vocab"] = {renamed.get(k, k): v for k, v in spec["model"]["vocab"].items()}
    if spec["model"].get("unk_token") in renamed:
        spec["model"]["unk_token"] = renamed[spec["model"]["unk_token"]]
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def test_a_tokenizer_the_locale_names_otherwise_is_said_to_be_so(tokenizer, tmp_path, monkeypatch):
    """Under a Latin-1 locale the tokenizers library opens "mc ü" by its UTF-8 name, another folder's: eval said
    "cannot read the tokenizer in ...: No such file or directory" of a tokenizer.json that is there (the s64
    audit). The line names the locale's encoding where that is the cause; any other failure is said as it is."""
    import shutil

    import transformers

    from megatron_patch.tokenizer import load_hf_tokenizer

    accented = tmp_path / "mc \u00fc"
    shutil.copytree(tokenizer, accented)

    def not_found(*args, **kwargs):
        raise Exception("No such file or directory (os error 2)")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", not_found)
    with pytest.raises(UserError, match="No such file or directory"):
        load_hf_tokenizer(accented)  # a UTF-8 locale here: the library names it as Python does
    monkeypatch.setattr(os, "fsencode", lambda p: os.fspath(p).encode("latin-1", "surrogateescape"))
    monkeypatch.setattr(sys, "getfilesystemencoding", lambda: "iso8859-1")
    with pytest.raises(UserError, match=r"the tokenizers library names files in UTF-8 and this locale names them in "
                                        r"iso8859-1, so .* is another file to it \(a UTF-8 locale, LC_ALL=C.UTF-8"):
        load_hf_tokenizer(accented)
    with pytest.raises(UserError, match="No such file or directory"):
        load_hf_tokenizer(tokenizer)


def test_an_eos_token_the_vocabulary_lacks_is_named(tokenizer, tmp_path):
    """The refusal said 'no eos_token in tokenizer_config.json' of a folder that names one tokenizer.json lacks."""
    from megatron_patch.tokenizer import load_tokenizer

    folder = _without_end_of_document_names(tokenizer, tmp_path / "tok")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    named = re.escape("tokenizer_config.json's eos_token '<|eot|>' is not in tokenizer.json")
    with pytest.raises(UserError, match=named):
        load_tokenizer(folder)


def test_a_special_token_only_transformers_adds_is_refused_in_a_text_that_holds_it(tokenizer, tmp_path, capsys):
    """tokenizer_config.json naming a pad token tokenizer.json lacks: transformers adds it past the file's ids, and
    preprocessing wrote that id (400 of a 400-id file, which no model has a row for), exit 0."""
    from megatron_patch.tokenizer import load_tokenizer

    folder = _linked_copy(tokenizer, tmp_path / "tok", skip=("tokenizer_config.json",))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<|pad|>"}))
    tok = load_tokenizer(folder)
    assert max(tok.encode("The cat sat.")) < tok.vocab_size == 200  # a text without it encodes as before
    with pytest.raises(UserError, match=re.escape("a text holds '<|pad|>', which") + ".*past tokenizer.json's 200 ids"):
        tok.encode("The cat <|pad|> sat.")
    # preprocessing names the line, in a worker or not
    write_jsonl(tmp_path / "in.jsonl", [{"text": "The cat sat."}] * 5 + [{"text": "The cat <|pad|> sat."}])
    for workers in ("1", "2"):
        rc, err = run_cli(capsys, "preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix",
                          str(tmp_path / "p"), "--tokenizer", str(folder), "--workers", workers, "--quiet")
        assert rc == 2 and err.count("\n") == 1 and f"{tmp_path / 'in.jsonl'} line 6: " in err, err
        assert "'<|pad|>'" in err and not list(tmp_path.glob("p_*")), err
    # and SFT data names the record
    from megatron_patch.training.sft_tokens import tokenize_record

    with pytest.raises(UserError, match=re.escape("record 3: ") + ".*" + re.escape("'<|pad|>'")):
        tokenize_record(tok, {"instruction": "Say <|pad|>.", "output": "No."}, "record 3")


def test_a_pipeline_the_folders_class_cannot_run_is_one_line(tmp_path):
    """A byte-level tokenizer.json beside a Gemma config.json: transformers' GemmaTokenizer wants an <unk> the file
    lacks and fails on the text, which preprocessing reported as an internal error ('a bug: please report it')."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from megatron_patch.demo_data import make_texts
    from megatron_patch.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(make_texts(100, seed=0), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "vocab_size": 400}))
    with pytest.raises(UserError, match="the GemmaTokenizer transformers builds cannot encode this text"):
        load_tokenizer(folder).encode("hello there")


@pytest.mark.parametrize("eos_id", [500, -1, 70000, 5])
def test_an_eos_token_id_outside_the_vocabulary_is_one_line_and_exit_2(tokenizer, tmp_path, capsys, eos_id):
    """A folder whose tokenizer names no end-of-document token falls back to config.json's eos_token_id, which
    is untrusted: 500 ended every document with an id the 200-token model has no row for (exit 0), -1 and 70000
    stopped preprocess with an OverflowError. An id inside the vocabulary is taken."""
    folder = _without_end_of_document_names(tokenizer, tmp_path / "tok")
    (folder / "config.json").write_text(json.dumps({"eos_token_id": eos_id}))
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "a b c"}])
    argv = ["preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "p"), "--tokenizer", str(folder),
            "--quiet"]
    if eos_id == 5:
        assert run_cli(capsys, *argv)[0] == 0
        return
    rc, err = run_cli(capsys, *argv)
    _one_line(rc, err, "config.json", f"eos_token_id {eos_id} is outside the tokenizer's 200 ids")
    assert not (tmp_path / "p_text_document.bin").exists()


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
    from megatron_patch.tokenizer import load_tokenizer

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


# --- N19: --hf-config, torch_dtype, data paths with spaces ----------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(hf, tmp_path_factory) -> Path:
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.runtime.distributed import ParallelLayout

    out = tmp_path_factory.mktemp("ck") / "ck"
    hf_to_mcore(hf, out, ParallelLayout(), progress=False)
    return out


@pytest.mark.parametrize("given", ["folder without config.json", "missing file"])
def test_hf_config_that_names_no_config_is_refused_not_ignored(ckpt, tmp_path, capsys, given):
    """The checkpoint describes itself (its sidecar wins), which is why a bad --hf-config went unnoticed."""
    where = tmp_path / "cfg"
    if given == "folder without config.json":
        where.mkdir()
    else:
        where = where / "config.json"
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "o"),
                      "--hf-config", str(where), "--quiet")
    _one_line(rc, err, "not found", "--hf-config takes the model's HF config.json")
    assert not (tmp_path / "o").exists()


def test_mp_hf_config_that_names_no_config_is_refused(hf, ckpt, tmp_path):
    from megatron_patch.training.validation import resolve

    (tmp_path / "empty").mkdir()
    args = launcher_args(PRETRAIN_CHECKPOINT_PATH=str(ckpt), OUTPUT_BASEPATH=str(tmp_path / "out"))
    with pytest.raises(UserError, match="MP_HF_CONFIG takes the model's HF config.json"):
        resolve("llama3_1", args, env={"MP_HF_CONFIG": str(tmp_path / "empty")}, check_paths=False)
    with pytest.raises(UserError, match="there is none: drop MP_HF_CONFIG"):
        resolve("llama3_1", launcher_args(), env={"MP_HF_CONFIG": str(hf)}, check_paths=False)


@pytest.mark.parametrize("key, value", [("torch_dtype", "evil"), ("dtype", "int8"), ("torch_dtype", 16)])
def test_a_config_dtype_that_is_not_a_float_is_refused(hf, tmp_path, capsys, key, value):
    folder = _linked_copy(hf, tmp_path / "hf", skip=("config.json",))
    raw = json.loads((hf / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, key: value}))
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(folder), "--save-dir", str(tmp_path / "o"))
    _one_line(rc, err, f"'{key}' must name a float dtype")


def test_config_dtype_names_the_float_dtype_for_callers_to_default_to():
    from megatron_patch.models.description.config_checks import config_dtype

    assert config_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert config_dtype({"dtype": "float16", "torch_dtype": "float32"}) == "float16"  # 5.x's name wins
    assert config_dtype({"torch_dtype": None}) is None and config_dtype({}) is None


def _mmap_prefix(folder: Path, name: str = "corpus_text_document") -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in (".bin", ".idx"):
        (folder / (name + suffix)).write_bytes(b"")
    return str(folder / name)


def test_a_data_path_with_spaces_is_one_path_and_blends_quote_theirs(tmp_path):
    from megatron_patch.training.validation import resolve

    spaced = _mmap_prefix(tmp_path / "my data")
    plain = _mmap_prefix(tmp_path / "plain")
    out = str(tmp_path / "out")
    cfg = resolve("llama3_1", launcher_args(DATASET_PATH=spaced, VALID_DATASET_PATH=spaced, OUTPUT_BASEPATH=out))
    assert cfg.dataset_path == [spaced] and cfg.dataset_weights is None and cfg.valid_dataset_path == [spaced]
    blend = f'0.3 "{spaced}" 0.7 {plain}'
    cfg = resolve("llama3_1", launcher_args(DATASET_PATH=blend, VALID_DATASET_PATH=blend, OUTPUT_BASEPATH=out))
    assert cfg.dataset_path == [spaced, plain] and cfg.dataset_weights == [0.3, 0.7]
    assert cfg.valid_dataset_path == [spaced, plain] and cfg.valid_dataset_weights == [0.3, 0.7]
    other = _mmap_prefix(tmp_path / "other")
    cfg = resolve("llama3_1", launcher_args(DATASET_PATH=f"{plain} {other}", OUTPUT_BASEPATH=out))
    assert cfg.dataset_path == [plain, other] and cfg.dataset_weights is None
    with pytest.raises(UserError, match=r"read as \d+ paths; quote a path that holds spaces"):
        resolve("llama3_1", launcher_args(DATASET_PATH=f"0.5 {spaced} 0.5 {plain}", OUTPUT_BASEPATH=out))
    with pytest.raises(UserError, match="cannot be split into paths"):
        resolve("llama3_1", launcher_args(DATASET_PATH=f'0.5 "{spaced} 0.5 {plain}', OUTPUT_BASEPATH=out))


def test_sft_data_with_spaces_in_its_path(tmp_path, tokenizer):
    from megatron_patch.training.validation import resolve

    data = write_jsonl(tmp_path / "my sft data.jsonl", [{"prompt": "a", "response": "b"}])
    cfg = resolve("llama3_1", launcher_args(SFT="true", DATASET_PATH=str(data), OUTPUT_BASEPATH=str(tmp_path / "o"),
                                            TRAIN_TOKENS_OR_ITERS="4", WARMUP_TOKENS_OR_ITERS="1"),
                  env={"MP_TOKENIZER": str(tokenizer)})
    assert cfg.dataset_path == [str(data)]


def test_a_link_out_of_a_model_folder_under_any_name_is_refused(tmp_path):
    """transformers' tokenizer classes open files by names of their own (ProphetNet's prophetnet.tokenizer): one
    linked to a private file was read as the vocabulary by `mpatch eval` (the sec audit). A link of any name that
    leads out of the folder is refused; one that stays inside is taken."""
    folder, outside = tmp_path / "model", tmp_path / "private.txt"
    folder.mkdir()
    outside.write_text("secret\n")
    (folder / "config.json").write_text("{}")
    (folder / "vocab-copy.txt").write_text("a\n")
    (folder / "inside-link.txt").symlink_to("vocab-copy.txt")
    check_folder_inputs(folder)
    (folder / "prophetnet.tokenizer").symlink_to(outside)
    with pytest.raises(UserError, match="found 'prophetnet.tokenizer', which leads outside the folder"):
        check_folder_inputs(folder)

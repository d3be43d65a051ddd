"""One line and exit 2 for every bad input (issue 19): each item of the issue as a regular test, and a fuzzed
contract (hypothesis) over config.json fields, safetensors headers, index.json, tracker contents, CLI numbers
and the launcher's positional arguments: every generated input ends in a correct result or in a one-line
``UserError``, never another exception. The library functions are called in process; the examples are
bounded so the whole file stays well under a minute. Inputs the fuzzing found wrong are kept below as
regular tests (``FOUND_BY_FUZZING``)."""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_patch.checkpoint.hf_reader import HFCheckpointReader, read_safetensors_header
from megatron_patch.checkpoint_files.layout import RELEASE, TRACKER_NAME, read_tracker
from megatron_patch.convert.checkpoint import hf_to_mcore
from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.config_checks import check_weights_fit, least_weight_elements
from megatron_patch.models.description.registry import parse_arch
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.runtime.distributed import ParallelLayout
from tests.convert_helpers import leftovers, run_cli

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    return make_tiny_hf_checkpoint("llama3_1", tmp_path_factory.mktemp("hf") / "llama", seed=2)


@pytest.fixture(scope="module")
def config(hf) -> dict:
    return json.loads((hf / "config.json").read_text())


def _one_line(rc: int, err: str, *words: str, code: int = 2) -> None:
    assert rc == code and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def _linked_copy(hf: Path, folder: Path, skip: tuple[str, ...] = ()) -> Path:
    """``folder``, holding hard links to the tiny HF folder's files (but ``skip``)."""
    folder.mkdir(exist_ok=True)
    for p in hf.iterdir():
        if p.name not in skip and not (folder / p.name).exists():
            os.link(p, folder / p.name)
    return folder


def _variant(hf: Path, tmp_path: Path, name: str, **config) -> Path:
    """A copy of the tiny HF folder (weights linked, not copied) with config.json fields replaced."""
    folder = _linked_copy(hf, tmp_path / name, skip=("config.json",))
    raw = json.loads((hf / "config.json").read_text())
    raw.update(config)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


# --- the items, each a regular test ---------------------------------------------------------------

BAD_CONFIGS = {
    "eps-negative": ({"rms_norm_eps": -1}, "'rms_norm_eps' must be > 0"),
    "eps-nan": ({"rms_norm_eps": math.nan}, "'rms_norm_eps' must be a finite number"),
    "eps-string": ({"rms_norm_eps": "1e-5"}, "'rms_norm_eps' must be a number"),
    "theta-negative": ({"rope_theta": -1}, "'rope_theta' must be > 0"),
    "theta-string": ({"rope_theta": "10000"}, "'rope_theta' must be a number"),
    "rope-parameters-string": ({"rope_parameters": "llama3"}, "'rope_parameters' must be a JSON object"),
    "positions-negative": ({"max_position_embeddings": -1}, "'max_position_embeddings' must be between 1"),
    "kv-heads-zero": ({"num_key_value_heads": 0}, "'num_key_value_heads' must be between 1"),
    "layers-1e9": ({"num_hidden_layers": 10**9}, "'num_hidden_layers' must be between 1 and 10,000"),
    "vocab-1e12": ({"vocab_size": 10**12}, "'vocab_size' must be between 1"),
    "layers-beyond-weights": ({"num_hidden_layers": 9000}, "do not belong together"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_values_are_one_line_in_hf2mcore(hf, tmp_path, capsys, name):
    fields, message = BAD_CONFIGS[name]
    folder = _variant(hf, tmp_path, name, **fields)
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(folder), "--save-dir", str(tmp_path / "o"), "--quiet")
    _one_line(rc, err, message)
    assert not (tmp_path / "o").exists() and not leftovers(tmp_path / "o")


def test_a_number_of_more_digits_than_python_reads_is_one_line(hf, tmp_path, capsys):
    """json.loads raises a plain ValueError for an integer of more than 4300 digits (Python's limit on int()): an
    internal error in hf2mcore's config.json and in every safetensors header (the hostile audit)."""
    huge = "9" * 5000
    folder = _variant(hf, tmp_path, "digits", num_hidden_layers="HUGE")
    (folder / "config.json").write_text((folder / "config.json").read_text().replace('"HUGE"', huge))
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(folder), "--save-dir", str(tmp_path / "o"))
    _one_line(rc, err, "config.json is not readable JSON (a number of more than 4300 digits, Python's limit)")
    header = f'{{"w": {{"dtype": "F32", "shape": [{huge}], "data_offsets": [0, 4]}}}}'.encode()
    shard = tmp_path / "x.safetensors"
    shard.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(UserError, match=r"header is not valid JSON: a number of more than 4300 digits") as err:
        read_safetensors_header(shard)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("command", ["parity", "align", "mcore2hf", "inspect"])
def test_every_command_that_reads_a_config_refuses_enormous_values(hf, tmp_path, capsys, command):
    layers = _variant(hf, tmp_path, "layers", num_hidden_layers=10**9)
    vocab = _variant(hf, tmp_path, "vocab", vocab_size=10**12)
    kv0 = _variant(hf, tmp_path, "kv0", num_key_value_heads=0)
    for folder in (layers, vocab, kv0):
        if command in ("parity", "align"):
            argv = [command, "--hf-dir", str(folder)]
        else:
            ckpt = tmp_path / f"ck-{folder.name}"
            hf_to_mcore(hf, ckpt, ParallelLayout(), progress=False)
            sidecar = ckpt / "mpatch_checkpoint.json"
            data = json.loads(sidecar.read_text())
            data["hf_config"] = json.loads((folder / "config.json").read_text())
            sidecar.write_text(json.dumps(data))
            argv = ["inspect", str(ckpt)] if command == "inspect" else \
                ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "o"), "--no-verify"]
        rc, err = run_cli(capsys, *argv)
        _one_line(rc, err, "config.json")


def test_a_config_that_outgrows_its_weights_is_refused_by_mcore2hf(hf, tmp_path, capsys):
    ckpt = tmp_path / "ck"
    hf_to_mcore(hf, ckpt, ParallelLayout(), progress=False)
    sidecar = ckpt / "mpatch_checkpoint.json"
    data = json.loads(sidecar.read_text())
    data["hf_config"]["vocab_size"] = data["vocab_size"] = data["padded_vocab_size"] = 2**30
    sidecar.write_text(json.dumps(data))
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "o"),
                      "--no-verify")
    _one_line(rc, err, "do not belong together")
    # without the sidecar, the tensors themselves answer a --hf-config that does not fit them
    sidecar.unlink()
    big = _variant(hf, tmp_path, "big", vocab_size=2**30)
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(ckpt), "--hf-config", str(big),
                      "--save-dir", str(tmp_path / "o"), "--no-verify")
    _one_line(rc, err, "embedding only")


@pytest.mark.parametrize("layers", [1, 10**9])
def test_a_sidecar_naming_more_mtp_layers_than_its_config_is_refused(hf, tmp_path, capsys, layers):
    """mtp_layers was only checked to be a whole number: 10**9 made mcore2hf plan that many layers (minutes,
    gigabytes) and inspect show the checkpoint as sound. This Llama's config declares none."""
    ckpt = tmp_path / "ck"
    hf_to_mcore(hf, ckpt, ParallelLayout(), progress=False)
    sidecar = ckpt / "mpatch_checkpoint.json"
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "mtp_layers": layers}))
    for argv in (["inspect", str(ckpt)],
                 ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "o"), "--no-verify"]):
        rc, err = run_cli(capsys, *argv)
        _one_line(rc, err, f"'mtp_layers' is {layers}, and the model's config declares 0")


def test_a_newer_releases_sidecar_asks_for_an_upgrade_not_called_damaged(hf, tmp_path, capsys):
    """The version was compared after the fields were read: a newer release's sidecar, with a field this release
    does not know (or a side file it does not carry), was 'malformed ... the checkpoint's sidecar is damaged'."""
    ckpt = tmp_path / "ck"
    hf_to_mcore(hf, ckpt, ParallelLayout(), progress=False)
    sidecar = ckpt / "mpatch_checkpoint.json"
    data = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**data, "sidecar_version": data["sidecar_version"] + 1, "a_later_field": {"x": 1},
                                   "carried_files": [*data.get("carried_files", []), "a_later_side_file.json"]}))
    for argv in (["inspect", str(ckpt)],
                 ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "o"), "--no-verify"]):
        rc, err = run_cli(capsys, *argv)
        _one_line(rc, err, f"has sidecar version {data['sidecar_version'] + 1}; this megatron_patch reads up to")
        assert "upgrade megatron_patch" in err and "damaged" not in err


@pytest.mark.parametrize("lora, said", [
    ("yes", "'lora' has the wrong type or value"),
    ({"base": "x", "spec": {"rank": 4, "alpha": 8}}, "'lora' has the wrong type or value"),
    ({"spec": 5}, "'lora' has the wrong type or value"),
    ({"spec": {"rank": "4", "alpha": 8}, "base": None}, "its spec's 'rank' is of the wrong type or value"),
    ({"spec": {"rank": 4}, "base": None}, "its spec's 'rank or alpha' is missing"),
])
def test_a_sidecar_lora_record_of_the_wrong_shape_is_refused(hf, tmp_path, capsys, lora, said):
    """The sidecar's lora record was read unchecked: inspect and mcore2hf --merge-lora ended in internal errors
    (AttributeError, TypeError, KeyError) on a string, a base that is not a record, a spec that is not one."""
    ckpt = tmp_path / "ck"
    hf_to_mcore(hf, ckpt, ParallelLayout(), progress=False)
    sidecar = ckpt / "mpatch_checkpoint.json"
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()), "lora": lora}))
    merge = ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "o"), "--no-verify",
             "--merge-lora"]
    # inspect shows a spec's fields as they are; the record's own shape it reads, and refuses
    for argv in ([["inspect", str(ckpt)]] if "'lora'" in said else []) + [merge]:
        rc, err = run_cli(capsys, *argv)
        _one_line(rc, err, said)


def test_a_sidecar_nested_too_deeply_for_its_readers_is_refused(hf, tmp_path, capsys):
    """A sidecar JSON parses at 600 levels, and its tokenizer_model_config then went through copy.deepcopy, out of
    stack: mcore2hf and mpatch eval said 'internal error: RecursionError ... a bug'."""
    ckpt = tmp_path / "ck"
    hf_to_mcore(hf, ckpt, ParallelLayout(), progress=False)
    sidecar = ckpt / "mpatch_checkpoint.json"
    nested: dict = {}
    for _ in range(600):
        nested = {"x": nested}
    sidecar.write_text(json.dumps({**json.loads(sidecar.read_text()),
                                   "tokenizer_model_config": {"model_type": "llama", "x": nested}}))
    for argv in (["inspect", str(ckpt)],
                 ["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "o"), "--no-verify"]):
        rc, err = run_cli(capsys, *argv)
        _one_line(rc, err, "mpatch_checkpoint.json is malformed", "nests deeper than 64 levels")


def test_align_and_parity_say_a_mismatched_vocabulary_in_one_line(hf, tmp_path, capsys):
    folder = _variant(hf, tmp_path, "vocab", vocab_size=json.loads((hf / "config.json").read_text())["vocab_size"] - 3)
    for argv in (["align", "--hf-dir", str(folder), "--quiet"], ["parity", "--hf-dir", str(folder)]):
        _one_line(*run_cli(capsys, *argv), "do not belong together")


def test_align_and_parity_numbers(hf, capsys):
    _one_line(*run_cli(capsys, "align", "--hf-dir", str(hf), "--tolerance", "nan"), "--tolerance")
    _one_line(*run_cli(capsys, "align", "--hf-dir", str(hf), "--tolerance", "inf"), "--tolerance")
    _one_line(*run_cli(capsys, "parity", "--hf-dir", str(hf), "--seq-len", "-4"), "--seq-len")
    _one_line(*run_cli(capsys, "align", "--hf-dir", str(hf), "--seq-len", "100000000", "--batch", "100000"),
              "--seq-len")
    _one_line(*run_cli(capsys, "align", "--hf-dir", str(hf), "--seq-len", "200", "--batch", "100000000"),
              "free: lower --batch or --seq-len")


@pytest.mark.parametrize("seed", ["-1", str(2 ** 32), str(2 ** 64)])
def test_a_seed_out_of_range_is_one_line_in_every_command(hf, tmp_path, capsys, seed):
    """--seed 2**64 failed in torch's or numpy's seeding, after the models were built: an internal error (exit 3 in
    align and parity, 1 in demo). Every command takes eval's range now, checked first."""
    for argv in (["align", "--hf-dir", str(hf), "--quiet"], ["parity", "--hf-dir", str(hf)],
                 ["demo", "--families", "llama3_1", "--layouts", "tp1", "--work-dir", str(tmp_path / "demo")]):
        _one_line(*run_cli(capsys, *argv, "--seed", seed), f"--seed must be in 0..4294967295, got {seed}")
    assert not (tmp_path / "demo").exists()


def test_an_empty_output_folder_is_one_line_in_align_and_eval(hf, tmp_path, capsys):
    """`--report-dir ""` / `--output-dir ""` (an unset shell variable) were taken as not given: the run went whole and
    wrote no report, without a word. Refused in one line, before any work, as `--save-dir ""` is."""
    pytest.importorskip("lm_eval")
    _one_line(*run_cli(capsys, "align", "--hf-dir", str(hf), "--report-dir", "", "--quiet"),
              "--report-dir is an empty path")
    _one_line(*run_cli(capsys, "eval", "--load-dir", str(tmp_path / "none"), "--tasks", "t", "--output-dir", ""),
              "--output-dir is an empty path")


def test_duplicate_tensors_across_files_name_both_files(hf, tmp_path, capsys):
    folder = _linked_copy(hf, tmp_path / "dup", skip=("model.safetensors.index.json",))
    weights = sorted(folder.glob("*.safetensors"))
    os.link(weights[0], folder / "zz-stale-copy.safetensors")
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(folder), "--save-dir", str(tmp_path / "o"))
    _one_line(rc, err, weights[0].name, "zz-stale-copy.safetensors", "remove the stale copy")


def _indexed(hf: Path, tmp_path: Path, weight_map) -> Path:
    folder = _linked_copy(hf, tmp_path / "indexed")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("mutation,message", [
    ("dotdot", "leads outside the folder"), ("absolute", "leads outside the folder"),
    ("list", "no 'weight_map' table"), ("number", "not a file name"),
])
def test_index_entries_that_leave_the_folder_or_are_malformed(hf, tmp_path, capsys, mutation, message):
    names = HFCheckpointReader(hf).keys()
    shard = sorted(hf.glob("*.safetensors"))[0]
    outside = tmp_path / "elsewhere.safetensors"
    os.link(shard, outside)
    weight_map = {n: shard.name for n in names}
    first = names[0]
    if mutation == "dotdot":
        weight_map[first] = "../elsewhere.safetensors"
    elif mutation == "absolute":
        weight_map[first] = str(outside)
    elif mutation == "list":
        weight_map = [[n, shard.name] for n in names]
    else:
        weight_map[first] = 7
    folder = _indexed(hf, tmp_path, weight_map)
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(folder), "--save-dir", str(tmp_path / "o"))
    _one_line(rc, err, message)


@pytest.mark.parametrize("target, said", [("/etc/passwd", "leads outside the folder"),
                                          ("tokenizer.json", "cannot be followed (a symlink loop)")])
def test_a_symlinked_side_file_that_leaves_the_folder_is_refused(hf, tmp_path, capsys, target, said):
    folder = _linked_copy(hf, tmp_path / "linked", skip=("tokenizer.json",))
    (folder / "tokenizer.json").symlink_to(target)  # or to itself: an internal error (the hostile audit)
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(folder), "--save-dir", str(tmp_path / "o"))
    _one_line(rc, err, "tokenizer.json", said)
    assert not (tmp_path / "o").exists()


def test_the_hub_cache_layout_of_symlinks_into_blobs_is_accepted(hf, tmp_path, capsys):
    snapshot = tmp_path / "models--x" / "snapshots" / "abc"
    blobs = tmp_path / "models--x" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, p in enumerate(sorted(hf.iterdir())):
        os.link(p, blobs / f"blob{i}")
        (snapshot / p.name).symlink_to(f"../../blobs/blob{i}")
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(snapshot), "--save-dir", str(tmp_path / "o"), "--quiet")
    assert rc == 0, err


def _safetensors(path: Path, header: dict, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_a_tensor_name_with_a_newline_stays_one_line(tmp_path):
    """Found by test_fuzz_safetensors_headers: the name was quoted as is, and the message broke in two."""
    path = _safetensors(tmp_path / "n.safetensors", {"a\nb": {}})
    with pytest.raises(UserError) as exc:
        read_safetensors_header(path)
    assert "\n" not in str(exc.value) and "'a\\nb'" in str(exc.value)


def test_non_dict_metadata_is_refused(tmp_path):
    path = _safetensors(tmp_path / "m.safetensors", {"__metadata__": ["pt"], "w": {
        "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    with pytest.raises(UserError, match="__metadata__"):
        read_safetensors_header(path)


@pytest.mark.parametrize("text", ["²", "١٢", "9" * 5000, "-3", "1.5", "", "release\nrelease"])
def test_tracker_that_is_not_a_number_is_one_line_everywhere(hf, tmp_path, capsys, text):
    ckpt = tmp_path / "ck"
    hf_to_mcore(hf, ckpt, ParallelLayout(), progress=False)
    (ckpt / TRACKER_NAME).write_text(text)
    with pytest.raises(UserError, match="neither 'release' nor an iteration number|damaged"):
        read_tracker(ckpt)
    for argv in (["convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "o")],
                 ["inspect", str(ckpt)]):
        rc, err = run_cli(capsys, *argv)
        assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    from megatron_patch.training.run_state import latest_iteration  # resume's own reading

    try:
        latest_iteration(ckpt)
    except UserError as exc:
        assert "\n" not in str(exc)


def test_internal_errors_are_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    from megatron_patch.cli import families

    def broken(args):
        raise KeyError("boom")

    monkeypatch.setattr(families, "run", broken)
    monkeypatch.setattr("megatron_patch.cli.families.register", _register_with(broken))
    rc, err = run_cli(capsys, "families")
    _one_line(rc, err, "internal error: KeyError", "MPATCH_DEBUG=1", code=1)
    monkeypatch.setenv("MPATCH_DEBUG", "1")
    rc, err = run_cli(capsys, "families")
    assert rc == 1 and "Traceback" in err



def test_a_missing_dependency_says_what_to_install_in_one_line(monkeypatch, capsys):
    """The launchers put the repository on PYTHONPATH, so a Python without the project installed imported
    megatron_patch and stopped at its first dependency as "internal error: ModuleNotFoundError ... (a bug)". A
    missing package is now one line naming it and this Python (exit 2); a missing module of the project itself is
    still a bug."""
    from megatron_patch.cli import families

    def lacks(name):
        def run(args):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)
        return run

    for name, code, words in (("xxhash", 2, ("the Python package 'xxhash' is not installed in", "pip install -e .")),
                              ("megatron_patch.gone", 1, ("internal error: ModuleNotFoundError", "a bug"))):
        monkeypatch.setattr("megatron_patch.cli.families.register", _register_with(lacks(name)))
        rc, err = run_cli(capsys, "families")
        _one_line(rc, err, *words, code=code)

def _register_with(fn):
    def register(subparsers):
        p = subparsers.add_parser("families")
        p.set_defaults(run=fn)
    return register


@pytest.mark.parametrize("argv, unbuffered", [(["families"], ""), (["--help"], ""), (["families"], "1")],
                         ids=["families", "help", "families-unbuffered"])
def test_a_closed_pipe_ends_quietly(argv, unbuffered):
    """The reader is gone before anything is written, so every write fails: at the final flush of output that
    fit Python's buffer (both outputs here do), or inside the command where stdout is unbuffered. Either way
    the exit status a shell gives a process ended by SIGPIPE, and nothing on stderr. (With `| head -1`
    which one happens is a race.)"""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), **({"PYTHONUNBUFFERED": "1"} if unbuffered else {}))
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "megatron_patch", *argv], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (141, ""), proc.stderr


def test_a_command_started_without_stdout_or_stdin_runs():
    """`mpatch families >&- <&-` (a daemon, a cron job): Python leaves sys.stdout None, and the final flush ended
    the command in an internal error; its output goes nowhere now."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(["bash", "-c", 'exec "$@" >&- <&-', "bash", sys.executable, "-m", "megatron_patch",
                           "families"], stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr


# --- the fuzzed contract -----------------------------------------------------------------------------------

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                  st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                           max_leaves=6)
CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
               "rope_scaling", "rope_parameters", "tie_word_embeddings", "hidden_act", "model_type", "architectures",
               "partial_rotary_factor", "mlp_bias", "attention_bias", "num_experts", "num_experts_per_tok",
               "moe_intermediate_size", "mlp_only_layers", "decoder_sparse_step", "norm_topk_prob"]
ROPE_FIELDS = st.fixed_dictionaries({}, optional={
    "rope_type": st.sampled_from(["default", "linear", "llama3", "yarn", "dynamic", 3]),
    "factor": JSON_SCALARS, "low_freq_factor": JSON_SCALARS, "high_freq_factor": JSON_SCALARS,
    "original_max_position_embeddings": JSON_SCALARS, "rope_theta": JSON_SCALARS})

# Inputs this fuzzing found breaking the contract in the code before issue 19 (run against main's parse_arch:
# a traceback, or a model accepted with impossible values), kept as regular tests.
FOUND_BY_FUZZING = [
    {"max_position_embeddings": -1.5, "rope_theta": -1.5},   # accepted: negative positions and theta
    {"head_dim": {"": []}},                                   # accepted: a dict as the head dimension
    {"num_key_value_heads": "\x98d"},                        # TypeError
    {"max_position_embeddings": {"": 0}},                     # TypeError
    {"rope_parameters": [[]]},                                # AttributeError ('list' has no 'get')
    {"architectures": 5, "model_type": None},                 # TypeError ('int' is not iterable)
]


def _check_arch(arch: Arch) -> None:
    assert isinstance(arch, Arch)
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        assert isinstance(getattr(arch, f), int) and getattr(arch, f) >= 1
    assert math.isfinite(arch.norm_eps) and arch.norm_eps > 0 and arch.rope_theta > 0


@FUZZ
@given(changes=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUES, max_size=4), rope=ROPE_FIELDS,
       family=st.sampled_from(["llama3_1", "qwen2_moe", "qwen3", "deepseek_v3"]))
def test_fuzz_config_fields(family, changes, rope):
    from megatron_patch.models.description.registry import get_family

    raw = {**get_family(family).tiny_config, **changes}
    if rope:
        raw["rope_parameters"] = {**rope}
    try:
        arch = parse_arch(raw)
    except UserError as exc:
        assert "\n" not in str(exc)
        return
    _check_arch(arch)
    try:  # sizes against a small checkpoint: refused in one line, or it fits
        check_weights_fit(arch, 10**6, "the test's files")
    except UserError as exc:
        assert least_weight_elements(arch) > 10**6 and "\n" not in str(exc)


@pytest.mark.parametrize("changes", FOUND_BY_FUZZING)
def test_inputs_found_by_fuzzing(changes):
    from megatron_patch.models.description.registry import get_family

    raw = {**get_family("llama3_1").tiny_config, **changes}
    try:
        _check_arch(parse_arch(raw))
    except UserError as exc:
        assert "\n" not in str(exc)


TAGS = st.sampled_from(["F32", "BF16", "F16", "I64", "F8_E4M3", "X9", 5])
ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": TAGS, "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=3), JSON_SCALARS),
    "data_offsets": st.one_of(st.lists(st.integers(-4, 64), min_size=0, max_size=3), JSON_SCALARS)})


@FUZZ
@given(header=st.dictionaries(st.text(max_size=6), st.one_of(ENTRY, JSON_VALUES), max_size=4),
       data=st.binary(max_size=64), length_delta=st.integers(-3, 3))
def test_fuzz_safetensors_headers(header, data, length_delta):
    with tempfile.TemporaryDirectory() as tmp:
        raw = json.dumps(header).encode()
        path = Path(tmp) / "x.safetensors"
        path.write_bytes(struct.pack("<Q", max(0, len(raw) + length_delta)) + raw + data)
        try:
            tensors = read_safetensors_header(path)
        except UserError as exc:
            assert "\n" not in str(exc)
            return
        for stored in tensors.values():  # accepted: every tensor lies inside the file
            assert stored.offset + stored.nbytes <= path.stat().st_size


@FUZZ
@example(index={"weight_map": {"w": "\n"}})  # found by this test: a file name with a line break broke the message
@example(index={"weight_map": {"w": "\x00"}})  # found by this test: a NUL byte made resolve() raise ValueError
@given(index=st.one_of(JSON_VALUES, st.fixed_dictionaries({"weight_map": st.one_of(
    JSON_VALUES, st.dictionaries(st.sampled_from(["w", "v", "u"]), st.one_of(
        st.sampled_from(["a.safetensors", "../a.safetensors", "/etc/passwd", "b.safetensors", ""]), JSON_SCALARS),
        max_size=3))})))
def test_fuzz_index_json(index):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "m"
        folder.mkdir()
        _safetensors(folder / "a.safetensors", {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
        _safetensors(Path(tmp) / "a.safetensors", {"v": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        try:
            reader = HFCheckpointReader(folder)
        except UserError as exc:
            assert "\n" not in str(exc)
            return
        assert all(Path(reader.stored(k).path).parent == folder for k in reader.keys())


@FUZZ
@given(text=st.one_of(st.text(max_size=20), st.integers(-10, 10**13).map(str), st.just(RELEASE)))
@example(text="²")
@example(text="9" * 5000)
def test_fuzz_tracker_contents(text):
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, TRACKER_NAME).write_text(text)
        try:
            value = read_tracker(tmp)
        except UserError as exc:
            assert "\n" not in str(exc)
            return
        assert value == RELEASE or (isinstance(value, int) and value >= 0)


NUMBER_TEXT = st.one_of(st.integers(-10**12, 10**12).map(str), st.floats(allow_nan=True).map(str),
                        st.sampled_from(["1e8", "0x10", "٣", "²", "", " 4", "nan", "-inf", "5GB", "0GB", "1e400MB"]),
                        st.text(max_size=5))


@FUZZ
@given(size=NUMBER_TEXT)
def test_fuzz_max_shard_size(size):
    from megatron_patch.convert.hf_writer import parse_size

    try:
        value = parse_size(size)
    except UserError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(value, int) and value >= 1


@FUZZ
@given(seq=NUMBER_TEXT, batch=NUMBER_TEXT, tolerance=NUMBER_TEXT, tp=NUMBER_TEXT)
def test_fuzz_align_numbers(hf, capsys, seq, batch, tolerance, tp):
    """align validates every number before running anything; what argparse refuses exits 2 with its usage."""
    from megatron_patch.align import alignment

    calls = []
    real = alignment.validate

    def validate_only(s):
        calls.append(real(s))
        raise UserError("validated")  # stop before the models run

    alignment.validate = validate_only
    try:
        rc, err = run_cli(capsys, "align", "--hf-dir", str(hf), "--seq-len", seq, "--batch", batch,
                          "--tolerance", tolerance, "--tp", tp, "--quiet")
    except SystemExit as exc:  # argparse: usage plus one error line, exit 2
        assert exc.code == 2 and "Traceback" not in capsys.readouterr().err
        return
    finally:
        alignment.validate = real
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err


LAUNCHER_TOKENS = st.one_of(st.sampled_from(["cpu", "dsw", "dlc", "tiny", "8B", "auto", "1", "2", "0", "-1", "true",
                                             "false", "none", "sel", "full", "fp32", "bf16", "fp8", "1e-3", "nan",
                                             "inf", "1e400", "²", "999999999999", "static:0.5", "auto", ""]),
                            st.text(max_size=6))


@FUZZ
@given(data=st.data())
def test_fuzz_launcher_arguments(data):
    from megatron_patch.training.launcher_args import arg_names
    from megatron_patch.training.validation import resolve
    from tests.training_helpers import launcher_args

    family = data.draw(st.sampled_from(["llama3_1", "qwen2_moe"]))
    names = arg_names(family)
    argv = launcher_args(family)
    for i in data.draw(st.lists(st.integers(0, len(names) - 1), max_size=3)):
        argv[i] = data.draw(LAUNCHER_TOKENS)
    if data.draw(st.booleans().filter(lambda b: True)) and data.draw(st.integers(0, 9)) == 0:
        argv = argv[:-1]
    try:
        resolve(family, argv, env={}, check_paths=False)
    except UserError as exc:
        assert "\n" not in str(exc)


def test_an_unknown_option_of_a_command_is_one_line_naming_the_command(capsys):
    """argparse named an unknown option under the top-level usage ('usage: mpatch [-h] [--version] COMMAND ...'),
    which lists no option of the command: two lines pointing at the wrong help."""
    for argv, words in ((["convert", "hf2mcore", "--hf-dir", "x", "--save-dir", "y", "--bogus"],
                         ("mpatch convert: error: unrecognized arguments: --bogus", "'mpatch convert hf2mcore --help'")),
                        (["verify", "a", "b"], ("mpatch verify: error: unrecognized arguments: b", "'mpatch verify --help'"))):
        rc, err = run_cli(capsys, *argv)
        _one_line(rc, err, *words)


def test_an_uneven_pipeline_is_pointed_to_where_it_is_taken(tmp_path, capsys):
    """hf2mcore --pp 4 of a 30-layer model was told "or MP_PP0_LAYERS=6", which hf2mcore never reads: the same
    refusal came back with it set. The commands without an uneven first stage point to the launcher, which takes
    it, and to a torch_dist conversion at any PP."""
    from megatron_patch.models.description.arch import validate_layout

    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf", num_hidden_layers=5)
    rc, err = run_cli(capsys, "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(tmp_path / "ck"),
                      "--pp", "2", "--quiet")
    assert rc == 2 and "PP=2 does not divide the 5 layers: choose a PP that divides 5 (the training launcher takes " \
        "PP=2 with MP_PP0_LAYERS=" in err and ", or MP_PP0_LAYERS" not in err, err
    with pytest.raises(UserError, match=r"choose a PP that divides 5, or MP_PP0_LAYERS=\d"):  # the launcher's words
        validate_layout(parse_arch(hf), ParallelLayout(pp=2))


@pytest.mark.parametrize("family, over, refused", [
    ("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": True}, "(softmax over the chosen expert)"),
    ("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": False}, None),  # the chosen expert's probability
    ("mixtral", {"num_experts_per_tok": 1}, "(softmax over the chosen expert)"),
    ("deepseek_v3", {"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True},
     "(norm_topk_prob)"),
    ("deepseek_v3", {"num_experts_per_tok": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": False}, None),
])
def test_top1_routing_megatron_core_cannot_weigh_is_one_line(family, over, refused):
    """Top-1 routing whose one weight transformers normalises to 1: megatron-core's post-softmax router raised its
    own ValueError (an internal error in hf2mcore and align), and its sigmoid router kept the sigmoid score as the
    weight (a silently other model: NOT aligned at rel_l2 0.3). The chosen expert's probability is supported."""
    from megatron_patch.models.blocks.builder import transformer_config
    from megatron_patch.models.description.registry import families, parse_arch
    from megatron_patch.runtime import ParallelLayout

    arch = parse_arch({**families()[family].tiny_config, **over})
    if refused is None:
        assert transformer_config(arch, ParallelLayout()).moe_router_topk == 1
    else:
        with pytest.raises(UserError, match=re.escape(refused) + ", which megatron-core's router does not compute"):
            transformer_config(arch, ParallelLayout())


def test_families_names_each_launcher_with_every_argument_count_it_takes(capsys):
    """README: `mpatch families` prints the launchers; the text named none, and its one count per family
    understated Gemma 4's (25 or 27) and Qwen3's (26 or 27) launchers (the rdoc audit)."""
    from megatron_patch.cli import main

    assert main(["families"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[2:]}
    assert "run_mcore_gemma4.sh: 25 or 27 (ETP, EP after CP)" in rows["gemma4"], rows["gemma4"]
    assert "run_mcore_qwen3.sh: 26 (EP after CP) or 27 (ETP, EP after CP)" in rows["qwen3"], rows["qwen3"]
    assert "run_mcore_llama3_1.sh: 25" in rows["llama3_1"], rows["llama3_1"]


def test_a_folder_nested_deeper_than_pythons_recursion_is_refused_in_one_line(hf, tmp_path, capsys):
    """A folder 1100 levels deep inside a checkpoint: os.walk and Path.rglob recurse per level on Python 3.11, and
    `mpatch verify` and `mcore2hf` ended in "internal error: RecursionError". Walked without recursion, it is an
    unlisted folder, refused in one line."""
    ckpt = tmp_path / "ck"
    hf_to_mcore(hf, ckpt, ParallelLayout(), progress=False)
    levels = [ckpt / "release" / "/".join(["d"] * n) for n in range(1, 1101)]
    for level in levels:  # made and removed level by level: os.makedirs and shutil.rmtree recurse too
        level.mkdir()
    (levels[-1] / "x").write_text("x")
    try:
        rc, err = run_cli(capsys, "verify", str(ckpt))
        _one_line(rc, err, "does not list")
        rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(ckpt), "--save-dir", str(tmp_path / "o"))
        _one_line(rc, err, "does not list")
    finally:
        (levels[-1] / "x").unlink()
        for level in reversed(levels):
            level.rmdir()


def test_a_run_folder_or_an_hf_folder_given_as_a_checkpoint_is_named_as_such(tmp_path, capsys):
    """OUTPUT_BASEPATH or an HF model folder given where a checkpoint goes was only "not a Megatron checkpoint", naming
    neither RUN/final nor hf2mcore (the newuser audit). A run stopped before its end has no final/ to name (the
    upgrade audit: it was named all the same)."""
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "log").mkdir()
    _one_line(*run_cli(capsys, "inspect", str(run)), "is not a Megatron checkpoint",
              "a training run's folder (OUTPUT_BASEPATH) with no exported model yet (final/ is written when the run "
              f"ends: launch it again to go on); its checkpoints are in {run / 'checkpoint'}")
    (run / "final").mkdir()
    _one_line(*run_cli(capsys, "inspect", str(run)), "is not a Megatron checkpoint",
              f"a training run's folder (OUTPUT_BASEPATH); its exported model is {run / 'final'}, its checkpoints "
              f"{run / 'checkpoint'}")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    _one_line(*run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(hf), "--save-dir", str(tmp_path / "out")),
              "a Hugging Face model folder; convert it first (mpatch convert hf2mcore")
    (tmp_path / "empty").mkdir()
    rc, err = run_cli(capsys, "inspect", str(tmp_path / "empty"))
    assert rc == 2 and err.rstrip().endswith("iter_XXXXXXX or release folder"), err

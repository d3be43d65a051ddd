"""The launchers' argument validation and dry runs: no process starts, so these are fast.

Each bad input must be refused before anything starts, with a one-line message that names what to
change; each representative flag combination must turn into the expected megatron-core settings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_patch.cli import main
from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import families, parse_arch
from megatron_patch.runtime.machine import Capabilities
from megatron_patch.training.launcher_args import arg_names, parse_count
from megatron_patch.training.machine_checks import machine_problems
from megatron_patch.training.validation import resolve
from tests.training_helpers import launcher_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture()
def data(tmp_path):
    """Files the path checks accept (their content is not read by resolve)."""
    prefix = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{suffix}").write_bytes(b"")
    sft = tmp_path / "sft.jsonl"
    sft.write_text('{"prompt": "a", "response": "b"}\n')
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text("{}")
    return {"prefix": str(prefix), "sft": str(sft), "tok": str(tok), "out": str(tmp_path / "out")}


def _args(data, family="llama3_1", **over):
    over.setdefault("DATASET_PATH", data["prefix"])
    over.setdefault("OUTPUT_BASEPATH", data["out"])
    return launcher_args(family, **over)


def test_launchers_take_25_26_27_arguments_in_the_reference_order():
    assert len(arg_names("llama3_1")) == 25
    assert arg_names("qwen2")[12] == "EP" and len(arg_names("qwen2")) == 26
    assert arg_names("qwen2_moe")[12:14] == ["ETP", "EP"] and len(arg_names("qwen2_moe")) == 27
    assert arg_names("mixtral")[12:14] == ["ETP", "EP"] and len(arg_names("mixtral")) == 27
    assert arg_names("llama3_1")[-1] == "OUTPUT_BASEPATH" and arg_names("llama3_1")[0] == "ENV"


@pytest.mark.parametrize("family", list(families()))
def test_every_family_has_its_launcher(family):
    """Each registered family's launcher exists, runs its own family, and takes the argument list derived
    from the family: MoE families put ETP then EP after CP (27), dense ones at most EP (25 or 26)."""
    fam = families()[family]
    script = os.path.join(REPO, fam.launcher)
    assert os.access(script, os.X_OK), script
    moe = parse_arch(fam.tiny_config).is_moe
    names = arg_names(family)
    assert names[12:12 + len(fam.launcher_parallel_args)] == list(fam.launcher_parallel_args)
    assert len(names) == (27 if moe else 25 + len(fam.launcher_parallel_args))
    if moe:
        assert fam.launcher_parallel_args == ("ETP", "EP")
    out = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"usage: {fam.launcher} " + " ".join(names) in out.stdout


# (family, overrides, environment, a piece of the expected message)
BAD = [
    ("llama3_1", dict(ENV="local"), {}, "ENV must be one of dsw | dlc | cpu, got 'local'"),
    ("llama3_1", dict(MODEL_SIZE="13B"), {}, "MODEL_SIZE for llama3_1 must be one of 1B | 3B | 8B | 70B | 405B | Mistral-7B | tiny | auto"),
    ("qwen2", dict(MODEL_SIZE="8B"), {}, "MODEL_SIZE for qwen2 must be one of 0.5B | 1.5B"),
    ("llama3_1", dict(BATCH_SIZE="two"), {}, "BATCH_SIZE must be an integer, got 'two'"),
    ("llama3_1", dict(BATCH_SIZE="0"), {}, "BATCH_SIZE must be >= 1"),
    ("llama3_1", dict(LR="fast"), {}, "LR must be a number"),
    ("llama3_1", dict(MIN_LR="1e-2"), {}, "MIN_LR (0.01) must not exceed LR"),
    ("llama3_1", dict(PR="fp4"), {}, "PR must be one of fp16 | bf16 | fp8 | fp32"),
    ("llama3_1", dict(SP="yes please"), {}, "SP must be true or false (yes/no and 1/0 are taken too), got 'yes please'"),
    ("llama3_1", dict(TP="2"), {"MP_TP_COMM_OVERLAP": "true"}, "TP communication overlap needs sequence parallelism"),
    ("llama3_1", dict(DO="false"), {"MP_OVERLAP_PARAM_GATHER": "true"}, "param-gather overlap needs the distributed optimizer"),
    ("llama3_1", dict(AC="partial"), {}, "AC must be one of sel | full | offload | none"),
    ("llama3_1", dict(OPTIMIZER_OFFLOAD="1.5"), {}, "OPTIMIZER_OFFLOAD must be false, static, auto or a fraction"),
    ("llama3_1", dict(OPTIMIZER_OFFLOAD="0.5"), {"MP_OFFLOAD_PROBE_SCRIPT": "/x.json"},
     "MP_OFFLOAD_PROBE_SCRIPT tunes OPTIMIZER_OFFLOAD=auto's decisions, and OPTIMIZER_OFFLOAD is 0.5: set "
     "OPTIMIZER_OFFLOAD=auto or drop MP_OFFLOAD_PROBE_SCRIPT"),
    ("llama3_1", dict(OPTIMIZER_OFFLOAD="false"), {"MP_OFFLOAD_MARGIN_GB": "4"},
     "MP_OFFLOAD_MARGIN_GB tunes OPTIMIZER_OFFLOAD=auto's decisions, and OPTIMIZER_OFFLOAD is false"),
    ("llama3_1", dict(OPTIMIZER_OFFLOAD="static"), {"MP_OFFLOAD_PATIENCE": "4"},
     "MP_OFFLOAD_PATIENCE tunes OPTIMIZER_OFFLOAD=auto's decisions, and OPTIMIZER_OFFLOAD is static"),
    ("llama3_1", dict(OPTIMIZER_OFFLOAD="auto"), {"MP_OFFLOAD_PROBE_SCRIPT": "/nonexistent.json"},
     "MP_OFFLOAD_PROBE_SCRIPT /nonexistent.json not found"),
    ("llama3_1", dict(), {"MP_OFFLOAD_NUMERICS": "precise"}, "MP_OFFLOAD_NUMERICS must be one of fast | exact"),
    ("llama3_1", dict(), {"MP_GPU_MEMORY_GB": "-3"}, "MP_GPU_MEMORY_GB must be a finite number >= 0"),
    ("llama3_1", dict(TP="3"), {}, "TP=3 does not divide the 4 attention heads"),
    ("llama3_1", dict(PP="3"), {}, "PP=3 does not divide the 4 layers: choose a PP that divides 4, or "
     "MP_PP0_LAYERS=2 (the first stage 2 layers, the 2 others 1 layer each)"),
    ("qwen2_moe", dict(EP="3"), {}, "EP=3 does not divide the 4 experts"),
    ("qwen2_moe", dict(TP="2", EP="2", ETP="1", GLOBAL_BATCH_SIZE="8"), {}, "needs sequence parallelism: set SP=true"),
    ("deepseek_v3", dict(TP="2"), {}, "a MoE model trained with TP > 1 needs sequence parallelism: set SP=true"),
    ("qwen2", dict(EP="2"), {}, "apply only to MoE models (EP=2), set EP=1"),
    ("llama3_1", dict(GLOBAL_BATCH_SIZE="7"), {}, "GLOBAL_BATCH_SIZE (7) must be a multiple of BATCH_SIZE*DP"),
    ("llama3_1", dict(TRAIN_TOKENS_OR_ITERS="100"), {}, "less than one iteration"),
    ("llama3_1", dict(TRAIN_TOKENS_OR_ITERS="lots"), {}, "TRAIN_TOKENS_OR_ITERS must be a count"),
    ("llama3_1", dict(WARMUP_TOKENS_OR_ITERS="1e9"), {}, "must be shorter than training"),
    ("llama3_1", dict(SEQ_LEN="512"), {}, "sequence length 512 exceeds the model's 256 positions"),
    ("llama3_1", dict(MODEL_SIZE="auto"), {}, "MODEL_SIZE=auto takes the architecture from PRETRAIN_CHECKPOINT_PATH"),
    ("llama3_1", dict(DATASET_PATH="/nonexistent/corpus"), {}, "mmap data /nonexistent/corpus.bin not found"),
    ("llama3_1", dict(DATASET_PATH="PREFIX.bin"), {}, "names one file of a .bin/.idx pair: give the pair's prefix, "),
    # With SFT=true an mmap prefix is Pai's SFT idxmap, checked before any rank starts (tests/test_sft_formats.py).
    ("llama3_1", dict(SFT="true"), {"MP_DATASET_TYPE": "mmap"}, "is not an index written by megatron-core"),
    ("llama3_1", dict(), {"MP_DATASET_TYPE": "raw"}, "MP_DATASET_TYPE=raw (JSON data) is for SFT"),
    ("llama3_1", dict(SFT="true", DATASET_PATH="SFT"), {}, "SFT needs a tokenizer"),
    # documents are cut at the tokenizer's end-of-document id, which pretraining data does not record
    ("llama3_1", dict(), {"MP_SFT_PACKING": "true"}, "MP_SFT_PACKING=true in pretraining keeps documents apart at "
     "the tokenizer's end-of-document token: set MP_TOKENIZER"),
    ("llama3_1", dict(SFT="true", PAD_LEN="128", DATASET_PATH="SFT"), {"MP_TOKENIZER": "TOK"}, "PAD_LEN (128) must not exceed SEQ_LEN"),
    # pretraining reads MP_TOKENIZER only for the files its export carries: a mistyped one left the export without
    ("llama3_1", dict(), {"MP_TOKENIZER": "/nonexistent/tok"}, "MP_TOKENIZER /nonexistent/tok not found: give the "
     "tokenizer folder whose files the run's checkpoints and export carry, or leave MP_TOKENIZER unset"),
    ("llama3_1", dict(), {"MP_VP_CHUNKS": "2"}, "MP_VP_CHUNKS=2 (virtual pipeline) needs PP > 1"),
    ("llama3_1", dict(PP="2"), {"MP_VP_CHUNKS": "4"}, "MP_VP_CHUNKS=4 with PP=2 needs the 4 layers to split into PP*VP=8"),
    ("llama3_1", dict(PP="2", GLOBAL_BATCH_SIZE="6"), {"MP_VP_CHUNKS": "2"}, "micro-batches per step, GLOBAL_BATCH_SIZE/(BATCH_SIZE*DP) = 3, to be a multiple of PP=2"),
    ("llama3_1", dict(PP="2"), {"MP_VP_CHUNKS": "2", "MP_PP0_LAYERS": "1"}, "MP_VP_CHUNKS and MP_PP0_LAYERS cannot be combined"),
    ("llama3_1", dict(PP="2"), {"MP_PP0_LAYERS": "4"}, "a first stage of 4 of the 4 layers leaves 0 that PP-1=1 stages cannot share evenly: try MP_PP0_LAYERS=2"),
    ("llama3_1", dict(PR="bf16"), {"MP_FP8_RECIPE": "delayed"}, "MP_FP8_RECIPE=delayed needs PR=fp8"),
    ("llama3_1", dict(PR="fp8"), {"MP_FP8_RECIPE": "fancy"}, "MP_FP8_RECIPE must be one of delayed"),
    ("llama3_1", dict(SAVE_INTERVAL="-5"), {}, "SAVE_INTERVAL must be >= 1"),
    ("llama3_1", dict(PR="bf16"), {"MP_LOSS_SCALE_WINDOW": "3"}, "MP_LOSS_SCALE_WINDOW applies to PR=fp16"),
    ("llama3_1", dict(), {"MP_INJECT_FAULT": "crash@3"}, "MP_INJECT_FAULT item 'crash@3' must be KIND@ITERATION"),
    # Checked up front since issue 14; megatron-core refused these only after every rank had started.
    ("llama3_1", dict(AC="offload", PP="2"), {}, "AC=offload (activation CPU offloading) does not work with pipeline"),
    ("llama3_1", dict(AC="offload"), {"MP_AC_LAYERS": "4"}, "AC=offload can offload at most 3 of the 4 layers"),
    ("llama3_1", dict(AC="full", PP="2"), {"MP_AC_LAYERS": "3"}, "a stage here holds 2: set MP_AC_LAYERS to 1 or 2 (<= 2)"),
    # blocks that do not divide a stage: megatron-core indexed past its last layer (IndexError on the rank)
    ("llama3_1", dict(AC="full"), {"MP_AC_LAYERS": "3"}, "a stage here holds 4: set MP_AC_LAYERS to 1 or 2 or 4"),
    # SFT decays over the iterations after the warm-up: megatron-core asserted it longer, on the rank
    ("llama3_1", dict(SFT="true", DATASET_PATH="SFT", TRAIN_TOKENS_OR_ITERS="20", WARMUP_TOKENS_OR_ITERS="12"),
     {"MP_TOKENIZER": "TOK"}, "SFT decays the learning rate until iteration 8 (training minus warm-up), which must come after the warm-up (12)"),
    ("llama3_1", dict(AC="full", PP="2"), {"MP_VP_CHUNKS": "2", "MP_AC_LAYERS": "2"}, "a stage here holds 1"),
    ("llama3_1", dict(SFT="true", CP="2", DATASET_PATH="SFT"), {"MP_TOKENIZER": "TOK", "MP_SFT_PACKING": "true"},
     "MP_SFT_PACKING=true with CP=2 is not supported"),
    ("llama3_1", dict(CP="2", SEQ_LEN="66"), {}, "CP=2 splits the sequence into 2*CP=4 chunks: SEQ_LEN (66)"),
    # DeepSeek-V4's attention is its own: no context parallelism, no packed documents
    ("deepseek_v4", dict(CP="2"), {}, "context parallelism does not split attention sinks (deepseek_v4): set CP=1"),
    ("deepseek_v4", dict(SFT="true", DATASET_PATH="SFT"), {"MP_TOKENIZER": "TOK", "MP_SFT_PACKING": "true"},
     "MP_SFT_PACKING=true: deepseek_v4's attention computes its own scores"),
    # a Gated DeltaNet's state runs on across packed documents: the dry run accepted it, the rank's forward refused it
    ("qwen3_next", dict(SFT="true", DATASET_PATH="SFT"), {"MP_TOKENIZER": "TOK", "MP_SFT_PACKING": "true"},
     "MP_SFT_PACKING=true: qwen3_next's Gated DeltaNet (linear attention) layers run unpacked sequences only here"),
    ("qwen3_5", dict(), {"MP_SFT_PACKING": "true"}, "MP_SFT_PACKING=true: qwen3_5's Gated DeltaNet"),
    ("llama3_1", dict(SFT="true", TP="2", SP="true", PAD_LEN="63", DATASET_PATH="SFT"), {"MP_TOKENIZER": "TOK"},
     "PAD_LEN (63) must be a multiple of 2"),
    ("llama3_1", dict(MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH="/x"), {"MP_NUM_LAYERS": "2"},
     "MP_NUM_LAYERS shapes a model from a MODEL_SIZE preset"),
    ("llama3_1", dict(ENV="dsw"), {"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"},
     "WORLD_SIZE=12 processes do not fill nodes of 8"),
    ("llama3_1", {}, {"MP_DIST_TIMEOUT_MIN": "0"}, "MP_DIST_TIMEOUT_MIN must be a number of minutes > 0, got '0'"),
    ("llama3_1", {}, {"MP_DIST_TIMEOUT_MIN": "soon"}, "MP_DIST_TIMEOUT_MIN must be a number, got 'soon'"),
    ("llama3_1", {}, {"MP_MAX_RESTARTS": "-1"}, "MP_MAX_RESTARTS must be >= 0, got -1"),
    ("llama3_1", {}, {"MP_SEED": str(2**32)}, "MP_SEED must be at most 4294967295, got 4294967296"),
    ("llama3_1", dict(ENV="dlc"), {"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                                   "GPUS_PER_NODE": "1"}, "RANK=2 is this node's rank among WORLD_SIZE=2 nodes"),
    ("llama3_1", dict(ENV="dlc"), {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "GPUS_PER_NODE": "1"},
     "ENV=dlc reads MASTER_PORT"),
    # torchrun's rendezvous met these as internal errors or waited (the multi-node audit)
    ("llama3_1", dict(ENV="dlc"), {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "70000",
                                   "GPUS_PER_NODE": "1"}, "ENV=dlc: MASTER_PORT must be a port from 1 to 65535, got 70000"),
    ("llama3_1", dict(ENV="dlc"), {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0",
                                   "GPUS_PER_NODE": "1"}, "ENV=dlc: MASTER_PORT must be a port from 1 to 65535, got 0"),
    ("llama3_1", dict(ENV="dlc"), {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "", "MASTER_PORT": "29500",
                                   "GPUS_PER_NODE": "1"}, "ENV=dlc: MASTER_ADDR is empty: set it to node 0's address"),
    ("llama3_1", dict(ENV="dlc"), {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "no-such-host.invalid",
                                   "MASTER_PORT": "29500", "GPUS_PER_NODE": "1"},
     "ENV=dlc: MASTER_ADDR no-such-host.invalid does not resolve on this node"),
    # a near-miss of an option's name would train without the option
    ("llama3_1", {}, {"MP_LORA_RANKS": "8"}, "MP_LORA_RANKS is not a launcher option: did you mean MP_LORA_RANK?"),
    ("llama3_1", {}, {"MP_DRYRUN": "1"}, "MP_DRYRUN is not a launcher option: did you mean MP_DRY_RUN?"),
    ("llama3_1", {}, {"MP_LOCAL_STRAT": "spawn"}, "MP_LOCAL_STRAT is not a launcher option: did you mean MP_LOCAL_START?"),
    # a value an option does not take (MP_DRY_RUN=false started a dry run; MP_LOCAL_START any word was taken)
    ("llama3_1", {}, {"MP_DRY_RUN": "json2"}, "MP_DRY_RUN takes 1 (the report), json (the report as JSON) or 0"),
    ("llama3_1", {}, {"MP_DRY_RUN": "no"}, "MP_DRY_RUN takes 1 (the report), json (the report as JSON) or 0"),
    ("llama3_1", {}, {"MP_LOCAL_START": "spwn"}, "MP_LOCAL_START takes spawn"),
]


@pytest.mark.parametrize("family,over,env,message", BAD, ids=[m[:40] for *_, m in BAD])
def test_bad_input_is_refused_with_a_message(data, family, over, env, message, monkeypatch, capsys):
    over = {k: data["sft"] if v == "SFT" else data["prefix"] + ".bin" if v == "PREFIX.bin" else v
            for k, v in over.items()}
    env = {k: data["tok"] if v == "TOK" else v for k, v in env.items()}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    code = main(["train", family, *_args(data, family, **over)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err, err
    assert err.count("\n") == 1, f"not one line: {err!r}"


@pytest.mark.parametrize("make, said, sft_said", [
    (lambda path: os.mkfifo(path), "is a FIFO, not a regular file", "is a FIFO, not a regular file"),
    (lambda path: path.symlink_to(path.parent / "gone"), "is a dangling link", "is a dangling link"),
    (lambda path: path.mkdir(), "is a folder, not a regular file", "is a folder"),
])
def test_data_that_is_there_but_no_regular_file_is_named_so(data, tmp_path, make, said, sft_said):
    """An .idx (or SFT file) that is a FIFO, a dangling link or a folder was called "not found" (the hostile
    audit)."""
    import shutil

    (tmp_path / "planted").mkdir()
    prefix = tmp_path / "planted" / "corpus_text_document"
    shutil.copy(data["prefix"] + ".bin", str(prefix) + ".bin")
    make(Path(str(prefix) + ".idx"))
    with pytest.raises(UserError) as err:
        resolve("llama3_1", _args(data, DATASET_PATH=str(prefix)), env={})
    assert f"mmap data {prefix}.idx {said}: give the .bin/.idx pair's regular files" == str(err.value)
    records = tmp_path / "planted" / "records.jsonl"
    make(records)
    with pytest.raises(UserError) as err:
        resolve("llama3_1", _args(data, SFT="true", DATASET_PATH=str(records)), env={"MP_TOKENIZER": data["tok"]})
    assert str(err.value).startswith(f"SFT data {records} {sft_said}"), str(err.value)


def test_token_counts_that_are_not_whole_iterations_are_noted(data):
    """Pretraining takes tokens, rounded down to whole iterations (as the reference): 100 warm-up tokens were 0
    warm-up iterations without a word."""
    cfg = resolve("llama3_1", _args(data, GLOBAL_BATCH_SIZE="8", SEQ_LEN="64", TRAIN_TOKENS_OR_ITERS="2100",
                                    WARMUP_TOKENS_OR_ITERS="100"), env={})  # CI's MP_ variables would add notes
    assert (cfg.train_iters, cfg.warmup_iters) == (4, 0)
    assert cfg.notes == [
        "TRAIN_TOKENS_OR_ITERS=2100 tokens is not a whole number of iterations of GLOBAL_BATCH_SIZE*SEQ_LEN = 512 "
        "tokens: 4 iteration(s), 2048 tokens",
        "WARMUP_TOKENS_OR_ITERS=100 tokens is not a whole number of iterations of GLOBAL_BATCH_SIZE*SEQ_LEN = 512 "
        "tokens: 0 iteration(s), 0 tokens"]


@pytest.mark.parametrize("ac,noted", [("sel", True), ("false", True), ("full", False)])
def test_mp_ac_layers_under_an_ac_that_counts_no_layers_is_noted(data, ac, noted):
    """Pai's launchers read MP_AC_LAYERS under AC=full/offload only: with AC=sel or none it is noted as ignored
    (not refused: an environment may export it for every run), and under AC=full it is used, with no note."""
    cfg = resolve("llama3_1", _args(data, AC=ac), env={"MP_AC_LAYERS": "2"})
    said = [n for n in cfg.notes if n.startswith("MP_AC_LAYERS=2 is ignored")]
    assert said == ([f"MP_AC_LAYERS=2 is ignored: it counts the layers of AC=full or AC=offload, and "
                     f"AC={'none' if ac == 'false' else ac}"] if noted else []), cfg.notes
    assert cfg.ac_layers == 2


def test_validation_on_training_data_or_on_nothing_is_noted(data, tmp_path):
    """Pai's README line gives one prefix for DATASET_PATH and VALID_DATASET_PATH (Pai's launcher holds out 1% of it):
    the validation loss here was on training samples, without a word; VALID_DATASET_PATH=none with an
    MP_EVAL_INTERVAL validated nothing, silently."""
    same = resolve("llama3_1", _args(data, VALID_DATASET_PATH=data["prefix"]), env={})
    assert [n for n in same.notes if "not held out" in n] == [
        "VALID_DATASET_PATH is training data (DATASET_PATH holds it): the validation loss is not held out, where "
        "Pai's launcher would hold out 1% of the data; give a held-out set, or set MP_SPLIT=99,1,0 to hold it out of "
        "DATASET_PATH as Pai does"]
    # SFT: MP_SPLIT cuts pretraining data alone (SFT is refused it), so the note does not offer it
    sft = resolve("llama3_1", _args(data, SFT="true", DATASET_PATH=data["sft"], VALID_DATASET_PATH=data["sft"]),
                  env={"MP_TOKENIZER": data["tok"]})
    assert [n for n in sft.notes if "not held out" in n] == [
        "VALID_DATASET_PATH is training data (DATASET_PATH holds it): the validation loss is not held out; give "
        "held-out records as VALID_DATASET_PATH"]
    split = resolve("llama3_1", _args(data, VALID_DATASET_PATH=data["prefix"]), env={"MP_SPLIT": "99,1,0"})
    assert not [n for n in split.notes if "not held out" in n] and split.valid_dataset_path is None
    for suffix in (".bin", ".idx"):
        (tmp_path / f"held_out{suffix}").write_bytes(b"")
    apart = resolve("llama3_1", _args(data, VALID_DATASET_PATH=str(tmp_path / "held_out")), env={})
    assert not [n for n in apart.notes if "not held out" in n]
    nothing = resolve("llama3_1", _args(data, VALID_DATASET_PATH="none"), env={"MP_EVAL_INTERVAL": "5"})
    assert nothing.notes == ["MP_EVAL_INTERVAL=5 validates nothing: VALID_DATASET_PATH is none"]
    assert resolve("llama3_1", _args(data, VALID_DATASET_PATH="none"), env={}).notes == []


def test_an_mp_variable_no_option_reads_is_named_in_the_notes(data):
    cfg = resolve("llama3_1", _args(data), env={"MP_SOMETHING_ELSE": "1", "MP_LAUNCHER_PID": "1"})
    assert cfg.notes == ["MP_SOMETHING_ELSE is set but is not a launcher option: it is ignored (examples/README.md "
                         "lists them)"]


def test_wrong_argument_count_and_usage(data, capsys):
    assert main(["train", "qwen2", *_args(data, "llama3_1")]) == 2
    err = capsys.readouterr().err
    assert "run_mcore_qwen2.sh takes 26 arguments" in err and "got 25" in err
    assert main(["train", "llama3_1", "--help"]) == 0
    out = capsys.readouterr().out
    for name in arg_names("llama3_1"):
        assert name in out
    assert "1B | 3B | 8B | 70B | 405B | Mistral-7B | tiny | auto" in out


def test_refusals_and_the_resume_checks_start_without_torch(data, tmp_path):
    """A launch refused for its arguments, and the launcher's look at the run folder before any rank starts (which
    checkpoint it resumes from, whether the run is complete, whether OUTPUT_BASEPATH is a run's), take no torch:
    every launch and every refused one would pay its import (scripts/bench_imports.py)."""
    run = tmp_path / "run"
    (run / "checkpoint" / "iter_0000010").mkdir(parents=True)  # a checkpoint with nothing in it: refused, unresumable
    code = f"""
import sys
from megatron_patch.cli import main
from megatron_patch.errors import UserError
from megatron_patch.training.run_state import check_output_basepath, latest_iteration
print(main(["train", "llama3_1", *{_args(data, "llama3_1", TP="3")!r}]))
check_output_basepath(__import__("pathlib").Path({str(run)!r}))
try:
    latest_iteration({str(run / "checkpoint")!r})
except UserError as exc:
    print("refused:", str(exc)[:60])
print(sorted(m for m in ("torch", "megatron") if m in sys.modules))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "2" and "TP=3" in proc.stderr, proc.stderr  # refused, in one line
    assert lines[1].startswith("refused:"), lines
    assert lines[-1] == "[]", lines


def test_mpatch_starts_and_the_dry_run_plans_without_megatron_core(data):
    """`mpatch --version` and `--help` import none of torch, megatron-core and transformers (the align and parity
    subcommands' help imported torch for the bounds it prints); the launcher's dry run asks torch what the machine
    is, and imports neither megatron-core nor transformers (its settings imported megatron-core for an enum)."""
    code = f"""
import contextlib, io, os, sys
from megatron_patch.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    for line in (["--version"], ["--help"]):
        try:
            main(line)
        except SystemExit:
            pass
print(sorted(m for m in ("torch", "megatron", "transformers") if m in sys.modules))
os.environ["MP_DRY_RUN"] = "1"
with contextlib.redirect_stdout(io.StringIO()):
    print(main(["train", "llama3_1", *{_args(data, "llama3_1")!r}]), file=sys.stderr)
print(sorted(m for m in ("torch", "megatron", "transformers") if m in sys.modules))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and proc.stderr.strip().splitlines()[-1] == "0", proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines() == ["[]", "['torch']"], proc.stdout


# --- what this machine can do ------------------------------------------------------------------------

CPU = Capabilities(cuda=False, transformer_engine=False, fp8=False, flash_attention_3=False, torchao=True)
H100 = Capabilities(cuda=True, transformer_engine=True, fp8=True, flash_attention_3=True, flash_attention_2=True,
                    compute_capability=(9, 0), cuda_version="13.0")


MACHINE_REFUSALS = [
    # PR=fp8 runs torchao's float8 on CPU (tests/test_fp8.py); transformer-engine's recipes need transformer-engine
    (dict(PR="fp8"), {"MP_FP8_RECIPE": "delayed"}, "MP_FP8_RECIPE=delayed is transformer-engine's"),
    (dict(TP="2", SP="true"), {}, "TP communication overlap (TP > 1 with SP=true) needs transformer-engine"),
    (dict(AC="offload"), {}, "AC=offload moves activations from GPU to host memory"),
    (dict(ENV="dsw", PR="bf16"), {"GPUS_PER_NODE": "1"}, "ENV=dsw trains on GPUs and this machine has none"),
]


@pytest.mark.parametrize("over,env,message", MACHINE_REFUSALS, ids=[m[:40] for *_, m in MACHINE_REFUSALS])
def test_machine_refusals_without_gpu(data, over, env, message, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = resolve("llama3_1", _args(data, **over))
    problems = machine_problems(cfg, CPU)
    assert any(message in p for p in problems), problems


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")
@pytest.mark.parametrize("over,env,message", MACHINE_REFUSALS, ids=[m[:40] for *_, m in MACHINE_REFUSALS])
def test_launcher_refuses_what_this_cpu_machine_cannot_do(data, over, env, message, monkeypatch, capsys):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["train", "llama3_1", *_args(data, **over)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")
def test_env_dsw_without_a_gpu_says_so_before_the_batch_sizes_it_would_fault(data, monkeypatch, capsys):
    """ENV=dsw plans a GPU node's 8 processes where it sees no GPU: the dry run keeps planning them, and a launch
    names the missing GPU, not a GLOBAL_BATCH_SIZE that 8 GPUs would not divide (what it said before)."""
    args = _args(data, ENV="dsw", PR="bf16", BATCH_SIZE="2", GLOBAL_BATCH_SIZE="4")
    assert main(["train", "llama3_1", *args]) == 2
    err = capsys.readouterr().err
    assert err == "mpatch train: error: ENV=dsw trains on GPUs and this machine has none: use ENV=cpu for a CPU run\n"
    monkeypatch.setenv("MP_DRY_RUN", "1")
    with pytest.raises(UserError, match=r"BATCH_SIZE\*DP = 2\*8 = 16"):
        resolve("llama3_1", args)
    planned = resolve("llama3_1", _args(data, ENV="dsw", PR="bf16", BATCH_SIZE="2", GLOBAL_BATCH_SIZE="16"))
    assert planned.world_size == 8
    # the dry run says where its 8 came from, and how to plan another count (the rdoc audit)
    assert ("ENV=dsw on a machine without a GPU: planned for 8 GPUs per node, as a GPU node has; set GPUS_PER_NODE "
            "to plan for another count") in planned.notes
    monkeypatch.setenv("GPUS_PER_NODE", "2")
    counted = resolve("llama3_1", _args(data, ENV="dsw", PR="bf16", BATCH_SIZE="2", GLOBAL_BATCH_SIZE="4"))
    assert counted.world_size == 2 and not any("without a GPU" in n for n in counted.notes)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cpu_machine_accepts_mixed_precision(data, precision):
    """bf16/fp16 train on ENV=cpu (megatron's mixed-precision optimizers, fp32 master weights); fp8 too, through
    torchao (tests/test_fp8.py)."""
    cfg = resolve("llama3_1", _args(data, PR=precision, DO="true"))
    assert machine_problems(cfg, CPU) == []


@pytest.mark.parametrize("value,policy,share", [("false", "off", 0.0), ("static", "static", 1.0),
                                                 ("0.3", "static", 0.3), ("auto", "auto", 0.0)])
def test_optimizer_offload_values_and_cpu(data, value, policy, share):
    """OPTIMIZER_OFFLOAD runs on ENV=cpu too: the 'device' tier is host memory tagged as the device."""
    cfg = resolve("llama3_1", _args(data, OPTIMIZER_OFFLOAD=value))
    assert (cfg.optimizer_offload_policy, cfg.optimizer_offload_fraction) == (policy, share)
    assert cfg.distributed_optimizer == (policy != "off")
    assert machine_problems(cfg, CPU) == []
    exact = resolve("llama3_1", _args(data), env={"MP_OFFLOAD_NUMERICS": "exact"})
    assert exact.distributed_optimizer and exact.offload_numerics == "exact"


# The lent GPU machine of issue 20: CUDA, megatron-core's local spec, no transformer-engine.
GPU_NO_TE = Capabilities(cuda=True, transformer_engine=False, fp8=False, flash_attention_3=False,
                         compute_capability=(9, 0), cuda_version="13.0")
TE_ONLY = [
    (dict(AC="offload"), "AC=offload (activation offloading) needs transformer-engine on GPUs"),
    (dict(TP="2", SP="true"), "SP=true needs transformer-engine on GPUs"),
    (dict(PR="fp8"), "PR=fp8 needs transformer-engine (on a GPU) or torchao"),  # a GPU without either
    (dict(CP="2"), "CP=2 needs transformer-engine attention on GPUs"),
]


@pytest.mark.parametrize("over,message", TE_ONLY, ids=[m[:30] for _, m in TE_ONLY])
def test_gpu_without_te_refuses_te_only_choices_before_launch(data, over, message, monkeypatch, capsys):
    """Each would start every rank and then fail inside megatron-core (AC=offload: TransformerBlock's
    assertion; SP: WrappedTorchNorm's): refused in one line, exit 2, nothing started."""
    monkeypatch.setenv("GPUS_PER_NODE", "2")
    monkeypatch.setattr(Capabilities, "detect", classmethod(lambda cls, import_torchao=False: GPU_NO_TE))
    argv = _args(data, ENV="dsw", **{"PR": "bf16", **over})
    assert any(message in p for p in machine_problems(resolve("llama3_1", argv), GPU_NO_TE))
    assert main(["train", "llama3_1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err, err
    assert machine_problems(resolve("llama3_1", argv), H100) == []


TE_FP8_SHAPES = [
    ("llama3_1", dict(BATCH_SIZE="1", SEQ_LEN="60"), {"GPUS_PER_NODE": "1"},
     "PR=fp8 with transformer-engine (recipe delayed): the tokens per GEMM, BATCH_SIZE*SEQ_LEN/CP = 60, must be a "
     "multiple of 8"),
    ("llama3_1", dict(BATCH_SIZE="1", SEQ_LEN="48"), {"MP_FP8_RECIPE": "mxfp8", "GPUS_PER_NODE": "1"},
     "= 48, must be a multiple of 32"),
    ("qwen2_moe", dict(EP="2", ETP="4", GLOBAL_BATCH_SIZE="16"), {"GPUS_PER_NODE": "8"},
     "divisible by 16, and this model at TP=1 has expert FFN size per ETP rank 8"),
]


@pytest.mark.parametrize("family,over,env,message", TE_FP8_SHAPES, ids=[m[:40] for *_, m in TE_FP8_SHAPES])
def test_transformer_engines_fp8_shape_rules_bind_where_it_runs_only(data, family, over, env, message, monkeypatch):
    """transformer-engine's FP8 shape rules (rows by 8, inner dimensions by 16) refused a GPU without it too, naming
    TE's recipe: torchao's float8 there pads its tokens and keeps GEMMs of other sizes in bf16."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = resolve(family, _args(data, family, ENV="dsw", PR="fp8", **over))
    b200 = Capabilities(**{**H100.__dict__, "compute_capability": (10, 0)})  # every TE recipe runs there
    assert any(message in p for p in machine_problems(cfg, b200)), machine_problems(cfg, b200)
    torchao_gpu = Capabilities(**{**GPU_NO_TE.__dict__, "torchao": True})
    assert not any(message in p for p in machine_problems(cfg, torchao_gpu)), machine_problems(cfg, torchao_gpu)


def test_gpu_without_te_accepts_the_local_spec_choices(data, monkeypatch):
    monkeypatch.setenv("GPUS_PER_NODE", "2")
    # FL=true there is torch SDPA (tests/test_sdpa_attention.py), in fp32 too
    for over in (dict(AC="sel"), dict(AC="full"), dict(AC="none"), dict(TP="2", SP="false"),
                 dict(PR="fp32", DO="true", OPTIMIZER_OFFLOAD="static"), dict(FL="true"), dict(PR="fp32", FL="true")):
        cfg = resolve("llama3_1", _args(data, ENV="dsw", **{"PR": "bf16", **over}))
        assert machine_problems(cfg, GPU_NO_TE) == [], over


def test_gpu_machine_accepts_fp8_flash_and_tp_overlap(data, monkeypatch):
    monkeypatch.setenv("GPUS_PER_NODE", "8")
    cfg = resolve("llama3_1", _args(data, ENV="dsw", PR="fp8", FL="true", TP="2", SP="true", DO="true"))
    assert machine_problems(cfg, H100) == []
    assert machine_problems(cfg, CPU)  # and the same config is refused without GPU


# --- dry runs -------------------------------------------------------------------------------------------


def test_a_rank_refusing_its_line_outside_a_job_of_several_joins_nothing(data, monkeypatch, capsys):
    """A refusing rank joins its job for the settings comparison only where torchrun set the job up (RANK, MASTER_*,
    WORLD_SIZE > 1): otherwise joining made the process a world of one and left RANK, LOCAL_RANK and MASTER_ADDR in
    its environment, which made every later launch in it a rank (this stop's CI rehearsal: 26 tests failed after it)."""
    import torch.distributed as dist

    for k, v in {"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    assert main(["train", "llama3_1", *_args(data, "llama3_1", ENV="dsw")]) == 2
    assert "WORLD_SIZE=12 processes do not fill nodes of 8" in capsys.readouterr().err
    assert not dist.is_initialized() and not {"RANK", "LOCAL_RANK", "MASTER_ADDR"} & set(os.environ)

def test_node_0s_master_port_in_use_is_refused_in_one_line(data, monkeypatch, capsys):
    """torchrun's rendezvous server failing to listen was an internal error (EADDRINUSE) on node 0."""
    import socket

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for k, v in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     "GPUS_PER_NODE": "1"}.items():
            monkeypatch.setenv(k, v)
        code = main(["train", "llama3_1", *_args(data, "llama3_1", ENV="dlc")])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"mpatch train: error: ENV=dlc: MASTER_PORT {port} is in use on this node (node 0 "
                                 "serves the rendezvous there): choose another port, the same on every node\n"), err



def test_node_0s_master_port_it_may_not_listen_on_is_refused_in_one_line(data, monkeypatch, capsys):
    """A port below 1024 for a user without the privilege (EACCES) was an internal error (this change's audit)."""
    import errno
    import socket

    def refused(self, address):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "bind", refused)
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "80",
                 "GPUS_PER_NODE": "1"}.items():
        monkeypatch.setenv(k, v)
    code = main(["train", "llama3_1", *_args(data, "llama3_1", ENV="dlc")])
    err = capsys.readouterr().err
    assert code == 2 and err == ("mpatch train: error: ENV=dlc: node 0 serves the rendezvous on MASTER_PORT 80 and "
                                 "cannot listen there ([Errno 13] Permission denied): choose another port (above 1023 "
                                 "without privileges), the same on every node\n"), err

@pytest.mark.parametrize("env, refusal", [
    ({"RANK": "5"}, "RANK=5 is this node's rank among WORLD_SIZE=2 nodes: it must be below 2"),
    ({"MASTER_PORT": "70000"}, "ENV=dlc: MASTER_PORT must be a port from 1 to 65535, got 70000"),
])
def test_the_dry_run_refuses_a_node_line_the_launch_refuses(data, env, refusal):
    """The dry run printed the refusal as its command and exited 0; an unresolvable MASTER_ADDR is this node's
    matter, not the line's, and is planned (the dry run plans a job on any machine)."""
    cmd = ["bash", os.path.join(REPO, "examples", "llama3_1", "run_mcore_llama3_1.sh"), *_args(data, "llama3_1", ENV="dlc")]
    base = {**os.environ, "MP_DRY_RUN": "1", "PYTHON": sys.executable, "WORLD_SIZE": "2", "RANK": "1",
            "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500", "GPUS_PER_NODE": "1"}
    planned = subprocess.run(cmd, env=base, capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr
    proc = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == f"mpatch train: error: {refusal}", proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("node, said", [("0", "waiting for clients. 1/2 clients joined"),
                                        ("1", "while trying to connect to (127.0.0.1, ")])
def test_a_node_that_never_joins_fails_the_rendezvous_within_mp_dist_timeout_min(corpus, tmp_path, node, said):
    """torchrun's static rendezvous waited 10 minutes, then went on waiting, for a node that never came (the
    multi-node audit: nothing said after 15 minutes); node 0 alone, or node 1 alone, fails within the timeout, in
    one line (node 1's torch printed c10d's timed-out connections and a page of C++ frames above it: the dlc
    audit)."""
    from megatron_patch.runtime.distributed import free_port

    cmd = ["bash", os.path.join(REPO, "examples", "llama3_1", "run_mcore_llama3_1.sh"),
           *launcher_args("llama3_1", ENV="dlc", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(tmp_path / "out"))]
    for _ in range(3):  # a free port can be taken by another process before node 0 binds it: another, then
        port = free_port()
        env = {**os.environ, "PYTHON": sys.executable, "WORLD_SIZE": "2", "RANK": node, "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "GPUS_PER_NODE": "1", "MP_DIST_TIMEOUT_MIN": "0.05"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        last = proc.stderr.strip().splitlines()[-1]
        if f"MASTER_PORT {port} is in use on this node" not in last:
            break
    assert proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.returncode == 1 and last.startswith(
        f"mpatch train: error: the nodes did not all join the rendezvous at 127.0.0.1:{port} within "
        "MP_DIST_TIMEOUT_MIN (") and said in last, proc.stderr[-2000:]
    assert last.endswith("): start the same launcher line on every node, RANK 0 to 1, or raise MP_DIST_TIMEOUT_MIN")

def _dry(data, family, env, **over) -> dict:
    cmd = ["bash", os.path.join(REPO, "examples", family, f"run_mcore_{family}.sh"), *_args(data, family, **over)]
    full_env = {**os.environ, "MP_DRY_RUN": "json", "PYTHON": sys.executable, **env}
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_dry_run_llama_8b_fp8_flash_tp_overlap(data):
    r = _dry(data, "llama3_1", {"GPUS_PER_NODE": "8"}, ENV="dsw", MODEL_SIZE="8B", PR="fp8", TP="4", PP="2", SP="true",
             DO="true", FL="true", AC="sel", BATCH_SIZE="1", GLOBAL_BATCH_SIZE="64", SEQ_LEN="4096",
             TRAIN_TOKENS_OR_ITERS="10B", WARMUP_TOKENS_OR_ITERS="1B")
    tc, ddp, opt = r["megatron_core"]["transformer_config"], r["megatron_core"]["ddp"], r["megatron_core"]["optimizer"]
    assert (tc["sequence_parallel"], tc["tp_comm_overlap"], tc["attention_backend"]) == (True, True, "flash")
    if r["fp8"]["implementation"] == "transformer-engine":
        assert (tc["fp8"], tc["fp8_recipe"], tc["fp8_amax_history_len"], tc["fp8_amax_compute_algo"]) == \
            ("hybrid", "delayed", 1024, "max")
    else:  # without transformer-engine here: torchao's float8 in the built model, nothing in TransformerConfig
        assert r["fp8"]["implementation"] == "torchao" and r["fp8"]["recipe"] == "tensorwise" and "fp8" not in tc
    assert tc["recompute_granularity"] == "selective"
    assert (ddp["use_distributed_optimizer"], ddp["overlap_grad_reduce"], ddp["overlap_param_gather"],
            ddp["grad_reduce_in_fp32"]) == (True, True, True, True)
    assert tc["deallocate_pipeline_outputs"] is True
    assert opt["bf16"] is True and opt["fp16"] is False and opt["use_distributed_optimizer"] is True
    assert r["model"]["num_layers"] == 32 and r["model"]["padded_vocab_size"] == 128256
    res = r["resolved"]
    assert res["world_size"] == 8 and r["megatron_core"]["data_parallel_size"] == 1
    assert res["train_iters"] == 10**10 // (64 * 4096) and res["warmup_iters"] == 10**9 // (64 * 4096)
    assert r["megatron_core"]["num_microbatches"] == 64
    # torchrun with this interpreter, one node on a free rendezvous port
    assert r["command"][:6] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                                "--nproc_per_node=8"]
    assert r["environment"] == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}  # TP=4 below (or without) sm100
    assert r["command"][-26:-25] == ["llama3_1"]
    # The dry run reports what this machine would refuse: fp8 exactly when it has neither an FP8 GPU with
    # transformer-engine nor torchao.
    caps = Capabilities.detect()
    assert any("PR=fp8" in p for p in r["machine_problems"]) == (not (caps.fp8 or caps.torchao))


def test_dry_run_fp8_recipe_and_full_recompute(data):
    r = _dry(data, "llama3_1", {"GPUS_PER_NODE": "8", "MP_FP8_RECIPE": "blockwise", "MP_AC_LAYERS": "2"},
             ENV="dsw", MODEL_SIZE="70B", PR="fp8", TP="8", AC="full", SEQ_LEN="8192", GLOBAL_BATCH_SIZE="8",
             BATCH_SIZE="1", TRAIN_TOKENS_OR_ITERS="1e9", WARMUP_TOKENS_OR_ITERS="1e8")
    tc = r["megatron_core"]["transformer_config"]
    if r["fp8"]["implementation"] == "transformer-engine":
        assert tc["fp8_recipe"] == "blockwise" and tc["fp8_amax_history_len"] == 1
    else:  # torchao runs here, and blockwise is transformer-engine's: refused, said in the dry run
        assert any("MP_FP8_RECIPE=blockwise is transformer-engine's" in p for p in r["machine_problems"])
    assert (tc["recompute_granularity"], tc["recompute_method"], tc["recompute_num_layers"]) == ("full", "uniform", 2)
    assert tc["attention_backend"] == "fused" and tc["sequence_parallel"] is False and tc["tp_comm_overlap"] is False


def test_dry_run_qwen2_moe_multinode_offload_forces_do(data):
    env = {"GPUS_PER_NODE": "8", "WORLD_SIZE": "4", "RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "23456"}
    r = _dry(data, "qwen2_moe", env, ENV="dlc", MODEL_SIZE="57B-A14B", PR="bf16", TP="2", PP="2", ETP="1", EP="8",
             SP="true", DO="false", OPTIMIZER_OFFLOAD="0.5", GLOBAL_BATCH_SIZE="256", BATCH_SIZE="1", SEQ_LEN="4096",
             TRAIN_TOKENS_OR_ITERS="100B", WARMUP_TOKENS_OR_ITERS="1B")
    opt = r["megatron_core"]["optimizer"]
    assert r["megatron_core"]["offload"] == {"policy": "static", "numerics": "fast", "host_share": 0.5}
    # megatron-core's own offload (HybridDeviceOptimizer) stays off: the chunked optimizer replaces it
    assert "optimizer_cpu_offload" not in opt and "use_precision_aware_optimizer" not in opt
    assert opt["use_distributed_optimizer"] is True
    assert r["megatron_core"]["ddp"]["overlap_param_gather"] is True
    assert any("forced by OPTIMIZER_OFFLOAD" in n for n in r["resolved"]["notes"])
    assert r["resolved"]["world_size"] == 32 and r["megatron_core"]["data_parallel_size"] == 8
    assert r["command"][3:8] == ["--nproc_per_node=8", "--nnodes=4", "--node_rank=1",
                                 "--master_addr=10.0.0.1", "--master_port=23456"]
    assert r["model"]["num_experts"] == 64


def test_dry_run_sft_counts_iterations_and_cpu_runs_locally(data):
    r = _dry(data, "qwen2", {"MP_TOKENIZER": data["tok"], "MP_SFT_PACKING": "true"}, SFT="true",
             DATASET_PATH=data["sft"], TRAIN_TOKENS_OR_ITERS="30", WARMUP_TOKENS_OR_ITERS="3", TP="2",
             SP="true", PAD_LEN="32")
    res = r["resolved"]
    assert (res["train_iters"], res["warmup_iters"], res["dataset_type"], res["sft_packing"]) == (30, 3, "raw", True)
    # ENV=cpu goes through torchrun too, the cluster's path: one process per rank on one node
    assert r["command"][1:7] == ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc_per_node=2",
                                 os.path.join(REPO, "mpatch.py")] and r["processes"] == 2
    assert r["command"][7:9] == ["train", "qwen2"]
    assert r["megatron_core"]["transformer_config"]["attention_backend"] == "local"
    assert any("TP communication overlap" in p for p in r["machine_problems"])


@pytest.mark.slow
def test_dry_run_virtual_pipeline_is_accepted_on_cpu(data):
    r = _dry(data, "llama3_1", {"MP_VP_CHUNKS": "2"}, PP="2")
    tc = r["megatron_core"]["transformer_config"]
    assert tc["virtual_pipeline_model_parallel_size"] == 2
    assert (tc["overlap_p2p_comm"], tc["batch_p2p_comm"]) == (True, False)
    assert r["resolved"]["virtual_pipeline"] == 2 and r["processes"] == 2
    assert r["machine_problems"] == []
    one = _dry(data, "llama3_1", {"MP_VP_CHUNKS": "1"}, PP="2")
    assert one["resolved"]["virtual_pipeline"] is None
    assert "virtual_pipeline_model_parallel_size" not in one["megatron_core"]["transformer_config"]


def test_dry_run_text_lists_settings(data, monkeypatch, capsys):
    monkeypatch.setenv("MP_DRY_RUN", "1")
    assert main(["train", "llama3_1", *_args(data, TP="2", SP="true", DO="true")]) == 0
    out = capsys.readouterr().out
    assert "nothing is started" in out
    assert "sequence_parallel=True tp_comm_overlap=True" in out
    cfg = resolve("llama3_1", _args(data, TP="2", SP="true", DO="true"))
    refused = bool(machine_problems(cfg, Capabilities.detect()))
    assert ("machine check: this machine would refuse" in out) == refused
    assert ("machine check: ok" in out) == (not refused)
    assert "command: " in out



def test_dry_run_refuses_what_the_launch_refuses_of_its_run_folder(data, monkeypatch, capsys):
    """The dry run returned 0 where the launch is refused before starting a rank: an OUTPUT_BASEPATH holding a
    file a run does not write. It now runs the launch's checks of the run folder, its checkpoints and the LoRA base
    (each one line, exit 2) after its report, and says whether the run would resume."""
    monkeypatch.setenv("MP_DRY_RUN", "1")
    out = Path(data["out"])
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["train", "llama3_1", *_args(data)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds notes.txt, which a training run does not write there" in err, err
    (out / "notes.txt").unlink()
    assert main(["train", "llama3_1", *_args(data)]) == 0
    said = capsys.readouterr().out
    assert f"would start afresh from the random initialisation (PRETRAIN_CHECKPOINT_PATH none): {out / 'checkpoint'} " \
           "holds no checkpoint of this run" in said and "would resume" not in said, said[-600:]
    # a LoRA run's checkpoints, resumed without a base: refused as the launch does (a dry run with neither plans
    # a LoRA run before its base exists, and passes)
    monkeypatch.setenv("MP_LORA_RANK", "4")
    assert main(["train", "llama3_1", *_args(data)]) == 0
    capsys.readouterr()
    assert main(["train", "llama3_1", *_args(data)]) == 0

SETTINGS_CASES = [
    ("llama3_1", {"GPUS_PER_NODE": "8"}, dict(ENV="dsw", MODEL_SIZE="tiny", PR="fp8", TP="2", PP="2", SP="true",
                                               DO="true", FL="true", AC="sel")),
    ("llama3_1", {"GPUS_PER_NODE": "8", "MP_FP8_RECIPE": "blockwise", "MP_AC_LAYERS": "1"},
     dict(ENV="dsw", PR="fp8", TP="2", AC="full")),
    ("llama3_1", {"MP_VP": "1"}, dict(PP="2")),  # Pai's meaning: 1 layer per virtual stage, 2 chunks per rank
    ("qwen2", {}, dict(PR="fp32", TP="2", SP="true", DO="true")),
    ("qwen2_moe", {"GPUS_PER_NODE": "8"}, dict(ENV="dsw", PR="bf16", TP="2", ETP="1", EP="2", SP="true")),
    ("llama3_1", {"GPUS_PER_NODE": "8"}, dict(ENV="dsw", PR="fp16", DO="true", GLOBAL_BATCH_SIZE="16")),
    ("qwen2_moe", {"GPUS_PER_NODE": "8"}, dict(ENV="dsw", PR="bf16", OPTIMIZER_OFFLOAD="0.5", GLOBAL_BATCH_SIZE="16")),
    ("llama3_1", {"MP_OFFLOAD_NUMERICS": "exact"}, dict(PR="bf16", OPTIMIZER_OFFLOAD="auto")),
]


@pytest.mark.parametrize("family,env,over", SETTINGS_CASES)
def test_megatron_settings_build_megatron_core_configs(data, family, env, over, monkeypatch):
    """What each flag becomes must be accepted by megatron-core's own config classes: an invalid or
    misspelt keyword fails here, not on the first GPU."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from megatron_patch.dtypes import precision_dtype
    from megatron_patch.models.blocks.builder import transformer_config
    from megatron_patch.training.megatron_settings import megatron_settings

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = resolve(family, _args(data, family, **over))
    settings = megatron_settings(cfg)
    tc = transformer_config(cfg.arch, cfg.layout, precision_dtype(cfg.precision), cfg.pp0_layers,
                            **settings["transformer_config"])
    for key, value in settings["transformer_config"].items():
        assert getattr(tc, key) == value, key
    ddp = DistributedDataParallelConfig(**settings["ddp"])
    opt = OptimizerConfig(**settings["optimizer"])
    assert ddp.use_distributed_optimizer == opt.use_distributed_optimizer == cfg.distributed_optimizer
    assert (opt.bf16, opt.fp16) == (tc.bf16, tc.fp16) == (cfg.precision in ("bf16", "fp8"), cfg.precision == "fp16")
    assert opt.lr == cfg.lr and opt.min_lr == cfg.min_lr
    if settings["offload"]["policy"] != "off" or settings["offload"]["numerics"] == "exact":
        # what build_chunked_optimizer requires of megatron's config
        assert opt.use_distributed_optimizer and not opt.optimizer_cpu_offload and not opt.use_precision_aware_optimizer


def test_recompute_a_family_cannot_run_is_refused_before_launch(data, monkeypatch):
    """Each was refused (or crashed) only on the rank, after the dry run had passed it: Gemma 4's KV-shared layers
    under AC=full (with megatron-core's "when instantiating ..." glued on), DeepSeek-V4's AC=full on megatron-core
    0.19, DeepSeek sparse attention under AC=sel on 0.16 (an internal error at the first forward), and AC=sel where a
    family's own attention module leaves megatron-core nothing to recompute."""
    import dataclasses

    from megatron_patch.models.gemma4.config import TINY_CONFIG as GEMMA4_TINY
    from megatron_patch.training import sparse_attention_run, validation

    # the tiny Gemma 4 with its last two layers reusing the first two's keys and values
    kv_shared = {**GEMMA4_TINY, "num_hidden_layers": 4, "num_kv_shared_layers": 2,
                 "layer_types": ["sliding_attention", "full_attention"] * 2,
                 "per_layer_config": {str(i): GEMMA4_TINY["per_layer_config"]["1"] for i in (1, 3)}}

    def refusal(family, ac, version, hf=None):
        monkeypatch.setattr(validation, "megatron_core_version", lambda: version)
        monkeypatch.setattr(sparse_attention_run, "megatron_core_version", lambda: version)
        cfg = resolve(family, _args(data, family), env={})
        cfg = dataclasses.replace(cfg, activation_checkpointing=ac, **({"hf_config": hf} if hf else {}))
        try:
            for check in validation.CHECKS:
                check(cfg)
        except UserError as err:
            return str(err)
        return None

    assert refusal("gemma4", "full", "0.16.1", kv_shared).startswith("AC=full: gemma4's KV-shared layers")
    assert refusal("gemma4", "sel", "0.16.1", kv_shared) is None and refusal("gemma4", "full", "0.16.1") is None
    assert "DeepSeek-V4's layers needs megatron-core 0.16" in refusal("deepseek_v4", "full", "0.19.2")
    assert refusal("deepseek_v4", "full", "0.16.1") is None
    # AC=sel is megatron-core's core attention's, which DeepSeek-V4's own attention never calls: accepted, it
    # recomputed nothing (autograd saved what AC=none saves) while the memory plan counted its savings
    assert refusal("deepseek_v4", "sel", "0.16.1") == (
        "AC=sel: megatron-core's selective recompute recomputes its core attention, which deepseek_v4's own attention "
        "module does not use, so it would recompute nothing: use AC=full or AC=none")
    assert refusal("deepseek_v4", "sel", "0.19.2").endswith("recompute nothing: use AC=none")
    assert refusal("deepseek_v32", "sel", "0.16.1").startswith("AC=sel with DeepSeek sparse attention needs "
                                                              "megatron-core 0.19")
    assert refusal("deepseek_v32", "sel", "0.19.2") is None and refusal("deepseek_v32", "full", "0.16.1") is None


def test_the_moe_load_balancing_loss_is_pais_unless_transformers_trains_with_the_configs(data, monkeypatch):
    """gpt-oss publishes router_aux_loss_coef 0.9 with output_router_logits false, and that 0.9 was added to every
    gpt-oss run's loss, which transformers never adds (the first gradient norm 3.07 against transformers' 2.06)."""
    import dataclasses

    from megatron_patch.training.megatron_settings import megatron_settings

    def coeff(family, env=None, hf=None):
        cfg = resolve(family, _args(data, family), env=env or {})
        if hf is not None:
            cfg = dataclasses.replace(cfg, hf_config={**cfg.hf_config, **hf})
        return megatron_settings(cfg)["transformer_config"].get("moe_aux_loss_coeff")

    assert coeff("gpt_oss") == 0.001 and coeff("qwen3_moe") == 0.001
    assert coeff("gpt_oss", hf={"output_router_logits": True, "router_aux_loss_coef": 0.9}) == 0.9
    assert coeff("gpt_oss", {"MP_MOE_AUX_LOSS": "0"}) == 0.0 and coeff("mixtral", {"MP_MOE_AUX_LOSS": "0.02"}) == 0.02
    assert coeff("llama3_1") is None
    for family, what in (("llama3_1", "is a dense model"),
                         ("deepseek_v4", "is an MoE model whose router has no load-balancing loss")):
        with pytest.raises(UserError, match=f"MP_MOE_AUX_LOSS applies to MoE models .*{what}: drop MP_MOE_AUX_LOSS"):
            resolve(family, _args(data, family), env={"MP_MOE_AUX_LOSS": "0.01"})


def test_the_balancing_losses_logged_are_those_the_routers_add():
    """The losses read from megatron-core's tracker: one per load-balancing type of a nonzero coefficient (0.19
    takes lists), none for a dense model; averaged over MoE and MTP layers as Megatron-LM averages them."""
    from types import SimpleNamespace

    from megatron_patch.training.moe_losses import moe_layer_count, tracked_losses

    def config(types, coeffs, experts=4, freq=1, layers=4, mtp=None):
        return SimpleNamespace(num_moe_experts=experts, moe_router_load_balancing_type=types,
                               moe_aux_loss_coeff=coeffs, moe_layer_freq=freq, num_layers=layers, mtp_num_layers=mtp)

    assert tracked_losses(config("aux_loss", 0.001)) == ["load_balancing_loss"]
    assert tracked_losses(config("seq_aux_loss", 0.001)) == ["seq_load_balancing_loss"]
    assert tracked_losses(config("aux_loss", 0.0)) == [] and tracked_losses(config("none", 0.0)) == []
    assert tracked_losses(config("aux_loss", 0.001, experts=None)) == []
    assert tracked_losses(config(["global_aux_loss", "aux_loss"], [0.01, 0.0])) == ["global_load_balancing_loss"]
    assert tracked_losses(config(["seq_aux_loss", "aux_loss"], 0.01)) == ["load_balancing_loss",
                                                                         "seq_load_balancing_loss"]
    assert moe_layer_count(config("aux_loss", 0.001, freq=[0, 1, 1, 1], mtp=1)) == 4
    assert moe_layer_count(config("aux_loss", 0.001, freq=2, layers=6)) == 3


# --- issue 14: what a GPU run needs, checked on CPU ------------------------------------------------------

def _cfg(data, env=None, **over):
    return resolve("llama3_1", _args(data, **over), env={"GPUS_PER_NODE": "1", **(env or {})})


def test_fp8_recipes_are_checked_against_the_gpu(data):
    """transformer-engine's own rules: mxfp8 on sm100 only, blockwise on sm90+ with CUDA >= 12.9."""
    b200 = Capabilities(**{**H100.__dict__, "compute_capability": (10, 0)})
    old_cuda = Capabilities(**{**H100.__dict__, "cuda_version": "12.4"})
    fp8 = dict(ENV="dsw", PR="fp8")
    for recipe, caps, message in [
        ("delayed", H100, None), ("tensorwise", H100, None), ("blockwise", H100, None),
        ("mxfp8", H100, "MP_FP8_RECIPE=mxfp8 needs a Blackwell GPU (compute capability 10.x) and this GPU is sm90"),
        ("mxfp8", b200, None),
        ("blockwise", old_cuda, "needs compute capability >= 9.0 and CUDA >= 12.9, and this GPU is sm90 with CUDA 12.4"),
    ]:
        problems = machine_problems(_cfg(data, {"MP_FP8_RECIPE": recipe}, **fp8), caps)
        if message is None:
            assert problems == [], (recipe, problems)
        else:
            assert len(problems) == 1 and message in problems[0], (recipe, problems)


def test_flash_attention_needs_a_flash_attn_package(data):
    from megatron_patch.training.machine_checks import attention_kernel

    cfg = _cfg(data, ENV="dsw", PR="bf16", FL="true")
    no_fa = Capabilities(**{**H100.__dict__, "flash_attention_2": False, "flash_attention_3": False})
    problems = machine_problems(cfg, no_fa)
    assert len(problems) == 1 and "neither is installed: pip install flash-attn, or set FL=false" in problems[0]
    assert attention_kernel(cfg, no_fa).startswith("none")  # the log no longer claims FlashAttention-2
    fa2 = Capabilities(**{**no_fa.__dict__, "flash_attention_2": True})
    assert machine_problems(cfg, fa2) == [] and attention_kernel(cfg, fa2) == "FlashAttention-2 (flash_attn)"


def test_attention_backend_per_precision_and_device(data):
    """fp32 on a GPU must not ask transformer-engine for fused/flash attention, which have no fp32 kernel. The settings
    name the backend (the dry run prints them without megatron-core); the model is built with megatron-core's enum."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_patch.training.megatron_settings import as_megatron_takes_it, megatron_settings

    def backend(**over):
        name = megatron_settings(_cfg(data, **over))["transformer_config"]["attention_backend"]
        return as_megatron_takes_it({"attention_backend": name})["attention_backend"]

    assert backend(ENV="dsw", PR="fp32") == AttnBackend.auto
    assert backend(ENV="dsw", PR="bf16") == AttnBackend.fused
    assert backend(ENV="dsw", PR="bf16", FL="true") == AttnBackend.flash
    assert backend(PR="fp32") == AttnBackend.local  # ENV=cpu


def test_dlc_ranks_take_the_world_size_torchrun_gives_them(data):
    """ENV=dlc: the user's process reads WORLD_SIZE as nodes; torchrun's children read it as processes."""
    over = dict(ENV="dlc", BATCH_SIZE="1", GLOBAL_BATCH_SIZE="16", PR="bf16")
    parent = resolve("llama3_1", _args(data, **over), env={"WORLD_SIZE": "2", "GPUS_PER_NODE": "8"})
    child_env = {"WORLD_SIZE": "16", "GPUS_PER_NODE": "8", "TORCHELASTIC_RUN_ID": "42", "LOCAL_WORLD_SIZE": "8",
                 "LOCAL_RANK": "3", "RANK": "11", "MASTER_ADDR": "10.0.0.1"}
    child = resolve("llama3_1", _args(data, **over), env=child_env)
    for cfg in (parent, child):
        assert (cfg.world_size, cfg.nproc_per_node, cfg.nnodes, cfg.data_parallel_size) == (16, 8, 2, 16)
    assert parent.num_microbatches == child.num_microbatches == 1


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="what ENV=dlc becomes on a node without GPUs")
def test_dlc_on_a_cpu_node_trains_on_gloo_with_restarts_and_a_timeout(data):
    """ENV=dlc without GPUs: PAI-DLC's variables make the torchrun command (static rendezvous at node 0), the
    ranks train on CPU (gloo, local attention, no refusal), MP_MAX_RESTARTS and MP_DIST_TIMEOUT_MIN reach
    torchrun and the process groups."""
    env = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29555", "GPUS_PER_NODE": "1",
           "MP_MAX_RESTARTS": "3", "MP_DIST_TIMEOUT_MIN": "0.5"}
    r = _dry(data, "llama3_1", env, ENV="dlc", TP="2")
    res, tc = r["resolved"], r["megatron_core"]["transformer_config"]
    assert (res["device"], res["world_size"], res["nnodes"], res["nproc_per_node"]) == ("cpu", 2, 2, 1)
    assert (res["max_restarts"], res["dist_timeout_min"]) == (3, 0.5)
    assert r["machine_problems"] == []
    assert tc["attention_backend"] == "local" and "deallocate_pipeline_outputs" not in tc
    assert r["command"][3:10] == ["--nproc_per_node=1", "--nnodes=2", "--node_rank=1", "--master_addr=10.1.2.3",
                                 "--master_port=29555", "--rdzv_conf=timeout=30", "--max-restarts=3"]
    assert r["command"][10:13] == [os.path.join(REPO, "mpatch.py"), "train", "llama3_1"]
    # Without PAI-DLC's GPUS_PER_NODE a CPU node runs one process.
    one = _dry(data, "llama3_1", {k: v for k, v in env.items() if k != "GPUS_PER_NODE"}, ENV="dlc")
    assert one["resolved"]["nproc_per_node"] == 1 and one["processes"] == 2
    # ENV=cpu passes MP_MAX_RESTARTS to torchrun the same way.
    cpu = _dry(data, "llama3_1", {"MP_MAX_RESTARTS": "2", "MP_NPROC": "2"})
    assert cpu["command"][3:7] == ["--standalone", "--nnodes=1", "--nproc_per_node=2", "--max-restarts=2"]
    assert cpu["resolved"]["dist_timeout_min"] == 10.0  # Megatron-LM's default


def test_launch_environment_serialises_kernels_for_tp_and_cp(data):
    from megatron_patch.training.machine_checks import launch_environment

    b200 = Capabilities(**{**H100.__dict__, "compute_capability": (10, 0)})
    wanted = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert launch_environment(_cfg(data, {"GPUS_PER_NODE": "2"}, ENV="dsw", PR="bf16", TP="2"), H100) == wanted
    assert launch_environment(_cfg(data, {"GPUS_PER_NODE": "2"}, ENV="dsw", PR="bf16", CP="2"), H100) == wanted
    assert launch_environment(_cfg(data, ENV="dsw", PR="bf16"), H100) == {}  # TP=CP=1
    assert launch_environment(_cfg(data, {"GPUS_PER_NODE": "2"}, ENV="dsw", PR="bf16", TP="2"), b200) == {}
    assert launch_environment(_cfg(data, TP="2"), CPU) == {}  # ENV=cpu


def test_num_layers_and_no_save_extras(data):
    cfg = _cfg(data, {"MP_NUM_LAYERS": "6", "MP_SAVE": "false"}, ENV="dsw", MODEL_SIZE="8B", PR="bf16")
    assert cfg.arch.num_layers == 6 and cfg.arch.hidden_size == 4096 and cfg.save is False
    assert _cfg(data).save is True


@pytest.mark.parametrize("raw", ["inf", "-inf", "nan", "infB", "2.5", "-1", "2.0000005M", "1e-999999999"])
def test_counts_that_are_not_whole_finite_numbers_are_refused_in_one_line(raw):
    """float() reads these; a count of tokens or iterations must still be a whole, finite, non-negative number
    (the fuzzed launcher found 'inf' and 'nan' crashing int())."""
    with pytest.raises(UserError, match="TRAIN_TOKENS_OR_ITERS must be a whole non-negative count"):
        parse_count("TRAIN_TOKENS_OR_ITERS", raw)
    assert parse_count("TRAIN_TOKENS_OR_ITERS", "10K") == 10_000 and parse_count("X", "1e9") == 10**9
    with pytest.raises(UserError, match="TRAIN_TOKENS_OR_ITERS=1e400 is more than"):  # whole, but no run's size
        parse_count("TRAIN_TOKENS_OR_ITERS", "1e400")


@pytest.mark.parametrize("raw,count", [("2.05M", 2_050_000), ("1.001K", 1_001), ("4.097B", 4_097_000_000),
                                       ("1.15T", 1_150_000_000_000), ("2.0500M", 2_050_000), ("0.000001M", 1)])
def test_whole_counts_written_with_a_decimal_and_a_suffix_are_read_exactly(raw, count):
    """float('2.05') * 10**6 is 2049999.9999999998: whole counts such as 2.05M and 1.001K were refused as not
    whole (1736 of the x.yyyK/M/B/T values)."""
    assert parse_count("TRAIN_TOKENS_OR_ITERS", raw) == count


@pytest.mark.parametrize("layout", [dict(TP="2", SP="true", ETP="1"), dict(ETP="2")], ids=["tp2-etp1", "tp1-etp2"])
def test_experts_split_otherwise_than_tp_at_ep1_train_only_where_megatron_core_groups_them(data, layout, monkeypatch,
                                                                                            capsys):
    """megatron-core 0.16 reduced the experts' gradients as a dense parameter's at EP=1: TP=2 with ETP=1 kept each
    rank's own tokens' part (54-69% off), ETP=2 added the other rank's shard in (100% off), and the run went on.
    Refused there in one line; 0.19 groups them and trains both as TP=1 does (checked by hand under 0.19.2)."""
    from megatron_patch.runtime.machine import experts_grouped_whenever_etp_differs

    monkeypatch.setenv("MP_NPROC", "2")
    if experts_grouped_whenever_etp_differs():
        _dry(data, "qwen2_moe", {"MP_NPROC": "2"}, **layout)
        return
    assert main(["train", "qwen2_moe", *_args(data, "qwen2_moe", **layout)]) == 2
    err = capsys.readouterr().err
    assert "at EP=1: megatron-core 0.16" in err and "reduces the experts' gradients over the wrong ranks" in err, err
    assert err.count("\n") == 1


def test_mp_overlap_param_gather_false_turns_it_off_under_the_distributed_optimizer(data):
    """Its values are true | false with DO's as the default; false was read only as "not insisting", and the
    run overlapped the param gather all the same (the rdoc audit)."""
    from megatron_patch.training.megatron_settings import megatron_settings

    def gathered(env: dict, **over) -> tuple:
        cfg = resolve("llama3_1", _args(data, DO="true", **over), env=env)
        settings = megatron_settings(cfg)
        return settings["ddp"]["overlap_param_gather"], settings["optimizer"]["overlap_param_gather"]

    assert gathered({}) == (True, True)
    assert gathered({"MP_OVERLAP_PARAM_GATHER": "false"}) == (False, False)
    assert gathered({"MP_OVERLAP_PARAM_GATHER": "true"}) == (True, True)
    with pytest.raises(UserError, match="param-gather overlap needs the distributed optimizer"):
        resolve("llama3_1", _args(data, DO="false"), env={"MP_OVERLAP_PARAM_GATHER": "true"})


def test_an_output_basepath_inside_what_the_run_reads_or_behind_a_literal_tilde_is_refused(data, tmp_path, monkeypatch,
                                                                                            capsys):
    """OUTPUT_BASEPATH inside PRETRAIN_CHECKPOINT_PATH: the launcher's lock made the checkpoint fail its manifest
    check, and with MP_NO_VERIFY=true the run wrote its checkpoints into it; a quoted "~/runs/r1" made a folder named
    ~ in the working directory, and every line after it read as the home folder (the outputs audit). Both refused
    before anything is written; a tokenizer folder (an HF model's: top-level files read) may hold the run."""
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.distributed import ParallelLayout

    ckpt = tmp_path / "ck"
    hf_to_mcore(make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf"), ckpt, ParallelLayout(), progress=False)
    written = sorted(p.name for p in ckpt.iterdir())
    for out, said in ((ckpt, "is PRETRAIN_CHECKPOINT_PATH"), (ckpt / "run", "lies inside PRETRAIN_CHECKPOINT_PATH")):
        with pytest.raises(UserError, match=said):
            resolve("llama3_1", _args(data, PRETRAIN_CHECKPOINT_PATH=str(ckpt), OUTPUT_BASEPATH=str(out)), env={})
    assert resolve("llama3_1", _args(data, OUTPUT_BASEPATH=str(Path(data["tok"]) / "run")),
                   env={"MP_TOKENIZER": data["tok"]}).output_basepath == str(Path(data["tok"]) / "run")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["train", "llama3_1", *_args(data, OUTPUT_BASEPATH="~/runs/r1")]) == 2
    err = capsys.readouterr().err
    assert "begins with a literal ~" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in ckpt.iterdir()) == written and not (tmp_path / "~").exists()

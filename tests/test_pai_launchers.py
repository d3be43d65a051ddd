"""Pai-Megatron-Patch's launcher lines run here unchanged, and mean what they mean there (issue 35).

Every launcher line its READMEs print (tests/fixtures/pai_readme_lines.txt) runs in its printed form, by the
shell it names and by the other one, from Pai's folder and through Pai's script path; only the sizes and paths
change: MODEL_SIZE becomes ``auto`` on a small converted checkpoint of that family (cut to fit the line's
TP/PP/EP), and data, checkpoint and output paths become the tests' own. The shells run the scripts with a
stand-in interpreter that records what they hand to Python (fast, and it is all a launcher script does); the
launcher's dry run then runs in this process on exactly that. Two lines train on CPU (slow).

This machine has no GPU: the tests set the documented variables a CPU machine needs, never the line itself:
ENV=dsw lines get GPUS_PER_NODE (the dry run plans that many processes and lists the GPU it would need);
ENV=dlc lines get PAI-DLC's WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT and KUBERNETES_CONTAINER_RESOURCE_GPU
(a dlc node without a GPU trains on its CPU), and the trained ones MP_TP_COMM_OVERLAP=false (SP with TP>1 turns
TP communication overlap on, which needs transformer-engine) and MP_EXIT_INTERVAL (the lines ask for 10000
iterations or 10000 tokens' worth).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from megatron_patch.cli import main
from megatron_patch.errors import UserError
from megatron_patch.training import launcher_args
from megatron_patch.training.validation import resolve
from tests.training_helpers import read_metrics

REPO = Path(__file__).resolve().parents[1]
LINES_FILE = REPO / "tests" / "fixtures" / "pai_readme_lines.txt"
# Pai's READMEs start launchers with `sh`, which is dash on Debian and Ubuntu: test dash itself where it is here.
SH = shutil.which("dash") or "/bin/sh"


@dataclass
class PaiLine:
    readme: str
    shell: str                 # sh | bash, as printed
    folder: str                # examples/<dir>, the README's `cd`
    script: str                # as printed, relative to the folder
    argv: list[str]
    exports: dict = field(default_factory=dict)

    @property
    def path(self) -> str:
        return f"{self.folder}/{self.script}"

    @property
    def id(self) -> str:
        sft = self.argv[-10] == "true"  # SFT is the tenth argument from the end in every layout
        return f"{self.path}:{'sft' if sft else 'pretrain'}" \
               + (f":{self.exports['MP_DATASET_TYPE']}" if "MP_DATASET_TYPE" in self.exports else "")

    @property
    def names(self) -> list[str]:
        launcher = launcher_of(self.path)
        return launcher.arg_names(launcher.layout_of(self.argv))

    def value(self, name: str) -> str:
        return self.argv[self.names.index(name)]


def read_lines() -> list[PaiLine]:
    lines = []
    for block in LINES_FILE.read_text().split("\n## ")[1:]:
        readme, _, body = block.partition("\n")
        exports, folder = {}, None
        for command in body.replace("\\\n", " ").splitlines():
            words = shlex.split(command)
            if not words:
                continue
            if words[0] == "export":
                key, _, value = words[1].partition("=")
                exports[key] = value
            elif words[0] == "cd":
                folder = words[1][words[1].index("examples/"):]
            elif words[0] in ("sh", "bash"):
                lines.append(PaiLine(readme, words[0], folder, words[1], words[2:], exports))
    return lines


LINES = read_lines()


def launcher_of(path: str):
    return next(x for x in launcher_args.launchers().values() if x.script == path)


# The small model each launcher's lines train here (family, changes to its tiny config), cut so that the lines'
# own TP/PP/CP/ETP/EP divide it: heads and query groups by TP, layers by PP (DeepSeek-V3's MP_PP0_LAYERS=5 with
# PP=8: 5 + 7), experts by EP, positions for SEQ_LEN=1024.
SMALL = {
    "examples/llama3_1": ("llama3_1", dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8)),
    "examples/mistral": ("llama3_1", dict(model_type="mistral", architectures=["MistralForCausalLM"], rope_scaling=None,
                                          sliding_window=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8)),
    "examples/qwen2": ("qwen2", {}),
    "examples/qwen2_5": ("qwen2", {}),
    "examples/qwen2/run_mcore_qwen2_moe.sh": ("qwen2_moe", dict(num_key_value_heads=4)),
    "examples/qwen3": ("qwen3_moe", dict(num_key_value_heads=4)),
    "examples/qwen3_next": ("qwen3_next", dict(num_experts=8, max_position_embeddings=2048)),
    "examples/deepseek_v3": ("deepseek_v3", dict(num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8,
                                                 n_routed_experts=16, max_position_embeddings=2048)),
}


def small_key(line: PaiLine) -> str:
    return line.path if line.path in SMALL else line.folder


def small_model(line: PaiLine) -> tuple[str, dict]:
    return SMALL[small_key(line)]


# What each printed MODEL_SIZE is here: (family, preset).
PAI_SIZES = {
    ("examples/llama3_1/run_mcore_llama3_1.sh", "8B"): ("llama3_1", "8B"),
    ("examples/qwen2/run_mcore_qwen.sh", "0.5B"): ("qwen2", "0.5B"),
    ("examples/qwen2/run_mcore_qwen2_moe.sh", "A14B"): ("qwen2_moe", "57B-A14B"),
    ("examples/qwen2_5/run_mcore_qwen.sh", "0.5B"): ("qwen2", "0.5B"),
    ("examples/qwen3/run_mcore_qwen3.sh", "A3B"): ("qwen3_moe", "30B-A3B"),
    ("examples/qwen3/run_mcore_qwen3_moe.sh", "A3B"): ("qwen3_moe", "30B-A3B"),
    ("examples/qwen3_next/run_mcore_qwen3.sh", "A3B"): ("qwen3_next", "80B-A3B"),
    ("examples/deepseek_v3/run_mcore_deepseek.sh", "A37B"): ("deepseek_v3", "671B"),
    ("examples/mistral/run_mcore_mistral.sh", "7B"): ("llama3_1", "Mistral-7B"),
}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory, corpus):
    """Data: an SFT file in Pai's raw-JSON format (instruction/input/output), the same records as Pai's SFT idxmap
    (SEQ_LEN 128, as every README line), and the small converted checkpoint of a launcher's lines (made on first
    use, each carrying the tokenizer)."""
    from megatron_patch.tokenizer import load_tokenizer
    from tests.sft_helpers import pai_sft_samples, write_mmap_pair

    root = tmp_path_factory.mktemp("pai")
    records = [{"instruction": f"Repeat: {t[:40]}", "input": "", "output": t[:60]} for t in corpus["texts"][:64]]
    alpaca = root / "alpaca_zh-train.json"
    alpaca.write_text(json.dumps(records))
    tok = load_tokenizer(corpus["tok"])  # the corpus's own ids (a chat template's markup would add ids)
    pairs = [(tok.encode(r["instruction"]), tok.encode(r["instruction"]) + tok.encode(r["output"])) for r in records]
    idxmap = write_mmap_pair(root / "sft_text_document",
                             [s for p in pairs for s in pai_sft_samples([p], 128, tok.eod)])
    made: dict[str, Path] = {}

    def checkpoint(key: str) -> Path:
        from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

        family, over = SMALL[key]
        name = f"{family}-{sorted(SMALL.values(), key=repr).index((family, over))}"
        if name not in made:
            hf = make_tiny_hf_checkpoint(family, root / name / "hf", seed=3, **over)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(corpus["tok"] / f, hf / f)
            assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(root / name / "mcore"),
                         "--quiet"]) == 0
            made[name] = root / name / "mcore"
        return made[name]

    return {"root": root, "corpus": corpus, "alpaca": alpaca, "idxmap": idxmap, "checkpoint": checkpoint}


def unchanged_but_paths(line: PaiLine, fx: dict, out: Path) -> list[str]:
    """The line's arguments with MODEL_SIZE scaled down (auto: the small checkpoint's) and its paths the tests'.

    A raw-JSON line's .json files become the alpaca file; the other SFT lines name Pai's SFT idxmap, and get one."""
    argv = list(line.argv)
    sft = line.value("SFT") == "true"
    raw = line.exports.get("MP_DATASET_TYPE") == "raw"
    for name in ("DATASET_PATH", "VALID_DATASET_PATH"):
        i = line.names.index(name)
        argv[i] = (str(fx["alpaca"]) if raw else fx["idxmap"]) if sft else fx["corpus"]["prefix"]
    argv[line.names.index("MODEL_SIZE")] = "auto"
    argv[line.names.index("PRETRAIN_CHECKPOINT_PATH")] = str(fx["checkpoint"](small_key(line)))
    argv[line.names.index("OUTPUT_BASEPATH")] = str(out)
    return argv


def machine_env(line: PaiLine) -> dict:
    """The documented variables that run the line on this CPU machine (the module's docstring says why)."""
    v = {n: int(line.value(n)) for n in ("TP", "PP", "CP")}
    ep = int(line.value("EP")) if "EP" in line.names else 1
    etp = int(line.value("ETP")) if "ETP" in line.names else v["TP"]
    world = math.lcm(v["TP"] * v["PP"] * v["CP"], v["PP"] * ep * etp)
    if line.value("ENV") == "dsw":
        return {"GPUS_PER_NODE": str(world)}
    return {"KUBERNETES_CONTAINER_RESOURCE_GPU": "8", "WORLD_SIZE": str(max(1, world // 8)), "RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_readme_lines_are_all_there():
    """24 launcher lines: pretraining, SFT on Pai's idxmap and SFT on raw JSON, for each of Pai's 8 READMEs."""
    assert len(LINES) == 24
    assert {line.path for line in LINES} == {path for path, _ in PAI_SIZES}
    assert sum(line.exports.get("MP_DATASET_TYPE") == "raw" for line in LINES) == 8


# --- the shells: every script is POSIX sh and hands its arguments to Python unchanged -------------------------

STAND_IN = """#!{python}
import json, os, sys
with open(os.environ["STAND_IN_OUT"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "pythonpath": os.environ.get("PYTHONPATH", "")}}, f)
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    path = tmp_path_factory.mktemp("stand_in") / "python"
    path.write_text(STAND_IN.format(python=sys.executable))
    path.chmod(0o755)
    return path


def run_script(shell: str, folder: Path, script: str, argv: list[str], stand_in: Path, env: dict, tmp: Path) -> dict:
    record = tmp / "handed.json"
    record.unlink(missing_ok=True)
    proc = subprocess.run([shell, script, *argv], cwd=folder, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env, "PYTHON": str(stand_in), "STAND_IN_OUT": str(record)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(record.read_text())


@pytest.mark.parametrize("shell", [SH, "bash"], ids=["sh", "bash"])
@pytest.mark.parametrize("line", LINES, ids=[line.id for line in LINES])
def test_each_line_runs_unchanged_under_sh_and_bash(line, shell, stand_in, tmp_path):
    """From Pai's folder, by Pai's script name, the line's arguments reach `python REPO/mpatch.py train` as
    printed, with this checkout first on PYTHONPATH. (On today's launchers dash stops at `set -o pipefail`, and
    five of the paths do not exist.)"""
    handed = run_script(shell, REPO / line.folder, line.script, line.argv, stand_in, line.exports, tmp_path)
    launcher = launcher_of(line.path)
    assert handed["argv"] == [str(REPO / "mpatch.py"), "train", launcher.name, *line.argv]
    assert handed["pythonpath"].split(":")[0] == str(REPO)
    assert launcher.pai


@pytest.mark.parametrize("script", sorted(str(p.relative_to(REPO)) for p in REPO.glob("examples/*/*.sh")))
def test_every_launcher_is_posix_sh(script, stand_in, tmp_path):
    """Each launcher, this project's and Pai's aliases, runs under dash as under bash, from any folder."""
    for shell, folder, name in ((SH, REPO, script), ("bash", REPO / Path(script).parent, Path(script).name)):
        handed = run_script(shell, folder, name, ["--help"], stand_in, {}, tmp_path)
        assert handed["argv"][:2] == [str(REPO / "mpatch.py"), "train"] and handed["argv"][-1] == "--help"
        assert launcher_of(script).name == handed["argv"][2]


# --- the dry run of each line, on exactly those arguments ---------------------------------------------------

def dry_run(line: PaiLine, argv: list[str], monkeypatch, capsys) -> dict:
    for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "KUBERNETES_CONTAINER_RESOURCE_GPU",
              "MP_DATASET_TYPE", "MP_PP0_LAYERS", "MP_VP", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**line.exports, **machine_env(line), "MP_DRY_RUN": "json"}.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()  # what making the fixtures printed
    code = main(["train", launcher_of(line.path).name, *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("line", LINES, ids=[line.id for line in LINES])
def test_each_line_dry_runs_with_pai_meanings(line, fixtures, tmp_path, monkeypatch, capsys):
    argv = unchanged_but_paths(line, fixtures, tmp_path / "out")
    r = dry_run(line, argv, monkeypatch, capsys)
    res, mc = r["resolved"], r["megatron_core"]
    family = small_model(line)[0]
    assert r["family"] == family and r["launcher"] == line.path
    assert r["arguments"] == dict(zip(line.names, argv))
    assert res["sft"] == (line.value("SFT") == "true")
    # Pai's SFT default is its idxmap (megatron-core's mmap pair here); MP_DATASET_TYPE=raw takes JSON
    assert res["dataset_type"] == ("raw" if line.exports.get("MP_DATASET_TYPE") == "raw" else "mmap")
    # Pai's AC=false and AC=none are no recompute
    assert ("recompute_granularity" in mc["transformer_config"]) == (line.value("AC") in ("sel", "full"))
    # SP=true at TP=1 is ignored, with a note, as Pai ignores it
    sp_ignored = line.value("SP") == "true" and line.value("TP") == "1"
    assert res["sequence_parallel"] == (line.value("SP") == "true" and not sp_ignored)
    assert any("SP=true at TP=1 is ignored" in n for n in res["notes"]) == sp_ignored
    # Pai's per-family weight decay, validation every 10000 iterations, SFT decaying after the warm-up
    # (Pai's dense Qwen2 script passes 0.1 for its MoE size too; its MoE script 0.01)
    wd = 0.01 if family in ("qwen2_moe", "qwen3_moe", "qwen3_next") and line.path != QWEN2_SCRIPT else 0.1
    assert mc["optimizer"]["weight_decay"] == mc["scheduler"]["start_wd"] == mc["scheduler"]["end_wd"] == wd
    assert res["eval_interval"] == 10000
    decay = res["train_iters"] - res["warmup_iters"] if res["sft"] else res["train_iters"]
    assert mc["scheduler"]["lr_decay_steps"] == decay
    # ENV=dlc's processes per node from PAI-DLC's KUBERNETES_CONTAINER_RESOURCE_GPU
    if line.value("ENV") == "dlc":
        assert res["nproc_per_node"] == 8 and res["world_size"] == 8 * int(machine_env(line)["WORLD_SIZE"])
    assert res["pp0_layers"] == (int(line.exports["MP_PP0_LAYERS"]) if "MP_PP0_LAYERS" in line.exports else None)


QWEN2_SCRIPT = "examples/qwen2/run_mcore_qwen.sh"


def test_the_weight_decay_is_the_scripts_that_trains_the_size():
    """Pai's dense Qwen2 script trains its A14B size with --weight-decay 0.1, its Qwen2-MoE script with 0.01; the
    dense script's A14B trained with 0.01, without a word."""
    from megatron_patch.training.launcher_args import get_launcher, launchers

    dense = next(launcher for launcher in launchers().values() if launcher.script == QWEN2_SCRIPT)
    moe = next(launcher for launcher in launchers().values() if launcher.script == "examples/qwen2/run_mcore_qwen2_moe.sh")
    assert dense.sizes["A14B"][0] == "qwen2_moe" and dense.weight_decay("qwen2_moe") == 0.1
    assert moe.weight_decay("qwen2_moe") == 0.01
    assert get_launcher("qwen2_moe").weight_decay("qwen2_moe") == 0.01


# What each Pai script passes for an MoE size (its moe_options): --moe-aux-loss-coeff (none: Megatron-LM's 0.0) and
# --moe-router-load-balancing-type; this project's own launchers: 0.001 per batch.
PAI_MOE_BALANCING = [
    ("examples/mistral/run_mcore_mistral.sh", "8x7B", "mixtral", 0.01, "aux_loss"),
    ("examples/qwen2/run_mcore_qwen.sh", "A14B", "qwen2_moe", 0.0, "aux_loss"),
    ("examples/qwen2/run_mcore_qwen2_moe.sh", "A14B", "qwen2_moe", 0.001, "seq_aux_loss"),
    ("examples/qwen3/run_mcore_qwen3.sh", "A3B", "qwen3_moe", 0.001, "aux_loss"),
    ("examples/qwen3_next/run_mcore_qwen3.sh", "A3B", "qwen3_next", 0.001, "aux_loss"),
    ("examples/deepseek_v3/run_mcore_deepseek.sh", "A37B", "deepseek_v3", 0.001, "seq_aux_loss"),
    ("examples/mixtral/run_mcore_mixtral.sh", "8x7B", "mixtral", 0.001, "aux_loss"),
    ("examples/qwen2_moe/run_mcore_qwen2_moe.sh", "A14B", "qwen2_moe", 0.001, "aux_loss"),
]


@pytest.mark.parametrize("script,size,family,coeff,balancing", PAI_MOE_BALANCING,
                         ids=[f"{p}:{s}" for p, s, *_ in PAI_MOE_BALANCING])
def test_a_pai_scripts_moe_size_balances_its_experts_as_that_script_does(script, size, family, coeff, balancing):
    """Pai's Mistral script trained Mixtral with a tenth of its coefficient, its Qwen2-MoE script balanced per batch
    where it balances per sequence, and its dense Qwen2 script's A14B had a balancing loss it does not pass (the pai2
    audit): each Pai script's line trains with what that script passes, whatever config.json says."""
    from megatron_patch.training.megatron_settings import megatron_settings

    launcher = launcher_of(script)
    values = dict(ENV="dsw", MODEL_SIZE=size, BATCH_SIZE="1", GLOBAL_BATCH_SIZE="8", LR="1e-5", MIN_LR="1e-6",
                  SEQ_LEN="128", PAD_LEN="128", PR="bf16", TP="1", PP="1", CP="1", ETP="1", EP="1", SP="false",
                  DO="true", FL="false", SFT="false", AC="false", OPTIMIZER_OFFLOAD="false", SAVE_INTERVAL="100",
                  DATASET_PATH="data", VALID_DATASET_PATH="none", PRETRAIN_CHECKPOINT_PATH="none",
                  TRAIN_TOKENS_OR_ITERS="100000", WARMUP_TOKENS_OR_ITERS="100", OUTPUT_BASEPATH="out")
    argv = [values[name] for name in launcher.arg_names(launcher.layouts[-1])]
    cfg = resolve(launcher.name, argv, env={"GPUS_PER_NODE": "8"}, check_paths=False)
    tc = megatron_settings(cfg, fp8_implementation=None)["transformer_config"]
    assert cfg.family == family
    assert (tc["moe_aux_loss_coeff"], tc.get("moe_router_load_balancing_type", "aux_loss")) == (coeff, balancing)
    # MP_MOE_AUX_LOSS still rules
    cfg = resolve(launcher.name, argv, env={"GPUS_PER_NODE": "8", "MP_MOE_AUX_LOSS": "0.05"}, check_paths=False)
    assert megatron_settings(cfg, fp8_implementation=None)["transformer_config"]["moe_aux_loss_coeff"] == 0.05


@pytest.mark.parametrize("path,size", list(PAI_SIZES), ids=[f"{p}:{s}" for p, s in PAI_SIZES])
def test_pai_size_names_are_presets_here(path, size):
    """The printed MODEL_SIZE of every line names this project's preset on that launcher."""
    assert launcher_of(path).model_size(size) == PAI_SIZES[path, size]


def test_a_printed_size_resolves_without_a_checkpoint(fixtures, tmp_path):
    """Pai's qwen3 line as printed (A3B, TP4 PP2 ETP1 EP4 on a node of 8) plans Qwen3-30B-A3B, and the same
    launcher takes a dense size with Pai's 27 arguments (ETP means nothing there: ignored, said once)."""
    line = next(x for x in LINES if x.path == "examples/qwen3/run_mcore_qwen3.sh" and x.value("SFT") == "false")
    argv = list(line.argv)
    for name in ("DATASET_PATH", "VALID_DATASET_PATH"):
        argv[line.names.index(name)] = fixtures["corpus"]["prefix"]
    argv[line.names.index("PRETRAIN_CHECKPOINT_PATH")] = "none"
    argv[line.names.index("OUTPUT_BASEPATH")] = str(tmp_path / "out")
    cfg = resolve("qwen3", argv, env=machine_env(line))
    assert (cfg.family, cfg.arch.num_experts, cfg.arch.num_layers, cfg.ep, cfg.etp) == ("qwen3_moe", 128, 48, 4, 1)
    dense = list(argv)
    dense[line.names.index("MODEL_SIZE")], dense[line.names.index("ETP")] = "8B", "2"
    dense[line.names.index("EP")] = "1"
    cfg = resolve("qwen3", dense, env={"GPUS_PER_NODE": "8", "WORLD_SIZE": "1"})
    assert (cfg.family, cfg.etp, cfg.layout.expert_tp) == ("qwen3", None, 4)
    assert any("ETP=2 is ignored: qwen3 8B is a dense model" in n for n in cfg.notes)
    # and the A3B line's EP, which Pai's launcher passes for its MoE sizes alone (the pai audit: refused)
    dense[line.names.index("EP")] = "4"
    cfg = resolve("qwen3", dense, env={"GPUS_PER_NODE": "8", "WORLD_SIZE": "1"})
    assert (cfg.family, cfg.ep, cfg.layout.ep) == ("qwen3", 1, 1)
    assert any("EP=4 is ignored: qwen3 8B is a dense model" in n for n in cfg.notes)


# --- what Pai's names mean ------------------------------------------------------------------------------------

def _qwen3_args(fx, out, **over) -> list[str]:
    base = dict(ENV="cpu", MODEL_SIZE="auto", BATCH_SIZE="1", GLOBAL_BATCH_SIZE="8", LR="1e-3", MIN_LR="1e-4",
                SEQ_LEN="64", PAD_LEN="64", PR="fp32", TP="1", PP="2", CP="1", ETP="1", EP="1", SP="false",
                DO="false", FL="false", SFT="false", AC="false", OPTIMIZER_OFFLOAD="false", SAVE_INTERVAL="10",
                DATASET_PATH=fx["corpus"]["prefix"], VALID_DATASET_PATH="none",
                PRETRAIN_CHECKPOINT_PATH=str(fx["checkpoint"]("examples/qwen3")), TRAIN_TOKENS_OR_ITERS="10",
                WARMUP_TOKENS_OR_ITERS="2", OUTPUT_BASEPATH=str(out))
    base.update(over)
    base["TRAIN_TOKENS_OR_ITERS"] = base["TRAIN_TOKENS_OR_ITERS"] if base["SFT"] == "true" else str(10 * 8 * 64)
    return [base[n] for n in launcher_args.get_launcher("qwen3").arg_names(("ETP", "EP"))]


def test_mp_vp_is_layers_per_virtual_stage_as_in_pai(fixtures, tmp_path):
    """MP_VP=L: L layers per virtual pipeline stage (Megatron-LM's --num-layers-per-virtual-pipeline-stage), so
    4 layers at PP=2 with MP_VP=1 are 2 chunks per rank, and MP_VP=2 is no virtual pipeline; the number of
    chunks, this project's old MP_VP, is MP_VP_CHUNKS."""
    args = _qwen3_args(fixtures, tmp_path / "out")
    assert resolve("qwen3", args, env={"MP_VP": "1"}).virtual_pipeline == 2
    two = resolve("qwen3", args, env={"MP_VP": "2"})
    assert two.virtual_pipeline is None and any("no virtual pipeline" in n for n in two.notes)
    assert resolve("qwen3", args, env={"MP_VP_CHUNKS": "2"}).virtual_pipeline == 2
    for env, message in (({"MP_VP": "3"}, "MP_VP=3 (layers per virtual pipeline stage) with PP=2 needs the 4 layers"),
                         ({"MP_VP": "1", "MP_VP_CHUNKS": "2"}, "both set the virtual pipeline: give one")):
        with pytest.raises(UserError, match=re.escape(message)):
            resolve("qwen3", args, env=env)
    one = _qwen3_args(fixtures, tmp_path / "out", PP="1")
    with pytest.raises(UserError, match=r"MP_VP=1 \(layers per virtual pipeline stage\) needs PP > 1"):
        resolve("qwen3", one, env={"MP_VP": "1"})


def test_pai_values_of_ac_sp_and_mp_dataset_type(fixtures, tmp_path):
    args = _qwen3_args(fixtures, tmp_path / "out", PP="1", AC="false", SP="true")
    cfg = resolve("qwen3", args, env={})
    assert cfg.activation_checkpointing == "none" and cfg.sequence_parallel is False
    assert resolve("qwen3", args, env={"MP_DATASET_TYPE": "idxmap"}).dataset_type == "mmap"
    with pytest.raises(UserError, match=re.escape("MP_DATASET_TYPE must be one of idxmap | mmap | raw")):
        resolve("qwen3", args, env={"MP_DATASET_TYPE": "parquet"})
    sft = _qwen3_args(fixtures, tmp_path / "out", PP="1", SFT="true", DATASET_PATH=str(fixtures["alpaca"]))
    assert resolve("qwen3", sft, env={}).dataset_type == "raw"  # a JSON file: raw, MP_DATASET_TYPE unset


def test_weight_decay_has_one_home(fixtures, tmp_path):
    """MP_WEIGHT_DECAY (default: the family's, Pai's) is what the optimizer gets and what megatron-core's scheduler
    sets it to at every step; it used to set 0.1 whatever the optimizer was given."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_patch.training.megatron_settings import megatron_settings

    args = _qwen3_args(fixtures, tmp_path / "out")
    assert resolve("qwen3", args, env={}).weight_decay == 0.01
    cfg = resolve("qwen3", args, env={"MP_WEIGHT_DECAY": "0.05"})
    settings = megatron_settings(cfg)
    assert settings["optimizer"]["weight_decay"] == 0.05

    class Optimizer:
        param_groups = [{"weight_decay": settings["optimizer"]["weight_decay"]}, {"wd_mult": 0.0}]

    scheduler = OptimizerParamScheduler(Optimizer(), **settings["scheduler"])
    for _ in range(3):
        scheduler.step(1)
        assert [g["weight_decay"] for g in Optimizer.param_groups] == [0.05, 0.0]


def test_sft_learning_rate_decays_over_the_iterations_after_warm_up(fixtures, tmp_path):
    """Pai's SFT: --lr-decay-iters = TRAIN - WARMUP, so MIN_LR is reached WARMUP iterations before the end."""
    from megatron_patch.training.megatron_settings import megatron_settings

    sft = _qwen3_args(fixtures, tmp_path / "out", PP="1", SFT="true", DATASET_PATH=str(fixtures["alpaca"]),
                      TRAIN_TOKENS_OR_ITERS="100", WARMUP_TOKENS_OR_ITERS="10")
    assert megatron_settings(resolve("qwen3", sft, env={}))["scheduler"]["lr_decay_steps"] == 90
    pre = _qwen3_args(fixtures, tmp_path / "out", PP="1")
    cfg = resolve("qwen3", pre, env={})
    assert megatron_settings(cfg)["scheduler"]["lr_decay_steps"] == cfg.train_iters == 10


def test_dlc_takes_gpus_per_node_from_kubernetes_container_resource_gpu(fixtures, tmp_path):
    args = _qwen3_args(fixtures, tmp_path / "out", ENV="dlc", PP="1")
    cfg = resolve("qwen3", args, env={"KUBERNETES_CONTAINER_RESOURCE_GPU": "4", "WORLD_SIZE": "2"})
    assert (cfg.nproc_per_node, cfg.nnodes, cfg.world_size) == (4, 2, 8)
    ours = resolve("qwen3", args, env={"KUBERNETES_CONTAINER_RESOURCE_GPU": "4", "GPUS_PER_NODE": "2",
                                        "WORLD_SIZE": "2"})
    assert ours.nproc_per_node == 2  # an explicit GPUS_PER_NODE wins


COUNT_ERRORS = [
    ("examples/qwen3/run_mcore_qwen3.sh", 25, "takes 26 (EP after CP) or 27 (ETP, EP after CP) arguments, got 25: the "
     "last one given is taken as WARMUP_TOKENS_OR_ITERS (25); OUTPUT_BASEPATH (26) is missing"),
    ("examples/qwen3_next/run_mcore_qwen3.sh", 26, "takes 27 arguments, got 26: the last one given is taken as "
     "WARMUP_TOKENS_OR_ITERS (26); OUTPUT_BASEPATH (27) is missing"),
    ("examples/qwen2_5/run_mcore_qwen.sh", 23, "takes 25 arguments, got 23: the last one given is taken as "
     "TRAIN_TOKENS_OR_ITERS (23); WARMUP_TOKENS_OR_ITERS (24) and OUTPUT_BASEPATH (25) are missing"),
    ("examples/mistral/run_mcore_mistral.sh", 28, "takes 26 arguments, got 28: OUTPUT_BASEPATH (26) is taken as "
     "'x26' and 2 more follow: 'x27' 'x28'"),
]


@pytest.mark.parametrize("path,count,message", COUNT_ERRORS, ids=[p for p, *_ in COUNT_ERRORS])
def test_a_wrong_count_names_the_missing_or_extra_position(path, count, message, capsys):
    assert main(["train", launcher_of(path).name, *[f"x{i}" for i in range(1, count + 1)]]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


# --- Mistral-7B: Llama's layers with a sliding window ---------------------------------------------------------

def test_mistral_sliding_window_is_built_and_matters(tmp_path):
    """Mistral's config.json sliding_window makes every layer a window of that many keys in megatron-core (gpt-oss's
    settings), where it was refused; the tiny window (8 keys, shorter than the parity tests' 32-token inputs) moves
    transformers' own logits, so tests/test_models.py's parity of the variant "mistral_sliding_window" judges it."""
    from megatron_patch.align.parity import hf_logits, random_tokens
    from megatron_patch.models.description.registry import get_family, parse_arch
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    mistral = dict(model_type="mistral", architectures=["MistralForCausalLM"], rope_scaling=None, sliding_window=8)
    arch = parse_arch({**get_family("llama3_1").tiny_config, **mistral})
    assert arch.layer_types == ("sliding_attention",) * 4 and arch.sliding_window == 8
    assert get_family("llama3_1").transformer_config_kwargs(arch) == {"window_size": (7, 0),
                                                                      "window_attn_skip_freq": None}
    preset = parse_arch(get_family("llama3_1").presets["Mistral-7B"])
    assert (preset.family, preset.sliding_window, preset.num_layers) == ("llama3_1", 4096, 32)
    tokens = random_tokens(200, seed=3)
    windowed = hf_logits(make_tiny_hf_checkpoint("llama3_1", tmp_path / "w", seed=1, **mistral), tokens)
    full = hf_logits(make_tiny_hf_checkpoint("llama3_1", tmp_path / "f", seed=1, **{**mistral, "sliding_window": None}),
                     tokens)
    assert (windowed - full).norm() / full.norm() > 1e-3


# --- a clash with Pai's own megatron_patch, and the warnings nobody needs -----------------------------------

def test_pai_megatron_patch_first_on_pythonpath_is_one_line(tmp_path):
    """Pai's repository has a top-level megatron_patch too: with it first on PYTHONPATH, `mpatch` says what to
    change in one line (exit 2) instead of dying in an ImportError traceback."""
    pai = tmp_path / "Pai-Megatron-Patch"
    (pai / "megatron_patch" / "template").mkdir(parents=True)
    (pai / "megatron_patch" / "__init__.py").write_text("# Copyright (c) 2023 Alibaba PAI team.\n")
    (pai / "megatron_patch" / "arguments.py").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{pai}:{REPO}"}
    # not from the checkout's folder, whose megatron_patch `python -m` would put first; `python -m megatron_patch`
    # too, which the editable install runs from this checkout while Python imports Pai's package (a traceback before)
    for entry in ("mpatch", "megatron_patch"):
        proc = subprocess.run([sys.executable, "-m", entry, "families"], env=env, capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)
        assert proc.returncode == 2, (entry, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, (entry, proc.stderr)
        assert f"take {pai} off PYTHONPATH" in proc.stderr
    # setup.py's console script is that entry
    assert '"mpatch=mpatch:main"' in (REPO / "setup.py").read_text()
    ours = subprocess.run([sys.executable, "-m", "mpatch", "families"], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert ours.returncode == 0 and "qwen3_moe" in ours.stdout, ours.stderr


def test_a_launcher_run_from_inside_another_checkout_runs_its_own_code(tmp_path):
    """The launchers ran `python -m megatron_patch`, which puts the working folder first on sys.path: from inside
    another checkout (an older release kept beside the new one) that one's code trained, without a word (the
    upgrade audit). They run their own checkout's mpatch.py by its path, and so does each rank's command."""
    other = tmp_path / "megatron_patch-old"
    (other / "megatron_patch").mkdir(parents=True)
    (other / "megatron_patch" / "__init__.py").write_text("print('THE OTHER CHECKOUT RAN')\n")
    (other / "megatron_patch" / "__main__.py").write_text("")
    (other / "mpatch.py").write_text("print('THE OTHER CHECKOUT RAN')\n")
    for shell, script, argv, said in (
            ("sh", "examples/llama3_1/run_mcore_llama3_1.sh", ["--help"], "usage"),
            ("bash", "toolkits/checkpoint/hf2mcore.sh", [str(tmp_path / "no-hf"), str(tmp_path / "out"), "1", "1"],
             "mpatch convert: error:")):
        proc = subprocess.run([shell, str(REPO / script), *argv], cwd=other, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHON": sys.executable})
        said_all = proc.stdout + proc.stderr
        assert "OTHER CHECKOUT" not in said_all and said in said_all, (script, said_all[-800:])
    from megatron_patch.cli.train import rank_entry

    assert rank_entry() == [str(REPO / "mpatch.py")]


def test_another_megatron_first_on_pythonpath_is_named_in_one_line(tmp_path):
    """An old Megatron-LM checkout or a Pai set-up's copy on PYTHONPATH: a `megatron` package without `core` hid the
    installed megatron-core, and eval and align ended in "internal error: ... No module named 'megatron.core'", the
    launcher and preprocess in "the Python package 'megatron' is not installed" (it is). One line names the folder;
    a namespace `megatron` folder (no __init__.py) hides nothing and runs; a whole megatron-core of a release the
    CPU layer was not written for is named where it was found (the env audit)."""
    old = tmp_path / "Megatron-LM-old"
    (old / "megatron" / "training").mkdir(parents=True)
    (old / "megatron" / "__init__.py").write_text("")
    for entry in ("mpatch", "megatron_patch"):
        proc = subprocess.run([sys.executable, "-m", entry, "families"], env={**os.environ, "PYTHONPATH": f"{REPO}:{old}"},
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (entry, proc.stderr)
        assert f"{old / 'megatron'}, holds no megatron.core" in proc.stderr and f"take {old} off PYTHONPATH" in proc.stderr

    spread = tmp_path / "namespace"
    (spread / "megatron" / "training").mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "megatron_patch", "families"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": f"{REPO}:{spread}"}, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0 and "qwen3_moe" in proc.stdout, proc.stderr

    whole = tmp_path / "Megatron-LM-0.13"
    (whole / "megatron" / "core").mkdir(parents=True)
    for init in ("megatron/__init__.py", "megatron/core/__init__.py"):
        (whole / init).write_text("")
    (whole / "megatron" / "core" / "package_info.py").write_text("__version__ = '0.13.0'\n")
    code = ("from megatron_patch.errors import UserError\nfrom megatron_patch.runtime.cpu_compat import "
            "check_mcore_version\ntry:\n    check_mcore_version()\nexcept UserError as exc:\n    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": f"{REPO}:{whole}", "MP_CPU_COMPAT_ANY_MCORE": ""})
    assert f"found 0.13.0 in {whole}, which comes before the megatron-core" in proc.stdout, proc.stdout + proc.stderr


def test_known_warnings_are_filtered_and_others_shown():
    """The entry points drop megatron-core's 'Transformer Engine and Apex are not installed' notices (printed
    several times per rank otherwise) and nothing else."""
    from megatron_patch.runtime.known_warnings import quiet_known_warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_known_warnings()
        for message, module in (
                ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                 "megatron.core.optimizer"),
                ("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends"),
                ("the loss scale fell", "megatron.core.optimizer"),
                ("Transformer Engine and Apex are not installed: mine", "my_module"),
                # megatron-core 0.19's per-rank load of a torch_dist checkpoint, attributed as torch attributes them
                ("The argument order of load has been changed. Please check the document to avoid future breakages.",
                 "torch.distributed.checkpoint.logger"),
                ("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load in a "
                 "single process.", "torch.distributed.checkpoint.utils"),
                ("The argument order of load has been changed: mine", "my_module")):
            warnings.warn_explicit(message, UserWarning, "x.py", 1, module=module)
    assert [str(w.message) for w in seen] == ["the loss scale fell",
                                              "Transformer Engine and Apex are not installed: mine",
                                              "The argument order of load has been changed: mine"]


def test_known_log_warnings_are_filtered_and_others_shown(caplog):
    """megatron-core logs 'Unknown MLP type ... Using default kwargs' for every layer whose MLP is a family's own
    subclass (Gemma 3 and 4): the entry points drop that record, once installed however often, and keep the
    logger's other records."""
    import logging

    from megatron_patch.runtime.known_warnings import quiet_known_warnings

    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    before = list(logger.filters)
    try:
        quiet_known_warnings()
        quiet_known_warnings()
        assert sum(type(f).__name__ == "_DropKnown" for f in logger.filters) == 1
        with caplog.at_level(logging.WARNING, logger=logger.name):
            logger.warning("Unknown MLP type: <class 'ModuleSpec'>. Using default kwargs.")
            logger.warning("something else")
        assert [r.getMessage() for r in caplog.records if r.name == logger.name] == ["something else"]
    finally:
        logger.filters[:] = before


def _after_mpatch(cwd, code: str) -> subprocess.CompletedProcess:
    """``code`` run in a fresh interpreter after `mpatch` has run there (a quick command), which installs the entry
    point's filters as it does for every command and rank; the process must succeed."""
    start = "import sys; sys.argv = ['mpatch', 'families', '--markdown', 'models']; import mpatch; mpatch.main(); "
    proc = subprocess.run([sys.executable, "-c", start + code], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_a_home_matplotlib_cannot_write_prints_nothing(tmp_path):
    """`mpatch align --quiet --report-dir R` under a read-only HOME (a cluster node's) printed matplotlib's two
    warnings about its cache folder, whose fallback (a temporary folder, removed at exit) is all a plot needs."""
    try:  # sysfs takes no new folder, root's included (os.access says it may)
        os.mkdir("/sys/.config")
    except OSError:
        pass
    else:
        os.rmdir("/sys/.config")
        pytest.skip("needs a folder nobody can write, /sys on Linux")
    env = {k: v for k, v in os.environ.items() if k not in ("MPLCONFIGDIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")}
    start = "import sys; sys.argv = ['mpatch', 'families', '--markdown', 'models']; import mpatch; mpatch.main(); "
    proc = subprocess.run([sys.executable, "-c", start + "import os, matplotlib; print(os.environ['MPLCONFIGDIR'])"],
                          env={**env, "HOME": "/sys", "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and "matplotlib-" in proc.stdout, proc.stderr  # its fallback was taken
    assert "matplotlib" not in proc.stderr.lower() and "MPLCONFIGDIR" not in proc.stderr, proc.stderr


def test_mpatch_installs_the_filter(tmp_path):
    """Through `mpatch` (each rank of a launch starts there too): megatron-core's notices, as its modules warn them,
    print nothing afterwards, and an unrelated warning still shows. (The CPU training runs below show the same
    of a whole launch.)"""
    proc = _after_mpatch(tmp_path, "import warnings; warnings.warn_explicit('Transformer Engine and Apex are not "
                         "installed. Falling back to Torch optimizers.', UserWarning, 'optimizer.py', 24, "
                         "module='megatron.core.optimizer'); warnings.warn('an unrelated warning')")
    # The warning line itself, not "not installed": Python 3.13 prints the `-c` source under each warning it shows.
    assert "UserWarning: Transformer Engine" not in proc.stderr, proc.stderr
    assert "UserWarning: an unrelated warning" in proc.stderr, proc.stderr


def _assert_quieted(cwd, known: list[tuple], others: list[tuple], imports: str = "") -> None:
    """Records ((logger, message, *args)) logged as their emitters log them, after `mpatch` has run: the ``known``
    ones print nothing, the ``others`` (the same loggers' other notices) print."""
    records = "; ".join(f"logging.getLogger({name!r}).warning(*{tuple(args)!r})" for name, *args in known + others)
    stderr = _after_mpatch(cwd, f"import logging{', ' + imports if imports else ''}; {records}").stderr
    for _, message, *args in known:
        assert (message % tuple(args) if args else message) not in stderr, stderr
    for _, message, *_ in others:
        assert message in stderr, stderr


def test_mpatch_quiets_torchao_s_import_notices(tmp_path):
    """transformers (5.25) imports torchao whenever it loads a model, where torchao is installed (the test extras,
    PR=fp8): its import logged each CUDA extension this machine cannot load and torch's notice about its enums, in
    every align, eval and local job. Through `mpatch`, none of them prints; other records of the same loggers do."""
    pytest.importorskip("torchao", reason="torchao is in the test extras; without it there is nothing to quiet")
    _assert_quieted(tmp_path, imports="transformers.quantizers.auto, torchao", known=[
        ("torchao", "Failed to load /x/_C_mxfp8.so: Could not load this library"),
        ("torch.utils._pytree", "%s is an Enum subclass and is now natively supported by torch.compile as an opaque "
                                "value type.", "KernelPreference")],
        others=[("torchao", "a torchao notice of another kind"), ("torch.utils._pytree", "a pytree notice")])


def test_mpatch_quiets_torch_s_no_cuda_notice_and_megatron_core_s_deprecation(tmp_path):
    """Under a CUDA build of torch (what pip gives on Python 3.12+, and for torch 2.14 and newer) on a machine with a
    CUDA toolkit and no GPU, megatron-core's import of torch's cpp_extension logged "No CUDA runtime is found" once
    per process; megatron-core 0.19 logs that GPTModel is deprecated each time one is built: lines in every launcher
    run's stderr. Through `mpatch`, those records, as they are emitted, print nothing; other records of the same
    loggers do."""
    _assert_quieted(tmp_path, known=[
        ("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local"),
        ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED. GPTModel is only accepting critical bug fixes")],
        others=[("torch.utils.cpp_extension", "a cpp_extension notice"), ("megatron.core.models.gpt.gpt_model",
                                                                            "a gpt_model notice")])


# --- two lines train on CPU -----------------------------------------------------------------------------------

def run_line(line: PaiLine, argv: list[str], env: dict) -> subprocess.CompletedProcess:
    """The line through Pai's script path, by the shell it names, with the real interpreter."""
    full = {**os.environ, **line.exports, **machine_env(line), **env, "PYTHON": sys.executable}
    return subprocess.run([SH if line.shell == "sh" else "bash", line.script, *argv], cwd=REPO / line.folder,
                          env=full, capture_output=True, text=True, timeout=900)


CPU = {"MP_TP_COMM_OVERLAP": "false"}


@pytest.mark.slow
def test_qwen3_pretraining_line_trains_on_cpu_and_a_rerun_resumes(fixtures, tmp_path):
    """Pai's Qwen3 pretraining line (dlc, A3B, TP4 PP2 ETP1 EP4, SP, AC=sel) trains 8 gloo processes; rerun into
    the same OUTPUT_BASEPATH it resumes, and its first line says so and from where. No rank prints megatron-core's
    'not installed' notices."""
    line = next(x for x in LINES if x.path == "examples/qwen3/run_mcore_qwen3.sh" and x.value("SFT") == "false")
    out = tmp_path / "out"
    argv = unchanged_but_paths(line, fixtures, out)
    first = run_line(line, argv, {**CPU, "MP_EXIT_INTERVAL": "2"})
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "loaded pretrained weights" in first.stdout
    for text in (first.stdout, first.stderr):
        assert "not installed" not in text, text[-3000:]
    second = run_line(line, argv, {**CPU, "MP_EXIT_INTERVAL": "4"})
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert second.stdout.splitlines()[0] == (f"resuming from iteration 2 of 9: {out / 'checkpoint' / 'iter_0000002'} "
                                             "(OUTPUT_BASEPATH holds this run's checkpoints; another OUTPUT_BASEPATH "
                                             "starts afresh)")
    assert [m["iteration"] for m in read_metrics(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_qwen3_raw_json_sft_line_trains_on_cpu(fixtures, tmp_path):
    """Pai's Qwen3 raw-JSON SFT line (MP_DATASET_TYPE=raw, alpaca records) trains through
    examples/qwen3/run_mcore_qwen3_moe.sh, the name Pai's README starts it by."""
    line = next(x for x in LINES if x.path == "examples/qwen3/run_mcore_qwen3_moe.sh")
    out = tmp_path / "out"
    proc = run_line(line, unchanged_but_paths(line, fixtures, out), {**CPU, "MP_EXIT_INTERVAL": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(out)
    assert [m["iteration"] for m in metrics] == [1, 2] and all(math.isfinite(m["loss"]) for m in metrics)

"""scripts/gpu_suite.sh --dry-run: the GPU check-up's plan and every command, checked on CPU.

The suite itself needs a GPU; its dry run validates what each step would run (launcher arguments via
MP_DRY_RUN, mpatch arguments, inputs, the gpu-marked tests collecting), so a broken step is found
here rather than on the first GPU. The failure handling (keep going, mark loudly, exit non-zero) is
exercised with a sequence length the model cannot take.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_patch.models.registry import families

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_suite.sh"
TRAIN_MODES = ["bf16", "fp8-delayed", "fp8-tensorwise", "fp8-blockwise", "fp8-mxfp8", "fl", "ac-none", "ac-full",
               "ac-offload", "optimizer-offload"]


def _suite(results: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--dry-run", "--results", str(results), *args],
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})},
                          capture_output=True, text=True, timeout=600)


def _steps(results: Path) -> dict[str, dict]:
    return {r["step"]: r for r in csv.DictReader(open(results / "steps.tsv"), delimiter="\t")}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    results = tmp_path_factory.mktemp("suite")
    proc = _suite(results)
    return {"results": results, "proc": proc}


@pytest.mark.slow
def test_dry_run_checks_every_step(dry_run):
    proc, results = dry_run["proc"], dry_run["results"]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    steps = _steps(results)
    expected = (["install", "info", "gpu-tests", "prepare"] + [f"parity-{f}" for f in families()]
                + [f"align-{f}" for f in families()] + [f"train-{m}" for m in TRAIN_MODES] + ["bench-convert"])
    assert list(steps) == expected
    assert {r["status"] for r in steps.values()} == {"OK (dry run)"}
    # The training steps went through the launcher's own validation with Llama-3.1-8B's shape.
    for mode in TRAIN_MODES:
        assert steps[f"train-{mode}"]["note"].startswith("ok: 2 layers"), steps[f"train-{mode}"]
    assert "--ablate" in steps["align-qwen2_moe"]["note"]
    assert re.search(r"[1-9]\d*/\d+ tests collected", steps["gpu-tests"]["note"])
    summary = (results / "summary.md").read_text()
    assert "All steps passed" in summary and "| train-fp8-mxfp8 | OK (dry run) |" in summary
    assert (results / "info.json").is_file() and (results / "work" / "hf" / "mixtral" / "config.json").is_file()


@pytest.mark.slow
def test_the_plan_fits_25_minutes(dry_run):
    planned = re.search(r"planned worst case (\d+)s", dry_run["proc"].stdout)
    assert planned and int(planned.group(1)) <= 25 * 60, dry_run["proc"].stdout[:2000]
    limits = [int(m) for m in re.findall(r"limit +(\d+)s", dry_run["proc"].stdout)]
    assert sum(limits) == int(planned.group(1))


@pytest.mark.slow
def test_a_failing_step_is_marked_and_the_suite_goes_on(dry_run):
    """Reuses the folder (the prepared inputs stay), with a sequence length beyond the model's positions."""
    results = dry_run["results"]
    proc = _suite(results, "--only", "info prepare train-bf16 bench-convert", env={"GPU_SUITE_SEQ_LEN": "300000"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    steps = _steps(results)
    assert list(steps) == ["info", "prepare", "train-bf16", "bench-convert"]
    assert steps["train-bf16"]["status"] == "FAILED"
    assert "sequence length 300000 exceeds the model's 131072 positions" in steps["train-bf16"]["note"]
    assert steps["bench-convert"]["status"] == "OK (dry run)"  # the step after the failure still ran
    assert "!!! FAILED  train-bf16" in proc.stdout and "1 step(s) FAILED" in proc.stderr
    assert "**1 step(s) FAILED**" in (results / "summary.md").read_text()

    # The same folder again, fixed: every step redone, the failure gone.
    again = _suite(results, "--only", "prepare train-bf16")
    assert again.returncode == 0, again.stdout[-3000:]
    assert {k: v["status"] for k, v in _steps(results).items()} == {"prepare": "OK (dry run)",
                                                                    "train-bf16": "OK (dry run)"}


def test_bad_option_is_refused(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--fast"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown argument '--fast'" in proc.stderr
    usage = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "--dry-run" in usage.stdout and "25 minutes" in usage.stdout


@pytest.mark.slow
def test_optional_offload_benchmark_dry_run(tmp_path):
    """bench-offload is not in the default plan (it needs its own ~15 minutes); --only runs it, and its dry
    run validates the sweep's launches against the memory plan of an 80 GiB GPU."""
    proc = _suite(tmp_path, "--only", "bench-offload")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert list(_steps(tmp_path)) == ["bench-offload"]
    import json

    report = json.loads((tmp_path / "work" / "bench-offload" / "report.json").read_text())
    assert (report["model"]["size"], report["model"]["layers"]) == ("8B", 32)
    assert report["model"]["fits_without_offload"] is False and report["model"]["fits_with_offload"] is True
    checks = {r["mode"]: r["check"] for r in report["sweep"]}
    assert list(checks) == ["false", *[f"{r / 10:g}" for r in range(1, 11)], "auto"]
    assert checks["false"] == "refused by the memory plan" and checks["1"] == checks["auto"] == "ok"
    assert report["exact"]["checks"] == {"off": "ok", "scripted": "ok"}

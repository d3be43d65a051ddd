"""Every registered family, end to end as a user runs it: a tiny HF model -> `mpatch convert hf2mcore` ->
the family's own launcher trains from it (the loss falls) -> `mpatch convert mcore2hf` of the run's
final export -> transformers loads the result, which has learnt: its loss on the training data is
below the starting model's.

One tiny run per family (a few iterations, one process), so a new family is covered by adding its
folder; the parallel layouts are covered elsewhere (tests/test_models.py, tests/test_convert.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_patch.cli import main
from megatron_patch.models.description.registry import families
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from tests.training_helpers import launcher_args, make_corpus, read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GBS, SEQ, ITERS = 4, 32, 6


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("e2e"), 300, seed=1)


def _hf_loss(folder, tokens: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    with torch.no_grad():
        return float(model.eval()(tokens, labels=tokens).loss)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(families()))
def test_convert_train_export_load(data, tmp_path, family):
    hf = make_tiny_hf_checkpoint(family, tmp_path / "hf", seed=11)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # travels with the weights both ways
        (hf / name).write_bytes((data["tok"] / name).read_bytes())
    mcore = tmp_path / "mcore"
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(mcore), "--quiet"]) == 0

    out = tmp_path / "out"
    args = launcher_args(family, MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(mcore), DATASET_PATH=data["prefix"],
                         OUTPUT_BASEPATH=str(out), LR="3e-3", MIN_LR="3e-4", GLOBAL_BATCH_SIZE=str(GBS),
                         BATCH_SIZE="2", SEQ_LEN=str(SEQ), TRAIN_TOKENS_OR_ITERS=str(ITERS * GBS * SEQ),
                         WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ), SAVE_INTERVAL=str(ITERS))
    script = os.path.join(REPO, families()[family].launcher)
    proc = subprocess.run(["bash", script, *args], env={**os.environ, "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "loaded pretrained weights" in proc.stdout
    losses = [m["loss"] for m in read_metrics(out)]
    assert len(losses) == ITERS and losses[-1] < losses[0], losses

    back = tmp_path / "back"
    assert main(["convert", "mcore2hf", "--load-dir", str(out / "final"), "--save-dir", str(back), "--quiet"]) == 0
    assert (back / "tokenizer.json").read_bytes() == (hf / "tokenizer.json").read_bytes()
    # tensors the family carries beside the model (Qwen3.5's vision tower) come out of training as they went in
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader

    source, exported = HFCheckpointReader(hf), HFCheckpointReader(back)
    carried = [n for n in source.keys() if families()[family].is_carried(n)]
    assert all(torch.equal(exported.get(n), source.get(n)) for n in carried)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = IndexedDataset(data["prefix"])
    ids = torch.cat([torch.from_numpy(docs[i].astype("int64")) for i in range(8)])[: 4 * SEQ]
    tokens = ids.view(4, SEQ)
    before, after = _hf_loss(hf, tokens), _hf_loss(back, tokens)
    assert after < before, (before, after)

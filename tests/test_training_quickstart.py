"""scripts/quickstart.sh, run once the way the README tells a user to (about 70 s on 2 CPU cores).

The whole flow must succeed and say what it did: the alignment verdict, the training loss falling,
the trained model converted back to HF and generating text in transformers.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_quickstart_runs_end_to_end(tmp_path):
    work = tmp_path / "qs"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "quickstart.sh"), str(work)], env=env,
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout
    (tmp_path / "quickstart.log").write_text(out + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]

    steps = re.findall(r"^== (\d)/7 ", out, flags=re.M)
    assert steps == [str(i) for i in range(1, 8)], steps
    # Alignment of HF vs the converted TP=2 checkpoint.
    assert re.search(r"^ALIGNED: ", out, flags=re.M), out[-4000:]
    # Training from the converted checkpoint: the launcher ran 40 iterations (20480 tokens of 8 x 64) and the loss fell.
    assert "loaded pretrained weights" in out and "iter     40/40 | loss" in out
    m = re.search(r"^training loss ([\d.]+) -> ([\d.]+) over (\d+) iterations$", out, flags=re.M)
    assert m, out[-3000:]
    first, last, n = float(m.group(1)), float(m.group(2)), int(m.group(3))
    assert n == 40 and last < first - 0.5, (first, last, n)
    # The trained model, back in HF format, generates: the prompt and at least a few new words.
    g = re.search(r"^generated: (.*)$", out, flags=re.M)
    assert g, out[-3000:]
    text = g.group(1)
    assert text.startswith("The cat") and len(text.split()) >= 5, text
    assert (work / "hf_trained" / "model.safetensors").is_file() and (work / "hf_trained" / "tokenizer.json").is_file()
    assert f"quick start done: everything is in {work}" in out
    # What a newcomer reads is the flow, not notices: megatron-core's fallbacks, torchao's import (transformers 5.25
    # imports it where it is installed), torch's refusal of a fused norm over mixed dtypes, blank progress lines.
    for text in (out, proc.stderr):
        for notice in ("not installed", "Failed to load", "Enum subclass", "Mismatch dtype", "\n\n\n"):
            assert notice not in text, (notice, text[-4000:])

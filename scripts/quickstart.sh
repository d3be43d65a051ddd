#!/usr/bin/env bash
# The whole flow on CPU in a few minutes, everything made locally (no model hub):
#   tiny Llama-3.1-style HF model + tokenizer + text corpus -> mpatch preprocess -> hf2mcore at TP=2
#   -> alignment check -> the Llama-3.1 launcher trains with ENV=cpu from that checkpoint
#   -> mcore2hf -> the result loads in transformers and generates.
# Usage: scripts/quickstart.sh [WORK_DIR]   (default: a new temporary folder)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python}"
WORK="${1:-$(mktemp -d -t mpatch-quickstart-XXXX)}"
mkdir -p "$WORK"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:$PYTHONPATH}"
mpatch() { "$PYTHON" -m megatron_patch "$@"; }
step() { printf '\n== %s\n' "$*"; }

step "1/7 a tiny Llama-3.1 HF model, a BPE tokenizer and a text corpus in $WORK"
"$PYTHON" - "$WORK" <<'PY'
import json, shutil, sys
from pathlib import Path
from megatron_patch.runtime.known_warnings import quiet_known_warnings
quiet_known_warnings()  # as mpatch does: torchao's import notices, where it is installed, say nothing here
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.demo_data import make_texts, make_tokenizer

work = Path(sys.argv[1])
texts = make_texts(3000, seed=0)
tok = make_tokenizer(work / "tokenizer", texts, vocab_size=200)
hf = make_tiny_hf_checkpoint("llama3_1", work / "hf", seed=0, eos_token_id=2, bos_token_id=1)
for f in tok.iterdir():
    shutil.copy(f, hf / f.name)
with open(work / "corpus.jsonl", "w") as out:
    for t in texts:
        out.write(json.dumps({"text": t}) + "\n")
print(f"model {hf}, tokenizer {tok}, corpus {work / 'corpus.jsonl'} ({len(texts)} documents)")
PY

step "2/7 preprocess: JSONL -> mmap indexed data"
mpatch preprocess --input "$WORK/corpus.jsonl" --output-prefix "$WORK/corpus" --tokenizer "$WORK/hf" --workers 2 --force --quiet

step "3/7 convert HF -> Megatron-Core (torch_dist, TP=2)"
mpatch convert hf2mcore --hf-dir "$WORK/hf" --save-dir "$WORK/mcore_tp2" --tp 2 --force --quiet

step "4/7 alignment: HF vs the converted checkpoint"
if mpatch align --help >/dev/null 2>&1; then
  mpatch align --hf-dir "$WORK/hf" --mcore-dir "$WORK/mcore_tp2" --tp 2 --report-dir "$WORK/align" --force --quiet
else
  mpatch parity --hf-dir "$WORK/hf" --tp 2
fi

step "5/7 train with the Llama-3.1 launcher, ENV=cpu, TP=2, from the converted checkpoint"
rm -rf "$WORK/train"
# 40 iterations of 8 x 64 tokens; SP with TP=2 but no TP overlap (that needs transformer-engine).
MP_TP_COMM_OVERLAP=false MP_LOG_INTERVAL=5 PYTHON="$PYTHON" bash "$ROOT/examples/llama3_1/run_mcore_llama3_1.sh" \
  cpu auto 2 8 3e-3 3e-4 64 64 fp32 2 1 1 true true false false none false 20 \
  "$WORK/corpus_text_document" none "$WORK/mcore_tp2" 20480 2048 "$WORK/train"

step "6/7 convert the trained model back to HF"
mpatch convert mcore2hf --load-dir "$WORK/train/final" --save-dir "$WORK/hf_trained" --force --quiet

step "7/7 load it in transformers and generate"
"$PYTHON" - "$WORK" <<'PY'
import json, sys
from pathlib import Path
from megatron_patch.runtime.known_warnings import quiet_known_warnings
quiet_known_warnings()
import torch
from transformers import AutoModelForCausalLM
from megatron_patch.tokenizer import load_tokenizer

work = Path(sys.argv[1])
tok = load_tokenizer(work / "hf_trained")
model = AutoModelForCausalLM.from_pretrained(work / "hf_trained", dtype=torch.float32).eval()
ids = torch.tensor([tok.encode("The cat")])
out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eod)
print("generated:", tok.decode(out[0].tolist()))
losses = [json.loads(l)["loss"] for l in open(work / "train" / "log" / "metrics.jsonl") if '"loss"' in l]
print(f"training loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} iterations")
PY
printf '\nquick start done: everything is in %s\n' "$WORK"

#!/usr/bin/env bash
# Regenerate docs/alignment-sample/: a tiny random Llama-3.1 (made locally, no download) converted to a
# torch_dist checkpoint, then `mpatch align` in bf16 at TP=2 PP=2 with every CPU-capable ablation.
#   usage: toolkits/alignment/sample_report.sh [OUT_DIR]   (default: docs/alignment-sample)
set -euo pipefail
OUT=${1:-docs/alignment-sample}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python -c "from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint as m; m('llama3_1', '$WORK/hf', seed=1)"
mpatch convert hf2mcore --hf-dir "$WORK/hf" --save-dir "$WORK/mcore" --format torch_dist --quiet
# Exit 1 (not aligned) still writes the report; keep it.
mpatch align --hf-dir "$WORK/hf" --mcore-dir "$WORK/mcore" --tp 2 --pp 2 --dtype bf16 --seq-len 128 --batch 2 \
    --seed 0 --ablate --report-dir "$WORK/report" || [ $? -eq 1 ]
# The report records the temporary paths; say how it was made instead. The sample is edited, so it is a copy
# of the three files, without the manifest that no longer matches them.
sed -i "s#$WORK/#<tmp>/#g" "$WORK/report/report.md" "$WORK/report/report.json"
sed -i "s#- command: .*#- command: \`toolkits/alignment/sample_report.sh\` (tiny Llama-3.1, seed 1, converted to torch_dist at TP=1, loaded at TP=2 PP=2)#" "$WORK/report/report.md"
mkdir -p "$OUT"
cp "$WORK/report/report.md" "$WORK/report/report.json" "$WORK/report/error_by_layer.png" "$OUT/"

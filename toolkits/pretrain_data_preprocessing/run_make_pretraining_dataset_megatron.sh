#!/bin/sh
# Pai-Megatron-Patch's run_make_pretraining_dataset_megatron.sh, its positional arguments unchanged, over
# `mpatch preprocess` (docs/coming-from-pai.md, "Data"). Runs under sh or bash.
# Usage: run_make_pretraining_dataset_megatron.sh INPUT TOKENIZER JSON_KEYS OUTPUT_DIR LOAD_DIR [DATASET_NAME]
#   INPUT: a JSONL file or a folder of .jsonl/.jsonl.zst files; TOKENIZER: Pai's name (Qwen2Tokenizer, Qwen3Tokenizer,
#   DeepSeekV2Tokenizer, LLamaTokenizer, LLama2Tokenizer, LLama3Tokenizer), which names the output as Pai does
#   (OUTPUT_DIR/mmap_qwen3_datasets_<key>_document); the tokenizer itself is LOAD_DIR's (tokenizer.json).
#   A rerun replaces the pair it wrote before, as Pai's does (--force: only a pair mpatch's manifest lists).
set -eu
if [ $# -ge 1 ] && { [ "$1" = "-h" ] || [ "$1" = "--help" ]; }; then
  sed -n '2,8p' "$0" | sed 's/^# //'
  exit 0
fi
if [ $# -lt 5 ]; then
  echo "run_make_pretraining_dataset_megatron.sh: takes INPUT TOKENIZER JSON_KEYS OUTPUT_DIR LOAD_DIR [DATASET_NAME]," \
       "got $# argument(s) (--help says more)" >&2
  exit 2
fi
INPUT=$1; TOKENIZER=$2; JSON_KEYS=$3; OUTPUT_DIR=$4; LOAD_DIR=$5
# Pai's output name and worker count for each tokenizer (LLama3Tokenizer's line passes no --json-keys: text).
case $TOKENIZER in
  Qwen2Tokenizer) NAME=qwen2; WORKERS=2 ;;
  Qwen3Tokenizer) NAME=qwen3; WORKERS=16 ;;
  DeepSeekV2Tokenizer) NAME=deepseekv2; WORKERS=8 ;;
  LLamaTokenizer) NAME=llama; WORKERS=16 ;;
  LLama2Tokenizer) NAME=llama2; WORKERS=16 ;;
  LLama3Tokenizer) NAME=llama3; WORKERS=16; JSON_KEYS=text ;;
  *) echo "run_make_pretraining_dataset_megatron.sh: TOKENIZER must be one of Qwen2Tokenizer, Qwen3Tokenizer," \
          "DeepSeekV2Tokenizer, LLamaTokenizer, LLama2Tokenizer, LLama3Tokenizer, got '$TOKENIZER' (for another" \
          "tokenizer run mpatch preprocess --tokenizer FOLDER)" >&2
     exit 2 ;;
esac
# Tokenizing is CPU-bound: Pai's count, but no more workers than this process has CPU cores.
MOST=$(nproc 2>/dev/null || echo 1)
[ "$WORKERS" -gt "$MOST" ] && WORKERS=$MOST
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH
# JSON_KEYS unquoted on purpose: Pai's script passes it as it is, several keys split by spaces.
# shellcheck disable=SC2086
exec "${PYTHON:-python}" "$ROOT/mpatch.py" preprocess --input "$INPUT" --output-prefix "$OUTPUT_DIR/mmap_${NAME}_datasets" \
  --json-keys $JSON_KEYS --tokenizer "$LOAD_DIR" --workers "$WORKERS" --append-eod --force

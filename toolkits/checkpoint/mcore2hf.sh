#!/usr/bin/env bash
# Megatron-Core checkpoint (hf2mcore's, a run's, or another tool's) -> HF model folder (`mpatch convert mcore2hf`).
# Usage: mcore2hf.sh LOAD_DIR SAVE_DIR [DTYPE=auto] [MAX_SHARD_SIZE=5GB] [FORCE=false] [HF_CONFIG=none] [FAMILY=none]
set -euo pipefail
if [[ $# -lt 2 || "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,3p' "$0" | sed 's/^# //'
  echo "  DTYPE: bf16 | fp16 | fp32 | auto (the checkpoint's dtype); FORCE: true replaces a non-empty SAVE_DIR."
  echo "  HF_CONFIG / FAMILY: for a checkpoint without mpatch_checkpoint.json (docs/foreign-checkpoints.md)."
  exit 2
fi
LOAD_DIR=$1; SAVE_DIR=$2; DTYPE=${3:-auto}; MAX_SHARD_SIZE=${4:-5GB}; FORCE=${5:-false}; HF_CONFIG=${6:-none}; FAMILY=${7:-none}
args=(convert mcore2hf --load-dir "$LOAD_DIR" --save-dir "$SAVE_DIR" --max-shard-size "$MAX_SHARD_SIZE")
[[ "$DTYPE" != "auto" ]] && args+=(--dtype "$DTYPE")
[[ "$FORCE" == "true" ]] && args+=(--force)
[[ "$HF_CONFIG" != "none" ]] && args+=(--hf-config "$HF_CONFIG")
[[ "$FAMILY" != "none" ]] && args+=(--family "$FAMILY")
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
exec "${PYTHON:-python}" "$ROOT/mpatch.py" "${args[@]}"

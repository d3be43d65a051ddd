#!/usr/bin/env bash
# HF model folder -> Megatron-Core checkpoint (positional wrapper over `mpatch convert hf2mcore`).
# Usage: hf2mcore.sh HF_DIR SAVE_DIR TP PP [EP=1] [ETP=none] [FORMAT=torch_dist] [DTYPE=auto] [FORCE=false] [MTP=auto]
set -euo pipefail
if [[ $# -lt 4 || "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,3p' "$0" | sed 's/^# //'
  echo "  ETP: expert tensor parallel size, 'none' = same as TP; FORMAT: torch_dist | legacy;"
  echo "  DTYPE: bf16 | fp16 | fp32 | auto (the HF tensors' dtype); FORCE: true replaces a non-empty SAVE_DIR."
  echo "  MTP: auto keeps the multi-token-prediction layers config.json declares (DeepSeek-V3's), for training"
  echo "  to train them; false drops them."
  exit 2
fi
HF_DIR=$1; SAVE_DIR=$2; TP=$3; PP=$4; EP=${5:-1}; ETP=${6:-none}; FORMAT=${7:-torch_dist}; DTYPE=${8:-auto}; FORCE=${9:-false}
MTP=${10:-auto}
[[ "$MTP" == "auto" || "$MTP" == "false" ]] || { echo "hf2mcore.sh: MTP must be auto or false, got '$MTP'" >&2; exit 2; }
args=(convert hf2mcore --hf-dir "$HF_DIR" --save-dir "$SAVE_DIR" --tp "$TP" --pp "$PP" --ep "$EP" --format "$FORMAT")
[[ "$ETP" != "none" ]] && args+=(--etp "$ETP")
[[ "$DTYPE" != "auto" ]] && args+=(--dtype "$DTYPE")
[[ "$FORCE" == "true" ]] && args+=(--force)
[[ "$MTP" == "auto" ]] && args+=(--mtp auto)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
exec "${PYTHON:-python}" "$ROOT/mpatch.py" "${args[@]}"

#!/bin/sh
# Pai-Megatron-Patch's run_8xH20.sh, with the positional arguments its README gives, over `mpatch convert`:
#   toolkits/distributed_checkpoints_convertor/scripts/qwen3/run_8xH20.sh MODEL_SIZE LOAD_DIR SAVE_DIR MG2HF USE_CUDA PR [HF_DIR]
# `mpatch convert pai run_8xH20.sh --help` and docs/coming-from-pai.md say what each position does here.
ROOT=$(cd "$(dirname "$0")/../../../.." && pwd) || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" convert pai toolkits/distributed_checkpoints_convertor/scripts/qwen3/run_8xH20.sh "$@"

#!/bin/sh
# Pai-Megatron-Patch's hf2mcore_qwen2.5_convertor.sh, with the positional arguments its README gives, over `mpatch convert`:
#   toolkits/distributed_checkpoints_convertor/hf2mcore_qwen2.5_convertor.sh MODEL_SIZE SOURCE_CKPT_PATH TARGET_CKPT_PATH TP PP PR USE_TE MG2HF [HF_CKPT_PATH]
# `mpatch convert pai hf2mcore_qwen2.5_convertor.sh --help` and docs/coming-from-pai.md say what each position does here.
ROOT=$(cd "$(dirname "$0")/../.." && pwd) || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" convert pai toolkits/distributed_checkpoints_convertor/hf2mcore_qwen2.5_convertor.sh "$@"

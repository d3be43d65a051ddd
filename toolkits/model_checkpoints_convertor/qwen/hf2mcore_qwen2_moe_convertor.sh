#!/bin/sh
# Pai-Megatron-Patch's hf2mcore_qwen2_moe_convertor.sh, with the positional arguments its README gives, over `mpatch convert`:
#   toolkits/model_checkpoints_convertor/qwen/hf2mcore_qwen2_moe_convertor.sh MODEL_SIZE SOURCE_CKPT_PATH TARGET_CKPT_PATH TP PP ETP EP PR MG2HF [HF_CKPT_PATH]
# `mpatch convert pai hf2mcore_qwen2_moe_convertor.sh --help` and docs/coming-from-pai.md say what each position does here.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd) || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" convert pai toolkits/model_checkpoints_convertor/qwen/hf2mcore_qwen2_moe_convertor.sh "$@"

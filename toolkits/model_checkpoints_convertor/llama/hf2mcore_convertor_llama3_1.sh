#!/bin/sh
# Pai-Megatron-Patch's hf2mcore_convertor_llama3_1.sh, with the positional arguments its README gives, over `mpatch convert`:
#   toolkits/model_checkpoints_convertor/llama/hf2mcore_convertor_llama3_1.sh MODEL_SIZE SOURCE_CKPT_PATH TARGET_CKPT_PATH TP PP mg2hf CHECK CHECK_ONLY PR [HF_CKPT_PATH]
# `mpatch convert pai hf2mcore_convertor_llama3_1.sh --help` and docs/coming-from-pai.md say what each position does here.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd) || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" convert pai toolkits/model_checkpoints_convertor/llama/hf2mcore_convertor_llama3_1.sh "$@"

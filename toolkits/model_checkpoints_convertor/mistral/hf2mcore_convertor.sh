#!/bin/sh
# Pai-Megatron-Patch's hf2mcore_convertor.sh, with the positional arguments its README gives, over `mpatch convert`:
#   toolkits/model_checkpoints_convertor/mistral/hf2mcore_convertor.sh MODEL_SIZE HG_CKPT_PATH MEGATRON_PATH SOURCE_CKPT_PATH TARGET_CKPT_PATH TP PP EXTRA_VOCAB_SIZE NUM_EXPERTS EXPERTS_TOPK EP mg2hf [WS]
# `mpatch convert pai hf2mcore_convertor.sh --help` and docs/coming-from-pai.md say what each position does here.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd) || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" convert pai toolkits/model_checkpoints_convertor/mistral/hf2mcore_convertor.sh "$@"

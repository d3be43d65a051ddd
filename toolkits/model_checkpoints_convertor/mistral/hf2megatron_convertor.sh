#!/bin/sh
# Pai-Megatron-Patch's hf2megatron_convertor.sh, with the positional arguments its README gives, over `mpatch convert`:
#   toolkits/model_checkpoints_convertor/mistral/hf2megatron_convertor.sh MEGATRON_PATH SOURCE_CKPT_PATH TARGET_CKPT_PATH TP PP MN EXTRA_VOCAB_SIZE mg2hf
# `mpatch convert pai hf2megatron_convertor.sh --help` and docs/coming-from-pai.md say what each position does here.
ROOT=$(cd "$(dirname "$0")/../../.." && pwd) || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" convert pai toolkits/model_checkpoints_convertor/mistral/hf2megatron_convertor.sh "$@"

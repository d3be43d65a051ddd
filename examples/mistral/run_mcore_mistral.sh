#!/bin/sh
# Pai-Megatron-Patch's Mistral launcher: 26 arguments (EP after CP); 7B is Mistral-7B (llama3_1, sliding window
# 4096), 8x7B Mixtral.
# A thin alias at Pai's path (docs/coming-from-pai.md); `run_mcore_mistral.sh --help` lists the arguments.
# POSIX sh, as Pai's READMEs start their launchers with `sh` (dash on Debian and Ubuntu).
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="${ROOT}${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" train mistral/run_mcore_mistral "$@"

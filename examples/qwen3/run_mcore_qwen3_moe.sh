#!/bin/sh
# The name Pai-Megatron-Patch's Qwen3 README starts its Qwen3 launcher by: 27 arguments (ETP, then EP, after CP),
# the dense and the MoE sizes.
# A thin alias at Pai's path (docs/coming-from-pai.md); `run_mcore_qwen3_moe.sh --help` lists the arguments.
# POSIX sh, as Pai's READMEs start their launchers with `sh` (dash on Debian and Ubuntu).
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="${ROOT}${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" train qwen3/run_mcore_qwen3_moe "$@"

#!/bin/sh
# Pai-Megatron-Patch's Qwen2-MoE launcher: 27 arguments (ETP, then EP, after CP), as examples/qwen2_moe's.
# A thin alias at Pai's path (docs/coming-from-pai.md); `run_mcore_qwen2_moe.sh --help` lists the arguments.
# POSIX sh, as Pai's READMEs start their launchers with `sh` (dash on Debian and Ubuntu).
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="${ROOT}${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" train qwen2/run_mcore_qwen2_moe "$@"

#!/bin/sh
# Pai-Megatron-Patch's Qwen3-Next launcher: 27 arguments (ETP, then EP, after CP), as examples/qwen3_next's.
# A thin alias at Pai's path (docs/coming-from-pai.md); `run_mcore_qwen3.sh --help` lists the arguments.
# POSIX sh, as Pai's READMEs start their launchers with `sh` (dash on Debian and Ubuntu).
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="${ROOT}${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" train qwen3_next/run_mcore_qwen3 "$@"

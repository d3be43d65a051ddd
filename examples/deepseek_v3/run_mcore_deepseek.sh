#!/bin/sh
# Pai-Megatron-Patch's DeepSeek-V3 launcher: 27 arguments (ETP, then EP, after CP), as run_mcore_deepseek_v3.sh.
# A thin alias at Pai's path (docs/coming-from-pai.md); `run_mcore_deepseek.sh --help` lists the arguments.
# POSIX sh, as Pai's READMEs start their launchers with `sh` (dash on Debian and Ubuntu).
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="${ROOT}${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" train deepseek_v3/run_mcore_deepseek "$@"

#!/bin/sh
# GLM-4.5 on megatron.core: 27 positional arguments in the Pai-Megatron-Patch order (ETP, then EP, after CP).
# `run_mcore_glm4_moe.sh --help` lists them; examples/README.md explains each. All validation lives in Python
# (megatron_patch/training/launcher_args.py, validation.py); MP_DRY_RUN=1 prints the resolved configuration and command.
# POSIX sh, as Pai's READMEs start their launchers with `sh` (dash on Debian and Ubuntu).
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="${ROOT}${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" train glm4_moe "$@"

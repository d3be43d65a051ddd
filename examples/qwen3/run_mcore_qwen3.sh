#!/bin/sh
# Qwen3 and Qwen3-MoE on megatron.core: 26 positional arguments (EP after CP), or Pai-Megatron-Patch's 27 (ETP, then
# EP, after CP), its one launcher for the dense and the MoE sizes.
# `run_mcore_qwen3.sh --help` lists them; examples/README.md explains each. All validation lives in Python
# (megatron_patch/training/launcher_args.py, validation.py); MP_DRY_RUN=1 prints the resolved configuration and command.
# POSIX sh, as Pai's READMEs start their launchers with `sh` (dash on Debian and Ubuntu).
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH="${ROOT}${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" "$ROOT/mpatch.py" train qwen3 "$@"

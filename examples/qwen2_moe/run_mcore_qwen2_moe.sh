#!/usr/bin/env bash
# Qwen2-MoE (ETP then EP after CP) on megatron.core: 27 positional arguments in the Pai-Megatron-Patch order.
# `run_mcore_qwen2_moe.sh --help` lists them; examples/README.md explains each. All validation lives in Python
# (megatron_patch/training/launcher_args.py, validation.py); MP_DRY_RUN=1 prints the resolved configuration and command.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python}" -m megatron_patch train qwen2_moe "$@"

"""Helpers of the conversion tests."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_patch.cli import main
from megatron_patch.convert.arch_source import open_checkpoint
from megatron_patch.convert.loading import load_checkpoint_into_model
from megatron_patch.models.builder import build_model
from megatron_patch.models.inference import forward_logits, place_on_rank_device
from megatron_patch.runtime import init_model_parallel


def leftovers(target: Path) -> list[str]:
    """Temporary siblings a conversion into ``target`` left behind."""
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


def run_cli(capsys, *argv) -> tuple[int, str]:
    """``mpatch argv`` in this process: its exit code and what it wrote to stderr."""
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def checkpoint_logits_worker(ckpt_dir: str, layout, tokens: torch.Tensor, dtype=torch.float32, hf_config=None):
    """Runs on every rank: build the model at ``layout``, load the checkpoint, return logits (last stage)."""
    arch = open_checkpoint(ckpt_dir, hf_config=hf_config).model_arch
    init_model_parallel(layout)
    model = build_model(arch, layout, dtype)
    load_checkpoint_into_model(model, ckpt_dir, layout, hf_config)
    return forward_logits(place_on_rank_device(model), tokens, arch.vocab_size)

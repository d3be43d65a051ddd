"""DeepSeek-V4 in bf16 with transformers' float32 parameters: the hyper-connections, the attention sinks and
compressor position biases and every norm stay float32 in a bf16 model (built, and after the training loop's
``cast_parameters``), as transformers' ``_keep_in_fp32_modules_strict`` keeps them; and the tiny model's bf16 error
against transformers' fp32 is within 2x transformers' own bf16 error at every layer and at the logits (the noise floor
``mpatch align --dtype bf16`` judges by)."""

from __future__ import annotations

import pytest
import torch

from megatron_patch.runtime.distributed import ParallelLayout
from tests.test_deepseek_v4_model import SEQ, hf_dir, v4  # noqa: F401 (fixtures)

TOLERANCE = 2.0


def _float32_shapes(named_parameters) -> list[tuple]:
    return sorted(tuple(p.shape) for _, p in named_parameters if p.dtype == torch.float32)


def bf16_worker(hf: str, tokens: torch.Tensor):
    """The bf16 model's float32 parameter shapes after ``cast_parameters``, its layers' outputs ([b, s, n, h] streams)
    and its logits."""
    from megatron_patch.models.deepseek_v4.family import registered

    with registered():
        from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
        from megatron_patch.checkpoint.model_io import load_hf_weights
        from megatron_patch.models.blocks.builder import build_model
        from megatron_patch.models.blocks.inference import forward_logits
        from megatron_patch.models.description.registry import parse_arch
        from megatron_patch.runtime import init_model_parallel
        from megatron_patch.training.loop import cast_parameters

        arch = parse_arch(hf)
        init_model_parallel(ParallelLayout())
        model = build_model(arch, ParallelLayout(), torch.bfloat16)
        cast_parameters([model], torch.bfloat16)
        load_hf_weights(model, arch, ParallelLayout(), HFCheckpointReader(hf))
        layers = []
        for layer in model.decoder.layers:
            layer.register_forward_hook(lambda m, i, o: layers.append(o[0].detach()))
        logits = forward_logits(model, tokens, arch.vocab_size)
        b, s = tokens.shape
        streams = [x.float().view(s, b, -1, x.shape[-1]).transpose(0, 1) for x in layers]
        return _float32_shapes(model.named_parameters()), streams, logits


def hf_run(hf_dir, tokens, dtype):
    from megatron_patch.models.description.hf_model import load_causal_lm

    model = load_causal_lm(hf_dir, dtype)
    layers = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, i, o: layers.append((o[0] if isinstance(o, tuple) else o).detach().float()))
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return _float32_shapes(model.named_parameters()), layers, logits


def test_bf16_keeps_transformers_float32_parameters_and_its_rounding(v4, hf_dir):
    from megatron_patch.align.metrics import compare, compare_logits
    from megatron_patch.align.parity import random_tokens
    from megatron_patch.align.verdict import min_floor
    from megatron_patch.runtime.launch import run_local

    tokens = random_tokens(300, batch=2, seq=SEQ, seed=1)
    _, ref_layers, ref_logits = hf_run(hf_dir, tokens, torch.float32)
    hf_fp32_shapes, floor_layers, floor_logits = hf_run(hf_dir, tokens, torch.bfloat16)
    shapes, layers, logits = run_local(bf16_worker, 1, str(hf_dir), tokens)[0]
    assert shapes == hf_fp32_shapes and len(shapes) > 0
    points = [(f"layers.{i}", compare(r, t)["rel_l2"], compare(r, f)["rel_l2"])
              for i, (r, f, t) in enumerate(zip(ref_layers, floor_layers, layers, strict=True))]
    points.append(("logits", compare_logits(ref_logits, logits)["rel_l2"], compare_logits(ref_logits, floor_logits)["rel_l2"]))
    ratios = {name: ours / max(floor, min_floor("bf16")) for name, ours, floor in points}
    assert all(r <= TOLERANCE for r in ratios.values()), ratios

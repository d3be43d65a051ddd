"""What the tests of a family's own model-level pieces share: its tiny model's logits as built, and with each piece
left out (a name in the family's layers module replaced while the model is built)."""

from __future__ import annotations

import torch

from megatron_patch.runtime import ParallelLayout


def logits_with_pieces_left_out(layers, hf_dir: str, tokens: torch.Tensor, left_out: dict[str, dict]) -> dict:
    """``left_out``: a name per variant (``"built"``: nothing changed) -> the module attributes it replaces. Run in
    a process of one rank (``run_local``): it joins a process group of its own."""
    from megatron_patch.align.parity import load_hf_weights
    from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
    from megatron_patch.models.blocks import builder
    from megatron_patch.models.blocks.inference import forward_logits
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.runtime import init_model_parallel

    arch = parse_arch(hf_dir)
    init_model_parallel(ParallelLayout())
    out = {}
    for name, changes in left_out.items():
        saved = {k: getattr(layers, k) for k in changes}
        for k, v in changes.items():
            setattr(layers, k, v)
        try:
            model = builder.build_model(arch, ParallelLayout(), torch.float32)
            load_hf_weights(model, arch, ParallelLayout(), HFCheckpointReader(hf_dir))
            out[name] = forward_logits(model.eval(), tokens, arch.vocab_size)
        finally:
            for k, v in saved.items():
                setattr(layers, k, v)
    return out


def parameter_dtypes_worker(family_names: list[str], dtype_name: str) -> dict[str, dict[str, list[str]]]:
    """Per family, the parameters of its tiny model as ``build_model`` makes it in ``dtype_name`` (the model training,
    ``mpatch align`` and ``mpatch eval`` run) that are not in that dtype: ``declared`` (a family's float32
    parameters, as transformers keeps them) and ``other``. Run in a process of one rank (``run_local``)."""
    from megatron_patch.models.blocks import builder
    from megatron_patch.models.blocks.precision import kept_in_float32
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.models.description.tiny import tiny_config
    from megatron_patch.runtime import init_model_parallel

    init_model_parallel(ParallelLayout())
    dtype, out = getattr(torch, dtype_name), {}
    for family in family_names:
        model = builder.build_model(parse_arch(tiny_config(family)), ParallelLayout(), dtype)
        odd = [(name, kept_in_float32(p)) for name, p in model.named_parameters() if p.dtype != dtype]
        out[family] = {"declared": [n for n, kept in odd if kept], "other": [n for n, kept in odd if not kept]}
    return out

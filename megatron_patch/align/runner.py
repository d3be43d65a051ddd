"""Run the two sides of an alignment: HF models in this process, MCore models in local rank processes.

Several MCore runs (dtypes, ablation variants, checkpoints) share one set of spawned processes: the
rank processes start once, build and load each model in turn, and send back each run's captures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_patch.align import ablations
from megatron_patch.align.capture import Captures, capture_hf, capture_mcore, load_hf_model, merge_captures
from megatron_patch.checkpoint.arch_source import open_checkpoint
from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
from megatron_patch.dtypes import precision_dtype
from megatron_patch.lora.sources import add_adapters, open_adapters
from megatron_patch.models.blocks.builder import build_model
from megatron_patch.models.blocks.inference import place_on_rank_device
from megatron_patch.models.description.arch import read_config_json
from megatron_patch.models.description.hf_model import check_finite_weights
from megatron_patch.models.description.registry import detect_family, get_family, parse_arch
from megatron_patch.runtime import init_model_parallel
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.runtime.launch import run_local

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# processes that import this module without building a megatron-core model (align's main process, the
# launcher's dry run and resume checks) do not pay for it.
# So are checkpoint.loading and checkpoint.model_io, which import torch at their top.


@dataclass(frozen=True)
class McoreRun:
    """One MCore model to build, fill and capture.

    Weights come from ``mcore_dir`` (any Megatron-Core checkpoint; one without this project's sidecar
    is read as the model of ``hf_dir``) when given, else from ``hf_dir`` through the in-memory mapping. ``ablation`` names a variant from
    ``align.ablations`` (None: the model as this package builds it).
    """

    dtype: str
    hf_dir: str | None = None
    mcore_dir: str | None = None
    ablation: str | None = None
    # LoRA adapters on top (a peft folder), unless ``mcore_dir`` carries adapters of its own
    peft_dir: str | None = None
    # check ``mcore_dir``'s files against its manifest before loading them (align --no-verify: False)
    verify: bool = True
    # a LoRA run's base where it is no longer where the run recorded it (align --base-dir)
    base_dir: str | None = None
    # dtype "fp8": torchao's float8 (recipe, filter) in the bf16 model's decoder GEMMs (models/blocks/float8.py)
    fp8: tuple | None = None


def _arch_of(run: McoreRun):
    if run.mcore_dir is not None:
        return open_checkpoint(run.mcore_dir, hf_config=run.hf_dir, config_option="--hf-dir",
                               family_option=None).model_arch
    return parse_arch(run.hf_dir)


def _build_and_load(run: McoreRun, layout: ParallelLayout):
    arch = _arch_of(run)
    overrides = ablations.config_overrides(run.ablation)
    model = build_model(arch, layout, precision_dtype(run.dtype), use_te=ablations.use_te(run.ablation),
                        core_attention=ablations.core_attention(run.ablation), **overrides)
    adapters = _adapters_of(run, arch)
    if run.mcore_dir is not None:
        from megatron_patch.checkpoint.loading import load_checkpoint_into_model

        base = adapters.base if adapters is not None and adapters.base is not None else run.mcore_dir
        load_checkpoint_into_model(model, base, layout, hf_config=run.hf_dir, verify=run.verify)
    else:
        from megatron_patch.checkpoint.model_io import load_hf_weights

        load_hf_weights(model, arch, layout, HFCheckpointReader(run.hf_dir))
    if adapters is not None:
        add_adapters([model], arch, adapters, layout, precision_dtype(run.dtype))
    if run.dtype == "fp8":
        from megatron_patch.models.blocks import float8  # torchao: only an fp8 alignment needs it

        float8.convert_chunks([model], *run.fp8, arch.linear_attention)
    return place_on_rank_device(model), arch


def _adapters_of(run: McoreRun, arch):
    """The LoRA adapters of the MCore side: those ``mcore_dir`` carries, else ``peft_dir``'s, else None."""
    if run.mcore_dir is not None:
        if open_checkpoint(run.mcore_dir, hf_config=run.hf_dir, config_option="--hf-dir",
                           family_option=None, verify=run.verify).sidecar.lora:
            return open_adapters(run.mcore_dir, arch, run.verify, run.base_dir, "--base-dir")
    return open_adapters(run.peft_dir, arch) if run.peft_dir else None


def mcore_capture_worker(layout: ParallelLayout, tokens: torch.Tensor, runs: list[McoreRun]) -> list[Captures] | None:
    """Runs on every rank: each run's captures from this rank if it is a stage's reporter, else None.

    One rank per pipeline stage reports (TP rank 0, data-parallel rank 0): the others hold equal
    copies of the same activations.
    """
    from megatron.core import parallel_state as ps

    init_model_parallel(layout)
    reporter = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    out = []
    for run in runs:
        model, arch = _build_and_load(run, layout)
        try:
            with ablations.patched(run.ablation, model):
                captured = capture_mcore(model, tokens, arch.vocab_size, get_family(arch.family).hf_modules,
                                         arch.is_moe)
        except ablations.NotApplicable as exc:
            captured = str(exc)  # why the variant is skipped, said by every rank alike
        out.append(captured if reporter else None)
        del model
    return out


def capture_mcore_runs(layout: ParallelLayout, tokens: torch.Tensor, runs: list[McoreRun]) -> list[Captures | str]:
    """Captures of every run at ``layout``, computed in ``layout.world_size`` local processes."""
    per_rank = run_local(mcore_capture_worker, layout.world_size, layout, tokens, list(runs))
    merged = []
    for i in range(len(runs)):
        parts = [r[i] if r else None for r in per_rank]
        # a variant that changes nothing in this model: why (ablations.NotApplicable), in place of its captures
        merged.append(next((p for p in parts if isinstance(p, str)), None) or merge_captures(parts))
    return merged


def capture_hf_dir(hf_dir: str | Path, tokens: torch.Tensor, dtype: str, peft_dir: str | Path | None = None,
                   fp8: tuple | None = None) -> Captures:
    """Captures of the HF model in ``hf_dir`` (with ``peft_dir``: peft's model of it with that adapter; dtype
    "fp8": in bf16 after torchao's ``convert_to_float8_training`` with ``fp8`` = (recipe, filter); "fp64": the
    floor of an fp32 run)."""
    config = read_config_json(hf_dir)
    modules = detect_family(config).hf_modules
    model = load_hf_model(hf_dir, torch.float64 if dtype == "fp64" else precision_dtype(dtype))
    if dtype == "fp8":
        from megatron_patch.models.blocks.float8 import convert_hf_model  # torchao: only an fp8 alignment needs it

        convert_hf_model(model, *fp8)
    if peft_dir is not None:
        # the adapters in the base's dtype, as the MCore side computes them: peft's default keeps them in fp32 on a
        # bf16 base, a rounding floor finer than the run being judged (a sound LoRA checkpoint read 2.03x there)
        model = peft_model(model, peft_dir, adapters_in_fp32=dtype == "fp32")
        check_finite_weights(model, peft_dir)  # the adapter's NaN would reach both sides too, as the base's would
    try:
        return capture_hf(model, tokens, modules, parse_arch(config).vocab_size)
    finally:
        del model


def peft_model(model, peft_dir: str | Path, adapters_in_fp32: bool = True):
    """``peft.PeftModel.from_pretrained(model, peft_dir)``, as the transformers model it adapts (the module paths
    the capture points name); ``adapters_in_fp32``: peft's ``autocast_adapter_dtype`` (False: the base's dtype)."""
    try:
        from peft import PeftModel
    except ImportError:
        from megatron_patch.errors import UserError

        raise UserError("--peft-dir compares against peft's own model of the adapter: pip install peft")
    return PeftModel.from_pretrained(model, str(peft_dir), autocast_adapter_dtype=adapters_in_fp32
                                     ).eval().get_base_model()

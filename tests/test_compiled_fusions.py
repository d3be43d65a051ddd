"""MP_COMPILE_FUSIONS: torch.compile of the local spec's RMSNorm, RoPE, SwiGLU and bias-dropout-add
(models/blocks/compiled_fusions.py), read, checked against the machine, and trained with on CPU: the same losses as
the eager model, step by step."""

from __future__ import annotations

import pytest

from megatron_patch.errors import UserError
from megatron_patch.training.megatron_settings import fusion_overrides
from megatron_patch.runtime import machine
from megatron_patch.runtime.launch import run_local
from megatron_patch.runtime.machine import Capabilities
from megatron_patch.training.launcher_options import OPTION
from megatron_patch.training.machine_checks import machine_problems
from megatron_patch.training.megatron_settings import megatron_settings
from megatron_patch.training.validation import resolve
from tests.training_helpers import launcher_args

CPU = Capabilities(cuda=False, transformer_engine=False, fp8=False, flash_attention_3=False)
GPU_NO_TE = Capabilities(cuda=True, transformer_engine=False, fp8=False, flash_attention_3=False,
                         compute_capability=(9, 0), cuda_version="13.0")
GPU_TE = Capabilities(cuda=True, transformer_engine=True, fp8=True, flash_attention_3=False,
                      compute_capability=(9, 0), cuda_version="13.0")


def _cfg(value: str | None, env="cpu", **over):
    extra = {"GPUS_PER_NODE": "1"} | ({"MP_COMPILE_FUSIONS": value} if value is not None else {})
    return resolve("llama3_1", launcher_args(ENV=env, **over), env=extra, check_paths=False)


def test_the_extra_is_read_and_becomes_megatrons_fusion_flags():
    assert "MP_COMPILE_FUSIONS" in OPTION
    for value, flags in (("true", True), ("false", False)):
        tc = megatron_settings(_cfg(value))["transformer_config"]
        assert (tc["bias_activation_fusion"], tc["bias_dropout_fusion"]) == (flags, flags)
    assert _cfg(None).compile_fusions is None
    assert "bias_activation_fusion" not in megatron_settings(_cfg(None))["transformer_config"]  # the builder's default
    with pytest.raises(UserError, match="MP_COMPILE_FUSIONS must be true or false"):
        _cfg("yes please")


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "gpt_oss"])
def test_a_fusion_the_family_cannot_take_stays_off(family):
    """Gemma's tanh GeLU and gpt-oss's clamped SwiGLU are no activation megatron-core's bias-SwiGLU fusion takes:
    MP_COMPILE_FUSIONS=true (or align's ablation) turned it on over the family's False and the model build
    stopped as an internal error (the cmp audit). The family's False stays; the bias-dropout-add still fuses."""
    from megatron_patch.models.blocks.builder import transformer_config
    from megatron_patch.models.description.registry import families, parse_arch
    from megatron_patch.runtime.distributed import ParallelLayout

    arch = parse_arch(families()[family].tiny_config)
    config = transformer_config(arch, ParallelLayout(), **fusion_overrides(True))
    assert (config.bias_activation_fusion, config.bias_dropout_fusion) == (False, True)
    llama = transformer_config(parse_arch(families()["llama3_1"].tiny_config), ParallelLayout(), **fusion_overrides(True))
    assert llama.bias_activation_fusion is True


def test_the_machine_must_be_able_to_compile(monkeypatch):
    assert machine_problems(_cfg("true"), CPU) == []
    assert machine_problems(_cfg("true", "dsw", PR="bf16"), GPU_NO_TE) == []
    no_compiler = Capabilities(**{**CPU.__dict__, "compile_problem": "torch.compile on CPU needs a C++ compiler"})
    assert machine_problems(_cfg("true"), no_compiler) == [
        "MP_COMPILE_FUSIONS=true: torch.compile on CPU needs a C++ compiler; or drop MP_COMPILE_FUSIONS"]
    assert machine_problems(_cfg("false"), no_compiler) == []  # all eager needs no compiler
    assert any("transformer-engine's spec" in p for p in machine_problems(_cfg("true", "dsw", PR="bf16"), GPU_TE))
    # what the detection looks at: a compiler on PATH (CPU), triton (GPU)
    monkeypatch.setattr(machine.shutil, "which", lambda name: None)
    assert "C++ compiler" in machine.compile_problem(cuda=False)
    monkeypatch.setattr(machine.importlib.util, "find_spec", lambda name: None)
    assert "needs triton" in machine.compile_problem(cuda=True)


def losses_worker(cfgs: list) -> list[dict]:
    """Three training steps of each configuration from the same initial weights: losses, what was compiled."""
    import torch

    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.training.loop import Trainer

    out = []
    for cfg in cfgs:
        init_model_parallel(cfg.layout, seed=cfg.seed)
        trainer = Trainer(cfg)
        trainer.build()
        trainer._param_gather_before_first_step()
        model = trainer.models[0].module
        norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
        out.append({"losses": [trainer.train_step()["loss"] for _ in range(3)],
                    "compiled_norms": sum("forward" in vars(m) for m in norms), "norms": len(norms),
                    "swiglu": model.config.bias_activation_fusion, "bias_add": model.config.bias_dropout_fusion})
    return out


@pytest.mark.slow
def test_compiled_fusions_train_with_the_same_losses(corpus, tmp_path):
    """On the SDPA path (FL=true) in fp32: eager and compiled take the same three steps (the compiled kernels
    add in another order: agreement to ~1e-6, not bit for bit)."""
    cfgs = [resolve("llama3_1", launcher_args(DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(tmp_path / v), FL="true",
                                              SAVE_INTERVAL="100"), env={"MP_COMPILE_FUSIONS": v})
            for v in ("false", "true")]
    eager, compiled = run_local(losses_worker, 1, cfgs, timeout=900)[0]
    assert (eager["swiglu"], eager["bias_add"], eager["compiled_norms"]) == (False, False, 0)
    assert (compiled["swiglu"], compiled["bias_add"]) == (True, True)
    assert compiled["compiled_norms"] == compiled["norms"] > 0
    for a, b in zip(eager["losses"], compiled["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (eager["losses"], compiled["losses"])
    assert eager["losses"][-1] < eager["losses"][0]  # it trains

"""PR=fp8 without transformer-engine: torchao's float8 GEMMs inside megatron-core's parallel linears
(models/blocks/float8.py), their options, refusals and dry run (training/fp8_run.py), and training through the
launcher (docs/fp8.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_patch.errors import UserError
from megatron_patch.models.blocks import float8, float8_plan
from megatron_patch.runtime.launch import run_local
from megatron_patch.runtime.machine import Capabilities
from megatron_patch.training import fp8_run
from megatron_patch.training.machine_checks import machine_problems
from megatron_patch.training.megatron_settings import megatron_settings
from megatron_patch.training.validation import resolve
from tests.fp8_helpers import gemms_worker, plan_and_live_worker, sequence_parallel_worker
from tests.training_helpers import REPO, launcher_args

torchao = pytest.importorskip("torchao")

RECIPES = float8_plan.RECIPES
CPU = Capabilities(cuda=False, transformer_engine=False, fp8=False, flash_attention_3=False, torchao=True)
H100_NO_TE = Capabilities(cuda=True, transformer_engine=False, fp8=False, flash_attention_3=False,
                          compute_capability=(9, 0), cuda_version="13.0", torchao=True)
H100_TE = Capabilities(cuda=True, transformer_engine=True, fp8=True, flash_attention_3=False,
                       compute_capability=(9, 0), cuda_version="13.0", torchao=True)


def _cfg(env=None, **over):
    return resolve("llama3_1", launcher_args(**{"PR": "fp8", **over}), env={"GPUS_PER_NODE": "1", **(env or {})},
                   check_paths=False)


# --- the options, the implementation, the refusals ------------------------------------------------------------

def test_the_filter_and_the_recipe_are_read_and_checked():
    assert _cfg().fp8_filter == "auto" and _cfg().fp8_recipe is None
    assert _cfg({"MP_FP8_FILTER": "all"}).fp8_filter == "all"
    assert _cfg({"MP_FP8_FILTER": "fc2, qkv"}).fp8_filter == ("qkv", "fc2")
    with pytest.raises(UserError, match="MP_FP8_FILTER takes auto, all or a comma list of qkv,proj,fc1,fc2"):
        _cfg({"MP_FP8_FILTER": "qkv,lm_head"})
    with pytest.raises(UserError, match="MP_FP8_FILTER=all needs PR=fp8, got PR=bf16"):
        _cfg({"MP_FP8_FILTER": "all"}, PR="bf16")
    # a kind the family lacks: every GEMM of Llama stayed in bf16, without a word (as MP_LORA_TARGETS refuses it)
    with pytest.raises(UserError, match="MP_FP8_FILTER names experts, which a llama3_1 model does not have: its "
                                        "kinds are qkv,proj,fc1,fc2"):
        _cfg({"MP_FP8_FILTER": "qkv,experts"})
    with pytest.raises(UserError, match="MP_FP8_RECIPE must be one of delayed . tensorwise . mxfp8 . blockwise . "
                                        "rowwise . rowwise_with_gw_hp, got 'bogus'"):
        _cfg({"MP_FP8_RECIPE": "bogus"})


def test_the_dry_run_names_routed_and_shared_experts_apart():
    """Qwen2-MoE with MP_FP8_FILTER=experts and with =shared_experts printed the same line: both kinds' GEMMs are
    linear_fc1/linear_fc2, so the float8 and bf16 lists held the same names."""
    def moe_line(kinds):
        cfg = resolve("qwen2_moe", launcher_args("qwen2_moe", PR="fp8"), env={"GPUS_PER_NODE": "1",
                                                                            "MP_FP8_FILTER": kinds}, check_paths=False)
        return next(line for line in fp8_run.dry_run_lines(cfg, CPU) if line.startswith("moe layers"))

    assert moe_line("experts").startswith("moe layers: float8 experts.linear_fc1.gate, experts.linear_fc1.up, "
                                          "experts.linear_fc2; bf16 linear_proj,"), moe_line("experts")
    assert moe_line("shared_experts").startswith("moe layers: float8 shared_experts.linear_fc1.gate, "
                                                 "shared_experts.linear_fc1.up, shared_experts.linear_fc2; bf16 "
                                                 "experts.linear_fc1.gate"), moe_line("shared_experts")
    with pytest.raises(UserError, match="MP_FP8_FILTER names fc1, which a qwen2_moe model does not have"):
        resolve("qwen2_moe", launcher_args("qwen2_moe", PR="fp8"), env={"MP_FP8_FILTER": "fc1"}, check_paths=False)


def test_each_machine_runs_its_implementation_with_its_recipes():
    cpu, gpu = _cfg(), _cfg(ENV="dsw")
    assert (fp8_run.implementation(cpu, CPU), fp8_run.recipe(cpu, "torchao")) == ("torchao", "tensorwise")
    assert fp8_run.implementation(gpu, H100_NO_TE) == "torchao"
    assert (fp8_run.implementation(gpu, H100_TE), fp8_run.recipe(gpu, "transformer-engine")) == \
        ("transformer-engine", "delayed")
    assert machine_problems(cpu, CPU) == [] and machine_problems(gpu, H100_NO_TE) == []
    for recipe in RECIPES:
        assert machine_problems(_cfg({"MP_FP8_RECIPE": recipe}), CPU) == []
    assert machine_problems(_cfg({"MP_FP8_RECIPE": "delayed"}), CPU) == [
        "MP_FP8_RECIPE=delayed is transformer-engine's, which this machine runs without: torchao takes tensorwise | "
        "rowwise | rowwise_with_gw_hp"]
    assert "is torchao's" in machine_problems(_cfg({"MP_FP8_RECIPE": "rowwise"}, ENV="dsw"), H100_TE)[0]
    # transformer-engine's FP8 is a TransformerConfig setting; torchao's changes the built model instead
    assert megatron_settings(gpu, "transformer-engine")["transformer_config"]["fp8"] == "hybrid"
    assert "fp8" not in megatron_settings(cpu, "torchao")["transformer_config"]
    a100 = Capabilities(**{**H100_NO_TE.__dict__, "compute_capability": (8, 0)})
    assert "FP8 tensor cores" in machine_problems(gpu, a100)[0]


def test_a_gemm_filter_is_refused_where_transformer_engine_runs_fp8():
    """transformer-engine puts every linear of its spec in FP8: MP_FP8_FILTER (torchao's) was accepted there and
    ignored. It is refused as torchao's recipes are; torchao's machines still take it. `all` is what TE does, so it
    stands there (a line written for a torchao machine; this change's audit)."""
    for kinds in ("qkv", "qkv,fc1"):
        assert machine_problems(_cfg({"MP_FP8_FILTER": kinds}, ENV="dsw"), H100_TE) == [
            f"MP_FP8_FILTER={kinds} is torchao's, and this GPU runs transformer-engine's FP8, which puts every linear "
            "of its layer spec in FP8: drop MP_FP8_FILTER (or give all)"]
        assert machine_problems(_cfg({"MP_FP8_FILTER": kinds}, ENV="dsw"), H100_NO_TE) == []
    assert machine_problems(_cfg(ENV="dsw"), H100_TE) == []
    assert machine_problems(_cfg({"MP_FP8_FILTER": "all"}, ENV="dsw"), H100_TE) == []


def test_a_torchao_that_does_not_import_is_refused_before_launch(monkeypatch):
    """torchao installed (its metadata) but its import failing (built for another torch, say): the machine check
    said ok, and every rank then stopped with an internal error. A PR=fp8 launch tries the import once and refuses."""
    import sys

    from megatron_patch.runtime import machine

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # its import now raises ImportError
    machine.torchao_import_error.cache_clear()
    try:
        caps = Capabilities.detect(import_torchao=True)
    finally:
        machine.torchao_import_error.cache_clear()
    assert caps.torchao and "import of torchao.float8 halted" in caps.torchao_import_error
    assert machine_problems(_cfg(), caps) == [
        f"PR=fp8 runs torchao's float8 here, and the torchao installed cannot run it ({caps.torchao_import_error})"
        ": install torchao>=0.18 for this torch (pip install -e \".[fp8]\"), or use PR=bf16"]


def test_a_torchao_without_the_float8_modules_the_run_uses_is_refused(monkeypatch):
    """The fdoc audit: a torchao whose float8 package imports without the modules the ranks use (float8_training_tensor
    was float8_tensor before 0.12) passed the check, and every rank failed; one older than the [fp8] extra's minimum
    is refused for its version alike."""
    import sys

    import torchao.float8

    from megatron_patch.runtime import machine

    monkeypatch.delattr(torchao.float8, "float8_training_tensor")
    monkeypatch.setitem(sys.modules, "torchao.float8.float8_training_tensor", None)
    machine.torchao_import_error.cache_clear()
    try:
        assert "torchao.float8.float8_training_tensor" in machine.torchao_import_error()
        machine.torchao_import_error.cache_clear()
        monkeypatch.setattr(machine, "installed_version", lambda *dists: "0.11.0" if dists == ("torchao",) else None)
        assert machine.torchao_import_error() == "torchao 0.11.0 is older than 0.18"
    finally:
        machine.torchao_import_error.cache_clear()


def test_neither_transformer_engine_nor_torchao_is_refused_in_one_line():
    bare = Capabilities(**{**CPU.__dict__, "torchao": False})
    problems = machine_problems(_cfg(), bare)
    assert problems == ["PR=fp8 needs transformer-engine (on a GPU) or torchao (pip install -e \".[fp8]\", or pip "
                        "install torchao), and neither is installed here: install torchao, or use PR=bf16"]
    assert "neither" in machine_problems(_cfg(ENV="dsw"), Capabilities(**{**H100_NO_TE.__dict__, "torchao": False}))[0]


def test_a_cpu_whose_float8_gemm_takes_no_row_scales_refuses_the_rowwise_recipes(tmp_path, monkeypatch, capsys):
    """torch 2.11's CPU torch._scaled_mm takes one scale per tensor: torchao's rowwise recipes died there in torch's
    internal assert ("please report a bug to PyTorch") on every rank. The launcher and `mpatch align` refuse them in
    one line on such a CPU; tensorwise still runs, and a GPU is not asked."""
    from megatron_patch.cli import main
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    old_cpu = Capabilities(**{**CPU.__dict__, "cpu_float8_rowwise": False, "torch_version": "2.11.0+cu130"})
    for recipe in float8_plan.ROWWISE:
        assert machine_problems(_cfg({"MP_FP8_RECIPE": recipe}), old_cpu) == [
            f"MP_FP8_RECIPE={recipe} scales float8 per row, and torch 2.11.0+cu130's CPU float8 GEMM takes one scale "
            "per tensor only (torch 2.13 takes both): use the tensorwise recipe on this CPU, or a newer torch"]
    assert machine_problems(_cfg({"MP_FP8_RECIPE": "tensorwise"}), old_cpu) == machine_problems(_cfg(), old_cpu) == []
    h100_with_that_torch = Capabilities(**{**H100_NO_TE.__dict__, "cpu_float8_rowwise": False})
    assert machine_problems(_cfg({"MP_FP8_RECIPE": "rowwise"}, ENV="dsw"), h100_with_that_torch) == []

    import megatron_patch.align.alignment as alignment

    monkeypatch.setattr(alignment, "cpu_float8_rowwise", lambda: False)
    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf")
    assert main(["align", "--hf-dir", str(hf), "--dtype", "fp8", "--fp8-recipe", "rowwise_with_gw_hp"]) == 2
    assert "--fp8-recipe rowwise_with_gw_hp scales float8 per row" in capsys.readouterr().err


def test_the_row_scale_probe_answers_what_torchaos_rowwise_linear_does():
    """`cpu_float8_rowwise()` asks torch one small GEMM; torchao's rowwise Float8Linear on the CPU runs exactly where
    it says yes (torch 2.13 and 2.15 here; 2.11 fails both)."""
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from megatron_patch.runtime.machine import cpu_float8_rowwise

    model = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(32, 16, dtype=torch.bfloat16)),
                                       config=Float8LinearConfig.from_recipe_name("rowwise"))
    try:
        model(torch.ones(16, 32, dtype=torch.bfloat16)).sum().backward()
        ran = True
    except RuntimeError:
        ran = False
    assert cpu_float8_rowwise() == ran


def test_mpatch_starts_and_plans_without_torchao(tmp_path):
    """torchao is optional: with it impossible to import, `mpatch` still starts and the launcher's options, checks
    and FP8 plan (which read no torchao) load."""
    blocker = tmp_path / "torchao.py"
    blocker.write_text("raise ImportError('torchao is blocked for this test')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    code = ("import megatron_patch.cli.train, megatron_patch.training.fp8_run, megatron_patch.models.blocks.float8; "
            "from megatron_patch.cli import main; main(['families'])")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "llama3_1" in proc.stdout, proc.stderr


def test_the_auto_filter_is_torchaos():
    from torchao.float8 import _auto_filter_for_recipe

    shapes = [(n, k) for n in (16, 24, 1024, 1040, 2048, 2064, 4096, 4112, 8192) for k in (16, 1024, 1040, 2048,
                                                                                           2064, 4096, 4112, 14336)]
    for recipe in ("tensorwise", "rowwise"):
        theirs = _auto_filter_for_recipe(recipe, filter_fqns=[])
        for n, k in shapes:
            linear = torch_linear(k, n)
            assert float8_plan.torchao_auto_filter(recipe, n, k) == theirs(linear, "layers.0.mlp"), (recipe, n, k)


def torch_linear(fan_in: int, fan_out: int):
    import torch

    with torch.device("meta"):
        return torch.nn.Linear(fan_in, fan_out, bias=False)


@pytest.mark.slow
def test_the_dry_run_names_the_implementation_recipe_and_the_gemms_left_in_bf16():
    big = _cfg({"MP_FP8_RECIPE": "rowwise"}, ENV="dsw", MODEL_SIZE="8B", BATCH_SIZE="1", SEQ_LEN="4096",
               PAD_LEN="4096", GLOBAL_BATCH_SIZE="8", TRAIN_TOKENS_OR_ITERS="1e9", WARMUP_TOKENS_OR_ITERS="1e8")
    lines = fp8_run.dry_run_lines(big, H100_NO_TE)
    assert lines[0].startswith("torchao float8, recipe rowwise, filter auto; communication in bf16")
    # Llama-3.1-8B under torchao's rowwise filter: k and v (1024 rows each) stay in bf16, the rest is float8
    assert lines[1] == ("dense layers: float8 linear_fc1.gate, linear_fc1.up, linear_fc2, linear_proj, "
                        "linear_qkv.q; bf16 linear_qkv.k, linear_qkv.v")
    tiny = fp8_run.summary(_cfg(), CPU)
    assert tiny["implementation"] == "torchao" and tiny["recipe"] == "tensorwise"
    assert not any(g["float8"] for g in tiny["gemms"]["dense"])  # every tiny GEMM is too small for torchao's filter
    assert all(g["float8"] for g in fp8_run.summary(_cfg({"MP_FP8_FILTER": "all"}), CPU)["gemms"]["dense"])
    assert fp8_run.dry_run_lines(_cfg(ENV="dsw"), H100_TE)[0].startswith("transformer-engine, recipe delayed")


# --- the GEMMs against torchao's own ----------------------------------------------------------------------------

def test_each_gemm_is_torchaos_bit_for_bit_at_tp1():
    """q/k/v fused in linear_qkv, gate/up in linear_fc1, the row-parallel fc2, and a Gated DeltaNet's in_proj (HF's
    in_proj_qkvz and in_proj_ba, which were one GEMM with one scale): output, input gradient and weight gradient equal
    torchao's Float8Linear on the HF linears, bit for bit, with every recipe."""
    result = run_local(gemms_worker, 1, 1, RECIPES)[0]
    for key, diffs in result.items():
        assert all(d["equal"] for d in diffs.values()), (key, diffs)


def test_tp2_scales_are_the_whole_tensors():
    """At TP=2 every float8 operand is cast as at TP=1: the results equal TP=1's (torchao's), except where
    megatron-core sums partial results over TP in bf16 (a row-parallel output, a column-parallel input
    gradient), which differ by a bf16 rounding. Scales from the local shard (the planted fault) do not."""
    exact = {"self_attention.linear_qkv": ("output", "grad_weight"), "mlp.linear_fc1": ("output", "grad_weight"),
             "mlp.linear_fc2": ("grad_input", "grad_weight"), "self_attention.in_proj": ("output", "grad_weight")}
    result = run_local(gemms_worker, 2, 2, RECIPES)[0]
    for (recipe, name), diffs in result.items():
        for what, d in diffs.items():
            if what in exact[name]:
                assert d["equal"], (recipe, name, what, d)
            else:
                assert d["relative"] <= 1e-2, (recipe, name, what, d)  # bf16 rounding of a sum
    local = run_local(gemms_worker, 2, 2, ("tensorwise",), False)[0]
    assert not any(local[("tensorwise", name)][what]["equal"] for name, whats in exact.items() for what in whats)


def test_under_sequence_parallelism_the_float8_linear_keeps_the_local_input_as_megatrons():
    """The fdoc audit: the float8 linear was fed the gathered sequence and kept it for backward, TP times what
    megatron-core's bf16 linear keeps (its local part, gathered again in backward), which docs/fp8.md's memory
    section says it does not add. It gathers inside now: the same bytes kept, the same results bit for bit."""
    result = run_local(sequence_parallel_worker, 2)[0]
    assert result["saved_float8"] == result["saved_bf16"] > 0, result
    assert result["same"]


def test_an_expert_without_tokens_computes_nothing():
    """A step may route no token to a local expert: its GEMMs get empty inputs (torch.max of an empty tensor stopped
    EP=2 training at its fifth iteration)."""
    import torch

    from megatron_patch.models.blocks.float8 import Float8ParallelMatmul, Parts, Sharding, _mm_config, torchao_config

    # one weight, and gate and up fused in one (two GEMMs, joined: at ETP=2 that join met the empty batch first)
    for recipe, parts in [(r, p) for r in RECIPES for p in (Parts(1, (8,), (True,)), Parts(1, (4, 4), (True, True)))]:
        config = torchao_config(recipe)
        weight = torch.randn(8, 16, dtype=torch.bfloat16, requires_grad=True)
        empty = torch.randn(0, 16, dtype=torch.bfloat16, requires_grad=True)
        out = Float8ParallelMatmul.apply(empty, weight, config, _mm_config(config), Sharding("column"), parts)
        out.sum().backward()
        assert out.shape == (0, 8) and empty.grad.shape == (0, 16)
        assert torch.equal(weight.grad, torch.zeros_like(weight)), recipe


def test_a_transposed_input_computes_as_its_contiguous_copy():
    """DeepSeek-V4's output projection gets a sequence-first transposed view: the row-scaled recipes stopped its first
    forward ('aten.clone.default with axiswise scaling is not supported yet'), the tensorwise one trained."""
    from megatron_patch.models.blocks.float8 import Float8ParallelMatmul, Parts, Sharding, _mm_config, torchao_config

    for recipe in RECIPES:
        config = torchao_config(recipe)
        weight = torch.randn(32, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
        batch_first = torch.randn(2, 16, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        outputs, grads = [], []
        for given in (batch_first.transpose(0, 1), batch_first.transpose(0, 1).contiguous()):
            given = given.detach().requires_grad_()
            w = weight.clone().requires_grad_()
            out = Float8ParallelMatmul.apply(given, w, config, _mm_config(config), Sharding("row"),
                                             Parts(1, (32,), (True,)))
            out.float().square().sum().backward()
            outputs.append(out)
            grads.append((given.grad, w.grad))
        assert torch.equal(*outputs), recipe
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1]), recipe


def test_the_weight_gradient_gemm_gets_its_tokens_in_multiples_of_16(monkeypatch):
    """The weight-gradient GEMM's inner dimension is the token count (an expert's routed tokens), which a GPU's
    torch._scaled_mm takes only in multiples of 16 (and a compiled one-token expert's backward broke on CPU too):
    its operands get zero rows up to 16 tokens, and the gradients stay torchao's (unpadded here) bit for bit. The GPU
    kernel's check is simulated on the CPU's."""
    import torch
    from torchao.float8 import convert_to_float8_training

    from megatron_patch.models.blocks.float8 import Float8ParallelMatmul, Parts, Sharding, _mm_config, torchao_config

    def inputs():
        gen = torch.Generator().manual_seed(3)
        weight = torch.randn(32, 16, dtype=torch.bfloat16, generator=gen)
        return weight, torch.randn(5, 16, dtype=torch.bfloat16, generator=gen), torch.randn(5, 32, generator=gen)

    references = {}
    for recipe in RECIPES:
        weight, x, grad = inputs()
        model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False, dtype=torch.bfloat16))  # torchao swaps children
        with torch.no_grad():
            model[0].weight.copy_(weight)
        convert_to_float8_training(model, config=torchao_config(recipe))
        model(x.requires_grad_(True)).backward(grad.to(torch.bfloat16))
        references[recipe] = (model[0].weight.grad, x.grad)
    scaled_mm = torch._scaled_mm

    def gpu_scaled_mm(a, b, *args, **kwargs):
        if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
            raise RuntimeError(f"Expected trailing dimension of mat1 to be divisible by 16: {tuple(a.shape)}")
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", gpu_scaled_mm)
    for recipe in RECIPES:
        config = torchao_config(recipe)
        weight, x, grad = inputs()
        weight.requires_grad_(True), x.requires_grad_(True)
        Float8ParallelMatmul.apply(x, weight, config, _mm_config(config), Sharding("column"),
                                   Parts(1, (32,), (True,))).backward(grad.to(torch.bfloat16))
        assert torch.equal(weight.grad, references[recipe][0]) and torch.equal(x.grad, references[recipe][1]), recipe


def test_a_frozen_weight_gets_no_weight_gradient_gemm():
    """LoRA with PR=fp8: the frozen base's GEMMs run in float8 and compute the input's gradient only (the adapters
    beside them stay bf16), the same input gradient as a trainable weight's."""
    import torch

    from megatron_patch.models.blocks.float8 import Float8ParallelMatmul, Parts, Sharding, _mm_config, torchao_config

    config = torchao_config("tensorwise")
    grads = {}
    for trainable in (True, False):
        weight = torch.randn(8, 16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        weight.requires_grad_(trainable)
        x = torch.randn(4, 16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2)).requires_grad_(True)
        Float8ParallelMatmul.apply(x, weight, config, _mm_config(config), Sharding("column"),
                                   Parts(1, (8,), (True,))).sum().backward()
        grads[trainable] = (x.grad, weight.grad)
    assert grads[False][1] is None and grads[True][1] is not None
    assert torch.equal(grads[False][0], grads[True][0])


# --- training through the launcher, from converted checkpoints (CPU) ---------------------------------------------

# Small: on CPU a float8 GEMM of the tiny model takes ~40 ms (torch._scaled_mm), and the machine is shared.
ITERS, GBS, SEQ = 4, 4, 32


def _train_args(corpus, converted, family: str, out, **over) -> list[str]:
    return launcher_args(family, **{"MODEL_SIZE": "auto", "PRETRAIN_CHECKPOINT_PATH": str(converted[family]["mcore"]),
                                    "DATASET_PATH": corpus["prefix"], "OUTPUT_BASEPATH": str(out), "PR": "fp8",
                                    "LR": "3e-3", "MIN_LR": "3e-4", "GLOBAL_BATCH_SIZE": str(GBS),
                                    "SEQ_LEN": str(SEQ), "PAD_LEN": str(SEQ),
                                    "TRAIN_TOKENS_OR_ITERS": str(ITERS * GBS * SEQ),
                                    "WARMUP_TOKENS_OR_ITERS": str(GBS * SEQ), "SAVE_INTERVAL": "2",
                                    "BATCH_SIZE": "4", **over})


FP8_ALL = {"MP_FP8_FILTER": "all"}  # the tiny models' GEMMs are all below torchao's auto-filter


@pytest.fixture(scope="module")
def converted(corpus, tmp_path_factory):
    """Tiny random HF models (a dense and an MoE family) with the corpus's tokenizer, converted by hf2mcore."""
    import shutil

    from megatron_patch.cli import main
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    out = {}
    for family in ("llama3_1", "qwen2_moe"):
        root = tmp_path_factory.mktemp(f"fp8-{family}")
        hf = make_tiny_hf_checkpoint(family, root / "hf", seed=3)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(corpus["tok"] / name, hf / name)
        assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(root / "mcore"), "--quiet"]) == 0
        out[family] = {"hf": hf, "mcore": root / "mcore"}
    return out


def _run(corpus, converted, tmp_path_factory, name: str, family: str = "llama3_1", env=None, **over):
    from tests.training_helpers import launch, read_metrics

    out = tmp_path_factory.mktemp(name) / "out"
    args = _train_args(corpus, converted, family, out, **over)
    proc = launch(args, {**FP8_ALL, **(env or {})}, family=family)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"out": out, "args": args, "stdout": proc.stdout, "metrics": read_metrics(out)}


@pytest.fixture(scope="module")
def tp2(corpus, converted, tmp_path_factory):
    return _run(corpus, converted, tmp_path_factory, "fp8-tp2", TP="2")


def _falls(metrics: list[dict]) -> bool:
    losses = [m["loss"] for m in metrics]
    return len(losses) == ITERS and losses[-1] < losses[0] - 0.1


@pytest.mark.slow
def test_fp8_trains_at_tp2_pp2_and_ep2_dense_and_moe(corpus, converted, tmp_path_factory, tp2):
    """The launcher trains PR=fp8 (torchao) from a converted checkpoint at TP=2 and PP=2 (Llama), and EP=2 and
    TP=2 x ETP=2 (Qwen2-MoE, each local expert's GEMMs in float8): the loss falls over 4 iterations, and the log says
    what ran in float8."""
    assert "float8 (torchao, tensorwise): this rank's decoder GEMMs in float8 by kind: proj 4/4, qkv 12/12, fc1 8/8, " \
        "fc2 4/4" in tp2["stdout"], tp2["stdout"][-2000:]
    assert _falls(tp2["metrics"]), [m["loss"] for m in tp2["metrics"]]
    pp2 = _run(corpus, converted, tmp_path_factory, "fp8-pp2", PP="2", env={"MP_FP8_RECIPE": "rowwise"})
    assert _falls(pp2["metrics"]), [m["loss"] for m in pp2["metrics"]]
    for stage in (0, 1):  # each stage says what its own layers run (rank 0 alone said it: the fdoc audit)
        assert (f"pipeline stage {stage}: float8 (torchao, rowwise): this rank's decoder GEMMs in float8 by kind: proj "
                "2/2, qkv 6/6, fc1 4/4, fc2 2/2") in pp2["stdout"], pp2["stdout"][-3000:]
    moe = _run(corpus, converted, tmp_path_factory, "fp8-ep2", family="qwen2_moe", EP="2", ETP="1", BATCH_SIZE="2",
               env={"MP_NPROC": "2"})
    assert "experts " in moe["stdout"] and _falls(moe["metrics"]), [m["loss"] for m in moe["metrics"]]
    # experts split by ETP=2 (the rest by TP=2, sequence-parallel as MoE at TP>1 must be): each expert GEMM in float8
    etp = _run(corpus, converted, tmp_path_factory, "fp8-etp2", family="qwen2_moe", TP="2", ETP="2", SP="true",
               BATCH_SIZE="2", env={"MP_TP_COMM_OVERLAP": "false"})
    assert "experts 48/48, shared_experts 12/12" in etp["stdout"] and _falls(etp["metrics"]), [m["loss"] for m in etp["metrics"]]


@pytest.mark.slow
def test_fp8_losses_follow_the_torchao_reference_loop_closer_than_bf16(corpus, converted, tmp_path_factory, tp2):
    """The first iterations' losses at TP=2 stay closer to torchao's float8 on the HF model (a plain master-weight
    loop with Megatron's settings, the same batches) than the bf16 run of the same launcher is to the fp8 one."""
    from tests.fp8_helpers import torchao_reference_losses

    bf16 = _run(corpus, converted, tmp_path_factory, "bf16-tp2", TP="2", PR="bf16", env={"MP_FP8_FILTER": ""})
    mine = [m["loss"] for m in tp2["metrics"]]
    ref = torchao_reference_losses(converted["llama3_1"]["hf"], "llama3_1", tp2["args"], "tensorwise", ITERS)
    plain = [m["loss"] for m in bf16["metrics"]]
    to_ref = max(abs(a - b) for a, b in zip(mine, ref))
    to_bf16 = max(abs(a - b) for a, b in zip(mine, plain))
    assert to_ref < to_bf16, (mine, ref, plain)


@pytest.mark.slow
def test_fp8_resumes_exactly_after_a_kill(corpus, converted, tmp_path_factory, tp2):
    """Killed as iteration 4 starts, relaunched: it resumes from iteration 2's checkpoint to the uninterrupted run's
    losses and gradient norms, exactly."""
    from tests.training_helpers import launch, read_metrics

    out = tmp_path_factory.mktemp("fp8-kill") / "out"
    args = _train_args(corpus, converted, "llama3_1", out, TP="2")
    killed = launch(args, {**FP8_ALL, "MP_INJECT_FAULT": "kill@4"})
    assert killed.returncode != 0
    resumed = launch(args, FP8_ALL)
    assert resumed.returncode == 0 and "iter_0000002" in resumed.stdout, resumed.stderr[-2000:]
    after = {m["iteration"]: m for m in read_metrics(out)}
    before = {m["iteration"]: m for m in tp2["metrics"]}
    for i in range(1, ITERS + 1):
        assert (after[i]["loss"], after[i]["grad_norm"]) == (before[i]["loss"], before[i]["grad_norm"]), i


@pytest.mark.slow
@pytest.mark.parametrize("family, recipes, ablation, decision", [
    ("llama3_1", (None, "tensorwise"), "attention_sdpa", "whole"), ("gemma4", (None,), None, "apart")])
def test_a_compiled_layer_equals_the_eager_one(tmp_path, family, recipes, ablation, decision):
    """MP_COMPILE=true: every layer compiled (dynamo built graphs for it), whole where it traces to one graph (Llama's
    with torch SDPA, FL=true's attention, in bf16 and with torchao float8), else its parts apart (Gemma 4's own layer
    class, whose unfused attention forks the RNG tracker around its dropout), and the model's logits within bf16's
    noise of the eager model's (the eager bf16 model's own error against fp32), on two batches."""
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from tests.compile_helpers import compiled_layers_worker

    hf = make_tiny_hf_checkpoint(family, tmp_path / "hf")
    for recipe in recipes:
        result = run_local(compiled_layers_worker, 1, str(hf), recipe, ablation)[0]
        assert result["layers"] == result["num_layers"] and result["graphs"] >= 1, result
        assert set(result["decisions"]) == {decision}, result["lines"]
        # the same arithmetic rounded in another order: the compiled model is as far from fp32 as the eager one
        # (within 25%), and the two differ by no more than that bf16 noise
        assert result["compiled_error"] < 1.25 * result["bf16_noise"], result
        assert result["relative"] < 1.25 * result["bf16_noise"], result


def test_the_memory_plan_counts_the_float8_casts():
    """torchao keeps the bf16 tensors a bf16 linear keeps; what float8 adds is the float8 copies of one GEMM's
    operands while it runs. Tiny Llama at 2 x 64 tokens: gate (128 x 64) or fc2 (64 x 128) with the gradient twice,
    the weight and the input, in one byte each: 2 * (128*64 + 128*64 + 128*128) bytes."""
    from megatron_patch.training.memory_plan import plan_memory

    fp8 = plan_memory(_cfg({"MP_FP8_FILTER": "all"}), caps=CPU).stage(0)
    bf16 = plan_memory(_cfg(PR="bf16"), caps=CPU).stage(0)
    assert fp8.fp8_casts == 2 * (128 * 64 + 128 * 64 + 128 * 128)
    assert fp8.device - bf16.device == fp8.fp8_casts
    assert plan_memory(_cfg(), caps=CPU).stage(0).fp8_casts == 0  # torchao's filter keeps every tiny GEMM in bf16
    assert "float8 casts 64.00 KiB" in plan_memory(_cfg({"MP_FP8_FILTER": "all"}), caps=CPU).lines()[1]


@pytest.mark.slow
def test_align_fp8_against_torchao_on_the_hf_model(tmp_path):
    """`mpatch align --dtype fp8`: MCore's float8 model (every decoder GEMM, tensorwise) against the HF model after
    torchao's convert_to_float8_training with the same recipe and filter, at TP=1 and TP=2: within that floor at
    every point; a filter it does not know is bad input."""
    import json

    from megatron_patch.cli import main
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf")
    for tp in ("1", "2"):
        report = tmp_path / f"report-tp{tp}"
        code = main(["align", "--hf-dir", str(hf), "--dtype", "fp8", "--fp8-filter", "all", "--tp", tp,
                     "--seq-len", "32", "--report-dir", str(report), "--quiet"])
        result = json.loads((report / "report.json").read_text())
        assert code == 0 and result["verdict"]["aligned"], result["verdict"]["summary"]
        assert "convert_to_float8_training (tensorwise, filter all)" in result["compared"]["floor"]
    assert main(["align", "--hf-dir", str(hf), "--dtype", "fp8", "--fp8-filter", "bogus"]) == 2


def test_on_a_gpu_a_gemm_whose_shard_is_no_multiple_of_16_stays_in_bf16_whatever_the_filter():
    """torch._scaled_mm takes only dimensions in multiples of 16 on a GPU (the CPU's takes any): a GEMM whose TP shard
    is not one would stop the run at its first step, so it stays in bf16 there, under `all` and a kind list too; on
    the CPU the filter alone decides. Experts are split by ETP, the rest by TP."""
    linears = {"self_attention.linear_proj": (64, 64), "mlp.linear_fc1": (96, 64),
               "mlp.experts.local_experts.0.linear_fc1": (64, 64)}

    def float8(gpu_tp, fp8_filter="all"):
        gemms = float8_plan.layer_gemms(linears, "tensorwise", fp8_filter, heads=4, groups=2, head_dim=16,
                                        gated=True, mla=False, gpu_tp=gpu_tp)
        return {f"{g.module.split('.')[-1] if g.kind != 'experts' else 'experts'}{'.' + g.part if g.part else ''}":
                g.float8 for g in gemms}

    # fc1's gate and up are 48 rows each: 24 per rank at TP=2
    assert all(float8(None).values()) and all(float8((1, 1)).values())
    assert float8((2, 1)) == {"linear_proj": True, "linear_fc1.gate": False, "linear_fc1.up": False,
                              "experts.gate": True, "experts.up": True}
    assert float8((8, 1)) == {"linear_proj": False, "linear_fc1.gate": False, "linear_fc1.up": False,
                              "experts.gate": True, "experts.up": True}
    assert float8((1, 8))["experts.gate"] is False and float8((1, 8))["linear_proj"] is True
    assert float8((2, 1), ("fc1", "proj")) == {**float8((2, 1)), "experts.gate": False, "experts.up": False}
    assert float8(None, ("fc1",))["linear_fc1.gate"] is True
    # the dry run asks with the run's TP on a GPU, and nothing on the CPU
    assert fp8_run.gpu_tp(_cfg(ENV="dsw")) == (1, 1) and fp8_run.gpu_tp(_cfg()) is None


# --- the HF floor of `mpatch align --dtype fp8`: the same GEMMs in float8 as on MCore's side ---------------------

def _tiny_hf(family: str, folder, **config):
    from transformers import AutoModelForCausalLM

    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    return AutoModelForCausalLM.from_pretrained(make_tiny_hf_checkpoint(family, folder, seed=7, **config),
                                                dtype=torch.bfloat16)


def _routed(experts, tokens: int = 24, top_k: int = 2):
    """Inputs of a fused experts module: hidden states, each token's top_k experts and their weights."""
    generator = torch.Generator().manual_seed(0)
    hidden = experts.down_proj.shape[2] if experts.is_transposed else experts.down_proj.shape[1]
    x = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    index = torch.stack([torch.randperm(experts.num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    return x, index, torch.rand(tokens, top_k, generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_the_hf_floors_experts_forward_is_transformers_own(tmp_path, family):
    """The floor's forward of a fused experts module (one GEMM per expert's gate, up and down) computes what
    transformers' does, in each layout it records (Mixtral's [gate; up]; gpt-oss' transposed, interleaved, biased)."""
    experts = _tiny_hf(family, tmp_path / family).model.layers[0].mlp.experts
    inputs = _routed(experts)
    expected = experts(*inputs)
    float8._float8_experts(experts, float8.torchao_config("tensorwise"), lambda out, in_: False)
    torch.testing.assert_close(experts(*inputs), expected, rtol=1e-2, atol=1e-3)


def test_the_hf_floors_routed_experts_run_torchaos_float8(tmp_path):
    """transformers 5 fuses the routed experts into one module of 3-D weights that torchao's
    convert_to_float8_training skips (it takes nn.Linear only), while MCore's run in float8: the floor's experts
    compute each expert's gate, up and down as torchao's Float8Linear does on that weight (audit fp8 #1)."""
    from torchao.float8 import convert_to_float8_training

    model = _tiny_hf("mixtral", tmp_path / "mixtral")
    experts = model.model.layers[0].mlp.experts
    x, index, weights = _routed(experts)
    inner = experts.down_proj.shape[2]
    reference = torch.zeros_like(x)
    for e in range(experts.num_experts):
        linears = torch.nn.ModuleDict({name: torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
                                       for name, w in (("gate", experts.gate_up_proj[e, :inner]),
                                                       ("up", experts.gate_up_proj[e, inner:]),
                                                       ("down", experts.down_proj[e]))})
        with torch.no_grad():
            for name, w in (("gate", experts.gate_up_proj[e, :inner]), ("up", experts.gate_up_proj[e, inner:]),
                            ("down", experts.down_proj[e])):
                linears[name].weight.copy_(w)
        convert_to_float8_training(linears, config=float8.torchao_config("tensorwise"))
        rows, k = torch.where(index == e)
        y = linears["down"](experts.act_fn(linears["gate"](x[rows])) * linears["up"](x[rows]))
        reference.index_add_(0, rows, y * weights[rows, k, None])
    float8.convert_hf_model(model, "tensorwise", ("experts",))
    with torch.no_grad():
        assert torch.equal(experts(x, index, weights), reference)


def test_the_hf_floor_keeps_routers_in_bf16_and_names_gemma4s_dense_mlp_shared_experts(tmp_path):
    """Under `all`, MCore keeps routers and the shared experts' gate outside its parallel linears, in bf16: so does
    the floor (Qwen2-MoE's mlp.shared_expert_gate, Gemma 4's router.proj). Gemma 4's dense MLP beside the experts is
    MCore's shared_experts: the floor's mlp.gate_proj/up_proj/down_proj are of that kind (audit fp8 #1, #8)."""
    from megatron_patch.models.gemma4.config import TINY_MOE_CONFIG

    def float8_linears(model, fp8_filter):
        float8.convert_hf_model(model, "tensorwise", fp8_filter)
        return {n.split(".layers.0.")[1] for n, m in model.named_modules()
                if ".layers.0." in n and type(m).__name__ == "Float8Linear"}

    qwen = float8_linears(_tiny_hf("qwen2_moe", tmp_path / "qwen2_moe"), "all")
    assert "mlp.shared_expert.gate_proj" in qwen and "mlp.shared_expert_gate" not in qwen
    gemma = float8_linears(_tiny_hf("gemma4", tmp_path / "gemma4", **TINY_MOE_CONFIG), "all")
    assert "self_attn.q_proj" in gemma and "router.proj" not in gemma
    assert float8_linears(_tiny_hf("gemma4", tmp_path / "gemma4", **TINY_MOE_CONFIG), ("shared_experts",)) == {
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    # Gemma 4's per-layer-input linears: replicated torch linears on MCore's side, bf16 like the embedding (the
    # second fp8 audit: the floor put them in float8 under all)
    e_model = float8_linears(_tiny_hf("gemma4", tmp_path / "gemma4_e", hidden_size_per_layer_input=8,
                                      vocab_size_per_layer_input=200), "all")
    assert "self_attn.q_proj" in e_model and not {"per_layer_input_gate", "per_layer_projection"} & e_model, e_model


def test_align_fp8_refuses_a_family_without_a_floor_like_mcores(tmp_path, capsys):
    """DeepSeek-V4's grouped output projection stopped align's HF floor in an internal error, and its other attention
    linears were of other kinds than MCore's (a sound conversion NOT aligned under --fp8-filter proj; the second fp8
    audit): refused in one line."""
    from megatron_patch.cli import main
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    hf = make_tiny_hf_checkpoint("deepseek_v4", tmp_path / "v4")
    assert main(["align", "--hf-dir", str(hf), "--dtype", "fp8", "--fp8-filter", "all", "--seq-len", "16",
                 "--quiet"]) == 2
    assert "--dtype fp8 has no HF floor for deepseek_v4" in capsys.readouterr().err


def test_align_refuses_fp8_options_without_fp8_dtype(tmp_path, capsys):
    """--fp8-recipe / --fp8-filter with another --dtype were ignored without a word (audit fp8 #4): refused in one
    line, as the launcher refuses MP_FP8_* without PR=fp8."""
    from megatron_patch.cli import main

    assert main(["align", "--hf-dir", str(tmp_path), "--dtype", "bf16", "--fp8-recipe", "rowwise",
                 "--fp8-filter", "all"]) == 2
    assert "--fp8-recipe and --fp8-filter need --dtype fp8, got --dtype bf16" in capsys.readouterr().err
    assert main(["align", "--hf-dir", str(tmp_path), "--dtype", "fp32", "--fp8-filter", "all"]) == 2
    assert "--fp8-filter needs --dtype fp8" in capsys.readouterr().err


def test_align_fp8_without_torchao_names_the_fp8_extra(tmp_path, monkeypatch, capsys):
    """--dtype fp8 without torchao advised `pip install -e .`, which does not install it (audit fp8b #1): one line
    naming the [fp8] extra, before anything runs."""
    from megatron_patch.align import alignment
    from megatron_patch.cli import main

    monkeypatch.setattr(alignment, "installed_version", lambda *dists: None, raising=False)
    assert main(["align", "--hf-dir", str(tmp_path), "--dtype", "fp8"]) == 2
    error = capsys.readouterr().err
    assert 'pip install -e ".[fp8]"' in error and len(error.strip().splitlines()) == 1
    # installed but unusable: it was an internal error after the fp32 run (the fdoc audit)
    monkeypatch.setattr(alignment, "installed_version", lambda *dists: "0.18.0")
    monkeypatch.setattr(alignment, "torchao_import_error", lambda: "ImportError: built for another torch")
    assert main(["align", "--hf-dir", str(tmp_path), "--dtype", "fp8"]) == 2
    assert capsys.readouterr().err == ("mpatch align: error: --dtype fp8 runs torchao's float8, and the torchao installed "
                                       "cannot run it (ImportError: built for another torch): install torchao>=0.18 for "
                                       "this torch (pip install -e \".[fp8]\"), or choose another --dtype\n")


def test_align_fp8_refuses_a_filter_that_leaves_every_gemm_in_bf16(tmp_path, capsys):
    """torchao's auto filter (the default) keeps every GEMM of a small model in bf16: align judged that bf16 run and
    called it ALIGNED in fp8 (audit fp8b #8). Refused in one line naming --fp8-filter all."""
    from megatron_patch.cli import main
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf")
    assert main(["align", "--hf-dir", str(hf), "--dtype", "fp8", "--seq-len", "16", "--quiet"]) == 2
    error = capsys.readouterr().err
    assert "leaves every decoder GEMM of this model in bf16" in error and "--fp8-filter all" in error


def test_every_fused_qkv_layout_is_split_into_its_hf_linears():
    """Audit (fp8 A#2, B#3): linear_qkv was split into q, k and v only for [q; k; v] per query group; Qwen3-Next's
    gated query and Gemma 4's global layers (their own head size and key/value heads) were one float8 GEMM with one
    scale and one filter decision, so k and v ran in float8 where torchao keeps HF's k_proj and v_proj in bf16."""
    def parts(rows, heads, groups, head_dim, hidden=2048):
        gemms = float8_plan.layer_gemms({"self_attention.linear_qkv": (rows, hidden)}, "tensorwise", "auto",
                                        heads=heads, groups=groups, head_dim=head_dim, gated=True, mla=False)
        return [(g.part, g.out_features, g.float8) for g in gemms]

    # Qwen3-Next-80B-A3B: 16 heads of 256 with their output gates (HF's q_proj holds both), 2 key/value heads
    assert parts(2 * 16 * 256 + 2 * 2 * 256, 16, 2, 256) == [("q", 8192, True), ("k", 512, False), ("v", 512, False)]
    # Gemma-4-E2B's global layer: 8 heads of 512, one key/value head of 512
    assert parts(8 * 512 + 2 * 512, 8, 1, 512, 1536) == [("q", 4096, True), ("k", 512, False), ("v", 512, False)]
    # keys doubling as values (Gemma 4's attention_k_eq_v): no v_proj; a KV-sharing layer: q_proj alone
    assert parts(16 * 256 + 4 * 256, 16, 4, 256) == [("q", 4096, True), ("k", 1024, False)]
    assert parts(16 * 256, 16, 4, 256) == [("q", 4096, True)]
    with pytest.raises(ValueError, match="no layout"):
        parts(100, 16, 4, 256)


def test_the_dry_run_and_the_memory_plan_count_linear_attentions_gemms():
    """Audit (fp8 A#5, B#4): the dry run listed only linear_* modules, so the Gated DeltaNet's in_proj and out_proj,
    which the run converts, were in neither list, and the memory plan's float8 casts left them out."""
    cfg = resolve("qwen3_next", launcher_args("qwen3_next", PR="fp8"), env={"GPUS_PER_NODE": "1",
                                                                        "MP_FP8_FILTER": "all"}, check_paths=False)
    gemms = fp8_run.summary(cfg, CPU)["gemms"]["linear_attention+moe"]
    assert {(g["module"], g["kind"], g["float8"]) for g in gemms if g["kind"] == "other"} == {
        ("self_attention.in_proj", "other", True), ("self_attention.out_proj", "other", True)}
    in_proj = next(g["shape"] for g in gemms if g["module"] == "self_attention.in_proj")
    tokens = cfg.micro_batch_size * cfg.sample_length
    assert fp8_run.cast_bytes(cfg) >= 2 * (in_proj[0] * in_proj[1] + tokens * (in_proj[0] + in_proj[1]))
    # in_proj is HF's linears apart (each its own scale and filter decision): Qwen3-Next's two, Qwen3.5's four
    assert [g["part"] for g in gemms if g["module"] == "self_attention.in_proj"] == ["qkvz", "ba"]
    qwen3_5 = resolve("qwen3_5", launcher_args("qwen3_5", PR="fp8"), env={"GPUS_PER_NODE": "1", "MP_FP8_FILTER": "all"},
                      check_paths=False)
    parts = [(g["part"], g["shape"][0]) for layer in fp8_run.summary(qwen3_5, CPU)["gemms"].values() for g in layer
             if g["module"] == "self_attention.in_proj"]
    linear = qwen3_5.arch.linear_attention
    qk, v = linear.num_key_heads * linear.key_head_dim, linear.num_value_heads * linear.value_head_dim
    assert parts == [("qkv", 2 * qk + v), ("z", v), ("b", linear.num_value_heads), ("a", linear.num_value_heads)]


def test_the_plan_lists_exactly_the_gemms_the_run_converts():
    """The fdoc audit: DeepSeek-V3.2's and GLM-5's indexers and DeepSeek-V4's whole linears (IndexerLinear) were in
    the dry run's float8 list and in align's HF floor, and the run kept them in bf16. Each is converted now; the
    plan and the live tiny model agree on every GEMM, a family of megatron-core's linears alone beside them."""
    families = ("deepseek_v32", "glm_moe_dsa", "deepseek_v4", "qwen3_moe")
    result = run_local(plan_and_live_worker, 1, families, "tensorwise", "all")[0]
    for family, (planned, live) in result.items():
        assert planned == live, (family, planned ^ live)
        assert all(fp8 for *_, fp8 in live), family
    assert {m.split(".")[-1] for m, _, _ in result["deepseek_v32"][1] if ".indexer." in m} == {
        "linear_wq_b", "linear_wk", "linear_weights_proj"}


def test_the_mtp_layer_is_converted_and_listed_like_a_decoder_layer():
    """Audit (fp8 A#3): MP_FP8_FILTER=all left the trained MTP layer's linears in bf16, and the dry run did not
    mention it: its transformer layer's linears are converted and listed as the decoder layers' are."""
    import dataclasses

    from megatron_patch.models.blocks import float8

    assert float8._DECODER_LAYER.match("mtp.layers.0.transformer_layer.mlp.linear_fc1").group(1) == "mlp.linear_fc1"
    assert not float8._DECODER_LAYER.match("mtp.layers.0.eh_proj")  # the MTP block's own projection stays bf16
    cfg = resolve("deepseek_v3", launcher_args("deepseek_v3", PR="fp8"), env={"GPUS_PER_NODE": "1",
                                                                          "MP_FP8_FILTER": "all"}, check_paths=False)
    gemms = float8_plan.arch_gemms(dataclasses.replace(cfg.arch, mtp_layers=1), "tensorwise", "all")
    lines = float8_plan.describe(gemms, "tensorwise", "all")
    assert any(line.startswith("mtp layers: float8 ") and "experts.linear_fc1.gate" in line for line in lines), lines

"""PR=fp8 in a training run: which implementation runs it (transformer-engine, or torchao's float8 inside
megatron-core's own linears), its recipe and filter (the FP8 part's MP_FP8_RECIPE and MP_FP8_FILTER), what a
machine cannot run refused in one line, and what the dry run says. docs/fp8.md.

- transformer-engine, where it is installed on a GPU run: its FP8 GEMMs (``fp8="hybrid"``), recipes
  delayed | tensorwise | mxfp8 | blockwise, as before;
- torchao everywhere else (the lent GPU, CPU): ``models/blocks/float8.py``, recipes tensorwise | rowwise |
  rowwise_with_gw_hp, the GEMMs chosen by MP_FP8_FILTER (``models/blocks/float8_plan.py``).
"""

from __future__ import annotations

from megatron_patch.models.blocks.float8_plan import RECIPES as TORCHAO_RECIPES
from megatron_patch.models.blocks.float8_plan import arch_gemms, cpu_recipe_problem, describe, filter_text, row_parallel
from megatron_patch.runtime.machine import TORCHAO_REINSTALL

TE_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
ALL_RECIPES = tuple(dict.fromkeys(TE_RECIPES + TORCHAO_RECIPES))
TRANSFORMER_ENGINE, TORCHAO = "transformer-engine", "torchao"
DEFAULT_RECIPE = {TRANSFORMER_ENGINE: "delayed", TORCHAO: "tensorwise"}


def implementation(cfg, caps) -> str | None:
    """Who runs ``cfg``'s FP8 GEMMs on the machine ``caps`` describes: transformer-engine where a GPU run has it,
    else torchao where it is installed, else None (refused)."""
    if cfg.device == "cuda" and caps.transformer_engine:
        return TRANSFORMER_ENGINE
    return TORCHAO if caps.torchao else None


def recipe(cfg, impl: str | None) -> str:
    """MP_FP8_RECIPE, or the implementation's default (unset)."""
    return cfg.fp8_recipe or DEFAULT_RECIPE.get(impl, "delayed")


def fp8_problem(cfg, caps) -> str | None:
    """Why this machine cannot run ``cfg``'s PR=fp8 (torchao's side; transformer-engine's recipe rules are
    machine_checks'), or None."""
    if not cfg.precision.fp8:
        return None
    impl = implementation(cfg, caps)
    if impl is None:
        return ("PR=fp8 needs transformer-engine (on a GPU) or torchao (pip install -e \".[fp8]\", or pip install "
                "torchao), and neither is installed here: install torchao, or use PR=bf16")
    if impl == TORCHAO and caps.torchao_import_error:
        return (f"PR=fp8 runs torchao's float8 here, and the torchao installed cannot run it "
                f"({caps.torchao_import_error}): {TORCHAO_REINSTALL}, or use PR=bf16")
    if impl == TORCHAO and recipe(cfg, impl) not in TORCHAO_RECIPES:
        return (f"MP_FP8_RECIPE={cfg.fp8_recipe} is transformer-engine's, which this machine runs without: torchao "
                f"takes {' | '.join(TORCHAO_RECIPES)}")
    if impl == TORCHAO and cfg.device == "cpu":
        chosen_recipe = recipe(cfg, impl)
        problem = cpu_recipe_problem(chosen_recipe, caps.cpu_float8_rowwise, caps.torch_version,
                                     f"MP_FP8_RECIPE={chosen_recipe}")
        if problem:
            return problem
    if impl == TORCHAO and cfg.device == "cuda" and caps.compute_capability and caps.compute_capability < (8, 9):
        cc = caps.compute_capability
        return f"PR=fp8 needs FP8 tensor cores (compute capability >= 8.9), and this GPU is sm{cc[0]}{cc[1]}: use PR=bf16"
    if impl == TRANSFORMER_ENGINE and recipe(cfg, impl) not in TE_RECIPES:
        return (f"MP_FP8_RECIPE={cfg.fp8_recipe} is torchao's, and this GPU runs transformer-engine's FP8: use "
                f"{' | '.join(TE_RECIPES)}")
    # auto: the default (what an unset one reads); all: what transformer-engine does, so a line from a torchao machine
    # means the same here
    if impl == TRANSFORMER_ENGINE and cfg.fp8_filter not in ("auto", "all"):
        return (f"MP_FP8_FILTER={filter_text(cfg.fp8_filter)} is torchao's, and this GPU runs transformer-engine's "
                "FP8, which puts every linear of its layer spec in FP8: drop MP_FP8_FILTER (or give all)")
    return None


def torchao_gemms(cfg, impl: str | None):
    """Each layer kind's GEMMs under torchao (``float8_plan.Gemm``), or None where torchao does not run them."""
    if not cfg.precision.fp8 or impl != TORCHAO:
        return None
    return arch_gemms(cfg.arch, recipe(cfg, impl), cfg.fp8_filter, gpu_tp(cfg))


def gpu_tp(cfg) -> tuple[int, int] | None:
    """(TP, ETP) where the run's GEMMs run on a GPU, whose float8 takes only shards in multiples of 16; None on the
    CPU."""
    return (cfg.tp, cfg.etp or cfg.tp) if cfg.device == "cuda" else None


def dry_run_lines(cfg, caps) -> list[str]:
    """What the dry run says about PR=fp8: the implementation, the recipe and which GEMMs stay in bf16."""
    if not cfg.precision.fp8:
        return []
    impl = implementation(cfg, caps)
    if impl is None:
        return ["none here: neither transformer-engine nor torchao is installed (refused)"]
    if impl == TRANSFORMER_ENGINE:
        return [f"transformer-engine, recipe {recipe(cfg, impl)}: every linear of the TE layer spec in FP8 "
                "(fp8=\"hybrid\"); the embedding and the output layer in bf16"]
    gemms = torchao_gemms(cfg, impl)
    return describe(gemms, recipe(cfg, impl), cfg.fp8_filter)


def summary(cfg, caps) -> dict | None:
    """The dry run's JSON entry."""
    if not cfg.precision.fp8:
        return None
    impl = implementation(cfg, caps)
    out = {"implementation": impl, "recipe": recipe(cfg, impl), "filter": filter_text(cfg.fp8_filter),
           "lines": dry_run_lines(cfg, caps)}
    gemms = torchao_gemms(cfg, impl)
    if gemms is not None:
        out["gemms"] = {kind: [{"module": g.module, "part": g.part, "kind": g.kind, "shape": [g.out_features,
                                                                                            g.in_features],
                                "float8": g.float8} for g in layer] for kind, layer in gemms.items()}
    return out


def cast_bytes(cfg) -> int:
    """What torchao's float8 adds to a rank's memory: the float8 copies of one GEMM's operands while it runs (its
    weight and input cast for the forward, the gradient, weight and input cast again for the backward's two GEMMs),
    transient beside the bf16 tensors autograd keeps (which float8 does not change: torchao saves its inputs in
    bf16, as a bf16 linear does). The largest float8 GEMM of the model decides, at one byte per element."""
    if not cfg.precision.fp8:
        return 0
    tokens = cfg.micro_batch_size * cfg.sample_length // cfg.cp
    worst = 0
    for layer in arch_gemms(cfg.arch, recipe(cfg, TORCHAO), cfg.fp8_filter, gpu_tp(cfg)).values():
        for g in layer:
            if not g.float8:
                continue
            split = (cfg.etp or cfg.tp) if g.kind == "experts" else cfg.tp
            if row_parallel(g.module):  # the input dimension is split
                rows, cols = g.out_features, g.in_features // split
            else:
                rows, cols = g.out_features // split, g.in_features
            worst = max(worst, 2 * (rows * cols + tokens * cols + tokens * rows))
    return worst

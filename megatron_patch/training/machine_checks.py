"""What this machine can run of a ``RunConfig`` (read from ``runtime/machine.py``'s ``Capabilities``):
transformer-engine's FP8 recipes and FlashAttention, sequence parallelism and TP overlap on a GPU, context
parallelism and activation offloading need transformer-engine; PR=fp8 elsewhere needs torchao. Each problem says
what to change; the launcher refuses on the first. Which attention runs is decided here too (``core_attention``,
``attention_kernel``)."""

from __future__ import annotations

from megatron_patch.errors import UserError
from megatron_patch.models.blocks import attention_kernels
from megatron_patch.models.blocks.core_attention import SDPA, UNFUSED, describe
from megatron_patch.runtime.machine import Capabilities, version_tuple
from megatron_patch.training import fp8_run
from megatron_patch.training.run_config import RunConfig, no_gpu_problem


def fp8_recipe_problem(recipe: str, caps: Capabilities) -> str | None:
    """Why transformer-engine cannot run ``recipe`` here (its own support checks), or None."""
    cc, cuda = caps.compute_capability, caps.cuda_version
    where = f"this GPU is sm{cc[0]}{cc[1]}" if cc else "the GPU's compute capability is unknown"
    if recipe == "mxfp8" and not (cc and (10, 0) <= cc < (12, 0)):
        return f"MP_FP8_RECIPE=mxfp8 needs a Blackwell GPU (compute capability 10.x) and {where}: " \
               "use MP_FP8_RECIPE=delayed, tensorwise or blockwise"
    if recipe == "blockwise" and not (cc and cc >= (9, 0) and version_tuple(cuda) >= (12, 9)):
        return f"MP_FP8_RECIPE=blockwise needs compute capability >= 9.0 and CUDA >= 12.9, and {where} with " \
               f"CUDA {cuda}: use MP_FP8_RECIPE=delayed or tensorwise"
    return None


def te_fp8_shape_problem(cfg: RunConfig, recipe: str) -> str | None:
    """Why transformer-engine's FP8 GEMMs cannot take ``cfg``'s shapes (rows divisible by 8 and the inner dimension
    by 16; MXFP8: 32 and 32), or None. A machine question: torchao's float8 (a GPU without TE) pads its tokens and
    keeps GEMMs of other sizes in bf16 (``models/blocks/float8.py``, ``float8_plan.py``)."""
    arch, tp, etp = cfg.arch, cfg.tp, cfg.layout.expert_tp
    tokens, tokens_name = cfg.tokens_per_gemm, f"BATCH_SIZE*{cfg.sample_length_name}/CP"
    rows, inner = (32, 32) if recipe == "mxfp8" else (8, 16)
    if tokens % rows:
        return (f"PR=fp8 with transformer-engine (recipe {recipe}): the tokens per GEMM, {tokens_name} = {tokens}, "
                f"must be a multiple of {rows}: change BATCH_SIZE or the sequence length")
    # every layer's attention width (a layer type may have heads of its own size): the first that does not fit
    widths = [arch.num_heads * s.head_dim // tp for s in arch.attention_shapes]
    dims = {"hidden_size": arch.hidden_size,
            "attention width per TP rank": next((w for w in widths if w % inner), widths[0]),
            "FFN size per TP rank": arch.ffn_hidden_size // tp}
    if arch.is_moe:
        dims["expert FFN size per ETP rank"] = arch.moe_ffn_hidden_size // etp
        if arch.shared_expert_ffn_hidden_size:
            dims["shared-expert FFN size per TP rank"] = arch.shared_expert_ffn_hidden_size // tp
    bad = [f"{name} {value}" for name, value in dims.items() if value % inner]
    if bad:
        return (f"PR=fp8 with transformer-engine (recipe {recipe}) needs GEMM inner dimensions divisible by {inner}, "
                f"and this model at TP={tp} has {', '.join(bad)}: use PR=bf16 or another TP")
    return None


def machine_problems(cfg: RunConfig, caps: Capabilities) -> list[str]:
    """Every reason this machine cannot run ``cfg``, each saying what to change."""
    out = []
    gpu_env = cfg.device == "cuda"
    if gpu_env and not caps.cuda:
        out.append(no_gpu_problem(cfg.env))
    te = caps.transformer_engine and gpu_env
    fp8 = fp8_run.fp8_problem(cfg, caps)
    if fp8:
        out.append(fp8)
    elif cfg.precision.fp8 and te and not caps.fp8:
        out.append("PR=fp8 needs a GPU with FP8 (compute capability >= 8.9): use PR=bf16")
    elif cfg.precision.fp8 and te:
        te_recipe = fp8_run.recipe(cfg, fp8_run.TRANSFORMER_ENGINE)
        problem = fp8_recipe_problem(te_recipe, caps) or te_fp8_shape_problem(cfg, te_recipe)
        if problem:
            out.append(problem)
    # Without transformer-engine FL=true is torch SDPA on the local spec (core_attention), which every
    # machine and precision has.
    if cfg.flash_attention and te and not cfg.precision.mixed:
        out.append("FL=true: transformer-engine's FlashAttention has no fp32 kernel: use PR=bf16/fp16/fp8 or FL=false")
    elif cfg.flash_attention and te and not (caps.flash_attention_2 or caps.flash_attention_3):
        out.append("FL=true: transformer-engine runs flash attention through the flash-attn package "
                   "(or flash_attn_3 on Hopper), and neither is installed: pip install flash-attn, or set FL=false")
    if cfg.sequence_parallel and gpu_env and not te:
        # CPU runs get sequence parallelism from cpu_compat; on a GPU megatron's WrappedTorchNorm asserts in every rank.
        out.append("SP=true needs transformer-engine on GPUs (megatron-core's local-spec RMSNorm refuses sequence "
                   "parallelism): set SP=false")
    elif cfg.tp_comm_overlap and not te:
        out.append("TP communication overlap (TP > 1 with SP=true) needs transformer-engine on GPUs: "
                   "set MP_TP_COMM_OVERLAP=false (keeps SP) or SP=false")
    if cfg.cp > 1 and not te:
        out.append(f"CP={cfg.cp} needs transformer-engine attention on GPUs: set CP=1")
    if cfg.activation_checkpointing == "offload" and not gpu_env:
        out.append("AC=offload moves activations from GPU to host memory; ENV=cpu has no GPU: use AC=sel, full or none")
    elif cfg.activation_checkpointing == "offload" and not te:
        # megatron-core's activation offload context is transformer-engine's; without it TransformerBlock asserts.
        out.append("AC=offload (activation offloading) needs transformer-engine on GPUs: use AC=sel, full or none")
    if cfg.compile_layers and te:
        out.append("MP_COMPILE=true compiles megatron-core's local layers, and this GPU runs transformer-engine's "
                   "spec: drop MP_COMPILE")
    elif cfg.compile_layers and caps.compile_problem:
        out.append(f"MP_COMPILE=true: {caps.compile_problem}; or drop MP_COMPILE")
    if cfg.compile_fusions and te:
        out.append("MP_COMPILE_FUSIONS=true compiles the local spec's norms and RoPE, and this GPU runs "
                   "transformer-engine's spec, whose kernels are fused already: drop MP_COMPILE_FUSIONS")
    elif cfg.compile_fusions and caps.compile_problem:
        out.append(f"MP_COMPILE_FUSIONS=true: {caps.compile_problem}; or drop MP_COMPILE_FUSIONS")
    return out


def check_machine(cfg: RunConfig, caps: Capabilities | None = None) -> None:
    problems = machine_problems(cfg, caps or Capabilities.detect())
    if problems:
        raise UserError(problems[0] + (f" (and {len(problems) - 1} more: see MP_DRY_RUN=1)" if len(problems) > 1 else ""))


def local_core_attention(cfg: RunConfig) -> str:
    """The core attention a run of ``cfg`` on megatron-core's local spec builds: SDPA on a GPU (one without
    transformer-engine) and with FL=true; on CPU otherwise megatron's unfused attention."""
    return SDPA if cfg.flash_attention or cfg.device == "cuda" else UNFUSED


def core_attention(cfg: RunConfig, caps: Capabilities) -> str | None:
    """``local_core_attention`` where the run builds the local spec, None where it builds transformer-engine's
    (which brings its own attention)."""
    if cfg.device == "cuda" and caps.transformer_engine:
        return None
    return local_core_attention(cfg)


def attention_kernel(cfg: RunConfig, caps: Capabilities) -> str:
    """What attention will run, as the log and the dry run report it."""
    if cfg.arch.sparse_attention is not None:
        from megatron_patch.models.blocks import sparse_attention  # imported inside: torch and megatron-core, only for these models

        return sparse_attention.describe(cfg.arch.sparse_attention, caps.cuda)
    if cfg.arch.family_config is not None and not cfg.arch.family_config.core_attention:
        # DeepSeek-V4's: it computes its own scores, so no core-attention kernel runs (memory_plan._attention)
        return f"{cfg.family}'s own attention module (its scores in torch; no core-attention kernel)"
    local = core_attention(cfg, caps)
    if local == SDPA:
        kernel = attention_kernels.sdpa_kernel(cfg.device == "cuda" and caps.cuda, caps.compute_capability,
                                               caps.torch_version, cfg.precision.mixed, caps.flash_attention_3,
                                               caps.flash_attention_4)
        return f"{describe(local)}: {kernel}{attention_kernels.fallback_note(cfg.arch)}"
    if local is not None:
        return describe(local)
    if cfg.flash_attention:
        if caps.flash_attention_3:
            return "FlashAttention-3 (flash_attn_interface)"
        return "FlashAttention-2 (flash_attn)" if caps.flash_attention_2 else "none: no flash-attn package (refused)"
    if not cfg.precision.mixed:
        return "auto (transformer-engine picks; fp32 runs its unfused attention)"
    return "fused (transformer-engine cuDNN attention)"


def launch_environment(cfg: RunConfig, caps: Capabilities) -> dict[str, str]:
    """Variables the launcher sets for every rank.

    CUDA_DEVICE_MAX_CONNECTIONS=1 makes kernels run in the order they were issued, so TP/CP
    communication launched before a GEMM really overlaps it; Megatron-LM requires it below sm100.
    """
    cc = caps.compute_capability
    if cfg.device == "cuda" and (cfg.tp > 1 or cfg.cp > 1) and (cc is None or cc < (10, 0)):
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}

"""Float8 GEMMs inside megatron-core's own parallel linears, through torchao's float8 training building blocks
(``PR=fp8`` without transformer-engine; docs/fp8.md).

torchao swaps ``torch.nn.Linear`` for its ``Float8Linear``; megatron-core's ``ColumnParallelLinear`` and
``RowParallelLinear`` are not ``nn.Linear``, and they hold one rank's shard of each weight. So each chosen linear
keeps its class, parameters and state dict, and only its local GEMM changes: ``_forward_impl`` (megatron-core's
own seam between its communication and its matmul) becomes ``Float8ParallelMatmul``, which casts its operands
with torchao's scaling functions and multiplies them with torchao's ``Float8TrainingTensor`` (``torch._scaled_mm``),
as torchao's ``matmul_with_hp_or_float8_args`` does, with two differences:

- **Scales under TP.** A scale that spans a dimension TP splits is that of the whole tensor: its amax is reduced
  (max) over the linear's tensor-parallel group before the scale is taken. Tensorwise: the weight always (every
  rank holds a part of it), a row-parallel input, a column-parallel gradient. Rowwise: only where the row a scale
  covers is split, the input dimension of a row-parallel linear or the output dimension of a column-parallel one's
  gradient; the other scales stay local. So TP=2 casts every element as TP=1 does.
- **Fused weights keep their tensors' scales.** megatron-core fuses what HF keeps apart (q, k and v in
  ``linear_qkv``, gate and up in ``linear_fc1``), and torchao scales each HF ``nn.Linear`` on its own. The parts
  of a fused weight are multiplied as separate GEMMs with their own scales (``Parts``), so a layer computes what
  torchao computes on the HF model (bit for bit at TP=1: ``mpatch align --dtype fp8``).

Communication stays in bf16: the sequence-parallel gathers and reduce-scatters and the TP all-reduces are
megatron-core's, around the float8 GEMM. torchao is imported only when a model is converted (the optional
``[fp8]`` extra); every other module of the project runs without it.
"""

from __future__ import annotations

import inspect
import re
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# torchao is imported inside the functions that use it (``_torchao``): it is an optional package, and importing
# it costs a second and prints notices about its CUDA extensions. megatron-core is imported inside functions too,
# so that in a rank it loads after runtime/cpu_compat has patched torch.

from megatron_patch.errors import UserError
from megatron_patch.models.blocks.float8_plan import RECIPES, Gemm, chosen, fused_parts, linear_kind
from megatron_patch.runtime.known_warnings import quiet_known_warnings

_DECODER_LAYER = re.compile(r"^(?:module\.)*(?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.(.+)$")


# --- torchao ------------------------------------------------------------------------------------------------------

_TORCHAO: list = []  # _torchao()'s modules, once imported


def _torchao():
    """torchao's float8 modules, imported once, without the notices its import prints about CUDA extensions
    this machine cannot load (they are not the float8 training path). Kept in a module list, not an lru_cache:
    dynamo, tracing a compiled layer's GEMMs (MP_COMPILE), reads the list as it is and would trace into the
    cache's function, whose logging calls break the graph."""
    if not _TORCHAO:
        _TORCHAO.append(_import_torchao())
    return _TORCHAO[0]


def _import_torchao():
    quiet_known_warnings()  # its import notices, as at the entry points: a test or library caller passes none
    import torchao.float8 as float8
    from torchao.float8 import float8_training_tensor, float8_utils

    return float8, float8_training_tensor, float8_utils


def torchao_config(recipe: str):
    """torchao's ``Float8LinearConfig`` of ``recipe``."""
    return _torchao()[0].Float8LinearConfig.from_recipe_name(recipe)


def _mm_config(config):
    """torchao's ``LinearMMConfig`` for ``config``, as ``Float8Linear.__init__`` builds it."""
    tt = _torchao()[1]
    return tt.LinearMMConfig(*(tt.ScaledMMConfig(config.emulate, gemm.use_fast_accum, False, config.pad_inner_dim)
                               for gemm in (config.gemm_config_output, config.gemm_config_grad_input,
                                            config.gemm_config_grad_weight)))


# --- the GEMM -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Parts:
    """How the local output rows of a weight divide into the HF tensors they came from: ``groups`` repeats of
    ``widths`` rows (q, k, v per query group: ``groups`` query groups, widths (q, k, v); gate and up: one group,
    widths (f, f); an unfused weight: one group of one width)."""

    groups: int
    widths: tuple[int, ...]
    float8: tuple[bool, ...]  # per part: in float8, or in bf16 (the filter left that HF linear out)

    def split_rows(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """[out, ...] -> each part's rows [groups * width, ...], contiguous (a copy only where groups interleave)."""
        if len(self.widths) == 1:
            return [weight]
        grouped = weight.reshape(self.groups, sum(self.widths), *weight.shape[1:])
        out, start = [], 0
        for width in self.widths:
            out.append(grouped[:, start:start + width].reshape(self.groups * width, *weight.shape[1:]))
            start += width
        return out

    def split_columns(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """[..., out] -> each part's columns [..., groups * width] (contiguous)."""
        if len(self.widths) == 1:
            return [tensor]
        lead = tensor.shape[:-1]
        grouped = tensor.reshape(*lead, self.groups, sum(self.widths))
        out, start = [], 0
        for width in self.widths:
            out.append(grouped[..., start:start + width].reshape(*lead, self.groups * width))
            start += width
        return out

    def join_columns(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of ``split_columns``."""
        if len(pieces) == 1:
            return pieces[0]
        lead = pieces[0].shape[:-1]
        return torch.cat([p.reshape(*lead, self.groups, w) for p, w in zip(pieces, self.widths)],
                         dim=-1).reshape(*lead, self.groups * sum(self.widths))  # lead may hold a 0

    def join_rows(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The inverse of ``split_rows``."""
        if len(pieces) == 1:
            return pieces[0]
        rest = pieces[0].shape[1:]
        return torch.cat([p.reshape(self.groups, w, *rest) for p, w in zip(pieces, self.widths)],
                         dim=1).reshape(-1, *rest)


@dataclass(frozen=True)
class Sharding:
    """Which 2-D operand dimension TP splits, for the scales that span it: a column-parallel linear splits the
    weight's output rows (and so its gradient's columns), a row-parallel one the input's columns (and the
    weight's). ``group``: the tensor-parallel group (None: TP=1, nothing to reduce)."""

    parallel: str  # "column" | "row"
    group: object = None

    def input_split(self) -> int | None:  # input [..., in]
        return -1 if self.parallel == "row" and self.group is not None else None

    def weight_t_split(self) -> int | None:  # weight transposed [in, out]
        if self.group is None:
            return None
        return -1 if self.parallel == "column" else 0

    def grad_output_split(self) -> int | None:  # grad_output [tokens, out]
        return -1 if self.parallel == "column" and self.group is not None else None


def _cast(tensor, cast_config, mm_config, role, axiswise_dim: int, split_dim: int | None, group, round_pow2: bool):
    """``tensor`` in float8 as torchao's ``hp_tensor_to_float8_dynamic`` casts it, with the amax reduced over
    ``group`` where the scale spans the dimension TP splits (``split_dim``: -1 the last, 0 the first); ``tensor`` itself
    where the recipe keeps this operand in high precision."""
    float8, tt, utils = _torchao()
    if cast_config.scaling_type is float8.ScalingType.DISABLED:
        return tensor
    axiswise = cast_config.scaling_granularity is float8.ScalingGranularity.AXISWISE
    dim = axiswise_dim if axiswise else None
    amax = utils.tensor_to_amax(tensor, scaling_granularity=cast_config.scaling_granularity, axiswise_dim=dim)
    if split_dim is not None and (not axiswise or axiswise_dim % tensor.dim() == split_dim % tensor.dim()):
        amax = _max_over(amax, group)
    scale = utils.amax_to_scale(amax, cast_config.target_dtype, round_scales_to_power_of_2=round_pow2)
    return tt.hp_tensor_and_scale_to_float8(tensor, scale, cast_config.target_dtype, mm_config, role, dim)


def _max_over(amax: torch.Tensor, group) -> torch.Tensor:
    """The elementwise max of ``amax`` over ``group`` (in fp32: exact for any 16-bit amax; torch.compile traces
    the functional collective)."""
    from torch.distributed import _functional_collectives as funcol

    reduced = funcol.all_reduce(amax.float(), "MAX", group)
    if isinstance(reduced, funcol.AsyncCollectiveTensor):
        reduced = reduced.wait()
    return reduced


_SCALED_MM_MULTIPLE = 16  # torch._scaled_mm's CUDA kernel takes inner dimensions in multiples of 16 only


def _pad_tokens(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` [tokens, n] with zero rows up to a multiple of 16 tokens, for the weight-gradient GEMM, whose inner
    dimension is the token count (an expert's routed tokens; any micro-batch's): torch._scaled_mm's CUDA kernel takes
    no other, and under torch.compile a one-token operand's ambiguous strides broke the CPU kernel's lowering too.
    Zero rows change neither an amax (so neither scale) nor the GEMM's sums: the result is exact."""
    missing = -tensor.shape[0] % _SCALED_MM_MULTIPLE
    return torch.nn.functional.pad(tensor, (0, 0, 0, missing)) if missing else tensor


class Float8ParallelMatmul(torch.autograd.Function):
    """``input @ weight.T`` with each operand of each of the three GEMMs cast to float8 as ``config`` (torchao's
    ``Float8LinearConfig``) says: torchao's ``matmul_with_hp_or_float8_args``, with the scales of ``sharding`` and
    one GEMM per part of the weight (``parts``).

    ``sequence_group``: the input is this rank's part of the sequence (sequence parallelism): it is gathered over
    the group in bf16 for the GEMMs, and the input's gradient reduce-scattered back, as megatron-core's own linear
    does, which keeps only the local part for backward and gathers it again there (the fdoc audit: gathered before
    this function, the float8 linear kept TP times the bf16 linear's input)."""

    @staticmethod
    def forward(ctx, input_hp, weight_hp, config, mm_config, sharding: Sharding, parts: Parts, sequence_group=None):
        # a transposed input (DeepSeek-V4's output projection takes its sequence-first view) would be reshaped after
        # its cast, a copy torchao's row-scaled float8 tensor cannot make ("aten.clone ... axiswise scaling")
        input_hp = input_hp.contiguous()
        local = input_hp
        if sequence_group is not None:
            from megatron.core.tensor_parallel.mappings import _gather_along_first_dim  # as the class above says

            input_hp = _gather_along_first_dim(local, sequence_group)
        ctx.sequence_group = sequence_group
        if input_hp.numel() == 0:
            # an expert no token was routed to this step: nothing to scale (every rank of a linear's TP group sees
            # the same tokens, so all of them skip the scales' reductions together)
            parts = Parts(parts.groups, parts.widths, (False,) * len(parts.widths))
        ctx.save_for_backward(local, weight_hp)
        ctx.config, ctx.mm_config, ctx.sharding, ctx.parts = config, mm_config, sharding, parts
        tt = _torchao()[1]
        c, group, pow2 = config, sharding.group, config.round_scales_to_power_of_2
        shape = input_hp.shape
        input_fp8 = None
        outputs = []
        for weight_part, float8 in zip(parts.split_rows(weight_hp), parts.float8):
            if not float8:
                outputs.append(torch.matmul(input_hp, weight_part.t()))
                continue
            if input_fp8 is None:
                input_fp8 = _cast(input_hp, c.cast_config_input, mm_config, tt.GemmInputRole.INPUT, -1,
                                  sharding.input_split(), group, pow2).reshape(-1, shape[-1])
            weight_t = _cast(weight_part.t(), c.cast_config_weight, mm_config, tt.GemmInputRole.WEIGHT, 0,
                             sharding.weight_t_split(), group, pow2)
            out = torch.mm(input_fp8, weight_t)
            outputs.append(out.reshape(*shape[:-1], out.shape[-1]))
        return parts.join_columns(outputs)

    @staticmethod
    def backward(ctx, grad_output):
        input_hp, weight_hp = ctx.saved_tensors
        if ctx.sequence_group is not None and ctx.needs_input_grad[1]:
            from megatron.core.tensor_parallel.mappings import _gather_along_first_dim  # megatron-core: see forward

            input_hp = _gather_along_first_dim(input_hp, ctx.sequence_group)
        c, mm, sharding, parts = ctx.config, ctx.mm_config, ctx.sharding, ctx.parts
        tt = _torchao()[1]
        group, pow2 = sharding.group, c.round_scales_to_power_of_2
        out_shape = grad_output.shape
        grad_2d = grad_output.reshape(-1, out_shape[-1])
        input_2d = input_hp.reshape(-1, input_hp.shape[-1])
        need_input, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_inputs, grad_weights, input_gw = [], [], None
        for grad_part, weight_part, float8 in zip(parts.split_columns(grad_2d), parts.split_rows(weight_hp),
                                                  parts.float8):
            weight_t = weight_part.t()
            if need_input:
                if float8:
                    grad_gi = _cast(grad_part, c.cast_config_grad_output, mm, tt.GemmInputRole.GRAD_OUTPUT, -1,
                                    sharding.grad_output_split(), group, pow2)
                    weight_gi = _cast(weight_t, c.cast_config_weight_for_grad_input, mm, tt.GemmInputRole.WEIGHT,
                                      -1, sharding.weight_t_split(), group, pow2)
                    piece = torch.mm(grad_gi, weight_gi.t())
                else:
                    piece = torch.mm(grad_part, weight_part)
                grad_inputs.append(piece)
            if need_weight:
                if float8:
                    if input_gw is None:
                        input_gw = _cast(_pad_tokens(input_2d), c.cast_config_input_for_grad_weight, mm,
                                         tt.GemmInputRole.INPUT, 0, sharding.input_split(), group, pow2)
                    grad_gw = _cast(_pad_tokens(grad_part), c.cast_config_grad_output_for_grad_weight, mm,
                                    tt.GemmInputRole.GRAD_OUTPUT, 0, sharding.grad_output_split(), group, pow2)
                    grad_weights.append(torch.mm(grad_gw.t(), input_gw))
                else:
                    grad_weights.append(torch.mm(grad_part.t(), input_2d))
        grad_input = None
        for piece in reversed(grad_inputs):  # summed as autograd sums separate linears' (the last one's first)
            grad_input = piece if grad_input is None else grad_input + piece
        if grad_input is not None:
            grad_input = grad_input.reshape(*out_shape[:-1], grad_input.shape[-1])
            if ctx.sequence_group is not None:  # back to this rank's part of the sequence, summed over the group
                from megatron.core.tensor_parallel.mappings import _reduce_scatter_along_first_dim  # see forward

                grad_input = _reduce_scatter_along_first_dim(grad_input, ctx.sequence_group)
        grad_weight = parts.join_rows(grad_weights) if need_weight else None
        return grad_input, grad_weight, None, None, None, None, None


# --- megatron-core's linears ----------------------------------------------------------------------------------------

def _parts(module, relative: str, recipe: str, fp8_filter, tp: int, linear_attention) -> tuple[Parts, list[Gemm]]:
    """How ``module``'s local output rows (``relative``: its name in the layer) divide into HF tensors, and which
    of those GEMMs run in float8 (decided on the whole model's shapes, as at TP=1)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    config, kind = module.config, linear_kind(relative)
    out_whole, in_whole = whole_shape(module)
    repeats, widths, names = fused_parts(relative, out_whole, heads=config.num_attention_heads,
                                         groups=config.num_query_groups or config.num_attention_heads,
                                         head_dim=config.kv_channels, gated=config.gated_linear_unit,
                                         mla=bool(config.multi_latent_attention), linear_attention=linear_attention)
    gpu_split = tp if module.weight.device.type == "cuda" else None
    gemms = [Gemm(relative, name, kind, repeats * width, in_whole,
                  chosen(kind, recipe, fp8_filter, repeats * width, in_whole, gpu_split))
             for width, name in zip(widths, names)]
    flags = tuple(g.float8 for g in gemms)
    column = isinstance(module, ColumnParallelLinear)
    if len(widths) > 1 and column and repeats > 1:
        return Parts(repeats // tp, widths, flags), gemms  # q, k, v: whole query groups per rank
    if len(widths) > 1 and column:
        return Parts(1, tuple(w // tp for w in widths), flags), gemms  # gate and up: each split over TP
    return Parts(1, (module.weight.shape[0],), flags), gemms


def _float8_forward_impl(module, config, mm_config, parts: Parts):
    """A ``_forward_impl`` for ``module`` (megatron-core's ``linear_with_grad_accumulation_and_async_allreduce``'s
    arguments): megatron-core's bf16 communication around ``Float8ParallelMatmul``."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if _whole_linear(module):
        # a whole weight on every rank, fed the whole sequence (the sparse attention gathers it first): nothing to
        # communicate, and no scale spans a split
        return lambda input, weight, bias=None: Float8ParallelMatmul.apply(input, weight, config, mm_config,
                                                                          Sharding("column"), parts)

    tp_group = module.tp_group
    group = tp_group if tp_group is not None and tp_group.size() > 1 else None
    sharding = Sharding("column" if isinstance(module, ColumnParallelLinear) else "row", group)

    def forward_impl(input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                     sequence_parallel=False, *args, **kwargs):
        # sequence parallelism: the sequence gathered in bf16 inside the GEMM's function (its gradient reduce-scattered
        # in bf16), which keeps the local part for backward, as megatron-core's linear does
        if allreduce_dgrad and not sequence_parallel:  # the input's gradient all-reduced over TP in bf16
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        output = Float8ParallelMatmul.apply(input, weight, config, mm_config, sharding, parts,
                                            tp_group if sequence_parallel else None)
        return output if bias is None else output + bias

    return forward_impl


def _whole_linear(module) -> bool:
    """Whether ``module`` is a sparse attention's whole linear (``IndexerLinear``), unsplit on every TP rank."""
    # sparse_attention imports megatron-core at its top: imported here, as megatron-core is (above)
    from megatron_patch.models.blocks.sparse_attention import IndexerLinear

    return isinstance(module, IndexerLinear)


def decoder_linears(chunk):
    """(layer-relative name, full name, module) of every column- and row-parallel linear in ``chunk``'s decoder
    layers and its MTP layers' transformer layers, and of the sparse attentions' whole linears (``IndexerLinear``:
    DeepSeek's indexers, V4's attention projections; the output layer, the embedding and MTP's eh_proj are not
    among them)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for name, module in chunk.named_modules():
        match = _DECODER_LAYER.match(name)
        if match and (isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or _whole_linear(module)) \
                and module.weight is not None:
            yield match.group(1), name, module


def whole_shape(module) -> tuple[int, int]:
    """[out, in] of the whole weight a module holds a shard of."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    out_local, in_local = module.weight.shape
    if _whole_linear(module):
        return out_local, in_local
    if isinstance(module, ColumnParallelLinear):
        return module.output_size, in_local
    return out_local, module.input_size


def convert_chunks(chunks: list, recipe: str, fp8_filter, linear_attention) -> list[Gemm]:
    """Every decoder linear of ``chunks`` with a GEMM that ``fp8_filter`` chooses computes in float8 with
    ``recipe`` (its other GEMMs in bf16); returns every decoder GEMM with what it runs. ``linear_attention``: the
    model's ``Arch.linear_attention`` (its in_proj's HF parts), None for a model without."""
    if recipe not in RECIPES:
        raise ValueError(f"torchao float8 recipe '{recipe}' is not one of {RECIPES}")
    config = torchao_config(recipe)
    mm_config = _mm_config(config)
    gemms = []
    for chunk in chunks:
        for relative, name, module in decoder_linears(chunk):
            # an IndexerLinear's whole weight is decided at the model's TP, as the dry run's plan sizes every decoder
            # GEMM (on a GPU a shape that TP would cut below float8's multiples of 16 stays in bf16 on both sides)
            tp = (module.config.tensor_model_parallel_size if _whole_linear(module)
                  else module.tp_group.size() if module.tp_group is not None else 1)
            parts, found = _parts(module, relative, recipe, fp8_filter, tp, linear_attention)
            gemms += found
            if any(parts.float8):
                module._float8_parts = parts
                module._bf16_forward_impl = module._forward_impl
                module._forward_impl = _float8_forward_impl(module, config, mm_config, parts)
    return gemms


@contextmanager
def in_bf16(chunks: list):
    """Every float8 GEMM of ``chunks`` computed by megatron-core's own bf16 linear for the duration: the model a
    training run exports and ``mpatch eval --dtype bf16`` computes (the live task evaluation of a PR=fp8 run)."""
    modules = [m for chunk in chunks for _, _, m in decoder_linears(chunk) if converted(m)]
    float8 = [m._forward_impl for m in modules]
    for module in modules:
        module._forward_impl = module._bf16_forward_impl
    try:
        yield
    finally:
        for module, impl in zip(modules, float8):
            module._forward_impl = impl


def describe_gemms(gemms: list[Gemm], recipe: str) -> str:
    """One line for the log: how many GEMMs of each kind run in float8 on this rank."""
    kinds: dict[str, list[int]] = {}
    for gemm in gemms:
        counts = kinds.setdefault(gemm.kind, [0, 0])
        counts[0 if gemm.float8 else 1] += 1
    parts = [f"{kind} {fp8}/{fp8 + bf16}" for kind, (fp8, bf16) in kinds.items()]
    return (f"float8 (torchao, {recipe}): this rank's decoder GEMMs in float8 by kind: {', '.join(parts) or 'none'}; "
            "the rest, the embedding and the output layer in bf16; communication in bf16")


def converted(module) -> bool:
    """Whether ``module`` (a parallel linear) computes any GEMM in float8."""
    return hasattr(module, "_float8_parts")


# --- the reference: torchao on the HF model -----------------------------------------------------------------------

_HF_KINDS = ((re.compile(r"\.experts?\.\d+\.|\.experts\."), "experts"), (re.compile(r"\.shared_experts?\."), "shared_experts"),
             (re.compile(r"\.(q|k|v|qkv|q_a|q_b|kv_a|kv_b)_proj(_with_mqa)?$"), "qkv"), (re.compile(r"\.o_proj$"), "proj"),
             (re.compile(r"\.(gate|up|gate_up)_proj$"), "fc1"), (re.compile(r"\.down_proj$"), "fc2"))
_HF_LAYER = re.compile(r"(^|\.)layers\.\d+\.")
# HF linears that megatron-core computes outside its parallel linears, in bf16 (docs/fp8.md: routers stay bf16):
# routers (Gemma 4's router.proj), the shared experts' sigmoid gate (Qwen2-MoE's, Qwen3-Next's) and Gemma 4's
# per-layer-input linears (replicated torch linears, bf16 like the embedding)
_HF_BF16 = re.compile(r"\.router\.|\.mlp\.gate$|\.shared_experts?_gate$|\.per_layer_(input_gate|projection)$")


def hf_linear_kind(name: str, moe_layer: bool = False) -> str:
    """The kind of an HF decoder linear (its full name), as ``float8_plan.linear_kind`` names MCore's;
    ``moe_layer``: its layer has routed experts, beside which megatron-core holds a dense MLP as its shared experts
    (Gemma 4's mlp.gate_proj/up_proj/down_proj)."""
    for pattern, kind in _HF_KINDS:
        if pattern.search(name):
            return "shared_experts" if moe_layer and kind in ("fc1", "fc2") else kind
    return "other"


def _float8_experts(experts, config, choose) -> None:
    """transformers 5's fused experts module (3-D ``gate_up_proj`` and ``down_proj``, not ``nn.Linear``, so
    torchao's ``convert_to_float8_training`` never sees them) with a forward that computes what transformers' eager
    one does, each expert's gate, up and down GEMMs through torchao's ``matmul_with_hp_or_float8_args`` (what
    ``Float8Linear`` runs) where ``choose(out, in)`` says so: gate and up scaled apart, as megatron-core's
    ``linear_fc1`` parts are. The layout comes from the flags transformers' ``use_experts_implementation`` records
    (transposed, interleaved, biases); ``_apply_gate`` is the module's own."""
    if not experts.has_gate or experts.has_post_expert_norm:
        raise UserError(f"mpatch align --dtype fp8 cannot put {type(experts).__name__}'s experts in float8 (no gate, "
                        "or a norm after each expert): choose an --fp8-filter without experts")
    matmul = _torchao()[0].float8_linear.matmul_with_hp_or_float8_args
    mm_config = _mm_config(config)
    shape = experts.down_proj.shape  # [E, H, I] (transposed: [E, I, H])
    hidden, inner = (shape[2], shape[1]) if experts.is_transposed else (shape[1], shape[2])
    gate_up_in_float8, down_in_float8 = choose(inner, hidden), choose(hidden, inner)
    signature = inspect.signature(type(experts).forward)

    def linear(x, weight, in_float8: bool):  # weight [out, in]
        return matmul.apply(x, weight.contiguous().t(), mm_config, config) if in_float8 else x @ weight.t()

    def forward(*args, **kwargs):
        hidden_states, top_k_index, top_k_weights = signature.bind(experts, *args, **kwargs).args[1:4]
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if experts.is_transposed:  # [E, in, out]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        out = torch.zeros_like(hidden_states)
        for e in range(gate_up.shape[0]):
            top_k_pos, token_idx = torch.where((top_k_index == e).t())  # transformers' order: by k, then token
            if token_idx.numel() == 0:
                continue
            x = hidden_states[token_idx]
            gate, up = ((gate_up[e, :inner], gate_up[e, inner:]) if experts.is_concatenated
                        else (gate_up[e, 0::2], gate_up[e, 1::2]))
            gate, up = linear(x, gate, gate_up_in_float8), linear(x, up, gate_up_in_float8)
            gate_up_out = (torch.cat([gate, up], dim=-1) if experts.is_concatenated
                           else torch.stack([gate, up], dim=-1).flatten(-2))
            if experts.has_bias:
                gate_up_out = gate_up_out + experts.gate_up_proj_bias[e]
            y = linear(experts._apply_gate(gate_up_out), down[e], down_in_float8)
            if experts.has_bias:
                y = y + experts.down_proj_bias[e]
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, top_k_pos, None]).to(out.dtype))
        return out

    experts.forward = forward


def _fused_experts(model) -> list:
    return [m for m in model.modules() if isinstance(getattr(m, "gate_up_proj", None), torch.nn.Parameter)
            and m.gate_up_proj.dim() == 3]


def convert_hf_model(model, recipe: str, fp8_filter) -> None:
    """torchao's ``convert_to_float8_training`` on ``model``'s decoder linears that ``fp8_filter`` chooses (the same
    decision as ``convert_chunks`` makes for MCore's GEMMs: routed experts included, routers and shared-expert gates
    left out): the reference ``mpatch align --dtype fp8`` and the tests compare with."""
    float8, config = _torchao()[0], torchao_config(recipe)
    for experts in _fused_experts(model):
        gpu_split = 1 if experts.down_proj.device.type == "cuda" else None
        def choose(out_features, in_features):
            return chosen("experts", recipe, fp8_filter, out_features, in_features, gpu_split)

        if choose(*experts.down_proj.shape[1:]) or choose(*reversed(experts.down_proj.shape[1:])):
            _float8_experts(experts, config, choose)
    moe_layers = {match.group(0) for name, _ in model.named_modules() if (match := _HF_LAYER.search(name))
                  and hf_linear_kind(name + ".") == "experts"}

    def keep(module, name: str) -> bool:
        layer = _HF_LAYER.search(name)
        if not isinstance(module, torch.nn.Linear) or not layer or _HF_BF16.search(name):
            return False
        kind = hf_linear_kind(name, layer.group(0) in moe_layers)
        return chosen(kind, recipe, fp8_filter, module.out_features, module.in_features,
                      1 if module.weight.device.type == "cuda" else None)

    float8.convert_to_float8_training(model, module_filter_fn=keep, config=config)

"""The adapters on a rank's live model chunks: sharded for TP (and SP), placed by EP, ETP-aware, trained
while the base weights stay frozen.

Each MCore linear layer with adapters (a ``plan.Site``) gets a ``SiteAdapters`` module and a forward hook
that adds the adapters' output to the layer's own:

- column-parallel layers (``linear_qkv``, ``linear_fc1``, MLA's projections): every A is replicated and
  each B split like the HF rows it feeds (a contiguous block per HF part, as the weight's split cuts it).
  The input is gathered over the sequence under SP; A's product is identical on every rank, and its
  gradient is summed over the TP group (``copy_to_tensor_model_parallel_region``), so A's gradient and the
  input's are whole on every rank. The B's outputs are laid out in the layer's fused rows by the rule's
  own split (``Split.shards`` on the per-part B blocks), which is where q/k/v and gate/up stay apart.
- row-parallel layers (``linear_proj``, ``linear_fc2``): A split on the input like the weight, B
  replicated. A's partial products are summed over TP, B applies to the whole sequence, and under SP the
  result is scattered over the sequence like the layer's own output.
- routed experts' layers do no communication themselves (megatron-core's dispatcher gathers their tokens
  over the expert-TP group and reduces their outputs): their replicated factors' gradients are summed over
  that group instead, and expert adapters sit in DDP's expert buffers (``allreduce = False``).
- layers that TE keeps whole on every rank (MLA's down projections with transformer-engine) keep whole
  adapters; under SP their gradients are summed over TP as megatron-core sums the layer's own.

The adapters of a model chunk live in one ``LoraAdapters`` container, the chunk's last child, so the
order of the trainable parameters (which the DDP buffers and the memory plan follow) is the plan's.
"""

from __future__ import annotations

import math
import re
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from megatron_patch.errors import UserError
from megatron_patch.lora.plan import COLUMN, ROW, WHOLE, Site, b_whole, site_split, split_mode
from megatron_patch.lora.saved import saved_mcore_names
from megatron_patch.lora.spec import LoraSpec
from megatron_patch.models.blocks.builder import model_spec_name
from megatron_patch.models.mapping import SplitContext, split_context
from megatron_patch.models.mapping.naming import local_to_te_names, te_to_local_name
from megatron_patch.models.mapping.splits import RowPieces

# megatron-core is imported inside the functions that use it, so that in a rank it loads after
# init_process_group has enabled runtime/cpu_compat (on CPU, megatron-core's CUDA-only spots are patched).


class _SumGradOver(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` (a factor replicated over ranks that each
    see a part of what it multiplies)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def init_a(key: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A fresh A as peft makes it (kaiming uniform, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), drawn from a seed of
    its own name so that every layout, and every rank holding a copy, draws the same whole tensor."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63)
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).float()


class SiteAdapters(nn.Module):
    """The adapters of one layer (one routed expert of it), this rank's shards.

    ``A[i]`` is adapter i's A (whole, or its input columns for a row-parallel layer); ``B[j]`` is one HF
    part's rows of its adapter's B (this rank's block of them for a column-parallel layer)."""

    def __init__(self, site: Site, spec: LoraSpec, split, shard: int, shards: int, ctx: SplitContext,
                 dtype: torch.dtype, device, *, expert: bool, sequence_parallel: bool):
        super().__init__()
        mode = split_mode(split)
        self.group_rank = shard  # this rank's place in the TP (expert-TP) group, whatever the mode
        if mode == WHOLE:
            shard, shards = 0, 1
        self.site, self.split, self.mode, self.shard, self.shards, self.expert = site, split, mode, shard, shards, expert
        self.sequence_parallel = sequence_parallel and not expert
        self.dropout = spec.dropout
        self.scalings = [spec.scaling(a.rank, a.alpha) for a in site.adapters]
        # the layer's split cuts this rank's fused rows from the per-part rows: with the local head counts
        self.ctx = SplitContext(ctx.num_heads // shards, ctx.num_kv_heads // shards, ctx.head_dim, ctx.vocab_size,
                                ctx.padded_vocab_size) if mode == COLUMN else ctx
        # A split described by row pieces (Qwen3-Next's gated QKV, the Gated DeltaNet's input projections): this
        # rank's fused rows are its pieces of the whole split, each read from the rank's block of its part, or
        # from the whole B where the rank's rows of a part are not one block (``plan.b_whole``).
        self.b_whole = mode == COLUMN and b_whole(split, site.part_rows, ctx, shards)
        self.pieces = None
        if isinstance(split, RowPieces):
            block = [0 if self.b_whole else shard * (rows // shards) for rows in site.part_rows]  # the B block's first row
            self.pieces = [(p, a - block[p], b - block[p]) for p, a, b in split.pieces(ctx, shards)[shard]]
        # Parameters of this module itself (not of a ParameterList inside it): DDP's forward pre-hook, which
        # waits for an overlapped parameter all-gather, looks at the parameters of the module being called.
        self.A: list[nn.Parameter] = []
        self.B: list[nn.Parameter] = []
        self.b_of_part: list[int | None] = []   # part -> index into B (None: no adapter covers it)
        self.b_adapter: list[int] = []          # B index -> its adapter
        for a in site.adapters:
            cols = a.in_features // shards if mode == ROW else a.in_features
            self.A.append(_param((a.rank, cols), dtype, device, tensor_parallel=1 if mode == ROW else None,
                                 expert=expert, sequence_parallel=self.sequence_parallel and mode == WHOLE))
            self.register_parameter(f"a{len(self.A) - 1}", self.A[-1])
        for part, rows in enumerate(site.part_rows):
            cover = site.covering(part)
            if cover is None:
                self.b_of_part.append(None)
                continue
            i, _ = cover
            self.b_of_part.append(len(self.B))
            self.b_adapter.append(i)
            local = rows // shards if mode == COLUMN and not self.b_whole else rows
            self.B.append(_param((local, site.adapters[i].rank), dtype, device,
                                 tensor_parallel=0 if mode == COLUMN and not self.b_whole else None, expert=expert,
                                 sequence_parallel=self.sequence_parallel and mode == WHOLE))
            self.register_parameter(f"b{len(self.B) - 1}", self.B[-1])
        self._columns = [0]
        for a in site.adapters:
            self._columns.append(self._columns[-1] + a.rank)

    # --- whole tensors <-> this rank's shards -----------------------------------------------------------

    def a_slice(self, i: int) -> tuple[slice, slice]:
        a = self.site.adapters[i]
        if self.mode == ROW:
            cols = a.in_features // self.shards
            return slice(0, a.rank), slice(self.shard * cols, (self.shard + 1) * cols)
        return slice(0, a.rank), slice(0, a.in_features)

    def b_slice(self, part: int) -> tuple[slice, slice]:
        """Rows of this rank's block of ``part`` within its adapter's whole B."""
        i, first = self.site.covering(part)
        rows = self.site.part_rows[part]
        if self.mode == COLUMN and not self.b_whole:
            per = rows // self.shards
            return slice(first + self.shard * per, first + (self.shard + 1) * per), slice(None)
        return slice(first, first + rows), slice(None)

    @torch.no_grad()
    def load_whole(self, tensors: dict) -> None:
        """Fill this rank's shards from whole tensors by checkpoint key (A, B of every adapter)."""
        for i, a in enumerate(self.site.adapters):
            for key, shape in ((a.key_a, a.shape_a), (a.key_b, a.shape_b)):
                if key not in tensors:
                    raise UserError(f"the adapter lacks {key}")
                if tuple(tensors[key].shape) != shape:
                    raise UserError(f"{key} has shape {tuple(tensors[key].shape)}, the model's adapter {shape}")
            self.A[i].copy_(tensors[a.key_a][self.a_slice(i)])
        for part, j in enumerate(self.b_of_part):
            if j is not None:
                a = self.site.adapters[self.b_adapter[j]]
                self.B[j].copy_(tensors[a.key_b][self.b_slice(part)])

    @torch.no_grad()
    def init_fresh(self, seed: int) -> None:
        """peft's initialisation: A kaiming-uniform, B zero (the adapted model starts as the base)."""
        for i, a in enumerate(self.site.adapters):
            self.A[i].copy_(init_a(a.key_a, a.shape_a, seed)[self.a_slice(i)])
        for b in self.B:
            b.zero_()

    # --- forward ----------------------------------------------------------------------------------------

    def _group(self):
        from megatron.core import parallel_state as ps

        return ps.get_expert_tensor_parallel_group() if self.expert else ps.get_tensor_model_parallel_group()

    def _factor(self, p: torch.Tensor, replicated: bool) -> torch.Tensor:
        """An expert's factor replicated over the expert-TP ranks, each of which sees part of its gradient."""
        if self.expert and replicated and self.shards > 1:
            return _SumGradOver.apply(p, self._group())
        return p

    def _fused_b(self) -> torch.Tensor:
        """This rank's rows of the layer's output x the adapters' ranks: each part's B block (scaled) in its
        adapter's columns, zeros elsewhere, laid out in the layer's fused row order by the rule's split."""
        width = self._columns[-1]
        blocks = []
        for part, rows in enumerate(self.site.part_rows):
            local = rows // self.shards if self.mode == COLUMN and not self.b_whole else rows
            j = self.b_of_part[part]
            if j is None:
                blocks.append(self.B[0].new_zeros(local, width) if len(self.B) else None)
                continue
            i = self.b_adapter[j]
            b = self.B[j]
            if self.b_whole:  # each rank uses its rows of the whole B: its gradient's rows summed over TP
                b = _SumGradOver.apply(b, self._group())
            b = self._factor(b, self.mode != COLUMN) * self.scalings[i]
            blocks.append(F.pad(b, (self._columns[i], width - self._columns[i + 1])))
        if self.pieces is not None:
            return torch.cat([blocks[p][a:b] for p, a, b in self.pieces], 0)
        if self.split.transposed:  # the split cuts an HF [in, out] tensor (gpt-oss's interleaved gate/up)
            return self.split.shards([b.t() for b in blocks], 1, self.ctx)[0]
        if len(blocks) == 1:
            return blocks[0]
        return self.split.shards(blocks, 1, self.ctx)[0]

    def _down(self, x: torch.Tensor) -> torch.Tensor:
        """x times every A (dropout per adapter, as peft drops each module's input apart)."""
        factors = [self._factor(a, self.mode != ROW) for a in self.A]
        if not self.dropout or not self.training:
            return F.linear(x, torch.cat(factors, 0) if len(factors) > 1 else factors[0])
        return torch.cat([F.linear(self._dropout(x), a) for a in factors], -1)

    def _dropout(self, x):
        if self.mode == ROW and not self.expert:  # a TP-split input: each rank its own mask
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.dropout(x, self.dropout, True)
        return F.dropout(x, self.dropout, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel as tpl

        if self.mode == COLUMN:
            if self.sequence_parallel:
                x = tpl.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self._group())
            z = self._down(x)
            if not self.expert and self.shards > 1:
                z = tpl.copy_to_tensor_model_parallel_region(z, group=self._group())
            return F.linear(z, self._fused_b())
        if self.mode == ROW:
            z = self._down(x)
            if self.expert:
                return F.linear(z, self._fused_b())
            if self.shards > 1:
                z = tpl.reduce_from_tensor_model_parallel_region(z, group=self._group())
            out = F.linear(z, self._fused_b())
            if self.sequence_parallel:
                out = tpl.scatter_to_sequence_parallel_region(out, group=self._group())
            return out
        return F.linear(self._down(x), self._fused_b())

    def sharded_state_dict(self, *args, **kwargs) -> dict:
        return {}  # the container's ``adapter_sharded_state`` names them: layout-free keys


def _param(shape, dtype, device, *, tensor_parallel: int | None, expert: bool, sequence_parallel: bool) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    if tensor_parallel is not None:
        # megatron's gradient-norm and checkpoint code: a TP shard, counted on every rank
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, tensor_parallel, 1
    if expert:
        p.allreduce = False  # DDP's expert buffers, reduced over expert data parallelism
    if sequence_parallel:
        p.sequence_parallel = True  # summed over TP by finalize_model_grads, like the layer's own
    return p


class LoraAdapters(nn.Module):
    """Every ``SiteAdapters`` of one model chunk (its last child), in the plan's order."""

    def __init__(self, spec: LoraSpec):
        super().__init__()
        self.spec = spec
        self.sites = nn.ModuleList()
        self._hooks = []

    def sharded_state_dict(self, *args, **kwargs) -> dict:
        return {}  # not part of megatron's model checkpoint: ``lora.state`` stores them by layout-free keys


# --- finding a site's live layer ---------------------------------------------------------------------------

def _layer_numbers(chunk) -> dict[int, int]:
    """Global decoder layer -> this chunk's local index (megatron's 1-based ``layer_number``)."""
    layers = chunk.decoder.layers if getattr(chunk, "decoder", None) is not None else []
    return {layer.layer_number - 1: i for i, layer in enumerate(layers)}


def _local_name(site: Site, local_layer: int, local_expert: int | None, spec_name: str) -> tuple[str, int | None]:
    """(the live module's name, the expert index within a grouped module or None)."""
    name = site.rule.mcore.replace("{layer}", str(local_layer))
    if local_expert is not None:
        name = name.replace("{expert}", str(local_expert))
    if spec_name == "local":
        return te_to_local_name(name).removesuffix(".weight"), None
    if local_expert is not None and name.rsplit(".", 1)[1] == f"weight{local_expert}":
        return name.rsplit(".", 1)[0], local_expert  # TE's grouped GEMM: one module, weight{e} per expert
    return name.removesuffix(".weight"), None


def attach(chunks: list, arch, spec: LoraSpec, sites: list[Site], dtype: torch.dtype) -> list[LoraAdapters]:
    """Add the adapters of ``sites`` this rank holds to each model chunk (uninitialised: ``init_fresh`` or
    ``load_whole`` them), hook them into their layers, and freeze every base weight except
    ``spec.modules_to_save``'s. Returns each chunk's container."""
    from megatron.core import parallel_state as ps

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    per_rank = arch.num_experts // ep if arch.is_moe else 0
    trainable = saved_mcore_names(arch, spec.modules_to_save)
    containers = []
    for chunk in chunks:
        spec_name = model_spec_name(chunk)
        numbers = _layer_numbers(chunk)
        modules = dict(chunk.named_modules())
        device = next(chunk.parameters()).device
        _freeze(chunk, numbers, trainable, spec_name)
        container = LoraAdapters(spec)
        grouped: dict[int, dict] = {}  # id(module) -> expert -> SiteAdapters
        for site in sites:
            if site.layer not in numbers:
                continue
            local_expert = None
            if site.expert is not None:
                if site.expert // per_rank != ep_rank:
                    continue
                local_expert = site.expert % per_rank
            name, group_index = _local_name(site, numbers[site.layer], local_expert, spec_name)
            module = modules.get(name)
            if module is None:
                raise UserError(f"LoRA: the model chunk has no layer {name} for {site.mcore_name}")
            expert = site.expert is not None
            shards, shard = (etp, etp_rank) if expert else (tp, tp_rank)
            split = site_split(site, spec_name)
            adapters = SiteAdapters(site, spec, split, shard, shards, split_context(arch, site.layer), dtype, device,
                                    expert=expert, sequence_parallel=_sequence_split(module, split_mode(split),
                                                                                     chunk.config.sequence_parallel))
            container.sites.append(adapters)
            if group_index is None:
                container._hooks.append(module.register_forward_hook(_hook(adapters, module), with_kwargs=True))
            else:
                grouped.setdefault(id(module), {"module": module})[group_index] = adapters
        for entry in grouped.values():
            module = entry.pop("module")
            container._hooks.append(module.register_forward_hook(_grouped_hook(entry), with_kwargs=True))
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None:
            container._hooks.append(embedding.register_forward_hook(input_requires_grad))
        chunk.add_module("lora", container)
        containers.append(container)
    return containers


def _sequence_split(module, mode: str, model_sequence_parallel: bool) -> bool:
    """Whether sequence parallelism cuts the layer's input (or a row-parallel layer's output) along the sequence, as
    the layer itself has it: megatron's linears keep their own flag (DeepSeek-V4's attention builds the projections
    inside it without, having gathered the sequence once), transformer-engine's duplicated linears mark their weight
    (whose gradient megatron then sums over TP); a layer that says neither follows the model."""
    marked = getattr(getattr(module, "weight", None), "sequence_parallel", None)
    if mode == WHOLE and marked is not None:
        return marked
    return getattr(module, "sequence_parallel", model_sequence_parallel)


def input_requires_grad(module, args, output):
    """The frozen embedding's output made to require a gradient: megatron-core's full recompute is an
    autograd Function of the layer's input, and an input that needs no gradient would skip the backward
    of every recomputed layer, adapters included (what transformers' enable_input_require_grads fixes)."""
    if isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)
    return output


def _freeze(chunk, numbers: dict[int, int], trainable: set[str], spec_name: str) -> None:
    """Every base weight frozen but those modules_to_save names (MCore names, global layers)."""
    local_of_global = {v: k for k, v in numbers.items()}
    names = [n for n, _ in chunk.named_parameters()]
    te = local_to_te_names(names) if spec_name == "local" else {n: n for n in names}
    for name, p in chunk.named_parameters():
        global_name = _global(te[name], local_of_global)
        p.requires_grad_(global_name in trainable)


def _global(name: str, local_of_global: dict[int, int]) -> str:
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
    return f"decoder.layers.{local_of_global[int(m.group(1))]}.{m.group(2)}" if m else name


def _normalized_input(module, x: torch.Tensor) -> torch.Tensor:
    """The input a transformer-engine layer with a fused norm multiplies (``TELayerNormColumnParallelLinear``):
    its RMSNorm (or LayerNorm) applied as the layer applies it; other layers take ``x`` as it is."""
    weight = getattr(module, "layer_norm_weight", None)
    if weight is None:
        return x
    eps = getattr(module, "eps", 1e-5)
    gamma = weight + 1 if getattr(module, "zero_centered_gamma", False) else weight
    if getattr(module, "normalization", "RMSNorm") == "LayerNorm":
        return F.layer_norm(x, x.shape[-1:], gamma, getattr(module, "layer_norm_bias", None), eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * gamma


def _hook(adapters: SiteAdapters, module):
    def hook(mod, args, kwargs, output):
        x = args[0] if args else kwargs.get("input_", kwargs.get("inp"))
        out, bias = (output[0], output[1]) if isinstance(output, tuple) else (output, None)
        out = out + adapters(_normalized_input(mod, x)).to(out.dtype)
        return (out, bias) if isinstance(output, tuple) else out
    return hook


def _grouped_hook(experts: dict[int, SiteAdapters]):
    """transformer-engine's grouped expert GEMM: forward(x, m_splits), x holding each expert's tokens in turn."""
    def hook(mod, args, kwargs, output):
        x, splits = args[0], args[1] if len(args) > 1 else kwargs.get("m_splits")
        splits = [int(s) for s in splits]
        out, bias = (output[0], output[1]) if isinstance(output, tuple) else (output, None)
        pieces = list(torch.split(x, splits, 0))
        deltas = [experts[e](p).to(out.dtype) if e in experts and p.shape[0] else p.new_zeros(p.shape[0], out.shape[-1])
                  for e, p in enumerate(pieces)]
        out = out + torch.cat(deltas, 0)
        return (out, bias) if isinstance(output, tuple) else out
    return hook

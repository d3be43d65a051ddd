"""Qwen3-Next's layers on megatron-core: the family's own layer spec, from torch and megatron-core's parallel
linears, on CPU and GPU alike.

megatron-core's Gated DeltaNet spec asserts transformer-engine (and its layer needs flash-linear-attention's
kernels); its local backend has no fused norm+linear for the linear-attention input. So the family builds:

- ``LocalGatedDeltaNet``: megatron-core's Gated DeltaNet parameters under its names and its torch_dist
  layout (``in_proj`` kept as [q; k; v; z; beta; alpha] per TP rank and checkpointed as six pieces, the
  convolution as q, k, v), computed as transformers computes it: a causal depthwise convolution with SiLU,
  q and k L2-normalised in float32, the chunked gated delta rule (flash-linear-attention's kernel where it
  is installed and the tensors are on a GPU, ``chunked_gated_delta_rule`` otherwise), then a gated
  RMSNorm (``GatedRMSNorm``) and the output projection. Given megatron-core's static inference context (a
  generation), it keeps there, under its layer number as attention keeps its KV cache, the convolution's last
  kernel - 1 inputs and the recurrent state, and each later forward continues from them: a generated token
  costs one token (``recurrent_gated_delta_rule``);
- full-attention layers: megatron-core's attention with its output gate (``attention_output_gate``) and
  q/k norms, MoE or dense MLPs as config.json places them, and the MTP layer's norms, all with the zero-centred
  RMSNorm (``models/blocks/norms.py``: the weight stored zero-centred, scaling by ``1 + weight``).

Checkpoints keep transformer-engine's names (``sharded_state_dict_keys_map``): a Gated DeltaNet layer's
input norm is ``self_attention.in_proj.layer_norm_weight`` there, as megatron-core's TE spec fuses it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint, sharded_state_dict_default

from megatron_patch.models.blocks.core_attention import core_attention_class
from megatron_patch.models.blocks.norms import ZeroCenteredRMSNorm
from megatron_patch.models.blocks.spec_edits import submodules_of, with_submodules
from megatron_patch.models.blocks.tp_gradients import summed_over_tp
from megatron_patch.models.description.arch import LINEAR_ATTENTION, Arch

try:  # megatron-core 0.19 moved it; 0.16 keeps it beside its Gated DeltaNet
    from megatron.core.ssm.utils import _split_tensor_factory
except ImportError:
    from megatron.core.ssm.gated_delta_net import _split_tensor_factory


class GatedRMSNorm(torch.nn.Module):
    """The Gated DeltaNet's output norm: RMSNorm (a plain weight) times SiLU of the gate, as transformers'
    ``Qwen3NextRMSNormGated`` computes it. One weight of a value head's width serves every head, and a TP rank runs
    its own heads: its gradient is summed over TP (``summed_over_tp``; it was each rank's heads' part at TP=2,
    which megatron's finalize step does not sum)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        y = summed_over_tp(self.weight) * y.to(dtype)
        return (y * F.silu(gate.float())).to(dtype)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first(query, key, value, g, beta):
    """What both forms of the rule compute from: float32 [batch, value heads, seq, dim] (g, beta: [batch, value
    heads, seq]), each key head repeated for its value heads, q and k L2-normalised, q scaled by 1/sqrt(dim)."""
    if value.shape[2] != query.shape[2]:
        query = query.repeat_interleave(value.shape[2] // query.shape[2], dim=2)
        key = key.repeat_interleave(value.shape[2] // key.shape[2], dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (query, key, value, g, beta))
    q, k = _l2norm(q), _l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunked_gated_delta_rule(query, key, value, g, beta, chunk: int = 64, initial_state=None,
                             output_final_state: bool = False):
    """The gated delta rule over a whole sequence, chunk by chunk: transformers' torch algorithm (q and k
    L2-normalised in float32, each key head serving value_heads // key_heads value heads, the within-chunk
    system solved as a unit lower-triangular one), float32 throughout. Shapes [batch, seq, heads, dim]
    (g, beta: [batch, seq, value heads]); returns (output [batch, seq, value heads, value dim] in value's dtype,
    the recurrent state [batch, value heads, key dim, value dim] in float32 or None), as transformers' and
    flash-linear-attention's functions do.

    ``initial_state``: the state a generation continues from (None: zeros). The state after the last chunk is
    computed only where ``output_final_state`` asks: a training forward continues nothing, and a graph branch
    backward never reaches would only hold memory."""
    dtype, length = value.dtype, query.shape[1]
    q, k, v, g, beta = _heads_first(query, key, value, g, beta)
    # the padding (k = 0, beta = 0, g = 0) adds nothing to the state and decays it by exp(0)
    pad = (chunk - length % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    b, h, n = q.shape[0], q.shape[1], (length + pad) // chunk
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(b, h, n, chunk).cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay.unsqueeze(4) - decay.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * decay.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    q = q * decay.exp().unsqueeze(-1)
    carried = n if output_final_state else n - 1  # the chunks whose state a later token reads
    if carried:
        k = k * (decay[..., -1:] - decay).exp().unsqueeze(-1)
        chunk_decay = decay[..., -1].exp()[..., None, None]
    state = q.new_zeros(b, h, k.shape[-1], v.shape[-1]) if initial_state is None else initial_state.float()
    out = []
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        if i < carried:
            state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = torch.stack(out, 2).reshape(b, h, -1, v.shape[-1])[:, :, :length]
    return out.transpose(1, 2).contiguous().to(dtype), state if output_final_state else None


def recurrent_gated_delta_rule(query, key, value, g, beta, state):
    """The gated delta rule token by token from ``state`` [batch, value heads, key dim, value dim] (float32):
    each token decays the state by exp(g), writes beta * (v - state^T k) at k, and reads it at q. A generated
    token's cost, where the chunked form would pad it to a whole chunk. Shapes as ``chunked_gated_delta_rule``;
    returns (output, the state after the last token)."""
    dtype = value.dtype
    q, k, v, g, beta = _heads_first(query, key, value, g, beta)
    state = state.float()
    out = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp().unsqueeze(-1).unsqueeze(-1)
        remembered = (state * k[:, :, t].unsqueeze(-1)).sum(dim=-2)
        written = (v[:, :, t] - remembered) * beta[:, :, t].unsqueeze(-1)
        state = state + k[:, :, t].unsqueeze(-1) * written.unsqueeze(-2)
        out.append((state * q[:, :, t].unsqueeze(-1)).sum(dim=-2))
    return torch.stack(out, 2).transpose(1, 2).contiguous().to(dtype), state


def _gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state: bool = False):
    """(output, final state or None): the recurrent form for one token continuing a state (a generation step);
    otherwise flash-linear-attention's chunked kernel on a GPU where it is installed, ``chunked_gated_delta_rule``
    elsewhere."""
    if initial_state is not None and query.shape[1] == 1:
        return recurrent_gated_delta_rule(query, key, value, g, beta, initial_state)
    if query.is_cuda:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            return chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=True)
        except ImportError:
            pass
    return chunked_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                    output_final_state=output_final_state)


@dataclasses.dataclass
class GenerationCache:
    """A Gated DeltaNet layer's rows of a generation's state (views into the inference context's buffers, written
    in place once the forward has read them): ``initial_state`` is what this forward continues from (None on a
    prompt: zeros)."""

    conv_inputs: torch.Tensor
    recurrent_state: torch.Tensor
    initial_state: torch.Tensor | None


@dataclasses.dataclass
class GatedDeltaNetSubmodules:
    in_proj: type = ColumnParallelLinear
    out_proj: type = RowParallelLinear
    out_norm: type = GatedRMSNorm


class LocalGatedDeltaNet(MegatronModule):
    """Gated DeltaNet (linear attention) with megatron-core's parameters and checkpoint layout."""

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int = None,
                 pg_collection: ProcessGroupCollection | None = None, **kwargs):
        super().__init__(config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.layer_number, self.tp_group = layer_number, pg_collection.tp
        self.tp_size = self.tp_group.size()
        self.sp_size = self.tp_size if config.sequence_parallel else 1
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.qk_dim = self.key_head_dim * self.key_heads
        self.v_dim = self.value_head_dim * self.value_heads
        self.in_proj_dim = 2 * self.qk_dim + 2 * self.v_dim + 2 * self.value_heads
        self.in_proj = build_module(submodules.in_proj, config.hidden_size, self.in_proj_dim, config=config,
                                    init_method=config.init_method, gather_output=False, bias=False,
                                    skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1",
                                    tp_group=self.tp_group)
        self.conv_dim_local = (2 * self.qk_dim + self.v_dim) // self.tp_size
        self.conv1d = torch.nn.Conv1d(self.conv_dim_local, self.conv_dim_local, bias=False,
                                      kernel_size=config.linear_conv_kernel_dim, groups=self.conv_dim_local,
                                      padding=config.linear_conv_kernel_dim - 1, dtype=config.params_dtype)
        self.conv1d.weight.tensor_model_parallel = True
        heads_local = self.value_heads // self.tp_size
        self.dt_bias = torch.nn.Parameter(torch.ones(heads_local, dtype=config.params_dtype))
        self.A_log = torch.nn.Parameter(torch.log(torch.empty(heads_local).uniform_(1, 16)).to(config.params_dtype))
        for p in (self.dt_bias, self.A_log):
            p.tensor_model_parallel = True
        if config.perform_initialization:
            torch.nn.init.kaiming_uniform_(self.conv1d.weight, a=math.sqrt(5))
        self.out_norm = build_module(submodules.out_norm, config=config, hidden_size=self.value_head_dim,
                                     eps=config.layernorm_epsilon)
        self.out_proj = build_module(submodules.out_proj, self.v_dim, config.hidden_size, config=config,
                                     init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
                                     skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
                                     tp_group=self.tp_group)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, inference_context=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            raise NotImplementedError("Gated DeltaNet here runs unpacked sequences only")
        seq_len, batch = hidden_states.shape[0] * self.sp_size, hidden_states.shape[1]
        qk, v, heads = self.qk_dim // self.tp_size, self.v_dim // self.tp_size, self.value_heads // self.tp_size
        projected, _ = self.in_proj(hidden_states)
        qkv, z, b, a = torch.split(projected.transpose(0, 1), [2 * qk + v, v, heads, heads], dim=-1)
        qkv = qkv.transpose(1, 2).contiguous()
        cache = None if inference_context is None else self._generation_cache(inference_context, batch)
        if cache is None:
            qkv = self.conv1d(qkv)[..., :seq_len]
        else:  # the convolution reads the kernel - 1 inputs before this step's (zeros before a prompt)
            qkv = torch.cat([cache.conv_inputs.to(qkv.dtype), qkv], dim=-1)
            cache.conv_inputs.copy_(qkv[..., qkv.shape[-1] - cache.conv_inputs.shape[-1]:])
            qkv = F.conv1d(qkv, self.conv1d.weight, groups=self.conv_dim_local)
        query, key, value = torch.split(F.silu(qkv).transpose(1, 2), [qk, qk, v], dim=-1)
        query = query.reshape(batch, seq_len, -1, self.key_head_dim)
        key = key.reshape(batch, seq_len, -1, self.key_head_dim)
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out, state = _gated_delta_rule(query.contiguous(), key.contiguous(), value.contiguous(), g, beta,
                                       initial_state=None if cache is None else cache.initial_state,
                                       output_final_state=cache is not None)
        if cache is not None:
            cache.recurrent_state.copy_(state)
        out = self.out_norm(out.reshape(-1, self.value_head_dim), z.reshape(-1, self.value_head_dim))
        out = out.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()
        return self.out_proj(out)

    def _generation_cache(self, context, batch: int) -> GenerationCache:
        """This layer's state for the ``batch`` rows of a generation in megatron-core's static inference context,
        kept where its attention keeps a layer's KV cache (``key_value_memory_dict[layer_number]``, buffers of
        the context's max batch, rows from ``batch_size_offset``): the convolution's last kernel - 1 inputs
        [batch, channels, kernel - 1] and the recurrent state [batch, value heads, key dim, value dim] in float32,
        this rank's channels and heads. A prompt (``sequence_len_offset`` 0) starts from zeros; every later
        forward continues from what the one before it left."""
        if not context.is_static_batching():
            raise NotImplementedError("Gated DeltaNet keeps its generation state in megatron-core's static "
                                      "inference context only")
        if self.layer_number not in context.key_value_memory_dict:
            weight = self.conv1d.weight
            context.key_value_memory_dict[self.layer_number] = (
                weight.new_zeros(context.max_batch_size, self.conv_dim_local, self.conv1d.kernel_size[0] - 1),
                torch.zeros(context.max_batch_size, self.value_heads // self.tp_size, self.key_head_dim,
                            self.value_head_dim, dtype=torch.float32, device=weight.device))
        conv_inputs, recurrent_state = (t[context.batch_size_offset:context.batch_size_offset + batch]
                                        for t in context.key_value_memory_dict[self.layer_number])
        prompt = context.sequence_len_offset == 0
        if prompt:
            conv_inputs.zero_()
        return GenerationCache(conv_inputs, recurrent_state, None if prompt else recurrent_state)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """As megatron-core's Gated DeltaNet: dt_bias, A_log and the convolution split over TP, and the input
        projection and convolution stored as their pieces, each a global tensor whatever the TP."""
        tp_group, dp = self.tp_group, (metadata or {}).get("dp_cp_group")
        state: dict = {}
        self._save_to_state_dict(state, "", keep_vars=True)
        out = make_sharded_tensors_for_checkpoint(state, prefix, {"A_log": 0, "dt_bias": 0}, sharded_offsets,
                                                  tp_group=tp_group, dp_cp_group=dp)
        for name, module in self.named_children():
            if name == "conv1d":
                out.update(make_sharded_tensors_for_checkpoint(module.state_dict(prefix="", keep_vars=True),
                                                               f"{prefix}conv1d.", {"weight": 0}, sharded_offsets,
                                                               tp_group=tp_group, dp_cp_group=dp))
            else:
                out.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                      tp_group=tp_group))
        qk, v, heads = self.qk_dim // self.tp_size, self.v_dim // self.tp_size, self.value_heads // self.tp_size
        out[f"{prefix}in_proj.weight"] = _split_tensor_factory(
            out[f"{prefix}in_proj.weight"], [qk, qk, v, v, heads, heads], ["query", "key", "value", "z", "beta", "alpha"], 0)
        out[f"{prefix}conv1d.weight"] = _split_tensor_factory(
            out[f"{prefix}conv1d.weight"], [qk, qk, v], ["query", "key", "value"], 0)
        return out


# --- the layer spec ----------------------------------------------------------------------------------

def _layer(arch: Arch, layer: int, attention: str, core_attention: str | None = None):
    moe = arch.is_moe_layer(layer)
    spec = get_gpt_layer_local_spec(num_experts=arch.num_experts if moe else None, moe_grouped_gemm=False,
                                    qk_layernorm=True, normalization="RMSNorm")
    if attention == LINEAR_ATTENTION:
        self_attention = ModuleSpec(module=LocalGatedDeltaNet, submodules=GatedDeltaNetSubmodules())
        keys = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
    else:
        self_attention = with_submodules(submodules_of(spec).self_attention, q_layernorm=ZeroCenteredRMSNorm,
                                         k_layernorm=ZeroCenteredRMSNorm,
                                         core_attention=core_attention_class(core_attention, mla=False))
        keys = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if not moe:  # TE fuses a dense MLP's norm into its first linear; an MoE layer keeps pre_mlp_layernorm
        keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return with_submodules(spec, input_layernorm=ZeroCenteredRMSNorm, pre_mlp_layernorm=ZeroCenteredRMSNorm,
                           self_attention=self_attention, sharded_state_dict_keys_map=keys)


def layer_spec(arch: Arch, config, use_te: bool, vp_stage, core_attention: str | None = None):
    """This pipeline stage's block: each layer as config.json's layer_types and MLP pattern say (the same
    modules with or without transformer-engine; ``core_attention`` for the full-attention layers)."""
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    return TransformerBlockSubmodules(layer_specs=[_layer(arch, i, arch.attention_type(i), core_attention) for i in layers],
                                      layer_norm=ZeroCenteredRMSNorm)


def mtp_block_spec(arch: Arch, config, spec, use_te: bool, vp_stage):
    """megatron-core's MTP block around a full-attention layer (the MTP layers' own kind, whatever the last
    decoder layer is), with Qwen3-Next's norms."""

    layer = _layer(arch, arch.num_layers, arch.attention_type(arch.num_layers))
    block = get_gpt_mtp_block_spec(config, TransformerBlockSubmodules(layer_specs=[layer], layer_norm=ZeroCenteredRMSNorm),
                                   use_transformer_engine=False, vp_stage=vp_stage)
    if block is None:
        return None
    norms = dict(enorm=ZeroCenteredRMSNorm, hnorm=ZeroCenteredRMSNorm, layer_norm=ZeroCenteredRMSNorm)
    return dataclasses.replace(block, layer_specs=[with_submodules(s, **norms) for s in block.layer_specs])


def config_kwargs(arch: Arch) -> dict:
    """The TransformerConfig fields of the Gated DeltaNet layers and of the local modules everywhere."""
    linear = arch.linear_attention
    return dict(
        experimental_attention_variant="gated_delta_net",
        # 1 for a linear-attention layer: megatron-core then checkpoints layers by number, not stacked
        linear_attention_freq=[int(arch.attention_type(i) == LINEAR_ATTENTION) for i in range(arch.num_layers)],
        linear_conv_kernel_dim=linear.conv_kernel, linear_key_head_dim=linear.key_head_dim,
        linear_value_head_dim=linear.value_head_dim, linear_num_key_heads=linear.num_key_heads,
        linear_num_value_heads=linear.num_value_heads,
        # the family's own modules, with or without transformer-engine: no TE-only fusions
        persist_layer_norm=False, apply_rope_fusion=False, moe_grouped_gemm=False, gradient_accumulation_fusion=False,
    )


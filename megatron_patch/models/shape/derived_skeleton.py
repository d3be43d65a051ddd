"""The model skeleton of a config (``skeleton.ModelSkeleton``) derived without megatron-core.

A conversion needs from megatron-core only what its GPTModel looks like for a config: every
parameter's shape and torch_dist chunks, and the ``_extra_state`` objects (``skeleton``). Importing
megatron-core alone takes about 3 s on 2 cores, more than the rest of a conversion's start-up, so a
conversion takes the skeleton from here. These are the rules of megatron-core's GPTModel (the local
layer spec, one rank, as ``skeleton.describe_model_here`` builds it) that decide it:

- which parameters it builds and their shapes: ``_LAYER``, ``_MTP`` and ``_top_level`` (a module's
  parameters in the order megatron-core registers its modules), read from the ``TransformerConfig``
  settings the builder and the family give (``_Config``);
- torch_dist keys: a decoder layer's tensors stacked on a leading layer axis when every layer is built
  alike, one key per layer otherwise (megatron-core's ``non_homogeneous_layers``: an MoE model with
  dense layers); a multi-token-prediction layer's always one key each; routed experts on an axis of
  their own (``...mlp.experts.experts.linear_fc1.weight``); a SwiGLU ``linear_fc1`` weight or bias as
  two chunks, gate then up;
- one ``_extra_state`` object per linear layer (each expert's own; the output layer's is dropped),
  holding ``[None]`` (the local spec's linears carry no extra state): written in torch.save's format by
  this project's own writer, so its bytes differ from torch's while torch reads the same ``[None]``.

The family's weight table must write exactly the parameters these rules say megatron-core builds.
Nothing here is guessed: a setting the rules do not model (a family ``transformer_config_kwargs`` key
outside ``_STRUCTURAL`` and ``_NUMERIC``, an ``Arch`` field outside ``_ARCH_FIELDS`` away from its
default, linear biases in an MoE or multi-latent-attention model), or a weight table that writes
anything else (a module these rules do not know, as a new family's may), makes ``derive_skeleton``
say why instead, and ``skeleton.describe_model`` then asks megatron-core itself (in its helper
process, cached on disk). ``tests/test_convert_bytes.py`` checks, in one megatron-core process, that
the derived skeleton equals megatron-core's for every registered family and the variants of their
configs the rules branch on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from megatron_patch.checkpoint_files.torch_files import torch_save_bytes
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.registry import get_family
from megatron_patch.models.mapping import plan_transfers
from megatron_patch.models.shape.skeleton_entries import ChunkEntry, ModelSkeleton, ObjectEntry, expected_hf_shapes
from megatron_patch.runtime.distributed import ParallelLayout

# TransformerConfig settings that change which parameters megatron-core builds or their shapes: read
# below. A family setting outside both sets means rules this module does not know.
_STRUCTURAL = {"kv_channels", "qk_layernorm", "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
               "qk_pos_emb_head_dim", "v_head_dim", "moe_router_enable_expert_bias"}
_MLA = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
# Settings that change only what the model computes, never its parameters.
_NUMERIC = {"rotary_base", "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
            "beta_slow", "mscale", "mscale_all_dim", "moe_router_score_function", "moe_router_num_groups",
            "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_router_pre_softmax",
            "moe_router_load_balancing_type"}
# Arch fields the builder turns into these settings (or into numerics); any other field must keep its
# default (a field added for a new kind of layer is a model these rules have not seen).
_ARCH_FIELDS = {"family", "vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_heads", "num_kv_heads",
                "head_dim", "norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "qkv_bias",
                "linear_bias", "rope_scaling", "num_experts", "moe_topk", "moe_ffn_hidden_size",
                "shared_expert_ffn_hidden_size", "shared_expert_gate", "norm_topk_prob", "router_aux_loss_coef",
                "dense_layers", "mla", "mtp_layers", "vocab_padded_to", "hf_config", "rotary_percent"}
# Arch fields the rules do not model: a model with one away from its default is asked of megatron-core, and its
# family says so (ModelFamily.skeleton_from_megatron_core). A new Arch field joins one set or the other
# (tests/test_family_seams.py), so none goes unnoticed.
ARCH_FIELDS_NOT_MODELLED = {"layer_types", "sliding_window", "attention_sinks", "linear_attention", "sparse_attention",
                            "family_config", "own_attention_shapes"}


class NotDerivable(Exception):
    """The rules here do not describe this model: megatron-core is asked instead (the message says why)."""


@dataclass(frozen=True)
class _Config:
    """The TransformerConfig values that shape the parameters (names as megatron-core's)."""

    hidden_size: int
    padded_vocab_size: int
    share_embeddings_and_output_weights: bool
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    add_bias_linear: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    multi_latent_attention: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    num_moe_experts: int
    moe_ffn_hidden_size: int
    shared_expert_size: int
    shared_expert_gate: bool
    expert_bias: bool


def _config(arch: Arch) -> _Config:
    """What ``builder.transformer_config`` gives megatron-core, from ``arch`` and the family's settings."""
    for f in dataclasses.fields(Arch):
        if f.name not in _ARCH_FIELDS:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if getattr(arch, f.name) != default:
                raise NotDerivable(f"Arch.{f.name}={getattr(arch, f.name)!r} is a setting these rules do not model")
    family = get_family(arch.family)
    if family.layer_spec is not None or family.mtp_block_spec is not None:
        raise NotDerivable(f"the {arch.family} family builds layers of its own")
    extra = family.transformer_config_kwargs(arch)
    unknown = sorted(set(extra) - _STRUCTURAL - _NUMERIC)
    if unknown:
        raise NotDerivable(f"the {arch.family} family sets {', '.join(unknown)}, which these rules do not model")
    mla = bool(extra.get("multi_latent_attention"))
    if mla and any(k not in extra for k in _MLA):
        raise NotDerivable("multi-latent attention without all of its sizes given (megatron-core's defaults)")
    if arch.linear_bias and (arch.is_moe or mla):
        raise NotDerivable("linear biases in an MoE or multi-latent-attention model")
    return _Config(
        hidden_size=arch.hidden_size, padded_vocab_size=arch.padded_vocab_size(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings, num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads,
        kv_channels=extra.get("kv_channels", arch.head_dim), ffn_hidden_size=arch.ffn_hidden_size,
        add_bias_linear=arch.linear_bias, add_qkv_bias=arch.qkv_bias, qk_layernorm=bool(extra.get("qk_layernorm")),
        multi_latent_attention=mla, q_lora_rank=extra.get("q_lora_rank"), kv_lora_rank=extra.get("kv_lora_rank", 0),
        qk_head_dim=extra.get("qk_head_dim", 0), qk_pos_emb_head_dim=extra.get("qk_pos_emb_head_dim", 0),
        v_head_dim=extra.get("v_head_dim", 0), num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size, shared_expert_size=arch.shared_expert_ffn_hidden_size,
        shared_expert_gate=arch.shared_expert_gate, expert_bias=bool(extra.get("moe_router_enable_expert_bias")))


@dataclass(frozen=True)
class _Param:
    """A parameter of a module, by its name in checkpoints (the TE spec's) within its scope."""

    name: str
    shape: Callable[[_Config], tuple[int, ...]]
    built: Callable[[_Config], bool] = lambda c: True
    linear: bool = False    # a linear layer's weight: its module has an ``_extra_state`` object
    swiglu: bool = False    # stored as two chunks: the gate half, then the up half
    buffer: bool = False


def _qkv_rows(c: _Config) -> int:
    return (c.num_attention_heads + 2 * c.num_query_groups) * c.kv_channels


def _mla(c: _Config) -> bool:
    return c.multi_latent_attention


def _gqa(c: _Config) -> bool:
    return not c.multi_latent_attention


def _q_head(c: _Config) -> int:
    return c.qk_head_dim + c.qk_pos_emb_head_dim


_ATTENTION = [
    # the input norm: fused into linear_qkv in TE's names, its own module in multi-latent attention
    _Param("self_attention.linear_qkv.layer_norm_weight", lambda c: (c.hidden_size,), _gqa),
    _Param("input_layernorm.weight", lambda c: (c.hidden_size,), _mla),
    _Param("self_attention.linear_proj.weight",
           lambda c: (c.hidden_size, c.num_attention_heads * (c.v_head_dim if c.multi_latent_attention else c.kv_channels)),
           linear=True),
    _Param("self_attention.linear_proj.bias", lambda c: (c.hidden_size,), lambda c: c.add_bias_linear),
    _Param("self_attention.linear_qkv.weight", lambda c: (_qkv_rows(c), c.hidden_size), _gqa, linear=True),
    _Param("self_attention.linear_qkv.bias", lambda c: (_qkv_rows(c),),
           lambda c: _gqa(c) and (c.add_qkv_bias or c.add_bias_linear)),
    _Param("self_attention.q_layernorm.weight", lambda c: (c.kv_channels,), lambda c: _gqa(c) and c.qk_layernorm),
    _Param("self_attention.k_layernorm.weight", lambda c: (c.kv_channels,), lambda c: _gqa(c) and c.qk_layernorm),
    _Param("self_attention.linear_q_proj.weight", lambda c: (c.num_attention_heads * _q_head(c), c.hidden_size),
           lambda c: _mla(c) and c.q_lora_rank is None, linear=True),
    _Param("self_attention.linear_q_down_proj.weight", lambda c: (c.q_lora_rank, c.hidden_size),
           lambda c: _mla(c) and c.q_lora_rank is not None, linear=True),
    _Param("self_attention.linear_q_up_proj.weight", lambda c: (c.num_attention_heads * _q_head(c), c.q_lora_rank),
           lambda c: _mla(c) and c.q_lora_rank is not None, linear=True),
    _Param("self_attention.linear_kv_down_proj.weight", lambda c: (c.kv_lora_rank + c.qk_pos_emb_head_dim, c.hidden_size),
           _mla, linear=True),
    _Param("self_attention.linear_kv_up_proj.weight",
           lambda c: (c.num_attention_heads * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank), _mla, linear=True),
    # the latent norms (megatron-core's q_layernorm / kv_layernorm), fused into the up projections in TE's names
    _Param("self_attention.linear_q_up_proj.layer_norm_weight", lambda c: (c.q_lora_rank,),
           lambda c: _mla(c) and c.qk_layernorm and c.q_lora_rank is not None),
    _Param("self_attention.linear_kv_up_proj.layer_norm_weight", lambda c: (c.kv_lora_rank,),
           lambda c: _mla(c) and c.qk_layernorm),
]
_DENSE_MLP = [
    _Param("mlp.linear_fc1.layer_norm_weight", lambda c: (c.hidden_size,)),   # the pre-MLP norm, fused in TE's names
    _Param("mlp.linear_fc1.weight", lambda c: (2 * c.ffn_hidden_size, c.hidden_size), linear=True, swiglu=True),
    _Param("mlp.linear_fc1.bias", lambda c: (2 * c.ffn_hidden_size,), lambda c: c.add_bias_linear, swiglu=True),
    _Param("mlp.linear_fc2.weight", lambda c: (c.hidden_size, c.ffn_hidden_size), linear=True),
    _Param("mlp.linear_fc2.bias", lambda c: (c.hidden_size,), lambda c: c.add_bias_linear),
]
_MOE_BEFORE_EXPERTS = [
    _Param("pre_mlp_layernorm.weight", lambda c: (c.hidden_size,)),
    _Param("mlp.router.weight", lambda c: (c.num_moe_experts, c.hidden_size)),
    _Param("mlp.router.expert_bias", lambda c: (c.num_moe_experts,), lambda c: c.expert_bias, buffer=True),
]
_EXPERT = [  # each routed expert's, ``{e}`` its index
    _Param("mlp.experts.linear_fc1.weight{e}", lambda c: (2 * c.moe_ffn_hidden_size, c.hidden_size), linear=True,
           swiglu=True),
    _Param("mlp.experts.linear_fc2.weight{e}", lambda c: (c.hidden_size, c.moe_ffn_hidden_size), linear=True),
]
_MOE_AFTER_EXPERTS = [
    _Param("mlp.shared_experts.linear_fc1.weight", lambda c: (2 * c.shared_expert_size, c.hidden_size),
           lambda c: c.shared_expert_size > 0, linear=True, swiglu=True),
    _Param("mlp.shared_experts.linear_fc2.weight", lambda c: (c.hidden_size, c.shared_expert_size),
           lambda c: c.shared_expert_size > 0, linear=True),
    _Param("mlp.shared_experts.gate_weight", lambda c: (1, c.hidden_size),
           lambda c: c.shared_expert_size > 0 and c.shared_expert_gate),
]
_EMBEDDING = [_Param("embedding.word_embeddings.weight", lambda c: (c.padded_vocab_size, c.hidden_size))]
_FINAL_NORM = [_Param("decoder.final_layernorm.weight", lambda c: (c.hidden_size,))]
# Tied, a single stage's output layer is the embedding itself.
_OUTPUT = [_Param("output_layer.weight", lambda c: (c.padded_vocab_size, c.hidden_size),
                  lambda c: not c.share_embeddings_and_output_weights)]
_MTP_BEFORE_LAYER = [
    _Param("enorm.weight", lambda c: (c.hidden_size,)),
    _Param("hnorm.weight", lambda c: (c.hidden_size,)),
    _Param("eh_proj.weight", lambda c: (c.hidden_size, 2 * c.hidden_size), linear=True),
]
_MTP_AFTER_LAYER = [_Param("final_layernorm.weight", lambda c: (c.hidden_size,))]
_EXPERTS_KEY = "mlp.experts.experts."   # megatron-core's torch_dist key of a routed expert's module


@dataclass
class _Builder:
    """Collects a model's parameters, chunks and objects in megatron-core's order."""

    config: _Config
    shapes: dict = field(default_factory=dict)
    chunks: list = field(default_factory=list)
    objects: list = field(default_factory=list)
    buffers: set = field(default_factory=set)

    def add(self, p: _Param, name: str, key: str, axes: tuple[tuple[int, int], ...]) -> None:
        """Parameter ``p`` as ``name``, stored under torch_dist ``key`` with the prepended ``axes``
        ((offset, size) of the layer or expert axis)."""
        shape = tuple(p.shape(self.config))
        self.shapes[name] = shape
        if p.buffer:
            self.buffers.add(name)
        offsets, sizes = tuple(o for o, _ in axes), tuple(s for _, s in axes)
        rows = shape[0]
        for start, length in ((0, rows // 2), (rows // 2, rows - rows // 2)) if p.swiglu else ((0, rows),):
            self.chunks.append(ChunkEntry(name=name, key=key, global_shape=sizes + shape,
                                          global_offset=offsets + (start,) + (0,) * (len(shape) - 1),
                                          local_shape=(1,) * len(axes) + (length,) + shape[1:], prepend=len(axes)))
        if p.linear:
            module = key.rsplit(".", 1)[0]
            offset, size = (".".join(map(str, offsets)), ".".join(map(str, sizes))) if axes else ("0", "1")
            self.objects.append(ObjectEntry(f"{module}._extra_state/shard_{offset}_{size}", _EMPTY_EXTRA_STATE))

    def params(self, group: list[_Param], prefix: str = "", key_prefix: str = "", axes=()) -> None:
        for p in group:
            if p.built(self.config):
                self.add(p, prefix + p.name, key_prefix + p.name, axes)

    def layer(self, prefix: str, key_prefix: str, axes, moe: bool) -> None:
        """One transformer layer (``prefix``: its parameters' names; ``key_prefix``: their torch_dist keys)."""
        self.params(_ATTENTION, prefix, key_prefix, axes)
        if not moe:
            self.params(_DENSE_MLP, prefix, key_prefix, axes)
            return
        self.params(_MOE_BEFORE_EXPERTS, prefix, key_prefix, axes)
        experts = self.config.num_moe_experts
        for e in range(experts):
            for p in _EXPERT:
                self.add(p, prefix + p.name.replace("{e}", str(e)),
                         key_prefix + _EXPERTS_KEY + p.name[len("mlp.experts."):].replace("{e}", ""),
                         axes + ((e, experts),))
        self.params(_MOE_AFTER_EXPERTS, prefix, key_prefix, axes)


_EMPTY_EXTRA_STATE = torch_save_bytes([None])   # what megatron-core stores for a local linear's extra state


def derive_skeleton(arch: Arch) -> ModelSkeleton:
    """``arch``'s skeleton by the rules above; ``NotDerivable`` (saying why) where they do not describe it."""
    b = _Builder(_config(arch))
    b.params(_EMBEDDING)
    layers = arch.num_layers
    # megatron-core stacks the layers on one axis only if every layer is built alike (moe_layer_freq an int)
    stacked = not (arch.is_moe and arch.dense_layers)
    for i in range(layers):
        prefix = f"decoder.layers.{i}."
        b.layer(prefix, "decoder.layers." if stacked else prefix, ((i, layers),) if stacked else (), arch.is_moe_layer(i))
    b.params(_FINAL_NORM)
    for k in range(arch.mtp_layers):
        # megatron-core builds an MTP layer with the last decoder layer's spec, one key per layer
        prefix = f"mtp.layers.{k}."
        b.params(_MTP_BEFORE_LAYER, prefix, prefix)
        b.layer(prefix + "transformer_layer.", prefix + "transformer_layer.", (), arch.is_moe_layer(layers - 1))
        b.params(_MTP_AFTER_LAYER, prefix, prefix)
    b.params(_OUTPUT)
    transfers = plan_transfers(get_family(arch.family).weight_rules(arch), arch, ParallelLayout())
    table = {t.placements[0].mcore_name for t in transfers}
    if table != set(b.shapes):
        differ = sorted(table ^ set(b.shapes))
        raise NotDerivable(f"the {arch.family} weight table and these rules disagree on {len(differ)} parameter(s), "
                           f"first {differ[0]}")
    return ModelSkeleton(b.shapes, b.chunks, b.objects, expected_hf_shapes(arch, b.shapes, transfers),
                         frozenset(b.buffers))

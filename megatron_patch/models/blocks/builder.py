"""Arch + parallel layout -> megatron-core TransformerConfig, layer spec and GPTModel."""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from megatron_patch.dtypes import Precision
from megatron_patch.errors import UserError
from megatron_patch.models.blocks import rope
from megatron_patch.models.blocks.core_attention import core_attention_class
from megatron_patch.models.blocks.precision import cast_parameters
from megatron_patch.models.description.arch import Arch, validate_layout
from megatron_patch.models.description.registry import get_family
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.runtime.machine import transformer_engine_usable

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# processes that import this module without building a megatron-core model (align's main process, the
# launcher's dry run and resume checks) do not pay for it.
# So is blocks.local_attention, which imports megatron-core at its top.

# TransformerConfig's fused-kernel switches: a family that sets one False keeps it off (transformer_config)
FUSION_FLAGS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "persist_layer_norm",
                "apply_rope_fusion", "gradient_accumulation_fusion")


@functools.lru_cache(maxsize=1)
def te_available() -> bool:
    """Transformer-engine is usable only with CUDA; on CPU we always take the local spec. The same test as
    the launcher's and ``mpatch info``'s (``runtime.machine.transformer_engine_usable``)."""
    return transformer_engine_usable()


def apex_wgrad_fusion_available() -> bool:
    """Apex's fused_weight_gradient_mlp_cuda, which megatron-core's own linears (the output layer) need for
    gradient_accumulation_fusion; transformer-engine's linears have their own."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def fused_softmax_available() -> bool:
    """Apex's scaled-masked-softmax kernels, which megatron's FusedScaleMaskSoftmax imports on the first
    fp16/bf16 forward with ``masked_softmax_fusion`` (sequences of 4096 or fewer); neither megatron-core
    nor transformer-engine ships them."""
    try:
        import scaled_masked_softmax_cuda  # noqa: F401
        import scaled_upper_triang_masked_softmax_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def transformer_config(arch: Arch, layout: ParallelLayout, dtype: torch.dtype = torch.float32,
                       pp_first_stage_layers: int | None = None, *, use_te: bool | None = None, **overrides):
    """The TransformerConfig of ``arch`` at ``layout`` for the TE layer spec (``use_te``; None: where TE is
    usable) or the local one; ``overrides`` win over everything derived, but for a fusion the family turns off."""
    from megatron.core.transformer import TransformerConfig

    validate_layout(arch, layout, pp_first_stage_layers=pp_first_stage_layers)
    gpu = torch.cuda.is_available()
    te = te_available() if use_te is None else use_te
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=arch.linear_bias,
        add_qkv_bias=arch.qkv_bias,
        # YaRN's attention factor (cos/sin scaled in HF) as a softmax scale; None for other RoPE.
        softmax_scale=rope.softmax_scale(arch),
        # Multi-token-prediction layers, when the checkpoint was converted with them.
        mtp_num_layers=arch.mtp_layers or None,
        # Fine-tuning and conversion checks need the model as released: no dropout.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        num_layers_in_first_pipeline_stage=pp_first_stage_layers,
        virtual_pipeline_model_parallel_size=layout.vp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=Precision.of_dtype(dtype).bf16,
        fp16=Precision.of_dtype(dtype).fp16,
        use_cpu_initialization=not gpu,
        # Fused kernels exist only on GPU, and each flag follows the spec being built, not CUDA alone:
        # the local spec's RMSNorm (torch's, WrappedTorchNorm) refuses persist_layer_norm, and the fused
        # softmax needs Apex's kernels (RoPE fusion needs transformer-engine).
        bias_activation_fusion=gpu,
        masked_softmax_fusion=gpu and fused_softmax_available(),
        bias_dropout_fusion=gpu,
        persist_layer_norm=gpu and te,
        apply_rope_fusion=gpu and te,
        gradient_accumulation_fusion=gpu and te and apex_wgrad_fusion_available(),
    )
    if arch.is_moe:
        kwargs.update(
            num_moe_experts=arch.num_experts,
            moe_router_topk=arch.moe_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size or None,
            moe_shared_expert_gate=arch.shared_expert_gate,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=arch.router_aux_loss_coef,
            moe_router_dtype="fp32",
            # The same dispatcher on GPU and CPU (gloo does uneven all_to_all; see docs/cpu-runtime.md).
            moe_token_dispatcher_type="alltoall",
            # TE's grouped GEMM; the local spec's would need the grouped_gemm package.
            moe_grouped_gemm=te,
            # 1 for an MoE layer, 0 for a dense one (ffn_hidden_size), as config.json places them.
            moe_layer_freq=arch.moe_layer_pattern if arch.dense_layers else 1,
        )
    kwargs.update(_cuda_graph_default(TransformerConfig))
    family_kwargs = get_family(arch.family).transformer_config_kwargs(arch)
    kwargs.update(family_kwargs)
    kwargs.update(overrides)
    # A fusion the family's own modules cannot take stays off whatever the run asks (MP_COMPILE_FUSIONS, an
    # align ablation): megatron-core fuses only the plain SwiGLU/GeGLU, not Gemma's tanh GeLU or gpt-oss's clamp.
    kwargs.update({flag: False for flag in FUSION_FLAGS if family_kwargs.get(flag) is False})
    _refuse_a_top1_weight_megatron_core_lacks(arch, kwargs)
    if kwargs.get("multi_latent_attention"):
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def _refuse_a_top1_weight_megatron_core_lacks(arch: Arch, kwargs: dict) -> None:
    """Top-1 routing whose one weight transformers normalises to 1 (softmax over the chosen experts, or
    norm_topk_prob under sigmoid scores): megatron-core's post-softmax router refuses top-1 (its ValueError was an
    internal error), and its sigmoid router renormalises only for top-k > 1 (a silently other model: align NOT
    aligned at rel_l2 0.3)."""
    if not arch.is_moe or kwargs.get("moe_router_topk") != 1:
        return
    score = kwargs.get("moe_router_score_function", "softmax")
    if (score == "softmax" and not kwargs.get("moe_router_pre_softmax")) or (score == "sigmoid" and arch.norm_topk_prob):
        raise UserError(f"config.json routes each token to 1 expert whose weight {arch.family} normalises to 1 "
                        f"({'softmax over the chosen expert' if score == 'softmax' else 'norm_topk_prob'}), which "
                        "megatron-core's router does not compute: top-1 routing is supported with the chosen "
                        "expert's probability as its weight (norm_topk_prob false) only")


def _cuda_graph_default(config_cls) -> dict:
    """The whole layer as CUDA-graph scope, spelled as megatron-core now asks: its default "full" warns
    that it is deprecated ("use empty ..."), and ``[]`` means the same. The field is ``cuda_graph_scope``
    in 0.16 and ``cuda_graph_modules`` in 0.19 (where the old name is itself deprecated)."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    field = "cuda_graph_modules" if "cuda_graph_modules" in names else "cuda_graph_scope"
    return {field: []}


def layer_spec(arch: Arch, config, use_te: bool | None = None, vp_stage: int | None = None,
               core_attention: str | None = None, *, family_spec: bool = True):
    """The layer spec of every decoder layer, or, for an MoE model with dense layers, this pipeline
    stage's block of per-layer specs (megatron-core's ``moe_layer_freq`` pattern picks each one).

    ``core_attention``: the local spec's core attention, "unfused" or "sdpa" (None: this machine's
    default, ``models/blocks/core_attention.py``); the TE spec brings its own. A family whose layers need modules
    of their own builds its spec itself (``ModelFamily.layer_spec``, starting from this standard one with
    ``family_spec=False`` where it wants)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec, get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    use_te = te_available() if use_te is None else use_te
    own = get_family(arch.family).layer_spec
    if family_spec and own is not None:
        return own(arch, config, use_te, vp_stage, core_attention)
    mla = bool(config.multi_latent_attention)
    if arch.is_moe and arch.dense_layers:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                           vp_stage=vp_stage)
        if not use_te:
            block.layer_specs = [_local_layer(s, _is_moe_spec(s), mla, config, core_attention)
                                 for s in block.layer_specs]
        return block
    experts = arch.num_experts or None
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                                          qk_layernorm=config.qk_layernorm, multi_latent_attention=mla)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm,
                                    multi_latent_attention=mla, normalization="RMSNorm")
    return _local_layer(spec, arch.is_moe, mla, config, core_attention)


def _local_layer(spec, moe: bool, mla: bool, config, core_attention: str | None):
    """A local layer spec made to keep TE's checkpoint names, with the core attention asked for (for
    multi-latent attention one that takes MLA's key/value head sizes: megatron-core 0.16's local one
    refuses them).

    Without a query LoRA (``q_lora_rank`` None, as DeepSeek-V2-Lite) there is no query norm: 0.16 skips
    the spec's ``q_layernorm`` then, 0.19 refuses a spec that names one, so it is left out, and the
    attention module builds the spec's plain projections (``LocalMLASelfAttention``)."""
    spec = _with_te_checkpoint_names(spec, moe, mla)
    attention = spec.submodules.self_attention
    submodules = dataclasses.replace(attention.submodules,
                                     core_attention=core_attention_class(core_attention, mla))
    if mla:
        from megatron_patch.models.blocks.local_attention import LatentRMSNorm, LocalMLASelfAttention

        # transformers' latent norms keep epsilon 1e-6 whatever rms_norm_eps says (Moonlight, GLM-5: 1e-5)
        submodules = dataclasses.replace(submodules, q_layernorm=LatentRMSNorm, kv_layernorm=LatentRMSNorm)
    if mla:  # the RoPE key's gradients summed over TP (RopeKeyGradsSummed)
        attention = dataclasses.replace(attention, module=LocalMLASelfAttention)
    if mla and config.q_lora_rank is None:
        submodules = dataclasses.replace(submodules, q_layernorm=None)
    attention = dataclasses.replace(attention, submodules=submodules)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attention))


def _is_moe_spec(spec) -> bool:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    built = _mlp_builder(spec.submodules.mlp)
    return isinstance(built, type) and issubclass(built, MoELayer)


def _mlp_builder(mlp):
    """What a layer spec's MLP entry builds: a ModuleSpec's module (megatron-core 0.16), or the callable of
    the ``functools.partial`` that 0.19's spec functions return instead."""
    return mlp.func if isinstance(mlp, functools.partial) else mlp.module


def _with_te_checkpoint_names(spec, moe: bool, mla: bool):
    """A local layer spec whose torch_dist keys are the TE spec's, so checkpoints cross specs.

    megatron-core's local spec maps the input and pre-MLP norms to TE's fused names for standard
    attention, but also the pre-MLP norm of MoE layers (TE keeps ``pre_mlp_layernorm`` there), and
    maps nothing for multi-latent attention (TE fuses its latent norms into the up projections).
    """
    if mla:
        keys = {"self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}
        if not moe:
            keys["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    else:
        keys = {k: v for k, v in spec.submodules.sharded_state_dict_keys_map.items()
                if not (moe and k.startswith("pre_mlp"))}
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, sharded_state_dict_keys_map=keys))


def build_model(arch: Arch, layout: ParallelLayout, dtype: torch.dtype = torch.float32, *,
                use_te: bool | None = None, pre_process: bool | None = None, post_process: bool | None = None,
                pp_first_stage_layers: int | None = None, vp_stage: int | None = None,
                core_attention: str | None = None, **config_overrides):
    """This rank's GPTModel (stage taken from parallel_state unless given).

    With a virtual pipeline (``layout.vp``), each pipeline rank holds ``vp`` model chunks; ``vp_stage``
    (0..vp-1) picks which one this call builds. megatron-core places the layers: chunk ``v`` of
    pipeline rank ``r`` holds global layers ``(v*pp + r) * L/(pp*vp)`` onwards, and its sharded state
    dict names them by those global numbers, so torch_dist checkpoints load into chunks unchanged.
    ``core_attention``: "unfused" or "sdpa" on the local spec (None: this machine's default).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if layout.vp is not None:
        if vp_stage is None or not 0 <= vp_stage < layout.vp:
            raise ValueError(f"{layout}: build_model needs vp_stage in 0..{layout.vp - 1}, got {vp_stage}")
    elif vp_stage not in (None, 0):
        raise ValueError(f"vp_stage={vp_stage} without a virtual pipeline in {layout}")
    config = transformer_config(arch, layout, dtype, pp_first_stage_layers, use_te=use_te, **config_overrides)
    virtual = layout.vp is not None
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=not virtual, vp_stage=vp_stage)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=not virtual, vp_stage=vp_stage)
    spec = layer_spec(arch, config, use_te, vp_stage if virtual else None, core_attention)
    mtp_spec = None
    if arch.mtp_layers and post_process:  # megatron-core keeps the MTP block on the last stage
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        te = te_available() if use_te is None else use_te
        own = get_family(arch.family).mtp_block_spec
        mtp_spec = own(arch, config, spec, te, vp_stage if virtual else None) if own else \
            get_gpt_mtp_block_spec(config, spec, use_transformer_engine=te, vp_stage=vp_stage if virtual else None)
    model = GPTModel(
        config,
        spec,
        vocab_size=arch.padded_vocab_size(),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
        rotary_percent=arch.rotary_percent,
        vp_stage=vp_stage if virtual else None,
        mtp_block_spec=mtp_spec,
    )
    rope.install(model, arch)
    _mark_head_split_sinks(model)
    _unmark_expert_biases(model, layout)
    finish = get_family(arch.family).finish_model
    if finish is not None:  # the model-level pieces the family owns (family.py)
        finish(model, arch)
    cast_parameters([model], dtype)  # the local spec's torch norms ignore params_dtype
    return model


def _mark_head_split_sinks(model) -> None:
    """megatron-core's learnable attention sinks (``softmax_offset``, gpt-oss) hold each TP rank's own heads' but
    are not marked TP-split: the gradient norm that clipping uses counted rank 0's only (at TP=2 the logged grad
    norm and the clip differed from TP=1's)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes  # as GPTModel is

    for module in model.modules():
        sinks = getattr(module, "softmax_offset", None)
        if isinstance(sinks, torch.nn.Parameter) and not getattr(sinks, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(sinks, is_parallel=True, dim=0, stride=1)


def _unmark_expert_biases(model, layout: ParallelLayout) -> None:
    """megatron-core's row-parallel linear marks its bias sequence-parallel whatever it belongs to, so an expert's
    output bias (gpt-oss, whose biased experts split only at ETP=1) was summed over the TP group by the finalize
    step: at TP=2 the two ranks hold other experts, and each expert's bias gradient got the other rank's expert's
    added (100% off); an expert's gradient is complete on its rank (its tokens come to it), or DDP's to sum over
    expert data parallelism. Unmarked, the bias was then a TP duplicate to the gradient norm, counted on TP rank 0
    only: at ETP=1 no expert tensor has a copy within its expert-TP group, so it is marked TP-split (never
    gathered: megatron-core's expert checkpoints name each expert's axes themselves)."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes  # as GPTModel is

    for name, param in model.named_parameters():
        if ".mlp.experts." not in f".{name}":
            continue
        if getattr(param, "sequence_parallel", False):
            param.sequence_parallel = False
        if layout.expert_tp == 1 and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)


def build_model_chunks(arch: Arch, layout: ParallelLayout, dtype: torch.dtype = torch.float32, **kwargs) -> list:
    """This rank's model chunks: one GPTModel per virtual pipeline stage (a list of one without VP)."""
    if layout.vp is None:
        return [build_model(arch, layout, dtype, **kwargs)]
    return [build_model(arch, layout, dtype, vp_stage=v, **kwargs) for v in range(layout.vp)]


def pipeline_batch_factor(model) -> int:
    """How many rows per sample the tensor a pipeline stage sends holds in its batch dimension: 1, or what the
    family's ``finish_model`` set on the model (DeepSeek-V4 folds its hyper-connection streams into the batch:
    [s, b * hc_mult, h]). megatron-core sizes its stage-to-stage buffers from micro_batch_size alone, so the
    schedule is given micro_batch_size times this. ``model``: a chunk, wrapped (DDP, Float16Module) or not."""
    while model is not None:
        if "pipeline_batch_factor" in vars(model):
            return int(vars(model)["pipeline_batch_factor"])
        model = getattr(model, "module", None)
    return 1


def model_spec_name(model) -> str:
    """"te" or "local": which naming this model's state dict uses."""
    return "te" if any("layer_norm_weight" in k for k in model.state_dict()) else "local"

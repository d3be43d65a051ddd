"""What a ``RunConfig`` becomes in megatron-core: TransformerConfig overrides, DDP, optimizer and scheduler
settings, each flag's translation in one place (the dry run prints it; the trainer builds from it)."""

from __future__ import annotations

from megatron_patch.models.description.registry import has_load_balancing_loss
from megatron_patch.runtime.machine import Capabilities
from megatron_patch.training import fp8_run, lora_run, sparse_attention_run
from megatron_patch.training.launcher_args import get_launcher
from megatron_patch.training.run_config import RunConfig

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# processes that import this module without building a megatron-core model (align's main process, the
# launcher's dry run and resume checks) do not pay for it.


def fusion_overrides(enabled: bool | None) -> dict:
    """TransformerConfig fields for MP_COMPILE_FUSIONS (None: megatron-core's defaults, set by the builder;
    models/blocks/compiled_fusions.py compiles the rest)."""
    if enabled is None:
        return {}
    return {"bias_activation_fusion": enabled, "bias_dropout_fusion": enabled}


def as_megatron_takes_it(transformer_config: dict) -> dict:
    """The TransformerConfig overrides with the attention backend as megatron-core's enum: the settings keep its
    name, so that the dry run prints them without importing megatron-core."""
    from megatron.core.transformer.enums import AttnBackend

    name = transformer_config.get("attention_backend")
    return transformer_config if name is None else transformer_config | {"attention_backend": AttnBackend[name]}


def megatron_settings(cfg: RunConfig, fp8_implementation: str | None = None) -> dict:
    """TransformerConfig overrides, DDP and optimizer settings: what each flag becomes. ``fp8_implementation``: who
    runs PR=fp8 (training/fp8_run.py; None: what this machine would run): transformer-engine's FP8 is a
    TransformerConfig setting, torchao's a change to the built model (models/blocks/float8.py)."""
    gpu = cfg.device == "cuda"
    tc: dict = {"sequence_parallel": cfg.sequence_parallel, "tp_comm_overlap": cfg.tp_comm_overlap}
    if gpu:
        # A stage's output, once sent on, is freed but for its autograd graph (Megatron-LM's default). Not
        # on gloo: its asynchronous sends read the buffer later (PP=2 x VP=2 then trained on garbage).
        tc["deallocate_pipeline_outputs"] = True
    if not gpu:
        # the local spec; FL=true picks its SDPA core attention (machine_checks.core_attention), not TE's
        tc["attention_backend"] = "local"
    elif cfg.flash_attention:
        tc["attention_backend"] = "flash"
    elif not cfg.precision.mixed:
        # transformer-engine's fused (cuDNN) and flash kernels have no fp32 path; auto lets TE take its unfused one.
        tc["attention_backend"] = "auto"
    else:
        tc["attention_backend"] = "fused"
    tc.update(fusion_overrides(cfg.compile_fusions))
    tc.update(sparse_attention_run.config_overrides(cfg))
    tc.update(lora_run.config_overrides(cfg))
    if cfg.precision.fp8 and fp8_implementation is None:
        fp8_implementation = fp8_run.implementation(cfg, Capabilities.detect())
    if cfg.precision.fp8 and fp8_implementation == fp8_run.TRANSFORMER_ENGINE:
        recipe = fp8_run.recipe(cfg, fp8_implementation)
        tc.update(fp8="hybrid", fp8_recipe=recipe, fp8_amax_history_len=1024 if recipe == "delayed" else 1,
                  fp8_amax_compute_algo="max" if recipe == "delayed" else "most_recent")
        if cfg.arch.is_moe:
            # Each expert's token count varies per step; pad it so its FP8 GEMM rows divide.
            tc["moe_router_padding_for_quantization"] = True
    if has_load_balancing_loss(cfg.arch):
        tc["moe_aux_loss_coeff"] = moe_aux_loss_coeff(cfg)
        if (balancing := get_launcher(cfg.launcher).moe_balancing(cfg.arch.family)) is not None:
            tc["moe_router_load_balancing_type"] = balancing  # Pai's Qwen2-MoE script balances per sequence
    if cfg.activation_checkpointing == "sel":
        tc.update(recompute_granularity="selective")
    elif cfg.activation_checkpointing == "full":
        tc.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=cfg.ac_layers)
    elif cfg.activation_checkpointing == "offload":
        tc.update(cpu_offloading=True, cpu_offloading_num_layers=cfg.ac_layers, cpu_offloading_activations=True,
                  cpu_offloading_weights=False)
    if cfg.virtual_pipeline:
        tc["virtual_pipeline_model_parallel_size"] = cfg.virtual_pipeline
        # Megatron-LM's interleaved defaults: overlapped, unbatched p2p. With batched p2p at PP=2 the
        # forward and backward receives from the one peer go out in one batch; on gloo that gave wrong
        # losses (no error). Unbatched p2p at PP=2 sends the two directions over different groups.
        tc.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    ddp = {"use_distributed_optimizer": cfg.distributed_optimizer, "overlap_grad_reduce": cfg.overlap_grad_reduce,
           "overlap_param_gather": cfg.overlap_param_gather, "grad_reduce_in_fp32": cfg.precision.mixed}
    optim = {"optimizer": "adam", "lr": cfg.lr, "min_lr": cfg.min_lr, "weight_decay": cfg.weight_decay,
             "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8, "clip_grad": 1.0,
             "bf16": cfg.precision.bf16, "fp16": cfg.precision.fp16,
             "use_distributed_optimizer": cfg.distributed_optimizer,
             "overlap_param_gather": cfg.overlap_param_gather}
    if cfg.precision.fp16:  # its dynamic loss scale
        optim.update(initial_loss_scale=2.0 ** 16, loss_scale_window=cfg.loss_scale_window, hysteresis=2,
                     min_loss_scale=1.0)
    # OptimizerParamScheduler's keywords. It sets the optimizer's weight decay every step: constant, the same value.
    sched = {"lr_warmup_steps": cfg.warmup_iters, "lr_decay_steps": cfg.lr_decay_iters, "lr_decay_style": "cosine",
             "init_lr": 0.0, "max_lr": cfg.lr, "min_lr": cfg.min_lr, "start_wd": cfg.weight_decay,
             "end_wd": cfg.weight_decay, "wd_incr_steps": cfg.train_iters, "wd_incr_style": "constant",
             # on resume, these settings rule and the checkpoint gives the step (the launcher notes a change):
             # megatron-core's default kept the checkpoint's silently, whatever the launch and its dry run said
             "use_checkpoint_opt_param_scheduler": False, "override_opt_param_scheduler": True}
    offload = {"policy": cfg.optimizer_offload_policy, "numerics": cfg.offload_numerics}
    if cfg.optimizer_offload_policy == "static":
        offload["host_share"] = cfg.optimizer_offload_fraction
    if cfg.optimizer_offload_policy == "auto":
        offload.update(margin_gb=cfg.offload_margin_gb, patience=cfg.offload_patience, cooldown=cfg.offload_cooldown)
    return {"transformer_config": tc, "ddp": ddp, "optimizer": optim, "scheduler": sched, "offload": offload,
            "num_microbatches": cfg.num_microbatches, "data_parallel_size": cfg.data_parallel_size,
            "pp_first_stage_layers": cfg.pp0_layers}


def moe_balancing(cfg: RunConfig) -> dict | None:
    """The experts' load balancing a run trains with, as its train state records it (``run_state.training_rules``):
    the coefficient, and the balancing type the launcher gives megatron-core (None: the family's own); None for a
    model without a load-balancing loss."""
    if not has_load_balancing_loss(cfg.arch):
        return None
    return {"coeff": moe_aux_loss_coeff(cfg), "type": get_launcher(cfg.launcher).moe_balancing(cfg.arch.family)}


# What most of Pai-Megatron-Patch's MoE launchers pass as --moe-aux-loss-coeff (Qwen's, DeepSeek-V3's).
PAI_MOE_AUX_LOSS = 0.001


def moe_aux_loss_coeff(cfg: RunConfig) -> float:
    """MP_MOE_AUX_LOSS, else what Pai's script passes where the launch is Pai's script for the family (its Mistral
    script 0.01 for Mixtral; its dense Qwen2 script none for its MoE size), else config.json's router_aux_loss_coef
    where transformers trains with it (its output_router_logits is true), else Pai's usual 0.001. config.json's
    coefficient alone was used: gpt-oss trained with 0.9, which transformers never adds (output_router_logits false)."""
    if cfg.moe_aux_loss is not None:
        return cfg.moe_aux_loss
    launcher = get_launcher(cfg.launcher)
    if (said := launcher.moe_aux_loss(cfg.arch.family)) is not None:
        return said
    if cfg.arch.hf_config.get("output_router_logits") and not launcher.trains_as_pai(cfg.arch.family):
        return cfg.arch.router_aux_loss_coef
    return PAI_MOE_AUX_LOSS

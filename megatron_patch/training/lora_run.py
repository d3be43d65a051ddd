"""LoRA in a training run: the MP_LORA_* options (launcher_options.py) made a ``LoraSpec`` (before any process starts), and on
each rank the base loaded and frozen, the adapters attached and started (fresh as peft starts them, from
a peft folder, or from a checkpoint that carries adapters).

Where the base comes from: PRETRAIN_CHECKPOINT_PATH, which a LoRA run needs (a converted checkpoint; or a
LoRA run's ``final/``, whose adapters then continue on the base it names). Checkpoints of the run hold only
the adapters, any modules_to_save weights and their optimizer state; their sidecar names the base by path
and digest (``lora.state``), so a resume or an export checks it is the same base.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from megatron_patch.checkpoint.arch_source import open_checkpoint
from megatron_patch.checkpoint.foreign import find_checkpoint
from megatron_patch.checkpoint.sidecar import read_sidecar
from megatron_patch.errors import UserError
from megatron_patch.lora.peft_io import read_peft_adapter
from megatron_patch.lora.plan import (COLUMN, ROW, check_targets, family_targets, plan_sites, rank_adapter_params,
                                     site_split, split_mode)
from megatron_patch.lora.saved import saved_mcore_names, saved_rules
from megatron_patch.lora.sources import add_adapters, open_adapters
from megatron_patch.lora.spec import DEFAULT_TARGETS, LoraSpec
from megatron_patch.lora.state import find_base
from megatron_patch.models.shape.model_shape import chunk_layers

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.
# So are blocks.builder and lora.layers, which import torch at their top.

def lora_from_options(options, arch, checkpoint: str | None) -> tuple[dict | None, str | None]:
    """(the LoRA spec as a dict, or None for full fine-tuning; the MP_LORA_INIT folder or None), from the LoRA
    part's options (``launcher_options.Options``).

    MP_LORA_RANK=R turns LoRA on (0: off), MP_LORA_ALPHA (default R), MP_LORA_DROPOUT (default 0),
    MP_LORA_TARGETS (default LoraSpec's). MP_LORA_INIT=PEFT_DIR starts from a peft adapter, whose config then
    decides rank, alpha, dropout and targets (an MP_LORA_* value that disagrees is refused). A
    PRETRAIN_CHECKPOINT_PATH that carries adapters (hf2mcore --peft-dir, a LoRA run's final/) starts from
    those the same way."""
    init, rank = options["MP_LORA_INIT"], options["MP_LORA_RANK"]
    alpha, dropout, targets = options["MP_LORA_ALPHA"], options["MP_LORA_DROPOUT"], options["MP_LORA_TARGETS"]
    given = [k for k in ("MP_LORA_ALPHA", "MP_LORA_DROPOUT", "MP_LORA_TARGETS") if options.given(k)]
    carried = _checkpoint_lora(checkpoint)
    if rank == 0 and init is None and carried is None:
        if given:
            raise UserError(f"{given[0]} configures LoRA, which is off: set MP_LORA_RANK=R (or MP_LORA_INIT=PEFT_DIR)")
        return None, None
    if init is not None and carried is not None:
        raise UserError(f"MP_LORA_INIT={init} and PRETRAIN_CHECKPOINT_PATH={checkpoint}, which carries adapters of its "
                        "own: start from one of them")
    if rank == 0 and options.given("MP_LORA_RANK"):  # an explicit 0 asks for full fine-tuning: not the adapter's
        source = f"MP_LORA_INIT={init}" if init is not None else f"PRETRAIN_CHECKPOINT_PATH={checkpoint}"
        raise UserError(f"MP_LORA_RANK=0 asks for full fine-tuning, and {source} starts from a LoRA adapter: leave "
                        "MP_LORA_RANK unset to continue the adapter" + (", or unset MP_LORA_INIT" if init else ""))
    if init is not None or carried is not None:
        if init is not None:
            spec = read_peft_adapter(init, arch)[0]
            source = f"MP_LORA_INIT={init}"
        else:
            spec, source = carried, f"PRETRAIN_CHECKPOINT_PATH={checkpoint}"
        asked = {"MP_LORA_RANK": (rank or None, spec.rank), "MP_LORA_ALPHA": (alpha, spec.alpha),
                 "MP_LORA_TARGETS": (targets, spec.targets)}
        for name, (value, have) in asked.items():
            # the same targets in another order are the same adapters (the lora audit: refused)
            same = value is not None and (set(value) == set(have) if name == "MP_LORA_TARGETS" else value == have)
            if value is not None and not same:
                shown = ",".join(have) if isinstance(have, tuple) else f"{have:g}"
                raise UserError(f"{name}={options.raw(name)} disagrees with the adapter of {source} ({shown}): leave "
                                f"{name} unset to continue that adapter")
        if dropout is not None:
            spec = dataclasses.replace(spec, dropout=dropout)  # dropout changes training, not the function
        return spec.to_dict(), init
    spec = LoraSpec(rank=rank, alpha=float(rank) if alpha is None else alpha, dropout=dropout or 0.0,
                    targets=targets or default_targets(arch))
    return spec.to_dict(), None


def default_targets(arch) -> tuple[str, ...]:
    """What LoRA adapts where MP_LORA_TARGETS is unset: the default targets (attention and dense MLP) the family has;
    an MoE family without dense MLPs gets its attention's (its experts only where asked for). The default was taken
    as asked, and refused as targets the model lacks."""
    have = family_targets(arch)
    return tuple(t for t in DEFAULT_TARGETS if t in have)


def _checkpoint_lora(checkpoint: str | None) -> LoraSpec | None:
    """The spec of the adapters a starting checkpoint carries (its sidecar's ``lora``), or None."""
    if checkpoint is None:
        return None

    try:
        found = find_checkpoint(checkpoint)
    except UserError:
        return None  # the launcher's own checks say what is wrong with it
    sidecar = found.sidecar if found.sidecar_dir is not None else None
    if sidecar is None or not sidecar.lora:
        return None
    return LoraSpec.from_dict(sidecar.lora["spec"])


def config_overrides(cfg) -> dict:
    """TransformerConfig fields of a LoRA run. The base is frozen, and so are the routers' expert biases (DeepSeek-V3's
    e_score_correction_bias: buffers megatron-core moves by the experts' load after every step): a run's checkpoints
    hold only the adapters, so a moved bias was lost at each resume and export, and the adapters were trained under
    another routing than the one they ship with. peft leaves the bias as it is too. Rate 0: sign(load) * 0 leaves
    each bit."""
    return {"moe_router_bias_update_rate": 0.0} if cfg.lora is not None and cfg.arch.is_moe else {}


def check_lora(cfg) -> None:
    """What a LoRA run needs besides its spec: targets the family has. With PR=fp8 the frozen base's GEMMs run in
    FP8 (transformer-engine's, or torchao's inside megatron-core's linears, whose frozen weights get no gradient
    GEMM) and the adapters beside them in bf16: nothing more to check."""
    if cfg.lora is None:
        return

    check_targets(cfg.arch, tuple(cfg.lora["targets"]))
    spec = LoraSpec.from_dict(cfg.lora)
    if spec.modules_to_save:
        saved_rules(cfg.arch, spec.modules_to_save)
        if cfg.virtual_pipeline:
            raise UserError("an adapter with modules_to_save cannot start under a virtual pipeline (MP_VP, MP_VP_CHUNKS) "
                            "yet: train it without one")


def check_lora_launch(cfg, resumed: Path | None) -> None:
    """Before a LoRA run starts (a dry run plans one without weights): the base checkpoint is given, and a
    run that resumes (from the iteration folder ``resumed``) trains on the base its checkpoints name."""
    if cfg.lora is None:
        return
    if cfg.pretrain_checkpoint is None:
        raise UserError("LoRA trains adapters on a base model: give its converted checkpoint as "
                        "PRETRAIN_CHECKPOINT_PATH (mpatch convert hf2mcore)")
    if resumed is None:
        cfg_base(cfg)  # a LoRA export given to continue from names its base: moved, refused here, not by the ranks
        return
    folder = resumed
    lora = read_sidecar(folder, release=False).lora
    if not lora:
        raise UserError(f"{folder} is a full fine-tuning checkpoint and this is a LoRA run: choose another "
                        "OUTPUT_BASEPATH, or drop the MP_LORA_* settings to resume it")
    find_base(lora["base"], cfg_base(cfg), f"the run in {cfg.output_basepath}", "PRETRAIN_CHECKPOINT_PATH")


def cfg_base(cfg) -> Path:
    """The base weights' checkpoint: PRETRAIN_CHECKPOINT_PATH, or the base a LoRA export there names."""
    sidecar = open_checkpoint(cfg.pretrain_checkpoint, verify=not cfg.no_verify).sidecar
    lora = sidecar.lora or {}
    if lora.get("base"):
        # no launcher option names another base: the record's own place is the way on (find_base says so)
        return find_base(lora["base"], None, cfg.pretrain_checkpoint, None)
    return Path(cfg.pretrain_checkpoint)


# --- on each rank --------------------------------------------------------------------------------------------

def setup_lora(cfg, chunks: list, base: Path, resuming: bool, log) -> list:
    """Freeze the base (loaded from ``base``, ``cfg_base``), attach the adapters and start them; returns each
    chunk's container."""
    from megatron_patch.lora.layers import attach
    spec = LoraSpec.from_dict(cfg.lora)
    arch = cfg.arch
    starting = None
    if not resuming and cfg.lora_init is not None:
        starting = open_adapters(cfg.lora_init, arch, not cfg.no_verify)
    elif not resuming and open_checkpoint(cfg.pretrain_checkpoint, verify=not cfg.no_verify).sidecar.lora:
        starting = open_adapters(cfg.pretrain_checkpoint, arch, not cfg.no_verify)
    if starting is not None:
        starting.spec = spec  # MP_LORA_DROPOUT may differ; the rest was checked to agree
        containers = add_adapters(chunks, arch, starting, cfg.layout, cfg.precision.dtype)
        source = starting.source
    else:
        containers = attach(chunks, arch, spec, plan_sites(arch, spec), cfg.precision.dtype)
        if not resuming:
            for container in containers:
                for sa in container.sites:
                    sa.init_fresh(cfg.seed)
        source = "the checkpoint being resumed" if resuming else "peft's initialisation (A kaiming-uniform, B zero)"
    biased = any(c.config.moe_router_enable_expert_bias for c in chunks)  # held still by config_overrides
    frozen = "frozen, the routers' expert bias too" if biased else "frozen"
    log(f"LoRA ({spec.describe()}): base weights from {base}, {frozen}; adapters from {source}")
    return containers


def describe_trainable(chunks: list) -> str:
    """One line: this rank's trainable and frozen parameters."""
    trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
    frozen = sum(p.numel() for c in chunks for p in c.parameters() if not p.requires_grad)
    return (f"parameters on rank 0: {trainable:,} trainable, {frozen:,} frozen "
            f"({100 * trainable / max(trainable + frozen, 1):.2f}% trainable)")


def split_trainable(arch, cfg, chunks: list[list], pp_rank: int, spec_name: str) -> tuple[list[list], int]:
    """For the memory plan: each model chunk's trainable parameters of a rank (modules_to_save weights, then
    the adapters, as the chunk holds them) and the number of frozen elements."""

    spec = LoraSpec.from_dict(cfg.lora)
    sites = plan_sites(arch, spec)
    saved = saved_mcore_names(arch, spec.modules_to_save)
    out, frozen = [], 0
    for v, params in enumerate(chunks):
        layers = list(chunk_layers(arch, cfg.layout, pp_rank, v, cfg.pp0_layers))

        def global_name(name: str) -> str:
            m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", name)
            return f"decoder.layers.{layers[int(m.group(1))]}.{m.group(2)}" if m else name

        trainable = [p for p in params if global_name(p.name) in saved]
        frozen += sum(p.numel for p in params) - sum(p.numel for p in trainable)
        out.append(trainable + rank_adapter_params(sites, arch, cfg.layout, pp_rank, v, cfg.pp0_layers, spec_name))
    return out, frozen


def layer_adapters(arch, cfg, spec_name: str, layer: int | None = None) -> tuple:
    """For the memory plan's activations: the adapted linears of decoder layer ``layer`` (None: the first MoE
    layer of an MoE model, the layer the plan's formula stands for) on rank 0, as ``memory_plan.Shape.lora``
    describes them."""
    spec = LoraSpec.from_dict(cfg.lora)
    if layer is None:
        layer = next((i for i in range(arch.num_layers) if arch.is_moe_layer(i)), 0)
    per_rank = arch.num_experts // cfg.ep if arch.is_moe else 0
    out = []
    for s in plan_sites(arch, spec):
        if s.layer != layer or (s.expert is not None and s.expert >= per_rank):
            continue
        mode = split_mode(site_split(s, spec_name))
        n = (cfg.layout.expert_tp if s.expert is not None else cfg.tp) if mode in (COLUMN, ROW) else 1
        width = s.in_features // n if mode == ROW else s.in_features
        rows = sum(s.part_rows) // n if mode == COLUMN else sum(s.part_rows)
        # routed experts see their share of the top-k tokens; everything else every token
        fan = arch.moe_topk / arch.num_experts if s.expert is not None else 1
        out.append((s.target if s.expert is None else f"experts{s.expert}", mode, width,
                    sum(a.rank for a in s.adapters), rows, len(s.adapters), fan))
    return tuple(out)

"""A launch's arguments resolved into one ``RunConfig``, everything a launch can get wrong refused before any
process starts, in one line that says what to change.

``resolve`` reads each value (``launcher_args``: its type and allowed values), derives what follows from
them (the model's architecture, the processes, the iterations), then runs ``CHECKS``: the combinations
megatron-core would reject deep inside a rank, or silently ignore, as small named checks in a fixed
order. What this machine can do is ``machine_checks``'.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable

from megatron_patch.checkpoint.arch_source import open_checkpoint
from megatron_patch.checkpoint.sidecar import legacy_layout_problem
from megatron_patch.errors import UserError
from megatron_patch.input_files import what_is_at
from megatron_patch.models.description.arch import read_config_json, validate_layout
from megatron_patch.models.blocks.float8_plan import check_filter_kinds
from megatron_patch.models.description.registry import get_family, has_load_balancing_loss, parse_arch
from megatron_patch.outputs.folders import refuse_unexpanded_home
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.runtime.machine import experts_grouped_whenever_etp_differs, megatron_core_version, version_tuple
from megatron_patch.training.launcher_args import (
    MAX_ITERATIONS,
    MAX_TOKENS,
    Launcher,
    get_launcher,
    launched_rank,
    names_data,
    parse_count,
    parse_data_paths,
    parse_int,
)
from megatron_patch.training import evaluation_run
from megatron_patch.training.launcher_options import Options, read_options, unread_variables
from megatron_patch.training.lora_run import check_lora, lora_from_options
from megatron_patch.training.sparse_attention_run import check_sparse_attention, dsa_from_options
from megatron_patch.training.run_config import RunConfig, no_gpu_problem
from megatron_patch.training.run_folder import WRITTEN_FOLDERS, require_folder

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.


# The options that tune only OPTIMIZER_OFFLOAD=auto's policy: given with another policy, they would do nothing.
AUTO_OFFLOAD_OPTIONS = ("MP_OFFLOAD_MARGIN_GB", "MP_OFFLOAD_PATIENCE", "MP_OFFLOAD_COOLDOWN", "MP_OFFLOAD_PROBE_SCRIPT")


def resolve(launcher: str, argv: list[str], env: dict | None = None, *, check_paths: bool = True) -> RunConfig:
    """Parse and validate ``launcher``'s positional arguments (and the environment options in ``env``) into a
    RunConfig; ``check_paths``: also that the data, tokenizer and probe files exist."""
    env = dict(os.environ if env is None else env)
    cfg = _parse(get_launcher(launcher), argv, env)
    for check in CHECKS + (PATH_CHECKS if check_paths else ()):
        check(cfg)
    return cfg


def _parse(launcher: Launcher, argv: list[str], env: dict) -> RunConfig:
    """Each option read (``launcher_options``: its reader and default), then what follows from them, and the
    options whose mere presence matters checked against what they need."""
    o = read_options(launcher, argv, env)
    notes: list[str] = unread_variables(env)
    if o["SP"] and o["TP"] == 1:
        o["SP"] = False  # as Pai-Megatron-Patch's launchers: sequence parallelism splits over TP ranks, and there is one
        notes.append("SP=true at TP=1 is ignored: sequence parallelism splits activations over tensor-parallel ranks")
    if (o["OPTIMIZER_OFFLOAD"][1] != "off" or o["MP_OFFLOAD_NUMERICS"] == "exact") and not o["DO"]:
        o["DO"] = True
        notes.append("DO=true: forced by OPTIMIZER_OFFLOAD / MP_OFFLOAD_NUMERICS (the optimizer's chunks are the "
                     "distributed optimizer's bucket shards)")
    sft, precision = o["SFT"], o["PR"]
    dataset_type = o.settle("MP_DATASET_TYPE", sft=sft, dataset_path=o["DATASET_PATH"])
    o.settle("MP_SFT_LOSS", sft=sft)
    for name in ("MP_FP8_RECIPE", "MP_FP8_FILTER"):
        if o.given(name) and not precision.fp8:
            raise UserError(f"{name}={o.raw(name)} needs PR=fp8, got PR={precision}")
    if o["MP_COMPILE"] and o["MP_COMPILE_FUSIONS"]:
        raise UserError("MP_COMPILE=true compiles the layers, norms, RoPE and SwiGLU included: drop "
                        "MP_COMPILE_FUSIONS=true (the lighter option, for those pieces alone)")
    if o.given("MP_SFT_LOSS") and not sft:
        raise UserError(f"MP_SFT_LOSS={o.raw('MP_SFT_LOSS')} weighs SFT records, and this run is pretraining (SFT=false):"
                        " drop MP_SFT_LOSS (pretraining's loss is the token mean, as Pai's and Megatron-LM's)")
    if o.given("MP_LOSS_SCALE_WINDOW") and not precision.fp16:
        raise UserError(f"MP_LOSS_SCALE_WINDOW applies to PR=fp16's dynamic loss scale, and PR={precision}")
    for name in AUTO_OFFLOAD_OPTIONS:
        if o.given(name) and o["OPTIMIZER_OFFLOAD"][1] != "auto":
            raise UserError(f"{name} tunes OPTIMIZER_OFFLOAD=auto's decisions, and OPTIMIZER_OFFLOAD is "
                            f"{o.raw('OPTIMIZER_OFFLOAD') if o.given('OPTIMIZER_OFFLOAD') else 'off'}: set "
                            f"OPTIMIZER_OFFLOAD=auto or drop {name}")
    if o.given("MP_AC_LAYERS") and o["AC"] in ("sel", "none"):
        # a note, not a refusal: Pai-Megatron-Patch's launchers read MP_AC_LAYERS under AC=full/offload only, and an
        # environment that exports it for every run is theirs
        notes.append(f"MP_AC_LAYERS={o.raw('MP_AC_LAYERS')} is ignored: it counts the layers of AC=full or "
                     f"AC=offload, and AC={o['AC']}")
    o.settle("MP_TP_COMM_OVERLAP", tp=o["TP"], sp=o["SP"])
    if o["MP_OVERLAP_PARAM_GATHER"] and not o["DO"]:
        raise UserError("param-gather overlap needs the distributed optimizer: set DO=true")

    size, ckpt = o["MODEL_SIZE"], o["PRETRAIN_CHECKPOINT_PATH"]
    family, hf_config, vocab_padded_to, mtp_layers, tokenizer_home = _model_config(
        launcher, size, ckpt, o["MP_HF_CONFIG"], o["MP_NUM_LAYERS"])
    if mtp_layers:
        notes.append(f"{ckpt} holds {mtp_layers} multi-token-prediction layer(s) (converted with --mtp): they train "
                     "with the model, their loss logged as mtp_N loss")
    arch = parse_arch(hf_config)
    if o["ETP"] is not None and not arch.is_moe:
        # a launcher that takes dense and MoE sizes (Pai's Qwen3): ETP and EP mean nothing to a dense model, and Pai's
        # launcher passes them for its MoE sizes alone (the pai audit: EP=4 with 8B was refused)
        if o["ETP"] not in (1, o["TP"]):
            notes.append(f"ETP={o['ETP']} is ignored: {family} {size} is a dense model")
        if o["EP"] != 1:
            notes.append(f"EP={o['EP']} is ignored: {family} {size} is a dense model")
            o["EP"] = 1
        o["ETP"] = None
    vp, vp_setting = _virtual_pipeline(o, o["PP"], arch.num_layers, notes)
    layout = ParallelLayout(tp=o["TP"], pp=o["PP"], ep=o["EP"], etp=o["ETP"], cp=o["CP"], vp=vp)
    world, nproc, nnodes = _world(o, layout, env, notes)
    train_iters, warmup_iters = _iterations(o, sft, o["GLOBAL_BATCH_SIZE"] * o["SEQ_LEN"], notes)
    found = functools.partial(names_data, dataset_type=dataset_type)
    paths, weights = parse_data_paths("DATASET_PATH", o["DATASET_PATH"], found)
    valid, valid_weights = (None, None) if o["VALID_DATASET_PATH"] is None else \
        parse_data_paths("VALID_DATASET_PATH", o["VALID_DATASET_PATH"], found)
    for name, listed in (("DATASET_PATH", paths), ("VALID_DATASET_PATH", valid or [])):
        _refuse_data_listed_twice(name, listed, dataset_type)
    if o["MP_SPLIT"] is not None:
        # validation is DATASET_PATH's held-out share; Pai's launcher ignores VALID_DATASET_PATH with --split
        if sft:
            raise UserError("MP_SPLIT holds validation out of pretraining data: with SFT=true give the validation "
                            "records as VALID_DATASET_PATH and leave MP_SPLIT unset")
        if valid is not None and _blend(valid, valid_weights, dataset_type) != _blend(paths, weights, dataset_type):
            raise UserError(f"MP_SPLIT={o.raw('MP_SPLIT')} validates on a held-out share of DATASET_PATH, and "
                            "VALID_DATASET_PATH names other data: set VALID_DATASET_PATH to none (or to DATASET_PATH, "
                            "as Pai's README does), or leave MP_SPLIT unset to validate on it")
        valid, valid_weights = None, None
    elif valid is None and o.given("MP_EVAL_INTERVAL") and o["MP_EVAL_INTERVAL"]:
        notes.append(f"MP_EVAL_INTERVAL={o.raw('MP_EVAL_INTERVAL')} validates nothing: VALID_DATASET_PATH is none")
    elif valid is not None and set(_data_files(valid, dataset_type)) <= set(_data_files(paths, dataset_type)):
        # Pai's README line gives one prefix for both, and Pai's launcher holds out 1% of it (--split 99,1,0).
        # MP_SPLIT cuts pretraining data alone: SFT is refused it, so its note does not offer it (the paisft audit)
        notes.append("VALID_DATASET_PATH is training data (DATASET_PATH holds it): the validation loss is not "
                     "held out; give held-out records as VALID_DATASET_PATH" if sft else
                     "VALID_DATASET_PATH is training data (DATASET_PATH holds it): the validation loss is not "
                     "held out, where Pai's launcher would hold out 1% of the data; give a held-out set, or set "
                     "MP_SPLIT=99,1,0 to hold it out of DATASET_PATH as Pai does")
    # JSON records are tokenized here, by default with the checkpoint's tokenizer; an idxmap is already ids.
    o.settle("MP_TOKENIZER", sft=sft, dataset_type=dataset_type, checkpoint=tokenizer_home)
    o.settle("MP_WEIGHT_DECAY", family=family, launcher=launcher)
    evaluation_run.settle_options(o)

    cfg = RunConfig(
        **o.fields(), launcher=launcher.name, family=family, dataset_path=paths, dataset_weights=weights,
        valid_dataset_path=valid, valid_dataset_weights=valid_weights, train_iters=train_iters,
        warmup_iters=warmup_iters,
        # SFT's learning rate decays over the iterations after warm-up (as Pai-Megatron-Patch's launchers),
        # pretraining's over all of them
        lr_decay_iters=train_iters - warmup_iters if sft else train_iters,
        virtual_pipeline=vp, virtual_pipeline_setting=vp_setting, overlap_grad_reduce=True,
        # MP_OVERLAP_PARAM_GATHER=false turns it off under DO=true (it was read only when true: the rdoc audit)
        overlap_param_gather=bool(o["MP_OVERLAP_PARAM_GATHER"]) if o.given("MP_OVERLAP_PARAM_GATHER") else o["DO"],
        world_size=world, nproc_per_node=nproc, nnodes=nnodes,
        device=_device(o["ENV"]), hf_config=hf_config, vocab_padded_to=vocab_padded_to, mtp_layers=mtp_layers,
        notes=notes,
    )
    cfg.lora, cfg.lora_init = lora_from_options(o, cfg.arch, cfg.pretrain_checkpoint)
    cfg.dsa = dsa_from_options(o, cfg.arch)
    cfg.checkpoint_tokenizer = tokenizer_home
    return cfg


def _virtual_pipeline(o: Options, pp: int, num_layers: int, notes: list[str]) -> tuple[int | None, str | None]:
    """(model chunks per pipeline rank, the setting that asked for them) from MP_VP, layers per virtual stage as
    Pai-Megatron-Patch and Megatron-LM mean it (--num-layers-per-virtual-pipeline-stage), or MP_VP_CHUNKS."""
    layers, chunks = o["MP_VP"], o["MP_VP_CHUNKS"]
    if layers is not None and chunks is not None:
        raise UserError(f"MP_VP={layers} (layers per virtual pipeline stage) and MP_VP_CHUNKS={chunks} (chunks per "
                        "pipeline rank) both set the virtual pipeline: give one")
    if layers is not None:
        setting = f"MP_VP={layers}"
        if pp == 1:
            raise UserError(f"{setting} (layers per virtual pipeline stage) needs PP > 1")
        if num_layers % (pp * layers):
            raise UserError(f"{setting} (layers per virtual pipeline stage) with PP={pp} needs the {num_layers} layers "
                            f"to split into virtual stages of {layers} layers, PP*MP_VP={pp * layers} at a time")
        chunks = num_layers // (pp * layers)
    elif chunks is not None:
        setting = f"MP_VP_CHUNKS={chunks}"
    else:
        return None, None
    if chunks == 1:  # one chunk per rank is the plain pipeline schedule
        notes.append(f"{setting}: one model chunk per pipeline rank, i.e. no virtual pipeline")
        return None, None
    return chunks, f"{setting} ({chunks} model chunks per pipeline rank)" if setting.startswith("MP_VP=") else setting


def _iterations(o: Options, sft: bool, tokens_per_iter: int, notes: list[str]) -> tuple[int, int]:
    """(training, warm-up) iterations: tokens for pretraining, iterations for SFT (the reference's convention);
    each within its ceiling (``launcher_args.MAX_TOKENS``, ``MAX_ITERATIONS``). A token count that is not whole
    iterations is rounded down, as the reference does, with a note."""
    train_raw, warm_raw = o["TRAIN_TOKENS_OR_ITERS"], o["WARMUP_TOKENS_OR_ITERS"]
    if sft:
        train = parse_count("TRAIN_TOKENS_OR_ITERS", train_raw, MAX_ITERATIONS, "iterations")
        warmup = parse_count("WARMUP_TOKENS_OR_ITERS", warm_raw, MAX_ITERATIONS, "iterations")
    else:
        train_tokens = parse_count("TRAIN_TOKENS_OR_ITERS", train_raw, MAX_TOKENS, "tokens")
        warmup_tokens = parse_count("WARMUP_TOKENS_OR_ITERS", warm_raw, MAX_TOKENS, "tokens")
        train, warmup = train_tokens // tokens_per_iter, warmup_tokens // tokens_per_iter
        if train < 1:
            raise UserError(f"TRAIN_TOKENS_OR_ITERS={train_raw} tokens is less than one iteration "
                            f"(GLOBAL_BATCH_SIZE*SEQ_LEN = {tokens_per_iter} tokens): pretraining takes a token count")
        if train > MAX_ITERATIONS:
            raise UserError(f"TRAIN_TOKENS_OR_ITERS={train_raw} tokens make {train} iterations of GLOBAL_BATCH_SIZE*"
                            f"SEQ_LEN = {tokens_per_iter} tokens, and at most {MAX_ITERATIONS} iterations are taken "
                            "(docs/training.md): check the number, or raise the global batch")
        for name, raw, tokens, whole in (("TRAIN_TOKENS_OR_ITERS", train_raw, train_tokens, train),
                                         ("WARMUP_TOKENS_OR_ITERS", warm_raw, warmup_tokens, warmup)):
            if tokens != whole * tokens_per_iter:
                notes.append(f"{name}={raw} tokens is not a whole number of iterations of GLOBAL_BATCH_SIZE*SEQ_LEN "
                             f"= {tokens_per_iter} tokens: {whole} iteration(s), {whole * tokens_per_iter} tokens")
    if train < 1:
        raise UserError(f"TRAIN_TOKENS_OR_ITERS must give at least one iteration, got '{train_raw}'")
    return train, warmup


def _device(run_env: str) -> str:
    if run_env == "cpu":
        return "cpu"
    if run_env == "dlc":
        import torch  # only a dlc node asks: one without a GPU trains on its CPU

        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda"


# --- the combinations, in the order they are checked ---------------------------------------------------------

def learning_rates(cfg: RunConfig) -> None:
    if cfg.lr <= 0:
        raise UserError(f"LR must be > 0, got {cfg.lr:g}")
    if cfg.min_lr > cfg.lr:
        raise UserError(f"MIN_LR ({cfg.min_lr}) must not exceed LR ({cfg.lr})")


def offload_settings(cfg: RunConfig) -> None:
    if cfg.offload_chunk_mb is not None and cfg.offload_chunk_mb <= 0:
        raise UserError("MP_OFFLOAD_CHUNK_MB must be > 0")
    if cfg.gpu_memory_gb is not None and cfg.gpu_memory_gb <= 0:
        raise UserError("MP_GPU_MEMORY_GB must be > 0")


def data_kind(cfg: RunConfig) -> None:
    if cfg.dataset_type == "raw" and not cfg.sft:
        raise UserError("MP_DATASET_TYPE=raw (JSON data) is for SFT: set SFT=true, or give mmap data for pretraining")


def sequence_parallelism(cfg: RunConfig) -> None:
    if cfg.tp_comm_overlap and not cfg.sequence_parallel:
        raise UserError("TP communication overlap needs sequence parallelism: set SP=true (with TP > 1) "
                        "or MP_TP_COMM_OVERLAP=false")


def activation_checkpointing_mode(cfg: RunConfig) -> None:
    if cfg.activation_checkpointing in ("full", "offload") and cfg.ac_layers < 1:
        raise UserError("MP_AC_LAYERS must be >= 1")
    if cfg.activation_checkpointing == "offload" and cfg.pp > 1:
        raise UserError(f"AC=offload (activation CPU offloading) does not work with pipeline parallelism in "
                        f"megatron-core: set PP=1 or AC=sel/full (PP={cfg.pp})")


def packing_and_context_parallelism(cfg: RunConfig) -> None:
    own = cfg.arch.family_config is not None and not cfg.arch.family_config.core_attention
    if cfg.sft_packing and own:
        # packed documents are kept apart by megatron-core's core attention (training/packing.py), which it has none of
        raise UserError(f"MP_SFT_PACKING=true: {cfg.arch.family}'s attention computes its own scores and does not "
                        "keep packed documents apart: drop MP_SFT_PACKING")
    if cfg.sft_packing and cfg.arch.linear_attention is not None:
        # a Gated DeltaNet's recurrent state would run on from one packed document into the next
        raise UserError(f"MP_SFT_PACKING=true: {cfg.arch.family}'s Gated DeltaNet (linear attention) layers run "
                        "unpacked sequences only here: drop MP_SFT_PACKING")
    if cfg.sft_packing and cfg.cp > 1:
        raise UserError(f"MP_SFT_PACKING=true with CP={cfg.cp} is not supported (packed sequences would need "
                        "per-document context-parallel partitioning): set CP=1 or drop MP_SFT_PACKING")


def pipeline_split(cfg: RunConfig) -> None:
    vp, pp0 = cfg.virtual_pipeline, cfg.pp0_layers
    if vp is not None and cfg.pp == 1:
        raise UserError(f"{cfg.virtual_pipeline_setting} (virtual pipeline) needs PP > 1")
    if pp0 is not None and cfg.pp == 1:
        raise UserError(f"MP_PP0_LAYERS={pp0} (uneven first stage) needs PP > 1")
    if vp is not None and pp0 is not None:
        raise UserError(f"{cfg.virtual_pipeline_setting.split('=')[0]} and MP_PP0_LAYERS cannot be combined: choose "
                        "one way to split the pipeline")


def sample_lengths(cfg: RunConfig) -> None:
    if cfg.sft and cfg.dataset_type == "raw" and cfg.pad_len > cfg.seq_len:
        raise UserError(f"PAD_LEN ({cfg.pad_len}) must not exceed SEQ_LEN ({cfg.seq_len})")


def model_layout(cfg: RunConfig) -> None:
    """The model splits over TP/PP/EP/ETP/VP as asked."""
    arch = cfg.arch
    validate_layout(arch, cfg.layout, pp_first_stage_layers=cfg.pp0_layers)
    vp, pp = cfg.virtual_pipeline, cfg.pp
    if vp is not None and arch.num_layers % (pp * vp):
        raise UserError(f"{cfg.virtual_pipeline_setting} with PP={pp} needs the {arch.num_layers} layers to split into "
                        f"PP*VP={pp * vp} equal chunks")
    if arch.is_moe and cfg.tp > 1 and not cfg.sequence_parallel:
        # megatron-core's MoE layer refuses to train under TP without it (deep in the first forward)
        raise UserError("a MoE model trained with TP > 1 needs sequence parallelism: set SP=true")


def _length(cfg: RunConfig) -> tuple[str, int]:
    return cfg.sample_length_name, cfg.sample_length


def sequence_splits(cfg: RunConfig) -> None:
    """The sequence divides over SP's TP ranks and CP's 2*CP chunks."""
    length_name, length = _length(cfg)
    tp, cp = cfg.tp, cfg.cp
    if cfg.sequence_parallel and length % tp:
        raise UserError(f"SP=true splits the sequence over TP={tp}: {length_name} ({length}) must be a multiple of {tp}")
    if cp > 1 and length % (2 * cp):
        # Each CP rank takes two of 2*CP equal chunks (one early, one late) to balance causal attention.
        raise UserError(f"CP={cp} splits the sequence into 2*CP={2 * cp} chunks: {length_name} ({length}) must be a "
                        f"multiple of {2 * cp}")


def recompute_blocks(cfg: RunConfig) -> None:
    """What megatron-core would reject (or crash on) only after every rank has started."""
    ac, ac_layers, num_layers = cfg.activation_checkpointing, cfg.ac_layers, cfg.arch.num_layers
    if ac in ("sel", "full"):
        family, release = get_family(cfg.arch.family), version_tuple(megatron_core_version())
        why = family.recompute_refused(cfg.arch, ac, release)
        if why is not None:
            raise UserError(f"AC={ac}: {why}")
        if ac == "sel" and cfg.arch.family_config is not None and not cfg.arch.family_config.core_attention:
            # selective recompute is megatron-core's core attention's, which such a layer never calls: the run
            # recomputed nothing while the memory plan counted what recompute saves
            instead = "AC=none" if family.recompute_refused(cfg.arch, "full", release) else "AC=full or AC=none"
            raise UserError(f"AC=sel: megatron-core's selective recompute recomputes its core attention, which "
                            f"{cfg.family}'s own attention module does not use, so it would recompute nothing: use "
                            f"{instead}")
    pp, vp, pp0 = cfg.pp, cfg.virtual_pipeline, cfg.pp0_layers
    if ac == "offload" and ac_layers >= num_layers:
        raise UserError(f"MP_AC_LAYERS={ac_layers}: AC=offload can offload at most {num_layers - 1} of the "
                        f"{num_layers} layers (the last layer's activations are needed at once)")
    if ac == "full":
        # Uniform recompute walks each model chunk in blocks of MP_AC_LAYERS layers, and indexes past a chunk's last
        # layer where they do not divide it (an IndexError on the rank; Pai's launcher refuses it so too)
        chunks = sorted({pp0, (num_layers - pp0) // (pp - 1)} if pp0 is not None else {num_layers // (pp * (vp or 1))})
        if any(n % ac_layers for n in chunks):
            fewest, divisors = chunks[0], [d for d in range(1, chunks[0] + 1) if all(n % d == 0 for n in chunks)]
            raise UserError(f"MP_AC_LAYERS={ac_layers}: AC=full recomputes blocks of MP_AC_LAYERS layers within a "
                            f"pipeline stage, and a stage here holds {' or '.join(map(str, chunks))}: set "
                            f"MP_AC_LAYERS to {' or '.join(map(str, divisors))}"
                            + (f" (<= {fewest})" if ac_layers > fewest else ""))


def fp8_filter_kinds(cfg: RunConfig) -> None:
    if cfg.precision.fp8:
        check_filter_kinds(cfg.arch, cfg.fp8_filter, "MP_FP8_FILTER")


def positions(cfg: RunConfig) -> None:
    length = _length(cfg)[1]
    if length > cfg.arch.max_position_embeddings:
        raise UserError(f"sequence length {length} exceeds the model's {cfg.arch.max_position_embeddings} positions")


def expert_gradient_groups(cfg: RunConfig) -> None:
    """megatron-core 0.16 reduces the experts' gradients over its expert groups only with EP > 1: at EP=1 with ETP
    other than TP it reduced them as a dense parameter's, over the wrong ranks, silently (ETP=2: the other rank's
    shard added in, expert gradients 100% off; TP=2 with ETP=1: each rank's own tokens only, 54-69% off). 0.19 groups
    them whenever ETP differs from TP, and trains these layouts as TP=1 does."""
    if not cfg.arch.is_moe or cfg.ep > 1 or cfg.layout.expert_tp == cfg.tp or experts_grouped_whenever_etp_differs():
        return
    etp, tp = cfg.layout.expert_tp, cfg.tp
    fix = f"set ETP={tp}, or " if not (cfg.arch.linear_bias and tp > 1) else ""  # biased experts split only at ETP=1
    raise UserError(f"ETP={etp} with TP={tp} at EP=1: megatron-core {megatron_core_version()} reduces the experts' "
                    f"gradients over the wrong ranks unless EP > 1 (0.19 does not): {fix}use EP > 1, or megatron-core "
                    ">= 0.19 (Python >= 3.12)")


def processes(cfg: RunConfig) -> None:
    """The processes hold the layout, and the global batch splits over data parallelism."""
    world, tp, pp, cp, ep, etp = cfg.world_size, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.layout.expert_tp
    mp = tp * pp * cp
    if world % mp:
        raise UserError(f"{world} processes cannot hold TP*PP*CP={mp}: use a multiple of {mp} processes")
    if world % (pp * ep * etp):
        raise UserError(f"{world} processes cannot hold PP*EP*ETP={pp * ep * etp}")
    mbs, gbs, dp = cfg.micro_batch_size, cfg.global_batch_size, cfg.data_parallel_size
    if gbs % (mbs * dp):
        raise UserError(f"GLOBAL_BATCH_SIZE ({gbs}) must be a multiple of BATCH_SIZE*DP = {mbs}*{dp} = {mbs * dp}")
    if cfg.virtual_pipeline is not None and (gbs // (mbs * dp)) % pp:
        # The interleaved schedule runs micro-batches in groups of PP per virtual stage.
        raise UserError(f"{cfg.virtual_pipeline_setting} (interleaved schedule) needs the micro-batches per step, "
                        f"GLOBAL_BATCH_SIZE/(BATCH_SIZE*DP) = {gbs // (mbs * dp)}, to be a multiple of PP={pp}")


def training_length(cfg: RunConfig) -> None:
    if cfg.warmup_iters >= cfg.train_iters:
        raise UserError(f"warm-up ({cfg.warmup_iters} iterations) must be shorter than training "
                        f"({cfg.train_iters} iterations)")
    if cfg.warmup_iters and cfg.warmup_iters >= cfg.lr_decay_iters:
        # SFT's decay ends at iteration TRAIN-WARMUP (Pai's --lr-decay-iters), and megatron-core's scheduler
        # asserts the warm-up shorter than the decay (on the rank, as an internal error)
        raise UserError(f"WARMUP_TOKENS_OR_ITERS: SFT decays the learning rate until iteration {cfg.lr_decay_iters} "
                        f"(training minus warm-up), which must come after the warm-up ({cfg.warmup_iters}): "
                        f"warm up for fewer than half the training ({cfg.train_iters} iterations), as Pai-Megatron-"
                        "Patch needs too")


def moe_aux_loss(cfg: RunConfig) -> None:
    if cfg.moe_aux_loss is not None and not has_load_balancing_loss(cfg.arch):
        what = "a dense model" if not cfg.arch.is_moe else "an MoE model whose router has no load-balancing loss"
        raise UserError(f"MP_MOE_AUX_LOSS applies to MoE models with a load-balancing loss, and {cfg.arch.family} "
                        f"here is {what}: drop MP_MOE_AUX_LOSS")


def sft_data(cfg: RunConfig) -> None:
    if cfg.sft and (len(cfg.dataset_path) != 1 or cfg.dataset_weights):
        raise UserError("SFT takes one JSON/JSONL file or one SFT idxmap prefix as DATASET_PATH")
    if cfg.sft and cfg.valid_dataset_path and (len(cfg.valid_dataset_path) != 1 or cfg.valid_dataset_weights):
        raise UserError("SFT validates on one JSON/JSONL file or one SFT idxmap prefix as VALID_DATASET_PATH")
    if cfg.sft and cfg.dataset_type == "raw" and cfg.tokenizer is None:
        raise UserError("SFT needs a tokenizer: set MP_TOKENIZER to a tokenizer folder/file, or give a "
                        "PRETRAIN_CHECKPOINT_PATH that carries tokenizer.json")


CHECKS: tuple[Callable[[RunConfig], None], ...] = (
    learning_rates, offload_settings, data_kind, sequence_parallelism, activation_checkpointing_mode,
    packing_and_context_parallelism, pipeline_split, sample_lengths, model_layout, check_lora, check_sparse_attention,
    sequence_splits, recompute_blocks, fp8_filter_kinds, positions, expert_gradient_groups, processes,
    training_length, sft_data, moe_aux_loss,
    evaluation_run.check_evaluation)


# --- files the configuration names (skipped by check_paths=False: a dry run planned elsewhere) ---------------

def probe_script_exists(cfg: RunConfig) -> None:
    if cfg.offload_probe_script and not Path(cfg.offload_probe_script).is_file():
        raise UserError(f"MP_OFFLOAD_PROBE_SCRIPT {cfg.offload_probe_script} not found")


def data_exists(cfg: RunConfig) -> None:
    for name, paths in (("DATASET_PATH", cfg.dataset_path), ("VALID_DATASET_PATH", cfg.valid_dataset_path or [])):
        for path in paths:
            try:
                _check_data(path, cfg.dataset_type, cfg.sft)
            except UserError as exc:
                if len(paths) > 1:  # perhaps one path with spaces, read as several
                    raise UserError(f"{exc} ({name} was read as {len(paths)} paths; quote a path that holds spaces "
                                    "inside a blend, as examples/README.md shows)")
                raise


def tokenizer_exists(cfg: RunConfig) -> None:
    """SFT reads MP_TOKENIZER (or the checkpoint's), which must hold a tokenizer. Pretraining reads it only for the
    files its checkpoints and export carry (``checkpointing.side_files_source``), but a path that is not there was
    passed over without a word and the export had no tokenizer: refused too."""
    if cfg.sft and cfg.tokenizer is not None:
        from megatron_patch.tokenizer import check_tokenizer_path  # transformers: only SFT needs it

        check_tokenizer_path(cfg.tokenizer)
    elif cfg.tokenizer is not None and not os.path.lexists(cfg.tokenizer):
        raise UserError(f"MP_TOKENIZER {cfg.tokenizer} not found: give the tokenizer folder whose files the run's "
                        "checkpoints and export carry, or leave MP_TOKENIZER unset")


def output_outside_inputs(cfg: RunConfig) -> None:
    """OUTPUT_BASEPATH is not, and lies in none of, the folders the run reads: inside PRETRAIN_CHECKPOINT_PATH the
    launcher's lock made the checkpoint fail its manifest check, and with MP_NO_VERIFY=true the run wrote its
    checkpoints into it (docs/outputs.md: an output never overlaps an input). A folder the run holds is its own; a
    tokenizer's (an HF model folder, of which only the top-level files are read) may hold it, as converters' outputs."""
    refuse_unexpanded_home(cfg.output_basepath, "OUTPUT_BASEPATH")
    out = Path(cfg.output_basepath).resolve()
    for name, given, around in (("PRETRAIN_CHECKPOINT_PATH", cfg.pretrain_checkpoint, out.parents),
                                ("MP_TOKENIZER", cfg.tokenizer, ()), ("MP_LORA_INIT", cfg.lora_init, out.parents),
                                ("MP_EVAL_INCLUDE_PATH", cfg.eval_include_path, out.parents)):
        if given is not None and (folder := Path(given).resolve()) in (out, *around):
            raise UserError(f"OUTPUT_BASEPATH {cfg.output_basepath} {'is' if folder == out else 'lies inside'} "
                            f"{name} {given}, which the run reads: choose an OUTPUT_BASEPATH outside it")


def output_folder_writable(cfg: RunConfig) -> None:
    """OUTPUT_BASEPATH, and the folders a run writes in it, are folders this process can write (or can be made
    so): each rank would otherwise fail at its first write, deep inside megatron-core."""
    out = Path(cfg.output_basepath).absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if existing != out:  # made by the launcher: its nearest existing folder must take it
        if not existing.is_dir():
            raise UserError(f"OUTPUT_BASEPATH {out} cannot be made: {existing} is a file, not a folder; choose another")
        _check_writable(existing, out)
        return
    require_folder(out)
    for folder in (out, *(out / name for name in WRITTEN_FOLDERS)):
        if folder.exists():
            if not folder.is_dir():
                raise UserError(f"OUTPUT_BASEPATH {out}: {folder.name} is a file, and the run keeps a folder of that "
                                "name there: move it away or choose another OUTPUT_BASEPATH")
            _check_writable(folder, out)


def _check_writable(folder: Path, out: Path) -> None:
    if os.access(folder, os.W_OK | os.X_OK):
        return
    why = "on a read-only file system" if os.statvfs(folder).f_flag & os.ST_RDONLY else "not writable by this user"
    raise UserError(f"OUTPUT_BASEPATH {out}: {folder} is {why}, and the run writes there: make it writable or choose "
                    "another OUTPUT_BASEPATH")


PATH_CHECKS: tuple[Callable[[RunConfig], None], ...] = (probe_script_exists, data_exists, tokenizer_exists,
                                                        output_outside_inputs, output_folder_writable,
                                                        evaluation_run.check_tasks_exist)



def check_starting_checkpoint_layout(cfg: RunConfig) -> None:
    """A legacy PRETRAIN_CHECKPOINT_PATH loads only at the layout it was written for: refused in one line before
    the ranks start (each rank refused it after loading megatron-core and building its model). Asked only of a run
    that starts from it, not of one that resumes."""
    if cfg.pretrain_checkpoint is None:
        return
    sidecar = open_checkpoint(cfg.pretrain_checkpoint, hf_config=cfg.hf_config, family=cfg.family).sidecar
    problem = legacy_layout_problem(sidecar, cfg.layout)
    if problem is not None:
        raise UserError(f"PRETRAIN_CHECKPOINT_PATH {cfg.pretrain_checkpoint}: {problem}")

# --- reading what a value names ------------------------------------------------------------------------------

def _refuse_data_listed_twice(name: str, paths: list[str], dataset_type: str) -> None:
    """megatron-core builds each entry of a blend with the run's seed: data listed twice is read in the same order
    twice, each sample twice in a row, and a global batch held half as many samples as it said (the s65 audit)."""
    seen: dict[str, str] = {}
    for path, files in zip(paths, _data_files(paths, dataset_type)):
        if not os.path.exists(files):  # not data (a blend split at a path's spaces): data_exists says what it is
            continue
        if files in seen:
            twice = path if path == seen[files] else f"{seen[files]} (and as {path})"
            raise UserError(f"{name} lists {twice} twice: megatron-core would read both in the same order, each "
                            "sample twice in a row; give it once, with a larger weight to read it more "
                            "('W1 P1 W2 P2 ...')")
        seen[files] = path


def _blend(paths: list[str], weights: list[float] | None, dataset_type: str) -> dict[str, float | None]:
    """A blend as megatron-core reads it: each file's share of the weights, in any order ('0.5 A 0.5 B' is '1 B 1 A';
    'A B' is 'B A'), so that DATASET_PATH given again as VALID_DATASET_PATH is known for itself (the s65 audit)."""
    files = _data_files(paths, dataset_type)
    if weights is None:
        return dict.fromkeys(files)
    return {f: round(w / sum(weights), 12) for f, w in zip(files, weights)}


def _data_files(paths: list[str], dataset_type: str) -> list[str]:
    """The files data paths name, links and relative spellings resolved: one prefix written two ways is one data
    (VALID_DATASET_PATH relative beside an absolute DATASET_PATH was 'other data'; the data audit)."""
    return [os.path.realpath(path if dataset_type == "raw" else path + ".bin") for path in paths]


def _model_config(launcher: Launcher, size: str, ckpt: str | None, hf_config_file: str | None,
                  num_layers: int | None = None) -> tuple[str, dict, int | None, int, str | None]:
    """(the model's family, its HF config, the checkpoint's own vocabulary padding when it differs from ours, the
    multi-token-prediction layers it holds: converted with --mtp, they train too, as Pai trains DeepSeek-V3's;
    the folder that carries its tokenizer: a run's checkpoint folder carries it in the iteration it starts from).

    MODEL_SIZE names the family among the launcher's (Pai's Qwen3 launcher takes dense and MoE sizes). With a
    PRETRAIN_CHECKPOINT_PATH the checkpoint's architecture wins: its sidecar, else MP_HF_CONFIG, else the
    MODEL_SIZE preset, else its saved Megatron-LM arguments (as this launcher's family), each checked against
    its tensors (``checkpoint.arch_source``)."""
    if size == "auto":
        family, preset = (launcher.families[0] if len(launcher.families) == 1 else None), None
    else:
        family, name = launcher.model_size(size)
        preset = dict(get_family(family).presets[name])
    if num_layers is not None:
        if preset is None or ckpt is not None:
            raise UserError("MP_NUM_LAYERS shapes a model from a MODEL_SIZE preset and cannot change a checkpoint's: "
                            "drop MP_NUM_LAYERS or PRETRAIN_CHECKPOINT_PATH")
        return family, {**preset, "num_hidden_layers": num_layers}, None, 0, None
    if size == "auto" and ckpt is None:
        raise UserError("MODEL_SIZE=auto takes the architecture from PRETRAIN_CHECKPOINT_PATH, which is none: "
                        "give a converted checkpoint or a model size")
    if hf_config_file is not None and ckpt is None:
        raise UserError("MP_HF_CONFIG describes the model a PRETRAIN_CHECKPOINT_PATH holds, and there is none: drop "
                        "MP_HF_CONFIG (MODEL_SIZE chooses the model)")
    if ckpt is None:
        return family, preset, None, 0, None

    given = None if hf_config_file is None else read_config_json(
        hf_config_file, hint="MP_HF_CONFIG takes the model's HF config.json or the folder that holds it")
    try:
        opened = open_checkpoint(ckpt, hf_config=preset if given is None else given, family=family)
    except UserError as exc:
        raise UserError(f"PRETRAIN_CHECKPOINT_PATH: {exc}" + (" (or set MP_HF_CONFIG)" if "--hf-config" in str(exc)
                                                              else ""))
    sidecar = opened.sidecar
    if sidecar.family not in launcher.families:
        raise UserError(f"{ckpt} holds a {sidecar.family} model; {launcher.script} trains "
                        f"{' and '.join(launcher.families)}")
    family = sidecar.family
    if preset is not None and opened.found.sidecar_dir is not None:
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "intermediate_size", "num_experts")
        diff = [k for k in keys if sidecar.hf_config.get(k) != preset.get(k)]
        if diff:
            raise UserError(f"{ckpt} does not hold a {family} {size} model (differs in {', '.join(diff)}): "
                            "use MODEL_SIZE=auto to take the checkpoint's architecture")
    carrier = opened.found.sidecar_dir
    tokenizer_home = (str(carrier) if carrier is not None and not _holds_a_tokenizer(Path(ckpt))
                      and _holds_a_tokenizer(carrier) else ckpt)
    return family, sidecar.hf_config, sidecar.arch.vocab_padded_to, sidecar.mtp_layers, tokenizer_home


def _holds_a_tokenizer(folder: Path) -> bool:
    return os.path.lexists(folder / "tokenizer.json") or any(folder.glob("*.tiktoken")) or \
        os.path.lexists(folder / "tiktoken.model")


# One run reads one kind of SFT data, the kind DATASET_PATH names (MP_DATASET_TYPE's default)
_ONE_KIND = ("training and validation data must be of one kind (MP_DATASET_TYPE, by default what DATASET_PATH names):"
             " both JSON/JSONL files, or both SFT idxmap prefixes")


def _check_data(path: str, dataset_type: str, sft: bool = False) -> None:
    """``path`` names data of the run's kind; else one line that says what it is instead ("not found" only where
    nothing is there)."""
    if dataset_type == "raw":
        if Path(path).is_file():
            return
        if names_data(path, "mmap"):
            raise UserError(f"SFT data {path} is the prefix of a .bin/.idx pair, and this run reads JSON/JSONL "
                            f"records: {_ONE_KIND}")
        if Path(path).is_dir():
            raise UserError(f"SFT data {path} is a folder: give one JSON or JSONL file (shards concatenated into "
                            "one: cat part-*.jsonl > train.jsonl)")
        there = what_is_at(path)
        if there:
            raise UserError(f"SFT data {path} {there}: give a JSON or JSONL file itself")
        raise UserError(f"SFT data {path} not found: give a JSON or JSONL file, or the prefix of an SFT idxmap's "
                        ".bin/.idx (Pai's sft_data_preprocessing)")
    missing = [s for s in (".bin", ".idx") if not Path(path + s).is_file()]
    if missing and path.endswith((".bin", ".idx")):  # Megatron names data by its prefix; "X.bin.bin not found" misled
        raise UserError(f"{path} names one file of a .bin/.idx pair: give the pair's prefix, {path[:-4]}")
    if missing and sft and Path(path).is_file():
        raise UserError(f"SFT data {path} is a file (JSON/JSONL records), and this run reads an SFT idxmap's "
                        f".bin/.idx: {_ONE_KIND}")
    there = next((f"{path}{s} {what}" for s in missing if (what := what_is_at(path + s))), None)
    if there:  # called "not found" (the hostile audit)
        raise UserError(f"{'SFT idxmap' if sft else 'mmap data'} {there}: give the .bin/.idx pair's regular files")
    if missing and sft:
        raise UserError(f"SFT idxmap {path}{missing[0]} not found: give the prefix of the .bin/.idx pair written by "
                        "Pai's sft_data_preprocessing (e.g. data/sft_text_document), or a JSON or JSONL file")
    if missing:
        raise UserError(f"mmap data {path}{missing[0]} not found: give the prefix of the .bin/.idx pair "
                        "written by 'mpatch preprocess' (e.g. data/corpus_text_document)")


def _world(o: Options, layout: ParallelLayout, env: dict, notes: list[str]) -> tuple[int, int, int]:
    """(world size, processes per node, nodes); ``env``: what torchrun and PAI-DLC say of the job."""
    run_env = o["ENV"]
    if run_env == "cpu":
        nproc = o["MP_NPROC"] or layout.world_size
        return nproc, nproc, 1
    if launched_rank(env) and env.get("WORLD_SIZE"):
        world = parse_int("WORLD_SIZE", env["WORLD_SIZE"])
        per_node = (parse_int("LOCAL_WORLD_SIZE", env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE")
                    else o["GPUS_PER_NODE"] or world)
        if world % per_node:
            raise UserError(f"WORLD_SIZE={world} processes do not fill nodes of {per_node}: check GPUS_PER_NODE")
        return world, per_node, world // per_node
    # PAI-DLC gives each node's GPUs in KUBERNETES_CONTAINER_RESOURCE_GPU, which Pai-Megatron-Patch's launchers read
    per_node = o["GPUS_PER_NODE"] or (o["KUBERNETES_CONTAINER_RESOURCE_GPU"] if run_env == "dlc" else None)
    if per_node is None:
        import torch

        # Without a GPU: a dlc node trains on its CPU, one process unless GPUS_PER_NODE says more; dsw keeps a GPU
        # node's 8 for dry runs that plan one, and a launch is refused here, before the batch sizes it would fault.
        per_node = torch.cuda.device_count() or (1 if run_env == "dlc" else 8)
        if not torch.cuda.device_count() and run_env != "dlc":
            if not o["MP_DRY_RUN"]:
                raise UserError(no_gpu_problem(run_env))
            # the plan's size is otherwise an unexplained guess (the rdoc audit)
            notes.append(f"ENV={run_env} on a machine without a GPU: planned for {per_node} GPUs per node, as a GPU "
                         "node has; set GPUS_PER_NODE to plan for another count")
    nnodes = parse_int("WORLD_SIZE", env.get("WORLD_SIZE", "1")) if run_env == "dlc" else 1
    return per_node * nnodes, per_node, nnodes

"""Every launcher option, declared once: the positional arguments (Pai-Megatron-Patch's order) and the
environment options, each one ``Option`` of ``OPTIONS``: its name, how a raw value is read, its default, its
help, the ``RunConfig`` field it fills and the part of the project that owns it.

One engine works from the table: ``read_options`` is the one place a launch reads its options (a value wrong on
its own is refused there, in one line naming it; combinations are ``validation.py``'s), ``usage`` is --help,
``dry_run_options`` the dry run's list, ``markdown`` examples/README.md's tables (scripts/update_docs_tables.py).
tests/test_launcher_options.py holds them together. An option is added by one entry here (and the
``RunConfig`` field it fills, if any); its checks against other values go to ``validation.py``.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from megatron_patch.dtypes import Precision
from megatron_patch.errors import UserError
from megatron_patch.evaluation import document_limit, task_names
from megatron_patch.lora.spec import LoraSpec, parse_targets
from megatron_patch.models.blocks.float8_plan import KINDS as FP8_KINDS
from megatron_patch.models.blocks.float8_plan import parse_filter
from megatron_patch.models.mapping import LORA_TARGETS
from megatron_patch.models.description.registry import families
from megatron_patch.training.faults import KINDS, parse_faults
from megatron_patch.training.fp8_run import ALL_RECIPES, TE_RECIPES, TORCHAO_RECIPES
from megatron_patch.training.launcher_args import (
    MAX_GLOBAL_BATCH,
    MAX_ITERATIONS,
    MAX_LOCAL_PROCESSES,
    Launcher,
    describe_size,
    get_launcher,
    is_none,
    launchers,
    names_data,
    parse_bool,
    parse_choice,
    parse_float,
    parse_int,
)
from megatron_patch.training.run_config import PRECISIONS

# The parts that own options. A later part adds its name here and its entries to OPTIONS.
CORE, LORA, DSA, FP8, EVALUATION = "core", "LoRA", "DSA", "FP8", "evaluation"
PARTS = (CORE, LORA, DSA, FP8, EVALUATION)


# --- how a raw value is read ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Reader:
    """How one raw value is read: ``read(name, raw)`` gives the value or raises a UserError of one line naming
    the option and what it takes. ``takes``: what it takes, as --help and the docs say it; ``refused``: a value
    it refuses (tests/test_launcher_options.py gives each option its reader's)."""

    read: Callable[[str, str], Any]
    takes: str
    refused: str | None = None


def integer(lo: int = 1, hi: int | None = None) -> Reader:
    return Reader(lambda name, raw: parse_int(name, raw, lo, hi),
                  f"integer >= {lo}" + (f", at most {hi:,}" if hi is not None else ""), "x")


def choice(*allowed: str, aliases: dict | None = None, means: Callable[[str], Any] = str) -> Reader:
    """One of ``allowed`` (``means`` turns it into the value); ``aliases``: other words taken for one of them
    (Pai's AC=false), not listed in a refusal."""
    aliases = aliases or {}
    return Reader(lambda name, raw: means(parse_choice(name, aliases.get(raw, raw), allowed)),
                  " | ".join(allowed) + "".join(f" ({a}: {v})" for a, v in aliases.items()), "bogus")


def _above_zero(what: str = "") -> Reader:
    def read(name: str, raw: str) -> float:
        value = parse_float(name, raw)
        if value <= 0:
            raise UserError(f"{name} must be {what}> 0, got '{raw}'")
        return value

    return Reader(read, f"{what}> 0", "0")


def _below_one(name: str, raw: str) -> float:
    value = parse_float(name, raw)
    if not value < 1:
        raise UserError(f"{name} must be in [0, 1), got '{raw}'")
    return value


def _offload(name: str, raw: str) -> tuple[float, str]:
    """OPTIMIZER_OFFLOAD -> (host share, policy)."""
    value = raw.strip().lower()
    if value in ("false", "static", "auto"):
        return {"false": (0.0, "off"), "static": (1.0, "static"), "auto": (0.0, "auto")}[value]
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise UserError(f"{name} must be false, static, auto or a fraction in (0, 1], got '{raw}'")
    return share, "static"


def _required_folder(name: str, raw: str) -> str:
    if is_none(raw):
        raise UserError(f"{name} is required: checkpoints, logs and TensorBoard go there")
    return str(raw)


def _task_list(name: str, raw: str) -> list[str]:
    return list(task_names(name, raw))


def _document_limit(name: str, raw: str) -> float | int:
    return document_limit(name, parse_float(name, raw))


def _split(name: str, raw: str) -> str | None:
    """Megatron-LM's ``--split`` (Pai's 99,1,0): train, validation and test shares of DATASET_PATH's documents,
    given as 1 to 3 numbers; the validation share must hold something."""
    if is_none(raw):
        return None
    parts = raw.replace("/", ",").split(",")
    try:
        shares = [parse_float(name, p) for p in parts] if len(parts) <= 3 else []
    except UserError:
        shares = []
    if not shares or sum(shares) <= 0:
        raise UserError(f"{name} takes train,valid,test shares of DATASET_PATH, e.g. 99,1,0 (Pai's --split), "
                        f"got '{raw}'")
    shares += [0.0] * (3 - len(shares))
    if shares[0] <= 0:
        raise UserError(f"{name}={raw} leaves nothing to train on: give training the first share, e.g. 99,1,0")
    if shares[1] <= 0:
        raise UserError(f"{name}={raw} holds nothing out for validation: give it a validation share, e.g. 99,1,0, "
                        "or leave it unset to validate on VALID_DATASET_PATH")
    # plain decimals: megatron-core reads the string's digits and dots alone (1e-05 would read as 1 and 05)
    return ",".join(f"{x:f}".rstrip("0").rstrip(".") for x in shares)


def _dry_run(name: str, raw: str) -> str | None:
    # MP_DRY_RUN=false started a dry run, as did any word but 0: a value it does not take is refused
    value = raw.strip().lower()
    if value in ("0", "false"):
        return None
    if value in ("1", "true", "json"):
        return "json" if value == "json" else "text"
    raise UserError(f"MP_DRY_RUN takes 1 (the report), json (the report as JSON) or 0 (a launch), got {raw!r}")


INTEGER = integer()
NUMBER = Reader(parse_float, "number >= 0", "x")
BOOL = Reader(parse_bool, "true | false", "maybe")
TEXT = Reader(lambda name, raw: raw, "text")
FOLDER_OR_NONE = Reader(lambda name, raw: None if is_none(raw) else raw, "folder or none")
# Read where the run's other values give it its meaning (validation.py): data paths split once the data's
# kind is known, token or iteration counts once SFT says which.
WHOLE = Reader(lambda name, raw: raw, "text")


# --- the table ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Default:
    """A default that depends on the run: ``says`` is what --help and the docs say (text, or a function that
    writes it), ``compute(**run)`` the value, given what it depends on (``Options.settle``); without
    ``compute`` the value stays None and the derivation that reads the option decides (validation.py)."""

    says: str | Callable[[], str]
    compute: Callable[..., Any] | None = None


@dataclass(frozen=True)
class Option:
    """One launcher option. ``field``: the RunConfig field it fills (a tuple for a reader that gives several
    values; None where a derivation reads it, ``DERIVED``). ``doc``: examples/README.md's text where it says more
    than ``help``; ``takes``: the docs' values where they say more than the reader's. A positional argument's
    ``default`` is its value on a launcher whose layout lacks it (ETP, EP)."""

    name: str
    part: str
    reader: Reader
    help: str
    default: Any = None
    field: str | tuple[str, ...] | None = None
    doc: str | None = None
    takes: str | None = None

    @property
    def positional(self) -> bool:
        return self.name in POSITIONAL_NAMES

    def default_text(self) -> str:
        value = self.default
        if isinstance(value, Default):
            return value.says() if callable(value.says) else value.says
        if value is None or value == []:
            return ""
        if isinstance(value, bool):
            return str(value).lower()
        return f"{value:g}" if isinstance(value, float) else str(value)

    def values_text(self) -> str:
        """What the option takes, as the docs say it."""
        return self.takes if self.takes is not None else self.reader.takes

    def help_line(self) -> str:
        said = self.default_text()
        return self.help + (f" (default {said})" if said and not self.positional else "")


def _weight_decays() -> str:
    """Each family's weight decay (Pai's launcher's), the most common one as 'the others'."""
    by_value: dict[float, list[str]] = {}
    for name, family in families().items():
        by_value.setdefault(family.weight_decay, []).append(name)
    common = max(by_value, key=lambda v: len(by_value[v]))
    rest = [f"{v:g} for {', '.join(sorted(names))}" for v, names in sorted(by_value.items()) if v != common]
    # a Pai script that passes another value for a family it also takes (Qwen2's for its MoE size)
    scripts = [f"{pai.weight_decay:g} for {name} through {pai.script}" for name, family in families().items()
               for pai in family.pai_launchers if pai.weight_decay is not None]
    return "; ".join(rest + [f"{common:g} for the others"] + scripts)


def _pai_moe_settings() -> str:
    """What Pai's scripts pass for the MoE families they train where not the usual (0.001, balanced per batch)."""
    said = [f"{pai.moe_aux_loss:g} for {name} through {pai.script}" for name, family in families().items()
            for pai in family.pai_launchers if pai.moe_aux_loss is not None]
    balanced = [f"{name} through {pai.script} balances with {pai.moe_balancing}" for name, family in families().items()
                for pai in family.pai_launchers if pai.moe_balancing is not None]
    return "; ".join(said + balanced)


def _dataset_type(sft: bool, dataset_path: str) -> str:
    """For SFT what DATASET_PATH names: a JSON/JSONL file (raw) or the prefix of an idxmap's .bin/.idx (Pai's
    default, idxmap, is what its SFT preprocessing writes); mmap for pretraining."""
    path = dataset_path.strip()
    if sft and not Path(path).is_file() and names_data(path, "mmap"):
        return "mmap"
    return "raw" if sft else "mmap"


ENVS = ("dsw", "dlc", "cpu")

POSITIONAL = [
    Option("ENV", CORE, choice(*ENVS), "dsw (one node, all its GPUs) | dlc (multi-node: WORLD_SIZE, RANK, "
           "MASTER_ADDR, MASTER_PORT; on CPU nodes gloo) | cpu (local gloo processes); all start through torchrun",
           field="env",
           doc="every ENV starts through torchrun, run by the launcher. dsw: `torchrun --standalone` on this node, one "
               "process per GPU (`GPUS_PER_NODE`, default all visible); dlc: `torchrun --nnodes=$WORLD_SIZE "
               "--node_rank=$RANK --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT` (PAI-DLC's node-level "
               "variables), on GPUs, or on CPU with gloo on nodes without one; cpu: `torchrun --standalone` with "
               "TP\\*PP\\*CP\\*DP local gloo processes (`MP_NPROC`, default the model-parallel size), for development "
               "and CI. Without a CUDA device (ENV=cpu, or dlc on a CPU node), torchrun's agent forks each rank from "
               "a fork server that imported torch and megatron-core once (about 4 s of CPU less per rank; "
               "`MP_LOCAL_START=spawn` starts each as a fresh interpreter, as GPUs always do). See docs/training.md, "
               "\"Multi-node and failures\""),
    Option("MODEL_SIZE", CORE, WHOLE, "a published size (Pai-Megatron-Patch's names too), tiny, or auto "
           "(architecture from PRETRAIN_CHECKPOINT_PATH)", field="model_size", takes="see the table above",
           doc="the published HF config.json of that size (`models/<family>/presets.py`); `tiny` trains on CPU in "
               "seconds; `auto` takes the architecture from the sidecar of PRETRAIN_CHECKPOINT_PATH. A size that "
               "disagrees with the checkpoint is refused"),
    Option("BATCH_SIZE", CORE, integer(hi=MAX_GLOBAL_BATCH), "micro-batch size per data-parallel rank (integer >= 1)",
           field="micro_batch_size", takes="integer >= 1",
           doc="micro-batch size per data-parallel rank (at most GLOBAL_BATCH_SIZE)"),
    Option("GLOBAL_BATCH_SIZE", CORE, integer(hi=MAX_GLOBAL_BATCH),
           "samples per optimizer step; a multiple of BATCH_SIZE * data-parallel size", field="global_batch_size",
           takes="multiple of BATCH_SIZE\\*DP, at most 10^6",
           doc="samples per optimizer step; micro-batches per step = GBS / (BATCH_SIZE\\*DP)"),
    Option("LR", CORE, NUMBER, "peak learning rate (> 0)", field="lr", takes="> 0",
           doc="peak learning rate of `OptimizerParamScheduler` (linear warm-up from 0, then cosine decay to MIN_LR: "
               "pretraining by the end of the last iteration, whose update runs one step short of it; SFT by iteration "
               "TRAIN-WARMUP, Pai's `--lr-decay-iters`, which "
               "megatron-core counts from iteration 0, so SFT's last WARMUP iterations run at MIN_LR; as "
               "Pai-Megatron-Patch's launchers)"),
    Option("MIN_LR", CORE, NUMBER, "final learning rate of the cosine decay (0 <= MIN_LR <= LR)", field="min_lr",
           takes="0..LR", doc="final learning rate"),
    Option("SEQ_LEN", CORE, INTEGER, "sequence length of pretraining samples (and of an SFT idxmap's, as in "
           "Pai-Megatron-Patch)", field="seq_len", takes="<= the model's positions",
           doc="pretraining sample length (`GPTDatasetConfig.sequence_length`), and an SFT idxmap's (Pai's meaning)"),
    Option("PAD_LEN", CORE, INTEGER, "length of SFT samples from JSON records (padded or packed to it); <= SEQ_LEN "
           "there (pretraining and idxmaps do not read it)", field="pad_len", takes="<= SEQ_LEN (SFT on JSON records)",
           doc="sample length of SFT on JSON records: they are padded (or packed, `MP_SFT_PACKING`) to it; pretraining "
               "and Pai's SFT idxmaps do not read it"),
    Option("PR", CORE, choice(*PRECISIONS, means=Precision), "precision: fp16 | bf16 | fp8 (transformer-engine's, "
           "else torchao's float8 GEMMs; docs/fp8.md) | fp32 (CPU development)", field="precision",
           doc="bf16/fp16: every parameter in that dtype (norms included, as Megatron-LM's Float16Module), fp32 "
               "gradient buffers and master weights, `OptimizerConfig.bf16/fp16` (fp16 with dynamic loss scaling "
               "from 2^16, hysteresis 2, doubled after `MP_LOSS_SCALE_WINDOW` good steps; a step with inf/nan "
               "gradients is skipped and logged); fp8: bf16 parameters with FP8 GEMMs: with transformer-engine "
               "`fp8=\"hybrid\"`, `fp8_recipe=$MP_FP8_RECIPE` (delayed: amax history 1024, max), GPU only, needing "
               "BATCH_SIZE x sample length / CP divisible by 8 (mxfp8: 32) and hidden/FFN/attention sizes per TP "
               "rank by 16 (32); without it torchao's float8 inside megatron-core's linears (`MP_FP8_FILTER`, GPU "
               "and CPU; [docs/fp8.md](../docs/fp8.md)); fp32: development precision (on GPU it runs with "
               "`attention_backend=auto`). ENV=cpu takes fp32, bf16, fp16 and fp8 (torchao)"),
    Option("TP", CORE, INTEGER, "tensor parallel size", field="tp",
           takes="divides heads, query groups, MLP, padded vocabulary", doc="`tensor_model_parallel_size`"),
    Option("PP", CORE, INTEGER, "pipeline parallel size", field="pp", takes="divides the layers (or see "
           "`MP_PP0_LAYERS`)", doc="`pipeline_model_parallel_size`; megatron-core's 1F1B schedule (interleaved "
                                   "with `MP_VP`)"),
    Option("CP", CORE, INTEGER, "context parallel size", field="cp", takes="sequence length divisible by 2\\*CP",
           doc="`context_parallel_size` (needs transformer-engine attention, GPU only); each CP rank trains on "
               "chunks r and 2\\*CP-1-r of every sequence; the launcher sets `CUDA_DEVICE_MAX_CONNECTIONS=1` for "
               "TP>1 or CP>1 below sm100"),
    Option("ETP", CORE, INTEGER, "expert tensor parallel size (MoE; ignored for a dense size)", field="etp",
           takes="divides the expert MLP; MoE launchers", doc="`expert_tensor_parallel_size` (ignored, with a note, "
                                                               "for a dense size on a launcher that takes both)"),
    Option("EP", CORE, INTEGER, "expert parallel size (MoE; 1 for dense)", default=1, field="ep",
           takes="divides the experts; 1 for dense", doc="`expert_model_parallel_size`"),
    Option("SP", CORE, BOOL, "sequence parallelism: true | false (TP > 1 with SP=true also turns on TP communication "
           "overlap; ignored at TP=1)", field="sequence_parallel",
           doc="`sequence_parallel`; at TP=1 ignored with a note (as Pai-Megatron-Patch's launchers); with TP>1 also "
               "`tp_comm_overlap=True` (transformer-engine userbuffers; `MP_TP_COMM_OVERLAP=false` keeps SP without "
               "it). MoE with TP>1 requires SP=true, at any EP (megatron-core's)"),
    Option("DO", CORE, BOOL, "distributed optimizer: true | false (true also overlaps the parameter all-gather)",
           field="distributed_optimizer", doc="`use_distributed_optimizer`; true also turns on `overlap_param_gather` "
                                              "(grad-reduce overlap is always on)"),
    Option("FL", CORE, BOOL, "flash attention: true | false (with transformer-engine its FlashAttention, FA3 on "
           "Hopper when installed; without it torch SDPA, the default on a GPU, FL=true on CPU)",
           field="flash_attention",
           doc="with transformer-engine: `attention_backend=flash` (FlashAttention-3 when its Hopper build, "
               "`flash_attn_interface`, is installed; else FlashAttention-2 from the flash-attn package; refused with "
               "neither, and with PR=fp32); false: `fused` (cuDNN) (`auto` with PR=fp32). Without transformer-engine "
               "(megatron-core's local spec): torch SDPA, the default on a GPU whatever FL says; on CPU FL=true "
               "selects SDPA, false keeps megatron's unfused attention (docs/gpu.md). The dry run says which "
               "attention runs"),
    Option("SFT", CORE, BOOL, "true: fine-tune on SFT data (token counts become iteration counts) | false: pretrain",
           field="sft", doc="true: JSON/JSONL records or Pai's SFT idxmap, loss on responses only, TRAIN/WARMUP are "
                            "iteration counts"),
    # Pai-Megatron-Patch's launchers take AC=false for no recompute (any value but sel/full/offload is none there).
    Option("AC", CORE, choice("sel", "full", "offload", "none", aliases={"false": "none"}),
           "activation checkpointing: sel | full | offload | none or false (MP_AC_LAYERS layers for full/offload)",
           field="activation_checkpointing",
           takes="`sel` \\| `full` \\| `offload` \\| `none` (`false`: none, Pai-Megatron-Patch's word)",
           doc="sel: `recompute_granularity=\"selective\"`; full: `\"full\"`, `recompute_method=\"uniform\"`, "
               "`recompute_num_layers=$MP_AC_LAYERS`; offload: `cpu_offloading=True` for `$MP_AC_LAYERS` layers (GPU "
               "only; PP=1, at most layers-1). full needs MP_AC_LAYERS to divide the layers of a pipeline stage (uniform "
               "recompute)"),
    Option("OPTIMIZER_OFFLOAD", CORE, Reader(_offload, "false | static | fraction in (0,1] | auto", "1.5"),
           "false | static (all optimizer state on the host) | a fraction 0..1 on the host | auto (what the GPU "
           "cannot hold, measured each step); forces DO=true",
           field=("optimizer_offload_fraction", "optimizer_offload_policy"),
           doc="the distributed optimizer's fp32 state in chunks over its bucket shards, the given share (static: "
               "all) on the host, updated there; `auto`: as much on the GPU as each step's memory readings leave "
               "room for, with a margin, patience and cooldown (docs/optimizer-offload.md). Forces DO=true (said in "
               "the resolved notes). ENV=cpu too (the \"device\" tier is host memory there)"),
    Option("SAVE_INTERVAL", CORE, INTEGER, "save a checkpoint every this many iterations", field="save_interval",
           doc="a torch_dist checkpoint every this many iterations (and at the end)"),
    Option("DATASET_PATH", CORE, WHOLE, "pretraining: mmap data prefix(es) (P_text_document, optionally 'W1 P1 W2 "
           "P2'; a path that exists is one path, spaces and all; quote one with spaces inside a blend); SFT: a "
           "JSON/JSONL file, or the prefix of Pai's SFT idxmap (sft_data_preprocessing)", takes="",
           doc="pretraining: prefix of `mpatch preprocess` output (`P_text_document`), several prefixes, or "
               "Megatron's blend `W1 P1 W2 P2` (prefixes without weights are weighted by the samples of one epoch of "
               "each, as Megatron-LM infers them from the lengths; a run that reads more than that epoch is blended "
               "by those weights over its whole length, each prefix repeated as megatron-core repeats one alone, "
               "where megatron-core builds one epoch; a prefix without one sample there, or data listed twice, is "
               "refused); SFT: one JSON or JSONL file (not "
               "a folder of shards), or the prefix of Pai's SFT idxmap. A "
               "value that names existing data as a whole is one path, whatever spaces it holds (`\"my "
               "data/corpus_text_document\"`); otherwise it is split as a shell splits words, so a path with spaces "
               "inside a blend is quoted: `'0.3 \"my data/a_text_document\" 0.7 b_text_document'`"),
    Option("VALID_DATASET_PATH", CORE, Reader(FOLDER_OR_NONE.read, "like DATASET_PATH, or none"),
           "validation data like DATASET_PATH, or none",
           takes="like DATASET_PATH (a blend's weights included), or `none`",
           doc="validation loss every `MP_EVAL_INTERVAL` iterations over `MP_EVAL_ITERS` global batches; SFT data of "
               "DATASET_PATH's kind (a JSON/JSONL file beside a file, an idxmap prefix beside a prefix)"),
    Option("PRETRAIN_CHECKPOINT_PATH", CORE, FOLDER_OR_NONE,
           "a checkpoint from 'mpatch convert hf2mcore' to start from, or none", field="pretrain_checkpoint",
           takes="folder or `none`",
           doc="a checkpoint written by `mpatch convert hf2mcore` (torch_dist: any TP/PP; legacy: its own layout), "
               "the `final/` folder of an earlier run, or a Megatron-Core checkpoint of another tool (Megatron-LM, "
               "Megatron-Bridge, Pai-Megatron-Patch: architecture from `MP_HF_CONFIG`, the MODEL_SIZE preset or its "
               "saved arguments, checked against its tensors; docs/foreign-checkpoints.md); its weights start the run "
               "(a resumed run takes its own checkpoint instead, at whatever TP/PP/DP it is relaunched with)"),
    Option("TRAIN_TOKENS_OR_ITERS", CORE, WHOLE, "pretraining: training tokens; SFT: iterations",
           takes="count (`1000000`, `1e9`, `10B`, `500M`, `2.05M`: an exact decimal, any whole count)",
           doc="pretraining: tokens, iterations = tokens / (GBS\\*SEQ_LEN); SFT: iterations. At most 10^15 tokens and "
               "10^8 iterations, far beyond any published run: a slip such as `1e30` is refused in one line before "
               "anything starts (megatron-core would build a dataset index of that many samples, silently, without "
               "end)"),
    Option("WARMUP_TOKENS_OR_ITERS", CORE, WHOLE, "pretraining: warm-up tokens; SFT: warm-up iterations",
           takes="count", doc="warm-up, the same units and ceilings"),
    Option("OUTPUT_BASEPATH", CORE, Reader(_required_folder, "folder", "none"),
           "where checkpoints, logs and TensorBoard go; a rerun with the same path resumes", field="output_basepath",
           doc="`checkpoint/` (torch_dist, resumable), `final/` (trained model, hf2mcore layout), `log/metrics.jsonl`, "
               "`tensorboard/`, `data_cache/`. Rerunning with the same folder resumes from the latest complete "
               "checkpoint, and the run's first line says so and from where (Pai-Megatron-Patch starts again)"),
]

ENVIRONMENT = [
    Option("MP_DRY_RUN", CORE, Reader(_dry_run, "1 | json"),
           "1: print the resolved configuration and command, train nothing; json: the same as JSON",
           doc="`1`: print the resolved configuration and command; `json`: the same as JSON"),
    Option("MP_DATASET_TYPE", CORE, choice("idxmap", "mmap", "raw", means=lambda v: "mmap" if v == "idxmap" else v),
           "mmap or idxmap (Pai's name): .bin/.idx data (pretraining, or Pai's SFT idxmap) | raw: JSON/JSONL SFT "
           "records", field="dataset_type",
           default=Default("mmap; for SFT what DATASET_PATH names (a file: raw, a prefix: idxmap)", _dataset_type),
           doc="`mmap` or `idxmap` (Pai's name): a `.bin`/`.idx` prefix, pretraining data or, with SFT=true, Pai's SFT "
               "idxmap \\| `raw`: JSON/JSONL SFT records (refused for pretraining)"),
    Option("MP_AC_LAYERS", CORE, INTEGER, "layers recomputed (AC=full) or offloaded (AC=offload) per stage",
           default=1, field="ac_layers"),
    Option("MP_VP", CORE, INTEGER, "layers per virtual pipeline stage (Pai-Megatron-Patch's and Megatron-LM's "
           "--num-layers-per-virtual-pipeline-stage): interleaved 1F1B; needs PP > 1",
           doc="layers per virtual pipeline stage, as Pai-Megatron-Patch's and Megatron-LM's "
               "`--num-layers-per-virtual-pipeline-stage`: layers / (PP\\*MP_VP) model chunks per pipeline rank "
               "(layers divisible by PP\\*MP_VP); a virtual stage of all a stage's layers is no virtual pipeline; "
               "the rest as `MP_VP_CHUNKS`"),
    Option("MP_VP_CHUNKS", CORE, INTEGER, "virtual pipeline stages (model chunks) per pipeline rank, instead of MP_VP",
           doc="instead of `MP_VP` (its meaning here before issue 35): virtual pipeline stages (model chunks) per "
               "pipeline rank: `virtual_pipeline_model_parallel_size`, megatron-core's interleaved 1F1B schedule with "
               "Megatron-LM's p2p settings for it (`overlap_p2p_comm=True`, `batch_p2p_comm=False`). Each rank builds "
               "one GPTModel per chunk (`vp_stage`), each wrapped in DDP; chunk v of pipeline rank r holds the "
               "(v\\*PP + r)-th block of layers. Needs PP>1, layers divisible by PP\\*VP, micro-batches per step a "
               "multiple of PP; not with `MP_PP0_LAYERS`; `1` means no virtual pipeline. Checkpoints store the "
               "chunks as `model0`, `model1`, ... (Megatron-LM's names); a torch_dist PRETRAIN_CHECKPOINT_PATH loads "
               "into chunks (a legacy one is refused)"),
    Option("MP_SFT_PACKING", CORE, BOOL, "true: several SFT records per sample, kept apart (JSON records packed in "
           "order, Pai's packed lists and idxmap samples as they are), or in pretraining each sample's documents kept "
           "apart; false: each record a sample of its own, documents attending across their ends",
           default=False, field="sft_packing",
           doc="`true`: several SFT records per sample (JSON records packed in order, a packed-SFT list or an idxmap "
               "sample as it is), trained as THD packed sequences (`PackedSeqParams`, `cu_seqlens`): attention stays "
               "within each sample and RoPE restarts, on GPU (transformer-engine) and CPU alike; the loss equals the "
               "unpacked loss. In pretraining (Pai's `--reset-position-ids` with it): a document starts after each "
               "end-of-document token of the tokenizer (MP_TOKENIZER or the checkpoint's), attends within itself "
               "and its positions restart; the loss is each document's alone. Not with CP>1, nor for the families whose "
               "attention keeps no documents apart (deepseek_v4, the DSA families, the Gated DeltaNet layers of "
               "qwen3_next and qwen3_5): refused in one line"),
    Option("MP_SFT_LOSS", CORE, choice("record", "token"), "SFT's loss: record (each record's mean over its trained "
           "tokens, averaged over the global batch's records, as Pai-Megatron-Patch) | token (each micro-batch's "
           "token mean, Megatron-LM's)", field="sft_loss",
           default=Default("record for SFT; a resumed run keeps what it started with", lambda sft: "record" if sft
                           else None),
           doc="`record`: each record's loss is the mean over its own trained tokens, and a step's loss the mean over "
               "the global batch's records, so a short answer weighs as much as a long one: Pai-Megatron-Patch's SFT "
               "(`per_seq_average` with `--calculate-per-token-loss`), packed or not; the logged `loss` and "
               "validation loss are that mean too. `token`: the mean of each micro-batch's token mean, Megatron-LM's "
               "default (this project's SFT before it took Pai's). The two agree where every record trains as many "
               "tokens. A run resumed without MP_SFT_LOSS keeps the weighting its checkpoint records (`token` for "
               "one saved before this option). Multi-token-prediction layers' losses stay token means. SFT only"),
    Option("MP_PP0_LAYERS", CORE, INTEGER, "layers on the first pipeline stage", field="pp0_layers",
           default=Default("the layers split evenly"),
           doc="layers of the first pipeline stage (the rest split evenly), `num_layers_in_first_pipeline_stage`"),
    Option("MP_TP_COMM_OVERLAP", CORE, BOOL, "false: keep SP but turn TP communication overlap off (needed without "
           "transformer-engine)", field="tp_comm_overlap",
           default=Default("true where TP > 1 with SP=true", lambda tp, sp: tp > 1 and sp),
           doc="`false`: SP without TP communication overlap (what machines without transformer-engine need)"),
    Option("MP_OVERLAP_PARAM_GATHER", CORE, BOOL, "true: insist on param-gather overlap (refused without DO=true); "
           "false: turn it off under DO=true", default=Default("what DO says"),
           doc="`true` insists on param-gather overlap, refused unless DO=true; `false` turns it off under DO=true"),
    Option("MP_NPROC", CORE, integer(hi=MAX_LOCAL_PROCESSES), "ENV=cpu: number of local processes",
           default=Default("TP*PP*CP, or what the expert layout needs"),
           doc="ENV=cpu: number of local processes (DP = MP_NPROC / (TP\\*PP\\*CP))"),
    Option("GPUS_PER_NODE", CORE, INTEGER, "dsw/dlc: processes per node",
           default=Default("the GPUs visible; on dlc KUBERNETES_CONTAINER_RESOURCE_GPU first, else 1 on a node "
                           "without GPUs; a dsw dry run without GPUs plans 8")),
    Option("KUBERNETES_CONTAINER_RESOURCE_GPU", CORE, INTEGER,
           "dlc: PAI-DLC's GPUs per node, read as GPUS_PER_NODE when that is unset",
           doc="ENV=dlc: PAI-DLC's GPUs per node, the processes per node where `GPUS_PER_NODE` is unset (as "
               "Pai-Megatron-Patch's launchers)"),
    Option("MP_MAX_RESTARTS", CORE, integer(lo=0), "restart the ranks up to N times after a failure (torchrun "
           "--max-restarts); each restart resumes from the latest complete checkpoint", default=0,
           field="max_restarts",
           doc="restart the ranks up to N times after a failure (`torchrun --max-restarts=N`); each restart resumes "
               "from the latest complete checkpoint by itself (0: the job fails with one line)"),
    Option("MP_DIST_TIMEOUT_MIN", CORE, _above_zero("a number of minutes "), "minutes a collective may wait for the "
           "other ranks before the job fails naming the rank that stopped answering", default=10.0,
           field="dist_timeout_min",
           doc="minutes a collective may wait for the other ranks; past it the job fails with one line naming the "
               "rank that stopped answering (its heartbeat), the collective and the iteration"),
    Option("MP_TOKENIZER", CORE, TEXT, "tokenizer folder (tokenizer.json) or tiktoken file: tokenizes SFT "
           "records, and its files go into checkpoints and the export",
           takes="tokenizer folder or tiktoken file",
           field="tokenizer",
           default=Default("PRETRAIN_CHECKPOINT_PATH, which carries tokenizer.json",
                           lambda sft, dataset_type, checkpoint: checkpoint if sft and dataset_type == "raw" else None),
           doc="HF tokenizer folder or tiktoken file: SFT's JSON records are tokenized with it (an idxmap is "
               "already ids); a folder's tokenizer files (chat template included) go into every checkpoint and "
               "the HF export in place of PRETRAIN_CHECKPOINT_PATH's (the launch says which differ; the model's "
               "own files, generation_config.json and the carried HF tensors, stay the checkpoint's), and "
               "MP_EVAL_TASKS and the SFT preview read it"),
    Option("MP_NAN_POLICY", CORE, choice("stop", "skip"), "what a NaN/inf loss, or in bf16/fp32 inf/nan gradients, "
           "do: stop | skip (the update)", default="stop", field="nan_policy",
           doc="`stop`: exit 2 naming the iteration, before its update \\| `skip`: skip that step's update. In "
               "bf16 and fp32 the gradients are checked too (every DDP buffer's norm, as clipping needs it); fp16's "
               "loss scaler skips inf/nan gradients whatever the policy, and lowers its scale once they have come "
               "`hysteresis` (2) times"),
    Option("MP_COMPILE_FUSIONS", CORE, BOOL, "true: torch.compile the local spec's RMSNorm, RoPE, SwiGLU and "
           "bias-dropout-add (no transformer-engine); false: all of them eager", field="compile_fusions",
           default=Default("megatron-core's own choice"),
           doc="`true`: `torch.compile` the local spec's RMSNorm and RoPE and turn on megatron-core's compiled "
               "SwiGLU (where it is megatron-core's plain one: not Gemma's GeLU or gpt-oss's clamped one, which stay "
               "eager) and bias-dropout-add (without transformer-engine; refused where torch.compile has no "
               "compiler, or where TE's spec runs); `false`: all of them eager; unset: megatron-core's choice "
               "(fused on GPU, eager on CPU). The lighter option beside `MP_COMPILE`, which compiles the layers "
               "(not both). docs/gpu.md"),
    Option("MP_COMPILE", CORE, BOOL, "true: torch.compile each decoder layer, whole where it traces to one graph, "
           "else its attention, norms and MLP apart (bf16 and fp8; the dry run says which, per kind of layer, and why)",
           default=False, field="compile_layers",
           doc="`true`: each decoder layer (megatron-core's `TransformerLayer` or a family's own, DeepSeek-V4's "
               "included) compiled in place with `torch.compile` (without transformer-engine's spec; bf16 and fp8, "
               "CPU and GPU), decided per kind of layer at its first call: whole where it traces to one graph "
               "(norms, RoPE, SwiGLU and torchao's float8 casts fused around the GEMMs), else its parts apart "
               "(attention, norms, MLP or the MoE block's router and experts; what does not trace stays eager). The "
               "dry run (on the family's tiny model) and the training log say per kind what was compiled and the "
               "first break's reason; a kind of which nothing compiles is refused. The first step compiles (tens of "
               "seconds). Not with `MP_COMPILE_FUSIONS=true`, whose pieces it covers ([docs/fp8.md](../docs/fp8.md))"),
    Option("MP_GPU_MEMORY_GB", CORE, NUMBER, "memory per GPU the memory plan checks against; ENV=cpu: the 'device' "
           "budget of OPTIMIZER_OFFLOAD=auto and the plan", field="gpu_memory_gb",
           default=Default("the visible GPU's"),
           doc="device memory per rank the memory plan checks against; on ENV=cpu also the \"device\" budget of "
               "OPTIMIZER_OFFLOAD=auto"),
    Option("MP_OFFLOAD_NUMERICS", CORE, choice("fast", "exact"), "fast | exact: optimizer updates bit-identical on "
           "every tier and schedule", default="fast", field="offload_numerics",
           doc="`fast`: torch's AdamW kernels (on CPU bit-identical to megatron's optimizer) \\| `exact`: "
               "single-rounding IEEE steps: any offload layout, on any device, gives the bits of no offload; with "
               "OPTIMIZER_OFFLOAD=false it still runs the chunked optimizer"),
    Option("MP_OFFLOAD_MARGIN_GB", CORE, NUMBER, "OPTIMIZER_OFFLOAD=auto: device memory kept free", default=2.0,
           field="offload_margin_gb"),
    Option("MP_OFFLOAD_PATIENCE", CORE, INTEGER, "OPTIMIZER_OFFLOAD=auto: steps with room before chunks come back to "
           "the GPU", default=3, field="offload_patience"),
    Option("MP_OFFLOAD_COOLDOWN", CORE, integer(lo=0), "OPTIMIZER_OFFLOAD=auto: steps after an eviction with no "
           "promotion", default=5, field="offload_cooldown"),
    Option("MP_OFFLOAD_CHUNK_MB", CORE, NUMBER, "optimizer offload chunk size in MiB of fp32 elements",
           field="offload_chunk_mb", default=Default("the least fragmentation")),
    Option("MP_OFFLOAD_PROBE_SCRIPT", CORE, TEXT, "testing: JSON {\"device_fraction\": {\"ITER\": share}} replaces "
           "auto's memory readings", field="offload_probe_script", takes="JSON file",
           doc="testing: JSON `{\"device_fraction\": {\"ITERATION\": share}}` replaces auto's memory readings"),
    Option("MP_OFFLOAD_TIMING", CORE, BOOL, "true: time the offloaded step's phases (adds synchronisations; "
           "benchmarks)", default=False, field="offload_timing",
           doc="`true`: time each step's forward/backward, copies, CPU and device Adam (adds synchronisations)"),
    Option("MP_LOSS_SCALE_WINDOW", CORE, INTEGER, "PR=fp16: good steps before the dynamic loss scale doubles",
           default=1000, field="loss_scale_window",
           doc="PR=fp16: good steps before the dynamic loss scale doubles (Megatron-LM's `--loss-scale-window`)"),
    Option("MP_INJECT_FAULT", CORE,
           Reader(lambda name, raw: parse_faults(raw), f"KIND@ITERATION, comma-separated ({' | '.join(KINDS)})",
                  "boom@1"),
           "testing: overflow@N (inf gradients at iteration N), kill@N (SIGKILL as N starts), error@N (an exception "
           "as N starts), comma-separated", default=[], field="faults",
           doc="testing the recovery paths: `overflow@N` fills the gradient buffers with inf after iteration N's "
               "backward (the step must be skipped; fp16's scale is lowered at the second, its hysteresis), "
               "`kill@N` sends SIGKILL to every rank and its helper processes as iteration N starts (the next launch must resume), `error@N` raises an "
               "exception on every rank as iteration N starts (the launcher's one line, the tracebacks in "
               "`log/rank<R>-error.log`); comma-separated. A group `MP_MAX_RESTARTS` restarts is not killed or "
               "failed again"),
    Option("MP_EXIT_INTERVAL", CORE, INTEGER, "stop after this many iterations (after saving), e.g. to test a resume",
           field="exit_interval"),
    Option("MP_LOG_INTERVAL", CORE, INTEGER, "log every this many iterations", default=1, field="log_interval"),
    Option("MP_EVAL_INTERVAL", CORE, integer(lo=0), "validate every this many iterations and after the last one (as "
           "Pai-Megatron-Patch; 0: never)", default=10000, field="eval_interval"),
    Option("MP_EVAL_ITERS", CORE, integer(hi=MAX_ITERATIONS), "validation global batches per evaluation",
           default=10, field="eval_iters"),
    Option("MP_SPLIT", CORE, Reader(_split, "train,valid,test shares, e.g. 99,1,0", "99,0,1"),
           "pretraining: hold validation out of DATASET_PATH by these shares of its sequences (documents), as Pai's "
           "launcher does (--split 99,1,0); VALID_DATASET_PATH is then none or DATASET_PATH", default=Default(
               "unset: validation reads VALID_DATASET_PATH"), field="split",
           doc="pretraining: Megatron-LM's `--split`, which Pai's pretraining launcher passes as `99,1,0`: "
               "megatron-core cuts DATASET_PATH's sequences (each prefix's of a blend) into train, validation and "
               "test shares, trains on the first and validates on the second, which training never reads. A sequence "
               "is a document of `mpatch preprocess`'s data; in Megatron-LM's and Pai's sentence-split data it is a "
               "sentence, and the cut may fall inside a document. "
               "VALID_DATASET_PATH is then none or DATASET_PATH itself (Pai's README gives one prefix for both, "
               "and Pai's launcher ignores it); other data there is refused. Not with SFT=true"),
    # at most 2**32 - 1: megatron-core's datasets and lm-eval (MP_EVAL_TASKS) seed numpy with it, which takes no more
    Option("MP_SEED", CORE, integer(lo=0, hi=2**32 - 1), "random seed (pipeline stage p initialises with seed + 100*p)",
           default=1234, field="seed", doc="random seed (pipeline stage p initialises with seed + 100\\*p)"),
    Option("MP_WEIGHT_DECAY", CORE, NUMBER, "AdamW weight decay, held constant by the scheduler",
           default=Default(lambda: "what Pai-Megatron-Patch's launcher for the family passes: " + _weight_decays(),
                           lambda family, launcher: launcher.weight_decay(family)),
           field="weight_decay"),
    Option("MP_MOE_AUX_LOSS", CORE, NUMBER, "MoE: coefficient of megatron-core's load-balancing loss "
           "(--moe-aux-loss-coeff)", field="moe_aux_loss",
           default=Default(lambda: "0.001, what most of Pai-Megatron-Patch's MoE launchers pass; a Pai script's own "
                           "where it passes another (" + _pai_moe_settings() + "); config.json's router_aux_loss_coef "
                           "where its output_router_logits is true on this project's own launchers, as transformers "
                           "trains with it then"),
           doc="MoE: coefficient of megatron-core's load-balancing loss (Megatron-LM's `--moe-aux-loss-coeff`), "
               "whose gradient is added to the language-model loss's (the logged `loss` is that loss alone; the "
               "balancing loss itself, without its coefficient, is logged as `load_balancing_loss`, the mean over MoE "
               "layers as Megatron-LM logs it, `seq_load_balancing_loss` for DeepSeek's `seq_aux` and Pai's Qwen2-MoE "
               "script). Default 0.001, what Pai-Megatron-Patch's launchers pass for Qwen's "
               "and DeepSeek's MoE; on Pai's own script for a family, what that script passes (its Mistral script 0.01 "
               "for Mixtral, its dense Qwen2 script none for A14B; its Qwen2-MoE and DeepSeek-V3 scripts balance per "
               "sequence, `seq_aux_loss`); on this project's launchers, where config.json's `output_router_logits` is "
               "true, its `router_aux_loss_coef`, "
               "as transformers trains then (transformers adds none otherwise: gpt-oss publishes 0.9 with "
               "`output_router_logits` false). `0`: none. Refused for a dense model and a router without one "
               "(Gemma 4, DeepSeek-V4); the dry run's megatron-core settings show it as `moe_aux_loss_coeff`"),
    Option("MP_HF_CONFIG", CORE, TEXT, "HF config.json (or folder) of a PRETRAIN_CHECKPOINT_PATH written by another "
           "tool without saved arguments (Megatron-Bridge); checked against its tensors (docs/foreign-checkpoints.md)",
           takes="config.json or its folder",
           doc="HF config.json (or its folder) of a PRETRAIN_CHECKPOINT_PATH written by another tool that saved no "
               "arguments (Megatron-Bridge); checked against its tensors, every disagreement named "
               "([docs/foreign-checkpoints.md](../docs/foreign-checkpoints.md))"),
    Option("MP_NUM_LAYERS", CORE, INTEGER, "override MODEL_SIZE's layer count (a same-shaped proxy for benchmarks; "
           "not with a checkpoint)",
           doc="overrides MODEL_SIZE's layer count: the model's shape with fewer layers, for benchmarks "
               "(`scripts/gpu_suite.sh`); not with a checkpoint"),
    Option("MP_SAVE", CORE, BOOL, "false: write no checkpoints and no final/ export (benchmarks)", default=True,
           field="save"),
    Option("MP_NO_VERIFY", CORE, BOOL, "true: read PRETRAIN_CHECKPOINT_PATH and the run's own checkpoints without "
           "checking their files against their manifests (a checkpoint edited on purpose; mcore2hf's and align's "
           "--no-verify)", default=False, field="no_verify",
           doc="`true`: read PRETRAIN_CHECKPOINT_PATH and the run's own checkpoints without checking their files "
               "against their `mpatch_manifest.json` (a checkpoint edited on purpose: surgery, debugging); `mpatch "
               "convert mcore2hf` and `mpatch align` take `--no-verify`"),
    Option("MP_LORA_RANK", LORA, integer(lo=0), "R: train LoRA adapters of rank R on the frozen "
           "PRETRAIN_CHECKPOINT_PATH (0: full fine-tuning; docs/lora.md)", default=0,
           doc="`R`: LoRA adapters of rank R on the frozen PRETRAIN_CHECKPOINT_PATH (0: full fine-tuning); "
               "checkpoints hold the adapters and their optimizer state and name the base by path and digest "
               "([docs/lora.md](../docs/lora.md))"),
    Option("MP_LORA_ALPHA", LORA, _above_zero(), "LoRA alpha: the adapters' output is scaled by alpha/R",
           default=Default("R")),
    Option("MP_LORA_DROPOUT", LORA, Reader(_below_one, "number in [0, 1)", "1"), "dropout on the adapters' input",
           default=Default("0")),
    Option("MP_LORA_TARGETS", LORA, Reader(lambda name, raw: parse_targets(raw),
                                           f"comma list out of {','.join(LORA_TARGETS)}", "bogus"),
           f"the linears that get adapters, a comma list out of {','.join(LORA_TARGETS)}",
           default=Default(lambda: "those of " + ",".join(LoraSpec.__dataclass_fields__["targets"].default)
                           + " the family has"),
           doc="the linears that get adapters (an MoE family without dense MLPs: qkv,proj by default); a target named "
               "that the family lacks is refused"),
    Option("MP_LORA_INIT", LORA, TEXT, "a peft adapter folder to start the adapters from (its config decides rank, "
           "alpha, targets)", takes="peft adapter folder", doc="a peft adapter folder to start from; its config decides rank, alpha, targets and "
                                  "per-module patterns"),
    Option("MP_DSA_INDEXER_LOSS_SCALE", DSA, NUMBER, "S: DeepSeek sparse attention's indexer loss (megatron-core's KL "
           "to the attention) at coefficient S (0: off, the indexer frozen as released)",
           default=Default("0, with MP_DSA_INDEXER_ONLY=true 1"),
           doc="DeepSeek-V3.2 / GLM-5: `S` turns megatron-core's indexer loss on at coefficient S (0: off, the "
               "indexers frozen as released); logged as `indexer loss` "
               "([docs/sparse-attention.md](../docs/sparse-attention.md))"),
    Option("MP_DSA_INDEXER_ONLY", DSA, BOOL, "true: DeepSeek's dense warm-up: dense attention, only the indexers "
           "train (their loss at MP_DSA_INDEXER_LOSS_SCALE)", default=False,
           doc="DeepSeek-V3.2 / GLM-5: `true` is DeepSeek's dense warm-up: dense attention, only the indexers train "
               "(their loss at MP_DSA_INDEXER_LOSS_SCALE, default 1)"),
    Option("MP_FP8_RECIPE", FP8, choice(*ALL_RECIPES), f"PR=fp8's scaling recipe: transformer-engine's "
           f"{' | '.join(TE_RECIPES)}; torchao's {' | '.join(TORCHAO_RECIPES)}", field="fp8_recipe",
           default=Default("delayed with transformer-engine, tensorwise with torchao"),
           doc="needs PR=fp8. transformer-engine: delayed/tensorwise: compute capability >= 8.9; blockwise: >= 9.0 "
               "with CUDA >= 12.9; mxfp8: 10.x (Blackwell). torchao (no transformer-engine): tensorwise (one "
               "dynamic scale per tensor), rowwise (per row, scales powers of 2), rowwise_with_gw_hp (rowwise, the "
               "weight gradient in bf16); a scale that spans a TP split is the whole tensor's "
               "([docs/fp8.md](../docs/fp8.md))"),
    Option("MP_FP8_FILTER", FP8, Reader(parse_filter, f"auto | all | comma list of {','.join(FP8_KINDS)}", "bogus"),
           "PR=fp8 with torchao: which decoder GEMMs run in float8: auto (torchao's filter: large enough, sizes "
           "multiples of 16) | all | a comma list of kinds", default="auto", field="fp8_filter",
           doc="PR=fp8 with torchao: `auto`: torchao's auto-filter on each HF linear's shape (small GEMMs stay bf16; "
               "every tiny test model's do); `all`: every decoder linear; or kinds, e.g. `qkv,fc1,fc2` (a kind the "
               "family lacks is refused). The embedding, the output layer and routers stay bf16; the dry run lists "
               "each GEMM"),
    Option("MP_EVAL_TASKS", EVALUATION, Reader(_task_list, "comma list of lm-eval task names", ","),
           "lm-evaluation-harness tasks run on the live model every MP_EVAL_TASKS_INTERVAL iterations "
           "(docs/evaluation.md)", field="eval_tasks",
           doc="lm-evaluation-harness tasks (the shipped offline `mpatch_perplexity`, `mpatch_arithmetic_choice`, "
               "`mpatch_arithmetic`, or lm-eval's own where their data can be reached) evaluated on the live model "
               "at the training layout, no save or reload; results in the log, TensorBoard (`eval/TASK/METRIC`) and "
               "`eval/results.jsonl` ([docs/evaluation.md](../docs/evaluation.md)). Not with a virtual pipeline"),
    Option("MP_EVAL_INCLUDE_PATH", EVALUATION, TEXT, "a folder of lm-eval task YAML files for MP_EVAL_TASKS "
           "(mpatch eval's --include-path)", takes="folder", field="eval_include_path"),
    Option("MP_EVAL_TASKS_INTERVAL", EVALUATION, INTEGER, "evaluate MP_EVAL_TASKS every this many iterations and "
           "after the last one",
           default=Default("MP_EVAL_INTERVAL", lambda eval_interval: eval_interval), field="eval_tasks_interval"),
    Option("MP_EVAL_TASKS_LIMIT", EVALUATION, Reader(_document_limit, "count, or a fraction below 1", "0"),
           "documents per task of MP_EVAL_TASKS (a fraction below 1: that share)", default=Default("all"),
           field="eval_tasks_limit"),
]

OPTIONS = POSITIONAL + ENVIRONMENT
OPTION = {option.name: option for option in OPTIONS}
POSITIONAL_NAMES = frozenset(option.name for option in POSITIONAL)

# The RunConfig fields no option fills on its own: what the run derives from its options, and from what.
DERIVED = {
    "launcher": "the launcher `mpatch train` runs",
    "family": "MODEL_SIZE on the launcher, or the checkpoint's",
    "hf_config": "MODEL_SIZE's preset, or PRETRAIN_CHECKPOINT_PATH's architecture (MP_HF_CONFIG), MP_NUM_LAYERS",
    "vocab_padded_to": "PRETRAIN_CHECKPOINT_PATH's vocabulary padding",
    "mtp_layers": "PRETRAIN_CHECKPOINT_PATH's multi-token-prediction layers",
    "dataset_path": "DATASET_PATH, split into paths", "dataset_weights": "DATASET_PATH's blend weights",
    "valid_dataset_path": "VALID_DATASET_PATH, split into paths",
    "valid_dataset_weights": "VALID_DATASET_PATH's blend weights",
    "train_iters": "TRAIN_TOKENS_OR_ITERS (tokens / (GLOBAL_BATCH_SIZE*SEQ_LEN) for pretraining)",
    "warmup_iters": "WARMUP_TOKENS_OR_ITERS, as TRAIN_TOKENS_OR_ITERS",
    "lr_decay_iters": "the training iterations (SFT: training minus warm-up, Pai's --lr-decay-iters)",
    "virtual_pipeline": "MP_VP or MP_VP_CHUNKS", "virtual_pipeline_setting": "MP_VP or MP_VP_CHUNKS",
    "overlap_grad_reduce": "always on", "overlap_param_gather": "DO (MP_OVERLAP_PARAM_GATHER insists)",
    "world_size": "ENV: MP_NPROC, GPUS_PER_NODE, KUBERNETES_CONTAINER_RESOURCE_GPU, PAI-DLC's WORLD_SIZE",
    "nproc_per_node": "as world_size", "nnodes": "ENV=dlc: PAI-DLC's WORLD_SIZE",
    "device": "ENV (dlc: whether the node has a GPU)",
    "lora": "the LoRA part's MP_LORA_* (training/lora_run.py)", "lora_init": "MP_LORA_INIT",
    "dsa": "the DSA part's MP_DSA_* (training/sparse_attention_run.py)",
    "checkpoint_tokenizer": "PRETRAIN_CHECKPOINT_PATH: the folder that carries its tokenizer",
    "notes": "what the run adjusted, and why",
}


# --- the engine -----------------------------------------------------------------------------------------------

_UNSETTLED = object()


class Options:
    """A launch's options as read: ``options[NAME]`` is its value (its default where not given); ``given`` and
    ``raw`` what the launch wrote. A value the run adjusts (SP=true at TP=1, with a note) is set back with
    ``options[NAME] = value``; a default that depends on the run is computed by ``settle``."""

    def __init__(self, values: dict, raw: dict):
        self._values, self._raw = values, raw

    def __getitem__(self, name: str):
        value = self._values[name]
        if value is _UNSETTLED:
            raise RuntimeError(f"{name}'s default depends on the run: settle it before reading it")
        return value

    def __setitem__(self, name: str, value) -> None:
        self._values[name] = value

    def given(self, name: str) -> bool:
        return name in self._raw

    def raw(self, name: str) -> str:
        return self._raw[name]

    def settle(self, name: str, **run):
        """The value of ``name``: given, or its default computed from ``run`` (what that default depends on)."""
        if self._values[name] is _UNSETTLED:
            self._values[name] = OPTION[name].default.compute(**run)
        return self._values[name]

    def fields(self) -> dict:
        """The RunConfig fields the options fill."""
        out = {}
        for option in OPTIONS:
            if isinstance(option.field, tuple):
                out.update(zip(option.field, self[option.name]))
            elif option.field is not None:
                out[option.field] = self[option.name]
        return out


def _unset(option: Option):
    if isinstance(option.default, Default):
        return None if option.default.compute is None else _UNSETTLED
    return copy.copy(option.default)


def read_options(launcher: Launcher, argv: list[str], env: dict) -> Options:
    """Every option of a launch read, in the table's order: the positional arguments (the layout their count
    selects) and the environment options (unset or empty: the default)."""
    raw = dict(zip(launcher.arg_names(launcher.layout_of(argv)), argv))
    raw.update({o.name: env[o.name] for o in ENVIRONMENT if env.get(o.name, "") != ""})
    return Options({o.name: o.reader.read(o.name, raw[o.name]) if o.name in raw else _unset(o) for o in OPTIONS},
                   raw)


def read_option(name: str, env: dict):
    """One environment option on its own (MP_DRY_RUN, read before the rest decides what this process is)."""
    option = OPTION[name]
    raw = env.get(name, "")
    return _unset(option) if raw == "" else option.reader.read(name, raw)


# MP_ variables of the project's runtime, not launcher options: the launcher leaves them alone.
RUNTIME_VARIABLES = frozenset({"MP_LAUNCHER_PID", "MP_LAUNCHER_WARNED", "MP_LAUNCHER_REFUSED", "MP_LAUNCHER_COMPLETE",
                               "MP_LOCAL_START", "MP_CPU_COMPAT_ANY_MCORE", "MP_SHOW_WARNINGS"})


def unread_variables(env: dict) -> list[str]:
    """Notes for the MP_ variables in ``env`` that no option reads. One that nearly spells an option's name is
    refused: a launch with MP_LORA_RANKS=8 would otherwise train every weight, with no word about it."""
    names = [o.name for o in ENVIRONMENT] + sorted(RUNTIME_VARIABLES)
    if env.get("MP_LOCAL_START", "") not in ("", "spawn"):
        raise UserError(f"MP_LOCAL_START takes spawn (a fresh interpreter per rank; unset: forked from a preloaded "
                        f"fork server), got {env['MP_LOCAL_START']!r}")
    notes = []
    for name in sorted(k for k in env if k.startswith("MP_") and k not in OPTION and k not in RUNTIME_VARIABLES):
        near = difflib.get_close_matches(name, names, n=1, cutoff=0.85)
        if near:
            raise UserError(f"{name} is not a launcher option: did you mean {near[0]}? (unset {name}; "
                            "examples/README.md lists the options)")
        notes.append(f"{name} is set but is not a launcher option: it is ignored (examples/README.md lists them)")
    return notes


def usage(name: str) -> str:
    """--help of launcher ``name``."""
    launcher = get_launcher(name)
    lines = [f"usage: {launcher.script} " + " ".join(launcher.arg_names(layout)) for layout in launcher.layouts]
    names = launcher.arg_names()
    lines += ["", f"{len(names)} positional arguments, in this order:"]
    sizes = " | ".join([describe_size(launcher, s) for s in launcher.sizes] + ["auto"])
    for i, arg in enumerate(names, 1):
        lines.append(f"  {i:2d} {arg:<25} {OPTION[arg].help}" + (f" [{sizes}]" if arg == "MODEL_SIZE" else ""))
    for layout in launcher.layouts[1:]:
        lines.append(f"  or {len(launcher.arg_names(layout))}, with {', '.join(layout) or 'nothing'} after CP "
                     "(Pai-Megatron-Patch's order for this script)")
    for part in PARTS:
        lines += ["", f"environment options ({part}):"]
        lines += [f"  {o.name:<25} {o.help_line()}" for o in ENVIRONMENT if o.part == part]
    return "\n".join(lines)


def dry_run_options(cfg, env: dict) -> dict:
    """The dry run's list: each environment option's value as given, or as the run resolved it, or what its
    default says; ``set``: whether the launch gave it."""
    out = {}
    for option in ENVIRONMENT:
        given = env.get(option.name, "") != ""
        if given:
            value = env[option.name]
        elif isinstance(option.field, str) and getattr(cfg, option.field) not in (None, []):
            value = _shown(getattr(cfg, option.field))
        else:
            value = option.default_text() or "unset"
        out[option.name] = {"value": value, "set": given, "part": option.part}
    # LoRA's settings from an adapter (MP_LORA_INIT's, or the one PRETRAIN_CHECKPOINT_PATH carries), which no option
    # fills: the list said MP_LORA_RANK 0 (full fine-tuning) where the adapter's rank trains
    lora = getattr(cfg, "lora", None)
    if lora and not out["MP_LORA_RANK"]["set"]:
        source = "MP_LORA_INIT's adapter" if getattr(cfg, "lora_init", None) else "the checkpoint's adapter"
        for name, value in (("MP_LORA_RANK", lora["rank"]), ("MP_LORA_ALPHA", f"{lora['alpha']:g}"),
                            ("MP_LORA_DROPOUT", f"{lora['dropout']:g}"),
                            ("MP_LORA_TARGETS", ",".join(lora["targets"]))):
            if not out[name]["set"]:
                out[name]["value"] = f"{value} ({source})"
    return out


def _shown(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# --- the docs' tables -----------------------------------------------------------------------------------------

def _positions(name: str) -> str:
    """Where ``name`` sits among the arguments, over every launcher's layouts ('13 / 14')."""
    found = sorted({launcher.arg_names(layout).index(name) + 1 for launcher in launchers().values()
                    for layout in launcher.layouts if name in launcher.arg_names(layout)})
    return " / ".join(map(str, found))


def _cell(text: str) -> str:
    """``text`` inside a table cell: its | and * as themselves (a cell written for the docs keeps its escapes)."""
    return text if "\\" in text else text.replace("|", "\\|").replace("*", "\\*")


def markdown(table: str) -> str:
    """examples/README.md's tables: ``positional`` (the arguments in order) or ``environment``."""
    if table == "positional":
        rows = ["| # | name | values | becomes |", "| --- | --- | --- | --- |"]
        rows += [f"| {_positions(o.name)} | {o.name} | {_cell(o.values_text())} | "
                 f"{o.doc or o.help} |" for o in POSITIONAL]
    elif table == "environment":
        rows = ["| variable | part | values | default | meaning |", "| --- | --- | --- | --- | --- |"]
        rows += [f"| `{o.name}` | {o.part} | {_cell(o.values_text())} | "
                 f"{_cell(o.default_text())} | {o.doc or o.help} |" for o in ENVIRONMENT]
    else:
        raise ValueError(f"no options table '{table}'")
    return "\n".join(rows) + "\n"


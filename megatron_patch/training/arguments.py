"""The positional launcher interface (Pai-Megatron-Patch order), resolved into one typed ``RunConfig``.

Everything a launch can get wrong is checked here, before any process starts: the number of
arguments, each value's type and allowed values, combinations megatron-core would reject deep inside
(TP overlap without sequence parallelism, param-gather overlap without the distributed optimizer),
and, separately, what this machine can do (``check_machine``: FP8, FlashAttention, sequence parallelism,
TP overlap, context parallelism and activation offloading need a GPU with transformer-engine).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_patch.errors import UserError
from megatron_patch.runtime.distributed import ParallelLayout
from megatron_patch.runtime.machine import Capabilities  # noqa: F401 (the launcher's checks take it)

# --- the positional interface ----------------------------------------------------------------------

HEAD = ["ENV", "MODEL_SIZE", "BATCH_SIZE", "GLOBAL_BATCH_SIZE", "LR", "MIN_LR", "SEQ_LEN", "PAD_LEN", "PR",
        "TP", "PP", "CP"]
TAIL = ["SP", "DO", "FL", "SFT", "AC", "OPTIMIZER_OFFLOAD", "SAVE_INTERVAL", "DATASET_PATH", "VALID_DATASET_PATH",
        "PRETRAIN_CHECKPOINT_PATH", "TRAIN_TOKENS_OR_ITERS", "WARMUP_TOKENS_OR_ITERS", "OUTPUT_BASEPATH"]



def launchers() -> dict[str, list[str]]:
    """family -> parallel sizes its launcher takes after CP (the reference launchers' order)."""
    from megatron_patch.models.registry import families

    return {name: list(f.launcher_parallel_args) for name, f in families().items()}

ARG_HELP = {
    "ENV": "dsw (one node, all its GPUs) | dlc (multi-node: WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT; on "
           "CPU nodes gloo) | cpu (local gloo processes); all start through torchrun",
    "MODEL_SIZE": "a published size of the family, tiny, or auto (architecture from PRETRAIN_CHECKPOINT_PATH)",
    "BATCH_SIZE": "micro-batch size per data-parallel rank (integer >= 1)",
    "GLOBAL_BATCH_SIZE": "samples per optimizer step; a multiple of BATCH_SIZE * data-parallel size",
    "LR": "peak learning rate (> 0)",
    "MIN_LR": "final learning rate of the cosine decay (0 <= MIN_LR <= LR)",
    "SEQ_LEN": "sequence length of pretraining samples",
    "PAD_LEN": "SFT sample length (samples are padded or packed to it); <= SEQ_LEN",
    "PR": "precision: fp16 | bf16 | fp8 (transformer-engine, hybrid format) | fp32 (CPU development)",
    "TP": "tensor parallel size", "PP": "pipeline parallel size", "CP": "context parallel size",
    "ETP": "expert tensor parallel size (MoE)", "EP": "expert parallel size (MoE)",
    "SP": "sequence parallelism: true | false (TP > 1 with SP=true also turns on TP communication overlap)",
    "DO": "distributed optimizer: true | false (true also overlaps the parameter all-gather)",
    "FL": "flash attention: true | false (FlashAttention-3 when its Hopper build is installed)",
    "SFT": "true: fine-tune on SFT data (token counts become iteration counts) | false: pretrain",
    "AC": "activation checkpointing: sel | full | offload | none (MP_AC_LAYERS layers for full/offload)",
    "OPTIMIZER_OFFLOAD": "false | static (all optimizer state on the host) | a fraction 0..1 on the host | auto "
                         "(what the GPU cannot hold, measured each step); forces DO=true",
    "SAVE_INTERVAL": "save a checkpoint every this many iterations",
    "DATASET_PATH": "pretraining: mmap data prefix(es) (P_text_document, optionally 'W1 P1 W2 P2'); "
                    "SFT: a JSON/JSONL file",
    "VALID_DATASET_PATH": "validation data like DATASET_PATH, or none",
    "PRETRAIN_CHECKPOINT_PATH": "a checkpoint from 'mpatch convert hf2mcore' to start from, or none",
    "TRAIN_TOKENS_OR_ITERS": "pretraining: training tokens; SFT: iterations",
    "WARMUP_TOKENS_OR_ITERS": "pretraining: warm-up tokens; SFT: warm-up iterations",
    "OUTPUT_BASEPATH": "where checkpoints, logs and TensorBoard go; a rerun with the same path resumes",
}

# Environment extras (name -> meaning); documented in examples/README.md.
EXTRAS = {
    "MP_DRY_RUN": "1: print the resolved configuration and command, train nothing",
    "MP_DATASET_TYPE": "mmap (default for pretraining) | raw (JSON/JSONL, the default for SFT)",
    "MP_AC_LAYERS": "layers recomputed (AC=full) or offloaded (AC=offload) per stage (default 1)",
    "MP_VP": "virtual pipeline stages (model chunks) per pipeline rank: interleaved 1F1B; needs PP > 1",
    "MP_SFT_PACKING": "true: pack several SFT samples into one PAD_LEN sequence",
    "MP_PP0_LAYERS": "layers on the first pipeline stage (the rest split evenly)",
    "MP_FP8_RECIPE": "delayed (default) | tensorwise | mxfp8 | blockwise",
    "MP_TP_COMM_OVERLAP": "false: keep SP but turn TP communication overlap off (needed without transformer-engine)",
    "MP_OVERLAP_PARAM_GATHER": "true: insist on param-gather overlap (refused without DO=true); default follows DO",
    "MP_NPROC": "ENV=cpu: number of local processes (default TP*PP*CP, or what the expert layout needs)",
    "MP_TOKENIZER": "tokenizer folder (tokenizer.json) or tiktoken file for SFT data (default: the checkpoint's)",
    "MP_NAN_POLICY": "stop (default) | skip: what a NaN/inf loss does",
    "MP_GPU_MEMORY_GB": "memory per GPU the memory plan checks against (default: the visible GPU's); ENV=cpu: the "
                        "'device' budget of OPTIMIZER_OFFLOAD=auto and the plan",
    "MP_OFFLOAD_NUMERICS": "fast (default) | exact: optimizer updates bit-identical on every tier and schedule",
    "MP_OFFLOAD_MARGIN_GB": "OPTIMIZER_OFFLOAD=auto: device memory kept free (default 2)",
    "MP_OFFLOAD_PATIENCE": "OPTIMIZER_OFFLOAD=auto: steps with room before chunks come back to the GPU (default 3)",
    "MP_OFFLOAD_COOLDOWN": "OPTIMIZER_OFFLOAD=auto: steps after an eviction with no promotion (default 5)",
    "MP_OFFLOAD_CHUNK_MB": "optimizer offload chunk size in MiB of fp32 elements (default: least fragmentation)",
    "MP_OFFLOAD_PROBE_SCRIPT": "testing: JSON {\"device_fraction\": {\"ITER\": share}} replaces auto's memory readings",
    "MP_OFFLOAD_TIMING": "true: time the offloaded step's phases (adds synchronisations; benchmarks)",
    "MP_LOSS_SCALE_WINDOW": "PR=fp16: good steps before the dynamic loss scale doubles (default 1000)",
    "MP_INJECT_FAULT": "testing: overflow@N (inf gradients at iteration N), kill@N (SIGKILL as N starts), comma-separated",
    "MP_EXIT_INTERVAL": "stop after this many iterations (after saving), e.g. to test a resume",
    "MP_LOG_INTERVAL": "log every this many iterations (default 1)",
    "MP_EVAL_INTERVAL": "validate every this many iterations (default 100, 0: never)",
    "MP_EVAL_ITERS": "validation micro-batch rounds per evaluation (default 10)",
    "MP_SEED": "random seed (default 1234; pipeline stage p initialises with seed + 100*p)",
    "MP_HF_CONFIG": "HF config.json (or folder) of a PRETRAIN_CHECKPOINT_PATH written by another tool without saved "
                    "arguments (Megatron-Bridge); checked against its tensors (docs/foreign-checkpoints.md)",
    "MP_NUM_LAYERS": "override MODEL_SIZE's layer count (a same-shaped proxy for benchmarks; not with a checkpoint)",
    "MP_SAVE": "false: write no checkpoints and no final/ export (benchmarks)",
    "MP_MAX_RESTARTS": "restart the ranks up to N times after a failure (torchrun --max-restarts); each restart "
                       "resumes from the latest complete checkpoint (default 0)",
    "MP_DIST_TIMEOUT_MIN": "minutes a collective may wait for the other ranks before the job fails naming the "
                           "rank that stopped answering (default 10)",
    "GPUS_PER_NODE": "dsw/dlc: processes per node (default: the GPUs visible; 1 on a dlc node without GPUs)",
}

FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
ENVS = ("dsw", "dlc", "cpu")
PRECISIONS = ("fp16", "bf16", "fp8", "fp32")
AC_MODES = ("sel", "full", "offload", "none")


def arg_names(family: str) -> list[str]:
    known = launchers()
    if family not in known:
        raise UserError(f"no launcher for family '{family}': launchers exist for {', '.join(known)}")
    return HEAD + known[family] + TAIL


def presets(family: str) -> dict[str, dict]:
    from megatron_patch.models.registry import get_family

    return dict(get_family(family).presets)


def usage(family: str) -> str:
    from megatron_patch.models.registry import get_family

    names = arg_names(family)
    script = get_family(family).launcher
    lines = [f"usage: {script} " + " ".join(names), "",
             f"{len(names)} positional arguments, in this order:"]
    sizes = " | ".join([*presets(family), "auto"])
    for i, name in enumerate(names, 1):
        text = ARG_HELP[name] + (f" [{sizes}]" if name == "MODEL_SIZE" else "")
        lines.append(f"  {i:2d} {name:<25} {text}")
    lines += ["", "environment extras:"] + [f"  {k:<19} {v}" for k, v in EXTRAS.items()]
    return "\n".join(lines)


# --- the resolved configuration --------------------------------------------------------------------

@dataclass
class RunConfig:
    family: str
    env: str
    model_size: str
    micro_batch_size: int
    global_batch_size: int
    lr: float
    min_lr: float
    seq_len: int
    pad_len: int
    precision: str
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int | None
    sequence_parallel: bool
    distributed_optimizer: bool
    flash_attention: bool
    sft: bool
    activation_checkpointing: str
    optimizer_offload_fraction: float  # static: share on the host; 0: off
    save_interval: int
    dataset_path: list[str]
    dataset_weights: list[float] | None
    valid_dataset_path: list[str] | None
    pretrain_checkpoint: str | None
    train_iters: int
    warmup_iters: int
    output_basepath: str
    # extras
    dataset_type: str = "mmap"
    ac_layers: int = 1
    virtual_pipeline: int | None = None
    sft_packing: bool = False
    pp0_layers: int | None = None
    fp8_recipe: str = "delayed"
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = False
    world_size: int = 1
    nproc_per_node: int = 1
    nnodes: int = 1
    # "cuda", or "cpu" for ENV=cpu and for ENV=dlc on nodes without a GPU (gloo, CPU limits)
    device: str = "cuda"
    max_restarts: int = 0
    dist_timeout_min: float = 10.0
    tokenizer: str | None = None
    nan_policy: str = "stop"
    loss_scale_window: int = 1000
    optimizer_offload_policy: str = "off"  # off | static | auto
    offload_numerics: str = "fast"
    offload_margin_gb: float = 2.0
    offload_patience: int = 3
    offload_cooldown: int = 5
    offload_chunk_mb: float | None = None
    offload_probe_script: str | None = None
    offload_timing: bool = False
    gpu_memory_gb: float | None = None
    faults: list = field(default_factory=list)
    exit_interval: int | None = None
    log_interval: int = 1
    eval_interval: int = 100
    eval_iters: int = 10
    seed: int = 1234
    save: bool = True
    hf_config: dict = field(default_factory=dict, repr=False)
    # The starting checkpoint's vocabulary padding, when another tool padded it otherwise (Arch).
    vocab_padded_to: int | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(tp=self.tp, pp=self.pp, ep=self.ep, etp=self.etp, cp=self.cp, vp=self.virtual_pipeline)

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def sample_length(self) -> int:
        return self.pad_len if self.sft else self.seq_len

    @property
    def tokens_per_gemm(self) -> int:
        """Rows of every linear layer's GEMM: a micro-batch's tokens on one context-parallel rank."""
        return self.micro_batch_size * self.sample_length // self.cp

    @property
    def arch(self):
        from megatron_patch.models.registry import parse_arch

        return dataclasses.replace(parse_arch(self.hf_config), vocab_padded_to=self.vocab_padded_to)

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.output_basepath) / "checkpoint"

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("hf_config")
        return d


# --- parsing helpers ---------------------------------------------------------------------------------

def _int(name: str, raw: str, lo: int = 1) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"{name} must be an integer, got '{raw}'")
    if value < lo:
        raise UserError(f"{name} must be >= {lo}, got {value}")
    return value


def _count(name: str, raw: str) -> int:
    """A token or iteration count: integers, also written as 1e9 or 10B/500M/20K."""
    text = raw.strip()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}.get(text[-1:].upper(), 1)
    if scale != 1:
        text = text[:-1]
    try:
        value = float(text) * scale
    except ValueError:
        raise UserError(f"{name} must be a count (e.g. 1000000, 1e9 or 10B), got '{raw}'")
    if value < 0 or value != int(value):
        raise UserError(f"{name} must be a whole non-negative count, got '{raw}'")
    return int(value)


def _float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise UserError(f"{name} must be a number, got '{raw}'")
    if not math.isfinite(value) or value < 0:
        raise UserError(f"{name} must be a finite number >= 0, got '{raw}'")
    return value


def _bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise UserError(f"{name} must be true or false, got '{raw}'")


def _choice(name: str, raw: str, allowed) -> str:
    if raw not in allowed:
        raise UserError(f"{name} must be one of {' | '.join(allowed)}, got '{raw}'")
    return raw


def _none(raw: str) -> bool:
    return raw.strip().lower() in ("", "none", "null")


def _data_paths(name: str, raw: str) -> tuple[list[str], list[float] | None]:
    """'P' or 'P1 P2' or 'W1 P1 W2 P2' (Megatron's blend syntax)."""
    parts = raw.split()
    if not parts:
        raise UserError(f"{name} is empty: give a data path")
    try:
        weights = [float(p) for p in parts[0::2]]
    except ValueError:
        return parts, None
    paths = parts[1::2]
    if len(paths) != len(weights):
        raise UserError(f"{name} '{raw}' mixes weights and paths: write 'W1 P1 W2 P2 ...'")
    return paths, weights


def _env_int(env: dict, name: str, default, lo: int = 1):
    raw = env.get(name, "")
    return default if raw == "" else _int(name, raw, lo)


def _env_float(env: dict, name: str, default):
    raw = env.get(name, "")
    return default if raw == "" else _float(name, raw)


def _env_minutes(env: dict, name: str, default: float) -> float:
    value = _env_float(env, name, default)
    if value <= 0:
        raise UserError(f"{name} must be a number of minutes > 0, got '{env.get(name)}'")
    return value


# --- resolve ---------------------------------------------------------------------------------------------

def resolve(family: str, argv: list[str], env: dict | None = None, *, check_paths: bool = True) -> RunConfig:
    """Parse and validate the positional arguments (and MP_* extras in ``env``) into a RunConfig."""
    env = dict(os.environ if env is None else env)
    names = arg_names(family)
    if len(argv) != len(names):
        raise UserError(f"run_mcore_{family}.sh takes {len(names)} arguments ({' '.join(names)}), got {len(argv)}; "
                        f"run it with --help for each one's meaning")
    a = dict(zip(names, argv))

    run_env = _choice("ENV", a["ENV"], ENVS)
    precision = _choice("PR", a["PR"], PRECISIONS)
    sft = _bool("SFT", a["SFT"])
    tp, pp, cp = _int("TP", a["TP"]), _int("PP", a["PP"]), _int("CP", a["CP"])
    ep = _int("EP", a["EP"]) if "EP" in a else 1
    etp = _int("ETP", a["ETP"]) if "ETP" in a else None
    sp = _bool("SP", a["SP"])
    do = _bool("DO", a["DO"])
    fl = _bool("FL", a["FL"])
    ac = _choice("AC", a["AC"], AC_MODES)
    mbs, gbs = _int("BATCH_SIZE", a["BATCH_SIZE"]), _int("GLOBAL_BATCH_SIZE", a["GLOBAL_BATCH_SIZE"])
    lr, min_lr = _float("LR", a["LR"]), _float("MIN_LR", a["MIN_LR"])
    if lr <= 0:
        raise UserError(f"LR must be > 0, got {a['LR']}")
    if min_lr > lr:
        raise UserError(f"MIN_LR ({min_lr}) must not exceed LR ({lr})")
    seq_len, pad_len = _int("SEQ_LEN", a["SEQ_LEN"]), _int("PAD_LEN", a["PAD_LEN"])
    save_interval = _int("SAVE_INTERVAL", a["SAVE_INTERVAL"])

    offload_raw = a["OPTIMIZER_OFFLOAD"].strip().lower()
    notes: list[str] = []
    offload_policy = "static"
    if offload_raw == "false":
        offload, offload_policy = 0.0, "off"
    elif offload_raw == "static":
        offload = 1.0
    elif offload_raw == "auto":
        offload, offload_policy = 0.0, "auto"
    else:
        try:
            offload = float(offload_raw)
        except ValueError:
            offload = -1.0
        if not 0.0 < offload <= 1.0:
            raise UserError(f"OPTIMIZER_OFFLOAD must be false, static, auto or a fraction in (0, 1], got "
                            f"'{a['OPTIMIZER_OFFLOAD']}'")
    offload_numerics = _choice("MP_OFFLOAD_NUMERICS", env.get("MP_OFFLOAD_NUMERICS") or "fast", ("fast", "exact"))
    if (offload_policy != "off" or offload_numerics == "exact") and not do:
        do = True
        notes.append("DO=true: forced by OPTIMIZER_OFFLOAD / MP_OFFLOAD_NUMERICS (the optimizer's chunks are the "
                     "distributed optimizer's bucket shards)")
    gpu_memory_gb = _env_float(env, "MP_GPU_MEMORY_GB", None)
    offload_margin_gb = _env_float(env, "MP_OFFLOAD_MARGIN_GB", 2.0)
    offload_chunk_mb = _env_float(env, "MP_OFFLOAD_CHUNK_MB", None)
    if offload_chunk_mb is not None and offload_chunk_mb <= 0:
        raise UserError("MP_OFFLOAD_CHUNK_MB must be > 0")
    if gpu_memory_gb is not None and gpu_memory_gb <= 0:
        raise UserError("MP_GPU_MEMORY_GB must be > 0")
    offload_probe_script = env.get("MP_OFFLOAD_PROBE_SCRIPT") or None
    if offload_probe_script and offload_policy != "auto":
        raise UserError("MP_OFFLOAD_PROBE_SCRIPT drives OPTIMIZER_OFFLOAD=auto's decisions: set OPTIMIZER_OFFLOAD=auto")
    if offload_probe_script and check_paths and not Path(offload_probe_script).is_file():
        raise UserError(f"MP_OFFLOAD_PROBE_SCRIPT {offload_probe_script} not found")

    # Extras
    dataset_type = env.get("MP_DATASET_TYPE", "") or ("raw" if sft else "mmap")
    _choice("MP_DATASET_TYPE", dataset_type, ("mmap", "raw"))
    if dataset_type == "raw" and not sft:
        raise UserError("MP_DATASET_TYPE=raw (JSON data) is for SFT: set SFT=true, or give mmap data for pretraining")
    if dataset_type == "mmap" and sft:
        raise UserError("SFT=true trains on raw JSON/JSONL data: leave MP_DATASET_TYPE unset or set it to raw")
    ac_layers = _env_int(env, "MP_AC_LAYERS", 1)
    vp = _env_int(env, "MP_VP", None)
    if vp == 1:
        vp = None  # one chunk per rank is the plain pipeline schedule
        notes.append("MP_VP=1: one model chunk per pipeline rank, i.e. no virtual pipeline")
    packing = _bool("MP_SFT_PACKING", env.get("MP_SFT_PACKING") or "false")
    if packing and not sft:
        raise UserError("MP_SFT_PACKING=true applies to SFT only: set SFT=true or drop MP_SFT_PACKING")
    pp0 = _env_int(env, "MP_PP0_LAYERS", None)
    fp8_recipe = _choice("MP_FP8_RECIPE", env.get("MP_FP8_RECIPE") or "delayed", FP8_RECIPES)
    if env.get("MP_FP8_RECIPE") and precision != "fp8":
        raise UserError(f"MP_FP8_RECIPE={env['MP_FP8_RECIPE']} needs PR=fp8, got PR={precision}")
    nan_policy = _choice("MP_NAN_POLICY", env.get("MP_NAN_POLICY") or "stop", ("stop", "skip"))
    loss_scale_window = _env_int(env, "MP_LOSS_SCALE_WINDOW", 1000)
    if env.get("MP_LOSS_SCALE_WINDOW") and precision != "fp16":
        raise UserError(f"MP_LOSS_SCALE_WINDOW applies to PR=fp16's dynamic loss scale, and PR={precision}")
    from megatron_patch.training.faults import parse_faults

    faults = parse_faults(env.get("MP_INJECT_FAULT"))

    # Combinations megatron-core would reject late (or silently ignore).
    if sp and tp == 1:
        raise UserError("SP=true needs TP > 1 (sequence parallelism splits activations over tensor-parallel ranks): "
                        "set SP=false or TP >= 2")
    tp_overlap_env = env.get("MP_TP_COMM_OVERLAP", "")
    tp_comm_overlap = tp > 1 and sp if tp_overlap_env == "" else _bool("MP_TP_COMM_OVERLAP", tp_overlap_env)
    if tp_comm_overlap and not sp:
        raise UserError("TP communication overlap needs sequence parallelism: set SP=true (with TP > 1) "
                        "or MP_TP_COMM_OVERLAP=false")
    overlap_param_gather = do
    if env.get("MP_OVERLAP_PARAM_GATHER") and _bool("MP_OVERLAP_PARAM_GATHER", env["MP_OVERLAP_PARAM_GATHER"]) and not do:
        raise UserError("param-gather overlap needs the distributed optimizer: set DO=true")
    if ac in ("full", "offload") and ac_layers < 1:
        raise UserError("MP_AC_LAYERS must be >= 1")
    if ac == "offload" and pp > 1:
        raise UserError(f"AC=offload (activation CPU offloading) does not work with pipeline parallelism in "
                        f"megatron-core: set PP=1 or AC=sel/full (PP={pp})")
    if fl and precision == "fp32":
        raise UserError("FL=true: FlashAttention has no fp32 kernel: use PR=bf16/fp16/fp8 or FL=false")
    if packing and cp > 1:
        raise UserError(f"MP_SFT_PACKING=true with CP={cp} is not supported (packed sequences would need "
                        "per-document context-parallel partitioning): set CP=1 or drop MP_SFT_PACKING")
    if vp is not None and pp == 1:
        raise UserError(f"MP_VP={vp} (virtual pipeline) needs PP > 1")
    if pp0 is not None and pp == 1:
        raise UserError(f"MP_PP0_LAYERS={pp0} (uneven first stage) needs PP > 1")
    if vp is not None and pp0 is not None:
        raise UserError("MP_VP and MP_PP0_LAYERS cannot be combined: choose one way to split the pipeline")
    if sft and pad_len > seq_len:
        raise UserError(f"PAD_LEN ({pad_len}) must not exceed SEQ_LEN ({seq_len})")

    # Model architecture.
    size = a["MODEL_SIZE"]
    ckpt = None if _none(a["PRETRAIN_CHECKPOINT_PATH"]) else a["PRETRAIN_CHECKPOINT_PATH"]
    hf_config, vocab_padded_to = _model_config(family, size, ckpt, env.get("MP_HF_CONFIG") or None,
                                               _env_int(env, "MP_NUM_LAYERS", None))
    from megatron_patch.models.registry import parse_arch
    from megatron_patch.models.arch import validate_layout

    arch = dataclasses.replace(parse_arch(hf_config), vocab_padded_to=vocab_padded_to)
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp, vp=vp)
    validate_layout(arch, layout, pp_first_stage_layers=pp0)
    if vp is not None and arch.num_layers % (pp * vp):
        raise UserError(f"MP_VP={vp} with PP={pp} needs the {arch.num_layers} layers to split into PP*VP={pp * vp} "
                        "equal chunks")
    if arch.is_moe and tp > 1 and not sp:
        # megatron-core's MoE layer refuses to train under TP without it (deep in the first forward)
        raise UserError("a MoE model trained with TP > 1 needs sequence parallelism: set SP=true")
    length_name, length = ("PAD_LEN", pad_len) if sft else ("SEQ_LEN", seq_len)
    if sp and length % tp:
        raise UserError(f"SP=true splits the sequence over TP={tp}: {length_name} ({length}) must be a multiple of {tp}")
    if cp > 1 and length % (2 * cp):
        # Each CP rank takes two of 2*CP equal chunks (one early, one late) to balance causal attention.
        raise UserError(f"CP={cp} splits the sequence into 2*CP={2 * cp} chunks: {length_name} ({length}) must be a "
                        f"multiple of {2 * cp}")
    _check_activation_checkpointing(ac, ac_layers, arch.num_layers, pp, vp, pp0)
    if precision == "fp8":
        _check_fp8_shapes(arch, fp8_recipe, mbs * length // cp, f"BATCH_SIZE*{length_name}/CP", tp, layout.expert_tp)
    if (pad_len if sft else seq_len) > arch.max_position_embeddings:
        raise UserError(f"sequence length {pad_len if sft else seq_len} exceeds the model's "
                        f"{arch.max_position_embeddings} positions")

    # Processes and data parallelism.
    if run_env == "cpu":
        device = "cpu"
    elif run_env == "dlc":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = "cuda"
    world, nproc, nnodes = _world(run_env, layout, env)
    mp = tp * pp * cp
    if world % mp:
        raise UserError(f"{world} processes cannot hold TP*PP*CP={mp}: use a multiple of {mp} processes")
    dp = world // mp
    if world % (pp * ep * layout.expert_tp):
        raise UserError(f"{world} processes cannot hold PP*EP*ETP={pp * ep * layout.expert_tp}")
    if gbs % (mbs * dp):
        raise UserError(f"GLOBAL_BATCH_SIZE ({gbs}) must be a multiple of BATCH_SIZE*DP = {mbs}*{dp} = {mbs * dp}")
    if vp is not None and (gbs // (mbs * dp)) % pp:
        # The interleaved schedule runs micro-batches in groups of PP per virtual stage.
        raise UserError(f"MP_VP={vp} (interleaved schedule) needs the micro-batches per step, GLOBAL_BATCH_SIZE/"
                        f"(BATCH_SIZE*DP) = {gbs // (mbs * dp)}, to be a multiple of PP={pp}")

    # Training length: tokens for pretraining, iterations for SFT (the reference's convention).
    train_raw, warm_raw = a["TRAIN_TOKENS_OR_ITERS"], a["WARMUP_TOKENS_OR_ITERS"]
    if sft:
        train_iters = _count("TRAIN_TOKENS_OR_ITERS", train_raw)
        warmup_iters = _count("WARMUP_TOKENS_OR_ITERS", warm_raw)
    else:
        tokens_per_iter = gbs * seq_len
        train_iters = _count("TRAIN_TOKENS_OR_ITERS", train_raw) // tokens_per_iter
        warmup_iters = _count("WARMUP_TOKENS_OR_ITERS", warm_raw) // tokens_per_iter
        if train_iters < 1:
            raise UserError(f"TRAIN_TOKENS_OR_ITERS={train_raw} tokens is less than one iteration "
                            f"(GLOBAL_BATCH_SIZE*SEQ_LEN = {tokens_per_iter} tokens): pretraining takes a token count")
    if train_iters < 1:
        raise UserError(f"TRAIN_TOKENS_OR_ITERS must give at least one iteration, got '{train_raw}'")
    if warmup_iters >= train_iters:
        raise UserError(f"warm-up ({warmup_iters} iterations) must be shorter than training ({train_iters} iterations)")

    # Data.
    paths, weights = _data_paths("DATASET_PATH", a["DATASET_PATH"])
    valid = None if _none(a["VALID_DATASET_PATH"]) else _data_paths("VALID_DATASET_PATH", a["VALID_DATASET_PATH"])[0]
    if sft and (len(paths) != 1 or weights):
        raise UserError("SFT takes one JSON/JSONL file as DATASET_PATH")
    if check_paths:
        for p in paths + (valid or []):
            _check_data(p, dataset_type)
    tokenizer = env.get("MP_TOKENIZER") or None
    if sft and tokenizer is None:
        if ckpt is None:
            raise UserError("SFT needs a tokenizer: set MP_TOKENIZER to a tokenizer folder/file, or give a "
                            "PRETRAIN_CHECKPOINT_PATH that carries tokenizer.json")
        tokenizer = ckpt
    if check_paths and tokenizer is not None and sft:
        from megatron_patch.training.tokenizer import check_tokenizer_path

        check_tokenizer_path(tokenizer)

    output = a["OUTPUT_BASEPATH"]
    if _none(output):
        raise UserError("OUTPUT_BASEPATH is required: checkpoints, logs and TensorBoard go there")

    cfg = RunConfig(
        family=family, env=run_env, model_size=size, micro_batch_size=mbs, global_batch_size=gbs, lr=lr,
        min_lr=min_lr, seq_len=seq_len, pad_len=pad_len, precision=precision, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
        sequence_parallel=sp, distributed_optimizer=do, flash_attention=fl, sft=sft, activation_checkpointing=ac,
        optimizer_offload_fraction=offload, save_interval=save_interval, dataset_path=paths, dataset_weights=weights,
        valid_dataset_path=valid, pretrain_checkpoint=ckpt, train_iters=train_iters, warmup_iters=warmup_iters,
        output_basepath=str(output), dataset_type=dataset_type, ac_layers=ac_layers, virtual_pipeline=vp,
        sft_packing=packing, pp0_layers=pp0, fp8_recipe=fp8_recipe, tp_comm_overlap=tp_comm_overlap,
        overlap_param_gather=overlap_param_gather, world_size=world, nproc_per_node=nproc, nnodes=nnodes,
        tokenizer=tokenizer, nan_policy=nan_policy, loss_scale_window=loss_scale_window, faults=faults,
        exit_interval=_env_int(env, "MP_EXIT_INTERVAL", None), optimizer_offload_policy=offload_policy,
        offload_numerics=offload_numerics, offload_margin_gb=offload_margin_gb,
        offload_patience=_env_int(env, "MP_OFFLOAD_PATIENCE", 3), offload_cooldown=_env_int(env, "MP_OFFLOAD_COOLDOWN", 5, lo=0),
        offload_chunk_mb=offload_chunk_mb, offload_probe_script=offload_probe_script,
        offload_timing=_bool("MP_OFFLOAD_TIMING", env.get("MP_OFFLOAD_TIMING") or "false"), gpu_memory_gb=gpu_memory_gb,
        log_interval=_env_int(env, "MP_LOG_INTERVAL", 1), eval_interval=_env_int(env, "MP_EVAL_INTERVAL", 100, lo=0),
        eval_iters=_env_int(env, "MP_EVAL_ITERS", 10), seed=_env_int(env, "MP_SEED", 1234, lo=0),
        save=_bool("MP_SAVE", env.get("MP_SAVE") or "true"), device=device,
        max_restarts=_env_int(env, "MP_MAX_RESTARTS", 0, lo=0),
        dist_timeout_min=_env_minutes(env, "MP_DIST_TIMEOUT_MIN", 10.0),
        hf_config=hf_config, vocab_padded_to=vocab_padded_to, notes=notes,
    )
    return cfg


def _check_activation_checkpointing(ac: str, ac_layers: int, num_layers: int, pp: int, vp: int | None,
                                    pp0: int | None) -> None:
    """What megatron-core would reject (or crash on) only after every rank has started."""
    if ac == "offload" and ac_layers >= num_layers:
        raise UserError(f"MP_AC_LAYERS={ac_layers}: AC=offload can offload at most {num_layers - 1} of the "
                        f"{num_layers} layers (the last layer's activations are needed at once)")
    if ac == "full":
        # Uniform recompute walks each model chunk in blocks of MP_AC_LAYERS layers.
        if pp0 is not None:
            fewest = min(pp0, (num_layers - pp0) // (pp - 1))
        else:
            fewest = num_layers // (pp * (vp or 1))
        if ac_layers > fewest:
            raise UserError(f"MP_AC_LAYERS={ac_layers}: AC=full recomputes blocks of MP_AC_LAYERS layers within a "
                            f"pipeline stage, and a stage here holds {fewest}: set MP_AC_LAYERS <= {fewest}")


def _check_fp8_shapes(arch, recipe: str, tokens: int, tokens_name: str, tp: int, etp: int) -> None:
    """transformer-engine's FP8 GEMMs need rows divisible by 8 and the inner dimension by 16 (MXFP8: 32 and 32)."""
    rows, inner = (32, 32) if recipe == "mxfp8" else (8, 16)
    if tokens % rows:
        raise UserError(f"PR=fp8 ({recipe}): the tokens per GEMM, {tokens_name} = {tokens}, must be a multiple of "
                        f"{rows}: change BATCH_SIZE or the sequence length")
    dims = {"hidden_size": arch.hidden_size, "attention width per TP rank": arch.num_heads * arch.head_dim // tp,
            "FFN size per TP rank": arch.ffn_hidden_size // tp}
    if arch.is_moe:
        dims["expert FFN size per ETP rank"] = arch.moe_ffn_hidden_size // etp
        if arch.shared_expert_ffn_hidden_size:
            dims["shared-expert FFN size per TP rank"] = arch.shared_expert_ffn_hidden_size // tp
    bad = [f"{name} {value}" for name, value in dims.items() if value % inner]
    if bad:
        raise UserError(f"PR=fp8 ({recipe}) needs GEMM inner dimensions divisible by {inner}, and this model at "
                        f"TP={tp} has {', '.join(bad)}: use PR=bf16 or another TP")


def _model_config(family: str, size: str, ckpt: str | None, hf_config_file: str | None,
                  num_layers: int | None = None) -> tuple[dict, int | None]:
    """(the model's HF config, the checkpoint's own vocabulary padding when it differs from ours).

    With a PRETRAIN_CHECKPOINT_PATH the checkpoint's architecture wins: its sidecar, else
    MP_HF_CONFIG, else the MODEL_SIZE preset, else its saved Megatron-LM arguments (as this
    launcher's family), each checked against its tensors (``convert.arch_source``)."""
    table = presets(family)
    if num_layers is not None:
        if size == "auto" or ckpt is not None:
            raise UserError("MP_NUM_LAYERS shapes a model from a MODEL_SIZE preset and cannot change a checkpoint's: "
                            "drop MP_NUM_LAYERS or PRETRAIN_CHECKPOINT_PATH")
        if size not in table:
            raise UserError(f"MODEL_SIZE for {family} must be one of {' | '.join([*table, 'auto'])}, got '{size}'")
        return {**table[size], "num_hidden_layers": num_layers}, None
    if size == "auto" and ckpt is None:
        raise UserError("MODEL_SIZE=auto takes the architecture from PRETRAIN_CHECKPOINT_PATH, which is none: "
                        "give a converted checkpoint or a model size")
    if size != "auto" and size not in table:
        raise UserError(f"MODEL_SIZE for {family} must be one of {' | '.join([*table, 'auto'])}, got '{size}'")
    if ckpt is None:
        return dict(table[size]), None
    from megatron_patch.convert.arch_source import open_checkpoint

    preset = None if size == "auto" else dict(table[size])
    try:
        opened = open_checkpoint(ckpt, hf_config=hf_config_file or preset, family=family)
    except UserError as exc:
        raise UserError(f"PRETRAIN_CHECKPOINT_PATH: {exc}" + (" (or set MP_HF_CONFIG)" if "--hf-config" in str(exc)
                                                              else ""))
    sidecar = opened.sidecar
    if sidecar.family != family:
        raise UserError(f"{ckpt} holds a {sidecar.family} model; this is the {family} launcher")
    if preset is not None and opened.found.sidecar_dir is not None:
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "intermediate_size", "num_experts")
        diff = [k for k in keys if sidecar.hf_config.get(k) != preset.get(k)]
        if diff:
            raise UserError(f"{ckpt} does not hold a {family} {size} model (differs in {', '.join(diff)}): "
                            "use MODEL_SIZE=auto to take the checkpoint's architecture")
    return sidecar.hf_config, sidecar.arch.vocab_padded_to


def _check_data(path: str, dataset_type: str) -> None:
    if dataset_type == "raw":
        if not Path(path).is_file():
            raise UserError(f"SFT data {path} not found: give a JSON or JSONL file")
        return
    missing = [s for s in (".bin", ".idx") if not Path(path + s).is_file()]
    if missing:
        raise UserError(f"mmap data {path}{missing[0]} not found: give the prefix of the .bin/.idx pair "
                        "written by 'mpatch preprocess' (e.g. data/corpus_text_document)")


def launched_rank(env) -> bool:
    """True in a process that a launcher (torchrun) started as one rank of the job.

    There WORLD_SIZE is the job's process count; in the process the user started (ENV=dlc), PAI-DLC's
    WORLD_SIZE is the node count.
    """
    return "TORCHELASTIC_RUN_ID" in env or ("LOCAL_RANK" in env and "MASTER_ADDR" in env)


def _world(run_env: str, layout: ParallelLayout, env: dict) -> tuple[int, int, int]:
    """(world size, processes per node, nodes)."""
    if run_env == "cpu":
        nproc = _env_int(env, "MP_NPROC", layout.world_size)
        return nproc, nproc, 1
    if launched_rank(env) and env.get("WORLD_SIZE"):
        world = _int("WORLD_SIZE", env["WORLD_SIZE"])
        per_node = _int("LOCAL_WORLD_SIZE", env.get("LOCAL_WORLD_SIZE") or env.get("GPUS_PER_NODE") or str(world))
        if world % per_node:
            raise UserError(f"WORLD_SIZE={world} processes do not fill nodes of {per_node}: check GPUS_PER_NODE")
        return world, per_node, world // per_node
    gpus = env.get("GPUS_PER_NODE")
    if gpus:
        per_node = _int("GPUS_PER_NODE", gpus)
    else:
        import torch

        # Without a GPU: a dlc node trains on its CPU, one process unless GPUS_PER_NODE says more;
        # dsw (refused there) keeps a GPU node's 8 for dry runs that plan one.
        per_node = torch.cuda.device_count() or (1 if run_env == "dlc" else 8)
    nnodes = _int("WORLD_SIZE", env.get("WORLD_SIZE", "1")) if run_env == "dlc" else 1
    return per_node * nnodes, per_node, nnodes


# --- what the configuration turns into in megatron-core --------------------------------------------------

def megatron_settings(cfg: RunConfig) -> dict:
    """TransformerConfig overrides, DDP and optimizer settings: what each flag becomes."""
    from megatron.core.transformer.enums import AttnBackend

    gpu = cfg.device == "cuda"
    tc: dict = {"sequence_parallel": cfg.sequence_parallel, "tp_comm_overlap": cfg.tp_comm_overlap}
    if gpu:
        # A stage's output, once sent on, is freed but for its autograd graph (Megatron-LM's default). Not
        # on gloo: its asynchronous sends read the buffer later (PP=2 x VP=2 then trained on garbage).
        tc["deallocate_pipeline_outputs"] = True
    if cfg.flash_attention:
        tc["attention_backend"] = AttnBackend.flash
    elif not gpu:
        tc["attention_backend"] = AttnBackend.local
    elif cfg.precision == "fp32":
        # transformer-engine's fused (cuDNN) and flash kernels have no fp32 path; auto lets TE take its unfused one.
        tc["attention_backend"] = AttnBackend.auto
    else:
        tc["attention_backend"] = AttnBackend.fused
    if cfg.precision == "fp8":
        tc.update(fp8="hybrid", fp8_recipe=cfg.fp8_recipe, fp8_amax_history_len=1024 if cfg.fp8_recipe == "delayed" else 1,
                  fp8_amax_compute_algo="max" if cfg.fp8_recipe == "delayed" else "most_recent")
        if cfg.arch.is_moe:
            # Each expert's token count varies per step; pad it so its FP8 GEMM rows divide.
            tc["moe_router_padding_for_quantization"] = True
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
           "overlap_param_gather": cfg.overlap_param_gather, "grad_reduce_in_fp32": cfg.precision != "fp32"}
    optim = {"optimizer": "adam", "lr": cfg.lr, "min_lr": cfg.min_lr, "weight_decay": 0.1, "adam_beta1": 0.9,
             "adam_beta2": 0.95, "adam_eps": 1e-8, "clip_grad": 1.0,
             "bf16": cfg.precision in ("bf16", "fp8"), "fp16": cfg.precision == "fp16",
             "use_distributed_optimizer": cfg.distributed_optimizer,
             "overlap_param_gather": cfg.overlap_param_gather}
    if cfg.precision == "fp16":
        optim.update(initial_loss_scale=2.0 ** 16, loss_scale_window=cfg.loss_scale_window, hysteresis=2,
                     min_loss_scale=1.0)
    sched = {"lr_warmup_steps": cfg.warmup_iters, "lr_decay_steps": cfg.train_iters, "lr_decay_style": "cosine",
             "init_lr": 0.0, "max_lr": cfg.lr, "min_lr": cfg.min_lr}
    offload = {"policy": cfg.optimizer_offload_policy, "numerics": cfg.offload_numerics}
    if cfg.optimizer_offload_policy == "static":
        offload["host_share"] = cfg.optimizer_offload_fraction
    if cfg.optimizer_offload_policy == "auto":
        offload.update(margin_gb=cfg.offload_margin_gb, patience=cfg.offload_patience, cooldown=cfg.offload_cooldown)
    return {"transformer_config": tc, "ddp": ddp, "optimizer": optim, "scheduler": sched, "offload": offload,
            "num_microbatches": cfg.num_microbatches, "data_parallel_size": cfg.data_parallel_size,
            "pp_first_stage_layers": cfg.pp0_layers}


# --- what this machine can do ----------------------------------------------------------------------------

def _version_tuple(text: str | None) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (text or "").split(".")[:2])
    except ValueError:
        return ()


def fp8_recipe_problem(recipe: str, caps: Capabilities) -> str | None:
    """Why transformer-engine cannot run ``recipe`` here (its own support checks), or None."""
    cc, cuda = caps.compute_capability, caps.cuda_version
    where = f"this GPU is sm{cc[0]}{cc[1]}" if cc else "the GPU's compute capability is unknown"
    if recipe == "mxfp8" and not (cc and (10, 0) <= cc < (12, 0)):
        return f"MP_FP8_RECIPE=mxfp8 needs a Blackwell GPU (compute capability 10.x) and {where}: " \
               "use MP_FP8_RECIPE=delayed, tensorwise or blockwise"
    if recipe == "blockwise" and not (cc and cc >= (9, 0) and _version_tuple(cuda) >= (12, 9)):
        return f"MP_FP8_RECIPE=blockwise needs compute capability >= 9.0 and CUDA >= 12.9, and {where} with " \
               f"CUDA {cuda}: use MP_FP8_RECIPE=delayed or tensorwise"
    return None


def machine_problems(cfg: RunConfig, caps: Capabilities) -> list[str]:
    """Every reason this machine cannot run ``cfg``, each saying what to change."""
    out = []
    gpu_env = cfg.device == "cuda"
    if gpu_env and not caps.cuda:
        out.append(f"ENV={cfg.env} trains on GPUs and this machine has none: use ENV=cpu for a CPU run")
    te = caps.transformer_engine and gpu_env
    if cfg.precision == "fp8" and not (te and caps.fp8):
        out.append("PR=fp8 needs transformer-engine on a GPU with FP8 (compute capability >= 8.9): use PR=bf16")
    elif cfg.precision == "fp8" and fp8_recipe_problem(cfg.fp8_recipe, caps):
        out.append(fp8_recipe_problem(cfg.fp8_recipe, caps))
    if cfg.flash_attention and not te:
        out.append("FL=true needs transformer-engine's flash attention on a GPU: set FL=false")
    elif cfg.flash_attention and not (caps.flash_attention_2 or caps.flash_attention_3):
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
    if cfg.precision == "fp32" and gpu_env:
        pass  # allowed (slow) on GPU
    return out


def check_machine(cfg: RunConfig, caps: Capabilities | None = None) -> None:
    problems = machine_problems(cfg, caps or Capabilities.detect())
    if problems:
        raise UserError(problems[0] + (f" (and {len(problems) - 1} more: see MP_DRY_RUN=1)" if len(problems) > 1 else ""))


def attention_kernel(cfg: RunConfig, caps: Capabilities) -> str:
    """What attention will run, as the log reports it."""
    if cfg.device == "cpu" or not caps.transformer_engine:
        return "local (megatron-core DotProductAttention, unfused softmax)"
    if cfg.flash_attention:
        if caps.flash_attention_3:
            return "FlashAttention-3 (flash_attn_interface)"
        return "FlashAttention-2 (flash_attn)" if caps.flash_attention_2 else "none: no flash-attn package (refused)"
    if cfg.precision == "fp32":
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

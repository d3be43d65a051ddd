"""The positional launcher interface (Pai-Megatron-Patch's order): the launchers, each argument's name, place and
meaning, the environment extras, and how one raw value is read (a value wrong on its own is refused here, in one
line naming it; combinations are ``validation.py``'s).

Every family has its launcher, ``examples/<family>/run_mcore_<family>.sh``. Pai-Megatron-Patch's own launcher
scripts (``ModelFamily.pai_launchers``) are launchers too, at Pai's paths under examples/: one script may train
several families (Pai's Qwen3 launcher takes the dense and the MoE sizes; its Mistral launcher Mistral-7B and
Mixtral), and may take several argument counts (this project's and Pai's). The argument count picks the
layout, MODEL_SIZE the family.
"""

from __future__ import annotations

import functools
import math
import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Callable

from megatron_patch.errors import UserError
from megatron_patch.models.description.registry import families

HEAD = ["ENV", "MODEL_SIZE", "BATCH_SIZE", "GLOBAL_BATCH_SIZE", "LR", "MIN_LR", "SEQ_LEN", "PAD_LEN", "PR",
        "TP", "PP", "CP"]
TAIL = ["SP", "DO", "FL", "SFT", "AC", "OPTIMIZER_OFFLOAD", "SAVE_INTERVAL", "DATASET_PATH", "VALID_DATASET_PATH",
        "PRETRAIN_CHECKPOINT_PATH", "TRAIN_TOKENS_OR_ITERS", "WARMUP_TOKENS_OR_ITERS", "OUTPUT_BASEPATH"]


@dataclass(frozen=True)
class Launcher:
    """One launcher script: the name ``mpatch train`` takes, its path, the parallel sizes it takes after CP (each
    layout it accepts, its first the one its --help lists), MODEL_SIZE -> (family, preset), its families, and
    whether Pai-Megatron-Patch has a launcher at that path."""

    name: str
    script: str
    layouts: tuple[tuple[str, ...], ...]
    sizes: dict[str, tuple[str, str]]
    families: tuple[str, ...]
    pai: bool = False

    def arg_names(self, layout: tuple[str, ...] | None = None) -> list[str]:
        return HEAD + list(self.layouts[0] if layout is None else layout) + TAIL

    def layout_of(self, argv: list[str]) -> tuple[str, ...]:
        """The layout ``argv``'s count selects; a count no layout has is refused naming the positions it misses or
        the values it has too many."""
        for layout in self.layouts:
            if len(self.arg_names(layout)) == len(argv):
                return layout
        raise UserError(self._count_error(argv))

    def _count_error(self, argv: list[str]) -> str:
        by_count = sorted((len(self.arg_names(layout)), layout) for layout in self.layouts)
        got = len(argv)
        count, layout = by_count[0] if got < by_count[0][0] else by_count[-1]
        names = self.arg_names(layout)
        expected = self.counts() if len(by_count) > 1 else str(count)
        if got < count:
            missing = [f"{name} ({i})" for i, name in enumerate(names[got:], got + 1)]
            listed = (missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " and " + missing[-1]
                      if len(missing) <= 3 else f"the {len(missing)} from {missing[0]} to {missing[-1]}")
            detail = (f"the last one given is taken as {names[got - 1]} ({got}); " if got else "") \
                + listed + (" is missing" if len(missing) == 1 else " are missing")
        else:
            extra = argv[count:]
            detail = (f"{names[-1]} ({count}) is taken as {argv[count - 1]!r} and {len(extra)} more "
                      f"follow{'s' if len(extra) == 1 else ''}: {' '.join(repr(x) for x in extra[:3])}"
                      + (" ..." if len(extra) > 3 else ""))
        return (f"{self.script} takes {expected} arguments, got {got}: {detail}; run it with --help for each one's "
                "meaning")

    def model_size(self, size: str) -> tuple[str, str]:
        """(family, preset) of a MODEL_SIZE other than auto."""
        if size not in self.sizes:
            raise UserError(f"MODEL_SIZE for {self.name} must be one of {' | '.join(self.size_names())}, got '{size}'")
        return self.sizes[size]

    def size_names(self) -> list[str]:
        return [*self.sizes, "auto"]

    def counts(self) -> str:
        """'26 (EP after CP) or 27 (ETP, EP after CP)'."""
        return " or ".join(f"{len(self.arg_names(layout))}" + (f" ({', '.join(layout)} after CP)" if layout else "")
                           for layout in sorted(self.layouts, key=len))


def _sizes(family, names=None) -> dict[str, tuple[str, str]]:
    """MODEL_SIZE -> (family, preset) for ``names`` (name -> preset; None: every preset and alias)."""
    names = names or {**{p: p for p in family.presets}, **family.size_aliases}
    return {name: (family.name, preset) for name, preset in names.items()}


@functools.cache
def launchers() -> dict[str, Launcher]:
    """Every launcher by name: each family's own, then Pai's scripts (merged into a family's where the path is
    the same, e.g. examples/qwen3/run_mcore_qwen3.sh)."""
    found = {f.launcher: Launcher(name, f.launcher, (f.launcher_parallel_args,), _sizes(f), (name,))
             for name, f in families().items()}
    for name, f in families().items():
        for pai in f.pai_launchers:
            known = found.get(pai.script) or Launcher(str(PurePosixPath(pai.script).relative_to("examples")
                                                          .with_suffix("")), pai.script, (), {}, ())
            sizes = _sizes(f, pai.sizes)
            clash = [s for s in sizes if known.sizes.get(s, sizes[s]) != sizes[s]]
            if clash:
                raise RuntimeError(f"{pai.script}: MODEL_SIZE {clash[0]} is both {known.sizes[clash[0]]} and "
                                   f"{sizes[clash[0]]}")
            found[pai.script] = Launcher(
                known.name, known.script,
                known.layouts + (() if pai.parallel_args in known.layouts else (pai.parallel_args,)),
                {**known.sizes, **sizes}, known.families + (() if name in known.families else (name,)), pai=True)
    return {launcher.name: launcher for launcher in found.values()}


def get_launcher(name: str) -> Launcher:
    known = launchers()
    if name not in known:
        raise UserError(f"no launcher '{name}': launchers exist for {', '.join(known)}")
    return known[name]


ARG_HELP = {
    "ENV": "dsw (one node, all its GPUs) | dlc (multi-node: WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT; on "
           "CPU nodes gloo) | cpu (local gloo processes); all start through torchrun",
    "MODEL_SIZE": "a published size (Pai-Megatron-Patch's names too), tiny, or auto (architecture from "
                  "PRETRAIN_CHECKPOINT_PATH)",
    "BATCH_SIZE": "micro-batch size per data-parallel rank (integer >= 1)",
    "GLOBAL_BATCH_SIZE": "samples per optimizer step; a multiple of BATCH_SIZE * data-parallel size",
    "LR": "peak learning rate (> 0)",
    "MIN_LR": "final learning rate of the cosine decay (0 <= MIN_LR <= LR)",
    "SEQ_LEN": "sequence length of pretraining samples (and of an SFT idxmap's, as in Pai-Megatron-Patch)",
    "PAD_LEN": "length of SFT samples from JSON records (padded or packed to it); <= SEQ_LEN",
    "PR": "precision: fp16 | bf16 | fp8 (transformer-engine, hybrid format) | fp32 (CPU development)",
    "TP": "tensor parallel size", "PP": "pipeline parallel size", "CP": "context parallel size",
    "ETP": "expert tensor parallel size (MoE; ignored for a dense size)",
    "EP": "expert parallel size (MoE; 1 for dense)",
    "SP": "sequence parallelism: true | false (TP > 1 with SP=true also turns on TP communication overlap; ignored "
          "at TP=1)",
    "DO": "distributed optimizer: true | false (true also overlaps the parameter all-gather)",
    "FL": "flash attention: true | false (with transformer-engine its FlashAttention, FA3 on Hopper when installed; "
          "without it torch SDPA, the default on a GPU, FL=true on CPU)",
    "SFT": "true: fine-tune on SFT data (token counts become iteration counts) | false: pretrain",
    "AC": "activation checkpointing: sel | full | offload | none or false (MP_AC_LAYERS layers for full/offload)",
    "OPTIMIZER_OFFLOAD": "false | static (all optimizer state on the host) | a fraction 0..1 on the host | auto "
                         "(what the GPU cannot hold, measured each step); forces DO=true",
    "SAVE_INTERVAL": "save a checkpoint every this many iterations",
    "DATASET_PATH": "pretraining: mmap data prefix(es) (P_text_document, optionally 'W1 P1 W2 P2'; a path "
                    "that exists is one path, spaces and all; quote one with spaces inside a blend); "
                    "SFT: a JSON/JSONL file, or the prefix of Pai's SFT idxmap (sft_data_preprocessing)",
    "VALID_DATASET_PATH": "validation data like DATASET_PATH, or none",
    "PRETRAIN_CHECKPOINT_PATH": "a checkpoint from 'mpatch convert hf2mcore' to start from, or none",
    "TRAIN_TOKENS_OR_ITERS": "pretraining: training tokens; SFT: iterations",
    "WARMUP_TOKENS_OR_ITERS": "pretraining: warm-up tokens; SFT: warm-up iterations",
    "OUTPUT_BASEPATH": "where checkpoints, logs and TensorBoard go; a rerun with the same path resumes",
}

# Environment extras (name -> meaning); documented in examples/README.md.
EXTRAS = {
    "MP_DRY_RUN": "1: print the resolved configuration and command, train nothing",
    "MP_DATASET_TYPE": "mmap or idxmap (Pai's name): .bin/.idx data (pretraining, or Pai's SFT idxmap) | raw: "
                       "JSON/JSONL SFT records; default: mmap, for SFT what DATASET_PATH names",
    "MP_AC_LAYERS": "layers recomputed (AC=full) or offloaded (AC=offload) per stage (default 1)",
    "MP_VP": "layers per virtual pipeline stage (Pai-Megatron-Patch's and Megatron-LM's "
             "--num-layers-per-virtual-pipeline-stage): interleaved 1F1B; needs PP > 1",
    "MP_VP_CHUNKS": "virtual pipeline stages (model chunks) per pipeline rank, instead of MP_VP",
    "MP_SFT_PACKING": "true: several SFT records per sample, kept apart (JSON records packed in order, Pai's packed "
                      "lists and idxmap samples as they are); false: each record a sample of its own",
    "MP_PP0_LAYERS": "layers on the first pipeline stage (the rest split evenly)",
    "MP_FP8_RECIPE": "delayed (default) | tensorwise | mxfp8 | blockwise",
    "MP_TP_COMM_OVERLAP": "false: keep SP but turn TP communication overlap off (needed without transformer-engine)",
    "MP_OVERLAP_PARAM_GATHER": "true: insist on param-gather overlap (refused without DO=true); default follows DO",
    "MP_NPROC": "ENV=cpu: number of local processes (default TP*PP*CP, or what the expert layout needs)",
    "MP_TOKENIZER": "tokenizer folder (tokenizer.json) or tiktoken file for SFT data (default: the checkpoint's)",
    "MP_NAN_POLICY": "stop (default) | skip: what a NaN/inf loss does",
    "MP_COMPILE_FUSIONS": "true: torch.compile the local spec's RMSNorm, RoPE, SwiGLU and bias-dropout-add (no "
                          "transformer-engine); false: all of them eager (default: megatron-core's own choice)",
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
    "MP_INJECT_FAULT": "testing: overflow@N (inf gradients at iteration N), kill@N (SIGKILL as N starts), error@N (an "
                       "exception as N starts), comma-separated",
    "MP_EXIT_INTERVAL": "stop after this many iterations (after saving), e.g. to test a resume",
    "MP_LOG_INTERVAL": "log every this many iterations (default 1)",
    "MP_EVAL_INTERVAL": "validate every this many iterations (default 10000, as Pai-Megatron-Patch; 0: never)",
    "MP_EVAL_ITERS": "validation micro-batch rounds per evaluation (default 10)",
    "MP_SEED": "random seed (default 1234; pipeline stage p initialises with seed + 100*p)",
    "MP_WEIGHT_DECAY": "AdamW weight decay (default: what Pai-Megatron-Patch's launcher for the family passes, 0.1 or "
                       "0.01)",
    "MP_HF_CONFIG": "HF config.json (or folder) of a PRETRAIN_CHECKPOINT_PATH written by another tool without saved "
                    "arguments (Megatron-Bridge); checked against its tensors (docs/foreign-checkpoints.md)",
    "MP_NUM_LAYERS": "override MODEL_SIZE's layer count (a same-shaped proxy for benchmarks; not with a checkpoint)",
    "MP_SAVE": "false: write no checkpoints and no final/ export (benchmarks)",
    "MP_NO_VERIFY": "true: read PRETRAIN_CHECKPOINT_PATH and the run's own checkpoints without checking their files "
                    "against their manifests (a checkpoint edited on purpose; mcore2hf's and align's --no-verify)",
    "MP_MAX_RESTARTS": "restart the ranks up to N times after a failure (torchrun --max-restarts); each restart "
                       "resumes from the latest complete checkpoint (default 0)",
    "MP_DIST_TIMEOUT_MIN": "minutes a collective may wait for the other ranks before the job fails naming the "
                           "rank that stopped answering (default 10)",
    "MP_LORA_RANK": "R: train LoRA adapters of rank R on the frozen PRETRAIN_CHECKPOINT_PATH (unset or 0: full "
                    "fine-tuning; docs/lora.md)",
    "MP_LORA_ALPHA": "LoRA alpha: the adapters' output is scaled by alpha/R (default R)",
    "MP_LORA_DROPOUT": "dropout on the adapters' input (default 0)",
    "MP_LORA_TARGETS": "comma list out of qkv,proj,fc1,fc2,experts,shared_experts,indexer (default "
                       "qkv,proj,fc1,fc2)",
    "MP_LORA_INIT": "a peft adapter folder to start the adapters from (its config decides rank, alpha, targets)",
    "MP_DSA_INDEXER_LOSS_SCALE": "S: DeepSeek sparse attention's indexer loss (megatron-core's KL to the attention) "
                                 "at coefficient S (default 0: off, the indexer frozen as released)",
    "MP_DSA_INDEXER_ONLY": "true: DeepSeek's dense warm-up: dense attention, only the indexers train (their loss "
                           "at MP_DSA_INDEXER_LOSS_SCALE, default 1)",
    "GPUS_PER_NODE": "dsw/dlc: processes per node (default: the GPUs visible; on dlc KUBERNETES_CONTAINER_RESOURCE_GPU "
                     "first, else 1 on a node without GPUs)",
    "KUBERNETES_CONTAINER_RESOURCE_GPU": "dlc: PAI-DLC's GPUs per node, read as GPUS_PER_NODE when that is unset",
}

FP8_RECIPES = ("delayed", "tensorwise", "mxfp8", "blockwise")
ENVS = ("dsw", "dlc", "cpu")
AC_MODES = ("sel", "full", "offload", "none")
# Pai-Megatron-Patch's launchers take AC=false for no recompute (any value but sel/full/offload is none there).
AC_SYNONYMS = {"false": "none"}
# MP_DATASET_TYPE: Pai-Megatron-Patch's name for .bin/.idx data is idxmap (any value but raw, there).
DATASET_TYPES = {"idxmap": "mmap", "mmap": "mmap", "raw": "raw"}


def arg_names(launcher: str) -> list[str]:
    """The positional arguments of ``launcher``'s first layout (the one its --help lists first)."""
    return get_launcher(launcher).arg_names()


def describe_size(launcher: Launcher, size: str) -> str:
    """``size`` as --help and the docs list it: a preset's name, an alias with what it stands for, another
    family's size with its family."""
    family, preset = launcher.sizes[size]
    said = [preset] if preset != size else []
    if family != launcher.families[0]:
        said.append(family)
    return size + (f" ({', '.join(said)})" if said else "")


def usage(name: str) -> str:
    launcher = get_launcher(name)
    lines = [f"usage: {launcher.script} " + " ".join(launcher.arg_names(layout)) for layout in launcher.layouts]
    names = launcher.arg_names()
    lines += ["", f"{len(names)} positional arguments, in this order:"]
    sizes = " | ".join([describe_size(launcher, s) for s in launcher.sizes] + ["auto"])
    for i, arg in enumerate(names, 1):
        text = ARG_HELP[arg] + (f" [{sizes}]" if arg == "MODEL_SIZE" else "")
        lines.append(f"  {i:2d} {arg:<25} {text}")
    for layout in launcher.layouts[1:]:
        lines.append(f"  or {len(launcher.arg_names(layout))}, with {', '.join(layout) or 'nothing'} after CP "
                     "(Pai-Megatron-Patch's order for this script)")
    lines += ["", "environment extras:"] + [f"  {k:<25} {v}" for k, v in EXTRAS.items()]
    return "\n".join(lines)



# --- reading one value -----------------------------------------------------------------------------

# Ceilings of the counts a launch takes, far beyond any published run, so that a slip of the keyboard (1e30
# tokens) is refused at once: megatron-core would build a dataset index of that many samples, silently, for good.
MAX_TOKENS = 10**15  # a thousand trillion: dozens of times the largest published pretraining runs (15-36T)
MAX_ITERATIONS = 10**8  # a hundred times the optimizer steps of the largest published runs
MAX_GLOBAL_BATCH = 10**6  # samples per step: hundreds of times the largest published global batches
MAX_LOCAL_PROCESSES = 256  # ENV=cpu's MP_NPROC: gloo ranks on one machine; beyond this a typo, not a plan


def parse_int(name: str, raw: str, lo: int = 1, hi: int | None = None) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"{name} must be an integer, got '{raw}'")
    if value < lo:
        raise UserError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise UserError(f"{name} must be at most {hi}, got {value}")
    return value


def parse_count(name: str, raw: str, most: int = MAX_TOKENS, unit: str = "tokens") -> int:
    """A token or iteration count of at most ``most`` ``unit``: integers, also written as 1e9 or 10B/500M/20K."""
    text = raw.strip()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}.get(text[-1:].upper(), 1)
    if scale != 1:
        text = text[:-1]
    try:
        value = float(text) * scale
    except ValueError:
        raise UserError(f"{name} must be a count (e.g. 1000000, 1e9 or 10B), got '{raw}'")
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise UserError(f"{name} must be a whole non-negative count, got '{raw}'")
    if value > most:
        raise UserError(f"{name}={raw} is more than {most} {unit}, the most a run takes (docs/training.md): check "
                        "the number")
    return int(value)


def parse_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise UserError(f"{name} must be a number, got '{raw}'")
    if not math.isfinite(value) or value < 0:
        raise UserError(f"{name} must be a finite number >= 0, got '{raw}'")
    return value


def parse_bool(name: str, raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise UserError(f"{name} must be true or false, got '{raw}'")


def parse_choice(name: str, raw: str, allowed) -> str:
    if raw not in allowed:
        raise UserError(f"{name} must be one of {' | '.join(allowed)}, got '{raw}'")
    return raw


def is_none(raw: str) -> bool:
    return raw.strip().lower() in ("", "none", "null")


def parse_data_paths(name: str, raw: str, names_data: Callable[[str], bool] = lambda path: False
                     ) -> tuple[list[str], list[float] | None]:
    """'P' or 'P1 P2' or 'W1 P1 W2 P2' (Megatron's blend syntax), split as a shell splits words, so a path with
    spaces inside a blend is quoted ('0.3 "my data/a_text_document" 0.7 b_text_document'). A value that names
    data as a whole (``names_data``: the files are there) is one path, spaces and all."""
    value = raw.strip()
    if not value:
        raise UserError(f"{name} is empty: give a data path")
    if names_data(value):
        return [value], None
    try:
        parts = shlex.split(value)
    except ValueError as exc:
        raise UserError(f"{name} '{raw}' cannot be split into paths ({exc}): quote each path that holds spaces "
                        "once, e.g. '0.3 \"my data/a_text_document\" 0.7 b_text_document'")
    if not parts:
        raise UserError(f"{name} is empty: give a data path")
    try:
        weights = [float(p) for p in parts[0::2]]
    except ValueError:
        return parts, None
    paths = parts[1::2]
    if len(paths) != len(weights):
        raise UserError(f"{name} '{raw}' mixes weights and paths: write 'W1 P1 W2 P2 ...'")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise UserError(f"{name} '{raw}': each weight of a blend must be a number > 0")
    return paths, weights


def env_int(env: dict, name: str, default, lo: int = 1, hi: int | None = None):
    raw = env.get(name, "")
    return default if raw == "" else parse_int(name, raw, lo, hi)


def env_float(env: dict, name: str, default):
    raw = env.get(name, "")
    return default if raw == "" else parse_float(name, raw)


def env_minutes(env: dict, name: str, default: float) -> float:
    value = env_float(env, name, default)
    if value <= 0:
        raise UserError(f"{name} must be a number of minutes > 0, got '{env.get(name)}'")
    return value


def launched_rank(env) -> bool:
    """True in a process that a launcher (torchrun) started as one rank of the job.

    There WORLD_SIZE is the job's process count; in the process the user started (ENV=dlc), PAI-DLC's
    WORLD_SIZE is the node count.
    """
    return "TORCHELASTIC_RUN_ID" in env or ("LOCAL_RANK" in env and "MASTER_ADDR" in env)



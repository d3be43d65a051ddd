"""`mpatch convert pai SCRIPT ARG...`: Pai-Megatron-Patch's converter scripts, with their positional forms, over
`mpatch convert`.

The scripts under ``toolkits/model_checkpoints_convertor/`` and ``toolkits/distributed_checkpoints_convertor/``
are POSIX sh wrappers that pass their name and arguments here. Each Pai script's positions (read from its own
source) are in ``SCRIPTS``; what a position means here is its role (``ROLES``): the direction (``mg2hf``), the
source, target and HF folders, the layout, the precision (``PR``: the output's dtype), the checks (``CHECK``,
``CHECK_ONLY``: `mpatch align`). The rest says nothing this converter needs (the model comes from config.json, the
bytes move on the CPU) and is named in one line with why. The conversion itself is `mpatch convert hf2mcore` or
`mcore2hf`, printed before it runs:

- hf2mcore writes torch_dist, which loads at any TP/PP/EP/ETP (Pai's model_checkpoints_convertor writes per-rank
  files for one layout); the layout given is still checked against the model (with MP_PP0_LAYERS, as Pai's
  converters read it), keeps the multi-token-prediction layers config.json declares where Pai's script does (its
  DeepSeek-V3 converter; Qwen3-Next's drops them), and replaces an earlier output of mpatch in the target, as Pai's
  scripts write over theirs.
- mcore2hf reads the architecture from the checkpoint's own record; Pai's HF folder gives it for a checkpoint
  without one, and the tokenizer files for a checkpoint that carries none.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_patch.checkpoint.arch_source import open_checkpoint
from megatron_patch.checkpoint.foreign import find_checkpoint
from megatron_patch.checkpoint.hf_reader import HFCheckpointReader
from megatron_patch.convert.checkpoint import dequantize_hf
from megatron_patch.dtypes import PRECISION_DTYPE_NAMES
from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import validate_layout
from megatron_patch.models.description.registry import parse_arch
from megatron_patch.runtime.distributed import ParallelLayout


@dataclass(frozen=True)
class PaiScript:
    """One of Pai's converter scripts: where its READMEs run it (under toolkits/) and its positions in order;
    the last ``optional`` of them may be left out."""

    paths: tuple[str, ...]
    positions: tuple[str, ...]
    optional: int = 1
    # whether it keeps the multi-token-prediction layers config.json declares (Pai's DeepSeek-V3 converter): the
    # others drop them (Qwen3-Next's), and a Pai launcher's line then trains none, as in Pai
    keeps_mtp: bool = False

    @property
    def name(self) -> str:
        return Path(self.paths[0]).name


_MODEL = "toolkits/model_checkpoints_convertor"
_DIST = "toolkits/distributed_checkpoints_convertor"
# Pai's 8xH20 scripts of the distributed converter, one per family, all with the same positions.
_RUN_8XH20 = ("MODEL_SIZE", "LOAD_DIR", "SAVE_DIR", "MG2HF", "USE_CUDA", "PR", "HF_DIR")
_HF2MEGATRON = ("MEGATRON_PATH", "SOURCE_CKPT_PATH", "TARGET_CKPT_PATH", "TP", "PP", "MN", "EXTRA_VOCAB_SIZE", "mg2hf")

SCRIPTS = {s.paths[0]: s for s in (
    PaiScript((f"{_MODEL}/llama/hf2mcore_convertor_llama3_1.sh",),
              ("MODEL_SIZE", "SOURCE_CKPT_PATH", "TARGET_CKPT_PATH", "TP", "PP", "mg2hf", "CHECK", "CHECK_ONLY", "PR",
               "HF_CKPT_PATH")),
    PaiScript((f"{_MODEL}/qwen/hf2mcore_qwen2_convertor.sh",),
              ("MODEL_SIZE", "SOURCE_CKPT_PATH", "TARGET_CKPT_PATH", "TP", "PP", "EP", "PR", "USE_TE", "MG2HF",
               "HF_CKPT_PATH")),
    PaiScript((f"{_MODEL}/qwen/hf2mcore_qwen2_moe_convertor.sh",),
              ("MODEL_SIZE", "SOURCE_CKPT_PATH", "TARGET_CKPT_PATH", "TP", "PP", "ETP", "EP", "PR", "MG2HF",
               "HF_CKPT_PATH")),
    # Qwen2.5's README runs it from the distributed converter's folder; Pai keeps it beside Qwen2's.
    PaiScript((f"{_MODEL}/qwen/hf2mcore_qwen2.5_convertor.sh", f"{_DIST}/hf2mcore_qwen2.5_convertor.sh"),
              ("MODEL_SIZE", "SOURCE_CKPT_PATH", "TARGET_CKPT_PATH", "TP", "PP", "PR", "USE_TE", "MG2HF",
               "HF_CKPT_PATH")),
    PaiScript((f"{_MODEL}/deepseek/hf2mcore_deepseek_v3_moe_convertor.sh",),
              ("MODEL_SIZE", "SOURCE_CKPT_PATH", "TARGET_CKPT_PATH", "TP", "PP", "ETP", "EP", "PR", "MG2HF",
               "HF_CKPT_PATH"), keeps_mtp=True),
    PaiScript((f"{_MODEL}/mistral/hf2mcore_convertor.sh",),
              ("MODEL_SIZE", "HG_CKPT_PATH", "MEGATRON_PATH", "SOURCE_CKPT_PATH", "TARGET_CKPT_PATH", "TP", "PP",
               "EXTRA_VOCAB_SIZE", "NUM_EXPERTS", "EXPERTS_TOPK", "EP", "mg2hf", "WS")),
    # Mistral's README converts back with the Megatron-LM converter, which Pai keeps beside Llama's.
    PaiScript((f"{_MODEL}/mistral/hf2megatron_convertor.sh", f"{_MODEL}/llama/hf2megatron_convertor.sh"),
              _HF2MEGATRON, optional=0),
    *(PaiScript((f"{_DIST}/scripts/{family}/run_8xH20.sh",), _RUN_8XH20) for family in ("qwen2_5", "qwen3", "qwen3_next")),
)}

# What each of Pai's position names is here; a name without a role is ignored, for the reason in IGNORED.
ROLES = {
    "mg2hf": "mg2hf", "MG2HF": "mg2hf",
    "SOURCE_CKPT_PATH": "source", "LOAD_DIR": "source",
    "TARGET_CKPT_PATH": "target", "SAVE_DIR": "target",
    "HF_CKPT_PATH": "hf", "HF_DIR": "hf", "HG_CKPT_PATH": "hf",
    "TP": "tp", "PP": "pp", "EP": "ep", "ETP": "etp", "PR": "pr", "CHECK": "check", "CHECK_ONLY": "check_only",
}
IGNORED = {
    "MODEL_SIZE": "the model is the one config.json describes",
    "MN": "the model is the one config.json describes",
    "USE_TE": "checkpoints hold transformer-engine's names, which load with or without it",
    "USE_CUDA": "the bytes move on the CPU, no GPU needed",
    "MEGATRON_PATH": "megatron-core is installed",
    "EXTRA_VOCAB_SIZE": "the vocabulary is config.json's, padded to a multiple of 128",
    "NUM_EXPERTS": "config.json gives the experts",
    "EXPERTS_TOPK": "config.json gives the experts",
    "WS": "no processes are started",
}
# What each role does here, for --help.
ROLE_HELP = {
    "mg2hf": "false: HF -> Megatron-Core ('mpatch convert hf2mcore'); true: Megatron-Core -> HF ('mcore2hf')",
    "source": "hf2mcore: the HF model folder; mg2hf: the checkpoint (its root, an iter_XXXXXXX or release folder, or a "
              "run's OUTPUT_BASEPATH/checkpoint or final)",
    "target": "the output folder; an earlier output of mpatch there is replaced, anything else is refused",
    "hf": "mg2hf: the HF folder the model came from: its config.json for a checkpoint without a record of its own, "
          "its tokenizer files for one that carries none",
    "tp": "hf2mcore: checked against the model (the torch_dist checkpoint loads at any TP/PP/EP/ETP); mg2hf: the "
          "checkpoint's; and the layout CHECK runs at",
    "pp": "as TP (MP_PP0_LAYERS in the environment: the first stage's layers, as Pai's converters read it)",
    "ep": "as TP", "etp": "as TP",
    "pr": "the output's dtype: fp32 | bf16 | fp16",
    "check": "true: 'mpatch align' then compares the HF model with the checkpoint, layer by layer (exit 1 if they "
             "differ)",
    "check_only": "true: that comparison alone, no conversion",
}
LAYOUT = ("tp", "pp", "ep", "etp")
# DeepSeek-V3's README casts the FP8 hub folder to bf16 first, with this Python script and its own flags.
FP8_CAST = f"{_MODEL}/deepseek/fp8_cast_bf16.py"


def find_script(name: str) -> PaiScript:
    """A script by its path under the repository (as a wrapper passes it) or its file name."""
    found = SCRIPTS.get(name) or next((s for s in SCRIPTS.values() if name in s.paths), None)
    if found is None:
        named = [s for s in SCRIPTS.values() if s.name == Path(name).name]
        found = named[0] if len(named) == 1 else None
    if found is None:
        raise UserError(f"{name} is none of Pai-Megatron-Patch's converter scripts that run here: "
                        f"{', '.join(sorted({s.name for s in SCRIPTS.values()}))}")
    return found


def usage(script: PaiScript) -> str:
    last = len(script.positions) - script.optional
    names = " ".join(n if i < last else f"[{n}]" for i, n in enumerate(script.positions))
    return f"{script.name} {names}"


def _values(script: PaiScript, argv: list[str]) -> dict[str, str]:
    """Position name -> value; a count that does not fit names the position missing or extra."""
    positions, least = script.positions, len(script.positions) - script.optional
    if len(argv) < least:
        missing = positions[len(argv)]
        raise UserError(f"{script.name} takes {least}{f' to {len(positions)}' if script.optional else ''} arguments "
                        f"({' '.join(positions)}), got {len(argv)}: position {len(argv) + 1}, {missing}, is missing")
    if len(argv) > len(positions):
        raise UserError(f"{script.name} takes at most {len(positions)} arguments ({' '.join(positions)}), got "
                        f"{len(argv)}: position {len(positions) + 1}, {argv[len(positions)]!r}, is one too many")
    return dict(zip(positions, argv))


def _flag(name: str, raw: str) -> bool:
    # Pai's scripts compare with `= true` / `= false`; anything else would do neither there.
    if raw not in ("true", "false"):
        raise UserError(f"{name} must be true or false, got '{raw}'")
    return raw == "true"


def _size(name: str, raw: str) -> str:
    # str.isdigit accepts digits int() refuses ('²'): ASCII digits only
    if not (raw.isascii() and raw.isdigit()) or int(raw) < 1:
        raise UserError(f"{name} must be a whole number of at least 1, got '{raw}'")
    return raw


@dataclass
class Plan:
    """What a Pai command line runs here: `mpatch convert ...` (None with CHECK_ONLY), then `mpatch align ...`
    (None without a check), and the positions ignored, with why."""

    convert: list[str] | None
    align: list[str] | None
    ignored: list[str]
    # what the check needs to know of the conversion
    mg2hf: bool = False
    source: str = ""
    hf: str | None = None
    pr: str | None = None


def plan(script: PaiScript, argv: list[str], env: dict) -> Plan:
    values = _values(script, argv)
    name_of = {ROLES[n]: n for n in values if n in ROLES}
    role = {r: values[n] for r, n in name_of.items()}
    ignored = [f"{n}={v} ({IGNORED[n]})" for n, v in values.items() if n not in ROLES]
    mg2hf = _flag(name_of["mg2hf"], role["mg2hf"])
    check = "check" in role and _flag("CHECK", role["check"])
    check_only = "check_only" in role and _flag("CHECK_ONLY", role["check_only"])
    if role.get("ep") == "0":  # Mistral's dense line: Pai passes its EP only with experts
        del role["ep"]
    layout = {k: _size(name_of[k], role[k]) for k in LAYOUT if k in role}
    pr = role.get("pr")
    if pr is not None and pr not in PRECISION_DTYPE_NAMES:
        raise UserError(f"PR must be one of {' | '.join(PRECISION_DTYPE_NAMES)}, got '{pr}'")
    source, target, hf = role["source"], role["target"], role.get("hf")
    if not mg2hf:
        if hf is not None and hf != source:
            ignored.append(f"{name_of['hf']}={hf} (the HF folder read is {name_of['source']})")
        convert = ["convert", "hf2mcore", "--hf-dir", source, "--save-dir", target, *_layout_args(source, layout, env),
                   "--format", "torch_dist", *(["--mtp", "auto"] if script.keeps_mtp else []), "--force"]
        align = ["align", "--hf-dir", source, "--mcore-dir", target]
    else:
        if not (check or check_only):
            ignored += [f"{name_of[k]}={v} (the checkpoint records its layout)" for k, v in layout.items()]
        convert = ["convert", "mcore2hf", "--load-dir", source, "--save-dir", target, "--force"]
        if hf is not None:
            convert += ["--hf-config", hf]
        align = ["align", "--hf-dir", target, "--mcore-dir", source]
    if pr is not None:
        convert += ["--dtype", pr]
    if env.get("MODEL_PARALLEL_ARGS"):
        ignored.append("MODEL_PARALLEL_ARGS (torch_dist loads at any layout)")
    align += [a for k, v in layout.items() for a in (f"--{k}", v)] + ["--dtype", pr or "fp32"]
    return Plan(convert=None if check_only else convert, align=align if check or check_only else None,
                ignored=ignored, mg2hf=mg2hf, source=source, hf=hf, pr=pr)


def _layout_args(source: str, layout: dict, env: dict) -> list[str]:
    """--tp/--pp/--ep/--etp for hf2mcore. MP_PP0_LAYERS (an uneven first stage, which Pai's converters read from the
    environment) is checked against the model here, and the torch_dist checkpoint, which loads at any split, is
    written without one."""
    pp0 = env.get("MP_PP0_LAYERS")
    if not pp0 or int(layout.get("pp", "1")) == 1:
        return [a for k, v in layout.items() for a in (f"--{k}", v)]
    sizes = {k: int(v) for k, v in layout.items()}
    validate_layout(parse_arch(source), ParallelLayout(**sizes), pp_first_stage_layers=int(_size("MP_PP0_LAYERS", pp0)))
    return [a for k, v in layout.items() if k != "pp" for a in (f"--{k}", v)]


def _judged_in_its_dtype(todo: Plan) -> list[str]:
    """What align adds to judge the conversion fairly. Its fp32 run certifies a conversion that kept every weight's
    value (PR the source's own dtype, or fp32, which holds any); one that rounded them on purpose (an fp32 model
    written in PR=bf16) is judged in PR alone, against HF's own rounding in PR (--only-dtype)."""
    if todo.pr in (None, "fp32"):
        return []
    if todo.mg2hf:
        stored = open_checkpoint(todo.source, hf_config=todo.hf).sidecar.dtype_name
    else:
        reader = HFCheckpointReader(todo.source)
        dtypes = [reader.dtype(n) for n in reader.keys()]
        stored = max(set(dtypes), key=dtypes.count)  # the weights', not a router bias kept in fp32
    return [] if stored == PRECISION_DTYPE_NAMES[todo.pr] else ["--only-dtype"]


def _check_describes_itself(script: PaiScript, source: str) -> None:
    """mg2hf of a checkpoint that does not say what model it holds needs the HF folder it came from: asked for by
    its position, not by mcore2hf's --family and --hf-config, which this line has no place for (the pdoc audit)."""
    found = find_checkpoint(source)
    if found.sidecar_dir is not None:
        return
    beside = f" ({found.hf_config_beside} lies beside the weights)" if found.hf_config_beside else ""
    at = next((i for i, name in enumerate(script.positions) if ROLES.get(name) == "hf"), None)
    if at is None:
        raise UserError(f"{source} does not say what model it holds, and {script.name} takes no HF folder: convert it "
                        f"with 'mpatch convert mcore2hf --load-dir {source} --hf-config PATH'{beside}")
    raise UserError(f"{source} does not say what model it holds: give the HF folder it came from as "
                    f"{script.positions[at]} (position {at + 1}){beside}")


def describe(script: PaiScript) -> str:
    """The script's positions and what each does here (its --help)."""
    least = len(script.positions) - script.optional
    lines = [f"usage: {usage(script)}", "", f"Pai-Megatron-Patch's {script.name}, over 'mpatch convert' "
             "(docs/coming-from-pai.md):"]
    for i, name in enumerate(script.positions):
        text = ROLE_HELP[ROLES[name]] if name in ROLES else f"ignored: {IGNORED[name]}"
        lines.append(f"  {i + 1:2d} {name:<17} {text}{' (may be left out)' if i >= least else ''}")
    return "\n".join(lines)


def cast_fp8(arguments: list[str]) -> int:
    """Pai's fp8_cast_bf16.py: the FP8 folder written again in bf16 (``convert.checkpoint.dequantize_hf``)."""
    parser = argparse.ArgumentParser(prog="fp8_cast_bf16.py", description="An FP8 hub folder (DeepSeek-V3's) written "
                                     "again in bf16, as Pai-Megatron-Patch's script of that name does; hf2mcore reads "
                                     "the FP8 folder itself, so a conversion does not need this step.")
    parser.add_argument("--input-fp8-hf-path", required=True, help="the FP8 hub folder")
    parser.add_argument("--output-bf16-hf-path", required=True,
                        help="the bf16 folder to write (an earlier output of mpatch there is replaced)")
    given = parser.parse_args(arguments)
    print(f"fp8_cast_bf16.py: not needed here (hf2mcore dequantizes {given.input_fp8_hf_path} itself); writing the "
          "bf16 folder all the same", file=sys.stderr, flush=True)
    dequantize_hf(given.input_fp8_hf_path, given.output_bf16_hf_path, "bf16", force=True)
    print(f"wrote {given.output_bf16_hf_path}")
    return 0


def run(args) -> int:
    from megatron_patch.cli import build_parser  # the package imports this module while it builds its parser

    if Path(args.script).name == Path(FP8_CAST).name:
        return cast_fp8(list(args.arguments))
    script = find_script(args.script)
    if args.arguments[:1] in (["-h"], ["--help"]):
        print(describe(script))
        return 0
    todo = plan(script, list(args.arguments), dict(os.environ))
    if todo.mg2hf and todo.hf is None:
        _check_describes_itself(script, todo.source)
    if todo.ignored:
        print(f"{script.name}: ignored here: " + "; ".join(todo.ignored), file=sys.stderr, flush=True)
    code = 0
    for argv in (todo.convert, todo.align):
        if argv is None:
            continue
        if argv[0] == "align":
            argv = [*argv, *_judged_in_its_dtype(todo)]
        print(f"{script.name}: mpatch {shlex.join(argv)}", file=sys.stderr, flush=True)
        parsed = build_parser(only=argv[0]).parse_args(argv)
        code = int(parsed.run(parsed) or 0)
        if code:
            break
    return code


def register(convert_subparsers) -> None:
    p = convert_subparsers.add_parser(
        "pai", help="run one of Pai-Megatron-Patch's converter scripts' command lines, unchanged",
        description="Pai-Megatron-Patch's converter scripts with their positional arguments: "
                    + "; ".join(dict.fromkeys(usage(s) for s in SCRIPTS.values()))  # one line per form
                    + "; and fp8_cast_bf16.py --input-fp8-hf-path FP8_DIR --output-bf16-hf-path BF16_DIR"
                    + ". toolkits/ holds each under Pai's path, a wrapper of this command (POSIX sh, or Python as "
                      "Pai's fp8_cast_bf16.py). "
                      "docs/coming-from-pai.md says what each position does here.")
    p.add_argument("script", help="the script's path under the repository, or its file name")
    p.add_argument("arguments", nargs=argparse.REMAINDER, help="its positional arguments, as Pai's README gives them")
    p.set_defaults(run=run)

"""The positional launcher interface (Pai-Megatron-Patch's order): the launchers and each argument's place, and
the readers of one raw value (a value wrong on its own is refused in one line naming it). Each option's meaning,
reader and default is its entry in ``launcher_options.py``.

Every family has its launcher, ``examples/<family>/run_mcore_<family>.sh``. Pai-Megatron-Patch's own launcher
scripts (``ModelFamily.pai_launchers``) are launchers too, at Pai's paths under examples/: one script may train
several families (Pai's Qwen3 launcher takes the dense and the MoE sizes; its Mistral launcher Mistral-7B and
Mixtral), and may take several argument counts (this project's and Pai's). The argument count picks the
layout, MODEL_SIZE the family.
"""

from __future__ import annotations

import decimal
import fractions
import functools
import math
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from megatron_patch.errors import UserError
from megatron_patch.models.description.family import PaiLauncher
from megatron_patch.models.description.registry import families, get_family

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
    # family -> what Pai's script at this path passes for it (its weight decay, MoE balancing), where it is Pai's
    pai_records: tuple[tuple[str, PaiLauncher], ...] = ()

    def weight_decay(self, family: str) -> float:
        said = self._pai_record(family)
        return get_family(family).weight_decay if said is None or said.weight_decay is None else said.weight_decay

    def moe_aux_loss(self, family: str) -> float | None:
        """What Pai's script passes as --moe-aux-loss-coeff for ``family``, where it says (None: the run decides)."""
        said = self._pai_record(family)
        return None if said is None else said.moe_aux_loss

    def moe_balancing(self, family: str) -> str | None:
        """Pai's script's --moe-router-load-balancing-type for ``family`` where not megatron-core's aux_loss."""
        said = self._pai_record(family)
        return None if said is None else said.moe_balancing

    def trains_as_pai(self, family: str) -> bool:
        """Whether this is Pai's script for ``family``, whose line passes Pai's MoE settings whatever config.json
        says."""
        return self._pai_record(family) is not None

    def _pai_record(self, family: str) -> PaiLauncher | None:
        return dict(self.pai_records).get(family)

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


def launchers() -> dict[str, Launcher]:
    """Every launcher by name: each family's own, then Pai's scripts (merged into a family's where the path is
    the same, e.g. examples/qwen3/run_mcore_qwen3.sh). Kept for as long as the registry holds the same families
    (a family being built is registered for a test's length)."""
    return _launchers(tuple(families()))


@functools.cache
def _launchers(names: tuple[str, ...]) -> dict[str, Launcher]:
    registered = [families()[name] for name in names]
    found = {f.launcher: Launcher(f.name, f.launcher, (f.launcher_parallel_args, *f.launcher_more_parallel_args),
                                  _sizes(f), (f.name,))
             for f in registered}
    for f in registered:
        name = f.name
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
                {**known.sizes, **sizes}, known.families + (() if name in known.families else (name,)), pai=True,
                pai_records=known.pai_records + ((name, pai),))
    return {launcher.name: launcher for launcher in found.values()}


def get_launcher(name: str) -> Launcher:
    known = launchers()
    if name not in known:
        raise UserError(f"no launcher '{name}': launchers exist for {', '.join(known)}")
    return known[name]


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
    """A token or iteration count of at most ``most`` ``unit``: integers, also written as 1e9 or 10B/500M/2.05K.
    Read as an exact decimal: in binary floating point 2.05M is 2049999.9999999998, not whole."""
    text = raw.strip()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}.get(text[-1:].upper(), 1)
    if scale != 1:
        text = text[:-1]
    try:
        number = decimal.Decimal(text)
    except decimal.InvalidOperation:
        raise UserError(f"{name} must be a count (e.g. 1000000, 1e9 or 10B), got '{raw}'") from None
    if number.is_finite() and number > most:  # before the exact product below, which 1e999999 would make huge
        raise _more_than(name, raw, most, unit)
    # A non-zero number below 10**-(digits + 12) is no whole count at any scale (and 1e-999999 a huge fraction)
    tiny = number.is_finite() and number and number.as_tuple().exponent < -(len(text) + 12)
    value = fractions.Fraction(number) * scale if number.is_finite() and not tiny else None
    if value is None or value < 0 or value.denominator != 1:
        raise UserError(f"{name} must be a whole non-negative count, got '{raw}'")
    if value > most:
        raise _more_than(name, raw, most, unit)
    return int(value)


def _more_than(name: str, raw: str, most: int, unit: str) -> UserError:
    return UserError(f"{name}={raw} is more than {most} {unit}, the most a run takes (docs/training.md): check "
                     "the number")


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
    raise UserError(f"{name} must be true or false (yes/no and 1/0 are taken too), got '{raw}'")


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


def names_data(path: str, dataset_type: str) -> bool:
    """Whether ``path`` names data as a whole: a value that does is one path, whatever spaces it holds."""
    return Path(path).is_file() if dataset_type == "raw" else any(Path(path + s).exists() for s in (".bin", ".idx"))


def launched_rank(env) -> bool:
    """True in a process that a launcher (torchrun) started as one rank of the job.

    There WORLD_SIZE is the job's process count; in the process the user started (ENV=dlc), PAI-DLC's
    WORLD_SIZE is the node count.
    """
    return "TORCHELASTIC_RUN_ID" in env or ("LOCAL_RANK" in env and "MASTER_ADDR" in env)



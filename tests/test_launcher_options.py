"""Launcher options declared once (training/launcher_options.py): --help, the dry run, the docs' tables and the
RunConfig are all derived from the one table, and no option is read from the environment anywhere else."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_patch.errors import UserError
from megatron_patch.training.run_config import RunConfig
from tests.training_helpers import launcher_args

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "megatron_patch"

# MP_* switches that are no launcher option, each read by the one module that owns it, and why.
NOT_LAUNCHER_OPTIONS = {
    "MP_SHOW_WARNINGS": "runtime/launch.py: keeps megatron-core's CPU warnings in every rank (debugging)",
    "MP_LOCAL_START": "runtime/launch.py: spawn starts local ranks as fresh interpreters, not forked (CPU)",
    "MP_CPU_COMPAT_ANY_MCORE": "runtime/cpu_compat.py: the CPU patches on an unaudited megatron-core, for every command",
    "MP_LAUNCHER_PID": "runtime/launch.py: set by the launcher for its own ranks",
    "MP_LAUNCHER_WARNED": "runtime/launch.py: set by the launcher for its own ranks (the warnings it printed)",
    "MP_LAUNCHER_REFUSED": "runtime/launch.py: set by a node's launcher that refused its line, for ranks that only "
                           "tell the other nodes so",
    "MP_LAUNCHER_COMPLETE": "runtime/launch.py: set by a node's launcher that found its run complete, for ranks that "
                            "only compare its line with the other nodes'",
}
# Where a launcher option's name is read by another program, and why.
READ_ELSEWHERE = {
    ("cli/pai_convert.py", "MP_PP0_LAYERS"): "Pai's converter scripts read it for the converter, as Pai's do",
    ("cli/train.py", "MP_SFT_LOSS"): "a resumed SFT run keeps the weighting it trained with: where the launch does "
                                     "not set it, the launcher sets it for its ranks",
    ("cli/train.py", "MP_MOE_AUX_LOSS"): "a resumed MoE run keeps the load-balancing coefficient it trained with, "
                                         "as MP_SFT_LOSS",
}
# RunConfig fields with a default of their own: set after the RunConfig is built, by the part that owns them.
SET_AFTER = {"lora", "lora_init", "dsa", "checkpoint_tokenizer"}


def _environment_reads() -> set[tuple[str, str]]:
    """(module, name) of every MP_* name read from an environment in megatron_patch/ (env.get, environ[...],
    getenv, and a module constant that names one)."""
    read = re.compile(r"""(?:environ|env|getenv)\s*(?:\.get\(|\[|\()\s*["'](MP_[A-Z0-9_]+)["']""")
    constant = re.compile(r"""^[A-Z_]+\s*=\s*["'](MP_[A-Z0-9_]+)["']""", re.M)
    found = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        module = str(path.relative_to(PACKAGE))
        found |= {(module, name) for name in read.findall(text) + constant.findall(text)}
    return found


def test_no_option_is_read_from_the_environment_but_by_the_table():
    """The launcher reads its options in one place, training/launcher_options.py; core, LoRA and DSA each read
    theirs from the environment before."""
    reads = {(module, name) for module, name in _environment_reads() if module != "training/launcher_options.py"}
    stray = sorted(r for r in reads if r[1] not in NOT_LAUNCHER_OPTIONS and r not in READ_ELSEWHERE)
    assert stray == [], f"read from the environment outside training/launcher_options.py: {stray}"


def test_the_exceptions_are_no_launcher_options():
    from megatron_patch.training.launcher_options import OPTION, RUNTIME_VARIABLES

    assert not set(NOT_LAUNCHER_OPTIONS) & set(OPTION)
    assert RUNTIME_VARIABLES == set(NOT_LAUNCHER_OPTIONS)  # a launch names any other MP_ variable as unread
    assert {name for _, name in READ_ELSEWHERE} <= set(OPTION)
    assert set(READ_ELSEWHERE) <= _environment_reads()  # an exception no longer needed goes


def test_run_config_holds_no_default_of_an_option():
    """A RunConfig field takes its value from the table (whose entry holds the default) or from a derivation:
    a default here would be a second home (RunConfig's weight_decay=0.1 beside each family's)."""
    own = sorted(f.name for f in dataclasses.fields(RunConfig)
                 if (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING)
                 and f.name not in SET_AFTER)
    assert own == []


def test_every_run_config_field_is_filled_by_one_option_or_derived():
    from megatron_patch.training.launcher_options import DERIVED, OPTIONS

    filled = [name for o in OPTIONS if o.field is not None
              for name in (o.field if isinstance(o.field, tuple) else (o.field,))]
    assert len(filled) == len(set(filled)), "a field filled by two options"
    assert not set(filled) & set(DERIVED), "a field both filled and derived"
    assert set(filled) | set(DERIVED) == {f.name for f in dataclasses.fields(RunConfig)}


def test_the_table_names_each_positional_argument_once():
    from megatron_patch.training.launcher_args import HEAD, TAIL, launchers
    from megatron_patch.training.launcher_options import ENVIRONMENT, PARTS, POSITIONAL

    assert [o.name for o in POSITIONAL] == HEAD + ["ETP", "EP"] + TAIL
    names = {name for launcher in launchers().values() for layout in launcher.layouts
             for name in launcher.arg_names(layout)}
    assert names == {o.name for o in POSITIONAL}
    assert all(o.part in PARTS for o in POSITIONAL + ENVIRONMENT)
    assert len({o.name for o in ENVIRONMENT}) == len(ENVIRONMENT)


def test_every_option_is_in_help_and_the_docs():
    from megatron_patch.training.launcher_options import ENVIRONMENT, POSITIONAL, usage

    text = usage("qwen3_moe")  # 27 arguments: every positional one
    readme = (REPO / "examples" / "README.md").read_text()
    for option in POSITIONAL + ENVIRONMENT:
        assert re.search(rf"^\s+(\d+ )?{option.name}\s", text, re.M), f"{option.name} not in --help"
        row = f"| {option.name} |" if option.positional else f"| `{option.name}` |"
        assert row in readme, f"{option.name} has no row in examples/README.md"


def test_docs_name_only_options_that_exist():
    """Every MP_* name the docs give is a launcher option (or one of the runtime's own switches)."""
    from megatron_patch.training.launcher_options import OPTION

    named = set()
    for path in [REPO / "README.md", REPO / "examples" / "README.md", *(REPO / "docs").glob("*.md")]:
        named |= {(path.name, m) for m in re.findall(r"\bMP_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    unknown = sorted((doc, name) for doc, name in named if name not in OPTION and name not in NOT_LAUNCHER_OPTIONS)
    assert unknown == []


def test_every_environment_option_is_in_the_dry_run():
    from megatron_patch.training.launcher_options import ENVIRONMENT, dry_run_options
    from megatron_patch.training.validation import resolve

    env = {"MP_SEED": "7"}
    options = dry_run_options(resolve("qwen3_moe", launcher_args("qwen3_moe"), env=env, check_paths=False), env)
    assert list(options) == [o.name for o in ENVIRONMENT]
    assert options["MP_SEED"] == {"value": "7", "set": True, "part": "core"}
    assert options["MP_WEIGHT_DECAY"] == {"value": "0.01", "set": False, "part": "core"}  # qwen3_moe's default
    assert options["MP_LORA_ALPHA"] == {"value": "R", "set": False, "part": "LoRA"}  # what its default says


@pytest.mark.slow  # megatron-core's import and the memory plan: 5-15 s on 2 cores
def test_the_dry_run_prints_every_environment_option(monkeypatch, capsys):
    from megatron_patch.cli.train import dry_run_report, print_dry_run
    from megatron_patch.training.launcher_options import ENVIRONMENT
    from megatron_patch.training.validation import resolve

    monkeypatch.setattr("os.environ", {"MP_SEED": "7"})
    argv = launcher_args("qwen3_moe")
    report = dry_run_report(resolve("qwen3_moe", argv, env={"MP_SEED": "7"}, check_paths=False), argv)
    print_dry_run(report)
    out = capsys.readouterr().out
    for option in ENVIRONMENT:
        assert re.search(rf"^  [ *] {option.name}\s", out, re.M), f"{option.name} not in the dry run"
    assert re.search(r"^  \* MP_SEED\s+7$", out, re.M)


def _refusals():
    from megatron_patch.training.launcher_options import OPTIONS

    return [o for o in OPTIONS if o.reader.refused is not None]


@pytest.mark.parametrize("option", _refusals(), ids=lambda o: o.name)
def test_a_value_an_option_does_not_take_is_one_line_naming_it(option):
    """Each option's reader refuses what it does not take, in one line that starts with the option's name."""
    from megatron_patch.training.validation import resolve

    family = "qwen3_moe"  # a MoE launcher: ETP and EP are positions too
    if option.positional:
        argv, env = launcher_args(family, **{option.name: option.reader.refused}), {}
    else:
        argv, env = launcher_args(family), {option.name: option.reader.refused}
    with pytest.raises(UserError) as exc:
        resolve(family, argv, env=env, check_paths=False)
    message = str(exc.value)
    assert message.startswith(option.name) and "\n" not in message, message


def test_unset_and_empty_are_the_default():
    from megatron_patch.training.launcher_options import ENVIRONMENT
    from megatron_patch.training.validation import resolve

    unset = resolve("qwen3_moe", launcher_args("qwen3_moe"), env={}, check_paths=False)
    empty = resolve("qwen3_moe", launcher_args("qwen3_moe"), env={o.name: "" for o in ENVIRONMENT},
                    check_paths=False)
    assert unset == empty
    assert (unset.weight_decay, unset.seed, unset.eval_interval) == (0.01, 1234, 10000)
    # PR=fp8's recipe is its implementation's default (training/fp8_run.py: delayed with transformer-engine,
    # tensorwise with torchao), decided where the machine is known
    assert (unset.fp8_recipe, unset.fp8_filter, unset.compile_layers) == (None, "auto", False)


def test_the_weight_decay_default_is_the_familys():
    """One home for the per-family default (``ModelFamily.weight_decay``); one for the value used (RunConfig's,
    which megatron_settings gives the optimizer and the scheduler)."""
    from megatron_patch.models.description.registry import families
    from megatron_patch.training.validation import resolve

    for name in ("llama3_1", "qwen3_moe"):
        cfg = resolve(name, launcher_args(name), env={}, check_paths=False)
        assert cfg.weight_decay == families()[name].weight_decay
    assert resolve("llama3_1", launcher_args(), env={"MP_WEIGHT_DECAY": "0.05"},
                   check_paths=False).weight_decay == 0.05

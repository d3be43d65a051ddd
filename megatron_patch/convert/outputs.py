"""Output folders that appear complete or not at all, and the HF side files carried along.

Everything is written under a hidden sibling (``.NAME.mpatch-partial.PID``) and renamed onto the
target only once complete; a failure removes the partial folder, and an interrupted run (even
``kill -9``) leaves at most a hidden folder whose name says it is partial, which the next run
removes once its process is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from megatron_patch.errors import UserError

PARTIAL_TAG = ".mpatch-partial."

# Files of an HF model folder that travel with the weights (tokenizer, chat template, generation).
CARRIED_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "*.tiktoken", "tokenizer.model", "spiece.model", "sentencepiece*.model", "generation_config.json",
    "chat_template.*", "preprocessor_config.json",
)


def carried_files(folder: str | Path) -> list[str]:
    folder = Path(folder)
    names = {p.name for pattern in CARRIED_PATTERNS for p in folder.glob(pattern) if p.is_file()}
    return sorted(names)


def copy_carried(src: str | Path, dst: str | Path, names: list[str] | None = None) -> list[str]:
    names = carried_files(src) if names is None else names
    for name in names:
        if not (Path(src) / name).is_file():
            raise UserError(f"{Path(src) / name} is missing: the checkpoint's side files are incomplete")
        shutil.copy2(Path(src) / name, Path(dst) / name)
    return names


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_partials(target: Path) -> None:
    for p in target.parent.glob(f".{target.name}{PARTIAL_TAG}*"):
        try:
            pid = int(p.name.rsplit(".", 1)[-1])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def check_target(target: str | Path, force: bool, *, inputs: tuple[str | Path, ...] = ()) -> Path:
    """Refuse a target that is a file, holds an input, or is non-empty without ``force``."""
    target = Path(target).absolute()
    for src in inputs:
        src = Path(src).resolve()
        t = target.resolve()
        if t == src or t in src.parents:
            raise UserError(f"the output folder {target} would overwrite the input {src}: choose another --save-dir")
    if target.exists() and not target.is_dir():
        raise UserError(f"{target} exists and is not a folder: choose another --save-dir")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise UserError(f"{target} is not empty: choose an empty or new --save-dir, or pass --force to replace it")
    if not target.parent.exists():
        raise UserError(f"the parent folder of {target} does not exist: create it first")
    if not os.access(target.parent, os.W_OK):
        raise UserError(f"cannot write in {target.parent}: choose a --save-dir you can write to")
    return target


@contextlib.contextmanager
def atomic_output_dir(target: str | Path, force: bool, *, inputs: tuple[str | Path, ...] = ()) -> Iterator[Path]:
    """Yield a temporary folder that becomes ``target`` when the block finishes without error."""
    target = check_target(target, force, inputs=inputs)
    _remove_stale_partials(target)
    tmp = target.parent / f".{target.name}{PARTIAL_TAG}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if target.exists():
            old = target.parent / f".{target.name}.mpatch-replaced.{os.getpid()}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""The converter's output folders (complete or absent, see ``checkpoint_files.layout``) and the HF side files
carried along with the weights.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

from megatron_patch.checkpoint_files.layout import atomic_dir
from megatron_patch.errors import UserError

# Files of an HF model folder that travel with the weights (tokenizer, chat template, generation).
CARRIED_PATTERNS = (
    "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
    "*.tiktoken", "tokenizer.model", "spiece.model", "sentencepiece*.model", "generation_config.json",
    "chat_template.*", "preprocessor_config.json",
    # HF tensors the MCore model does not hold, kept beside it (convert/carried.py)
    "carried_tensors.safetensors",
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
    with atomic_dir(check_target(target, force, inputs=inputs)) as tmp:
        yield tmp

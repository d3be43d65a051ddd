"""The converter's output folders (complete or absent, one writer at a time: ``megatron_patch.outputs``), what
``--force`` may replace, and the HF side files carried along with the weights.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from megatron_patch.checkpoint_files.layout import TRAIN_STATE
from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME, manifest_of, read_manifest, unlisted_entries, write_manifest
from megatron_patch.errors import UserError
from megatron_patch.input_files import HF_SIDE_FILES, NAMED_CHAT_TEMPLATES, checked_input
from megatron_patch.outputs.folders import atomic_dir, overlap, refuse_unexpanded_home

# Files of an HF model folder that travel with the weights (tokenizer, chat template, generation), and the HF
# tensors the MCore model does not hold, kept beside it (convert/carried.py).
CARRIED_PATTERNS = (*HF_SIDE_FILES, "carried_tensors.safetensors")
# The weights' licence and use policy travel too: Llama's licence asks that a copy go with every copy of the
# weights, and transformers reads neither, so an export had none (DeepSeek's LICENSE-MODEL, Llama's USE_POLICY.md).
# Not the model card (README.md): it describes the original model, not what a run trained it into.
LICENCE_FILES = ("LICENSE*", "LICENCE*", "License*", "license*", "NOTICE*", "USE_POLICY*")
CARRIED_PATTERNS += LICENCE_FILES
# and one folder down: the tokenizer's named chat templates (both converters dropped the folder without a word)
CARRIED_ONE_DOWN = (NAMED_CHAT_TEMPLATES,)


def is_carried_file(name: str) -> bool:
    """Whether ``name`` is a side file a checkpoint carries: a plain name that ``CARRIED_PATTERNS`` matches, or a
    folder and a plain name that ``CARRIED_ONE_DOWN`` matches (never a weight file or config.json, which an export
    writes itself, nor any other path)."""
    parts = name.split("/")
    if any(part in ("", ".", "..") or "\\" in part for part in parts) or len(parts) > 2:
        return False
    patterns = CARRIED_PATTERNS if len(parts) == 1 else CARRIED_ONE_DOWN
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def carried_files(folder: str | Path) -> list[str]:
    """The side files of ``folder`` (names relative to it, '/' between a folder and its file)."""
    folder = Path(folder)
    # Whatever is there but folders: a FIFO or a dangling link is refused when copied, not silently left out.
    names = {p.name for pattern in CARRIED_PATTERNS for p in folder.glob(pattern) if not p.is_dir()}
    names |= {p.relative_to(folder).as_posix() for pattern in CARRIED_ONE_DOWN for p in folder.glob(pattern)
              if not p.is_dir()}
    return sorted(names)


def copy_carried(src: str | Path, dst: str | Path, names: list[str] | None = None) -> list[str]:
    """Copy the side files into the output; one that leads outside ``src`` (a symlink to a system file, a
    sidecar naming ``../x``) is refused."""
    names = carried_files(src) if names is None else names
    for name in names:
        path = checked_input(Path(src) / name, inside=src, how="has a side file", limit=None,
                             hint="the checkpoint's side files are incomplete")
        target = Path(dst) / name
        target.parent.mkdir(exist_ok=True)  # a file one folder down (CARRIED_ONE_DOWN)
        shutil.copy2(path, target)
    return names


def _first_file_above(path: Path) -> Path | None:
    """The nearest ancestor of ``path`` that exists and is not a folder (a --save-dir under a file), or None."""
    for parent in path.parents:
        if parent.exists() or parent.is_symlink():
            return None if parent.is_dir() else parent
    return None


def command_of(tool: str) -> str:
    """The command a manifest's ``tool`` names ("mpatch convert mcore2hf --merge-lora" -> "mpatch convert"): an
    output may replace the earlier outputs of its own command only."""
    match = re.match(r"mpatch \w+", tool)
    return match.group(0) if match else tool


def replace_refusal(folder: Path, writer: str | None = None) -> str | None:
    """Why ``--force`` must not replace ``folder`` (None: it is an earlier output of this project, and with
    ``writer`` (a manifest's tool) one of the same command: align's --force replaces an align report, never a
    converted checkpoint).

    Recognised: a folder whose manifest lists everything in it, links and empty folders included. A folder
    without a manifest is refused whatever it holds: a downloaded HF model, a Megatron-LM or Pai checkpoint and
    an output of mpatch from before manifests look alike, and every Pai converter line passes --force."""
    manifest = manifest_of(folder)
    if manifest is None:
        names = sorted(p.name for p in folder.iterdir())
        return (f"has no {MANIFEST_NAME}, so mpatch did not write it (it holds {names[0]}: a model you downloaded "
                "or another tool's checkpoint would be lost)")
    try:
        data = read_manifest(manifest)
    except UserError as exc:
        return f"has a damaged manifest ({exc})"
    listed = set(data["files"])
    extra = [f for f in unlisted_entries(folder) if f not in listed]
    if extra:
        return f"holds {extra[0]}, which its {MANIFEST_NAME} does not list (added after mpatch wrote the folder)"
    written_by = str(data.get("tool", ""))
    if writer is not None and command_of(written_by) != command_of(writer):
        return f"was written by {written_by}, not by {command_of(writer)}"
    return None


def training_run_part(folder: Path) -> str | None:
    """Why ``folder`` is part of a training run, which no ``--force`` replaces (a run has none: a rerun resumes
    it), or None: a run's ``final/`` export, or its ``checkpoint/`` folder, whose iterations hold the training
    state. Either would pass as a converter's output (a manifest, a tracker beside iter_* folders), and one
    mistyped --save-dir would delete the run's checkpoints."""
    manifest = manifest_of(folder)
    if manifest is not None:
        try:
            tool = str(read_manifest(manifest).get("tool", ""))
        except UserError:
            return None  # replace_refusal names the damaged manifest
        if tool.startswith("mpatch train"):
            return f"is a training run's export ({tool})"
    trained = next((p.name for p in sorted(folder.glob("iter_[0-9]*")) if (p / TRAIN_STATE).is_file()), None)
    if trained is not None:
        return f"is a training run's checkpoint folder ({trained} holds its training state)"
    return None


@dataclass(frozen=True)
class TopLevelInput:
    """An input folder of which only the top-level files are read: an HF model folder (config.json, safetensors,
    tokenizer files). An output may be a new folder inside it, as Pai-Megatron-Patch's READMEs lay conversions out
    (``Meta-Llama-3.1-8B/mcore-tp4-pp2``), unless the folder is itself an output of mpatch, whose manifest a folder
    added to it would contradict."""

    path: str | Path


def _overlap(target: Path, inputs: tuple) -> Path | None:
    plain = []
    for given in inputs:
        if isinstance(given, TopLevelInput):
            folder = Path(given.path).resolve()
            if folder in target.resolve().parents and manifest_of(folder) is None:
                continue
            given = given.path
        plain.append(given)
    return overlap(target, plain)


def check_target(target: str | Path, force: bool, *, inputs: tuple = (), what: str = "--save-dir",
                 writer: str | None = None) -> Path:
    """Refuse an output folder that overlaps an input (``--force`` or not; a ``TopLevelInput`` may hold it), is a
    file or under one, is a symlink, is non-empty without ``force``, or (with ``force``) is not an earlier output
    of this project's command ``writer`` (a manifest's tool, e.g. "mpatch align"), or is or holds the working
    directory."""
    if str(target) == "":
        raise UserError(f"{what} is an empty path: give the output folder")
    refuse_unexpanded_home(target, what)
    target = Path(target).absolute()
    _refuse_overlap(target, inputs, what)
    cwd = Path.cwd()
    if target.resolve() in (cwd, *cwd.parents):
        # The output is published by putting a new folder in the place of this one (an empty one is removed
        # first): the shell standing in it would be left in a deleted folder.
        raise UserError(f"{target} is the working directory{'' if target.resolve() == cwd else ' or holds it'}, which "
                        "mpatch would replace with a new folder, leaving your shell in a deleted one: give a new "
                        f"folder inside it, such as {target / 'out'}, or run from another folder")
    above = _first_file_above(target)
    if above is not None:
        raise UserError(f"{target} would be under {above}, which is a file: choose another {what}")
    if target.is_symlink():
        # The output is published by renaming a new folder onto this name: that would replace the link, not
        # write where it points, and --force would delete a link that was no output of mpatch.
        raise UserError(f"{target} is a symbolic link (to {os.readlink(target)}): mpatch writes a new folder in its "
                        f"place and does not write through links; give the folder it points to, or another {what}")
    if target.exists() and not target.is_dir():
        raise UserError(f"{target} exists and is not a folder: choose another {what}")
    if not target.parent.exists():
        raise UserError(f"the parent folder of {target} does not exist: create it first")
    if not os.access(target.parent, os.W_OK):
        raise UserError(f"cannot write in {target.parent}: choose a {what} you can write to")
    if target.is_dir() and any(target.iterdir()):
        if not force:
            raise UserError(f"{target} is not empty: choose an empty or new {what}, or pass --force to replace an "
                            "earlier output of mpatch")
        part = training_run_part(target)
        if part is not None:
            raise UserError(f"{target} {part}, and --force never replaces a training run's files (rerunning the run "
                            f"resumes it): move it away or choose another {what}")
        why = replace_refusal(target, writer)
        if why is not None:
            mine = command_of(writer) if writer else "mpatch"
            raise UserError(f"--force replaces only an earlier output of {mine}, and {target} {why}: move it away or "
                            f"choose another {what}")
    return target


def _refuse_overlap(target: Path, inputs: tuple, what: str) -> None:
    clash = _overlap(target, inputs)
    if clash is not None:
        raise UserError(f"the output folder {target} overlaps the input {clash} (it is, lies inside, or holds it): "
                        f"choose a {what} outside every input")


def make_parent_folders(target: str | Path, *, inputs: tuple = (), what: str) -> None:
    """The folders above an output that its command makes (align's --report-dir, eval's --output-dir), made only once
    the output is known to be outside every input: a refused one left them inside its input (a stray folder that
    made the checkpoint fail its manifest check)."""
    refuse_unexpanded_home(target, what)
    target = Path(target).absolute()
    _refuse_overlap(target, inputs, what)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create the folder of {what} {target} ({exc.strerror or exc})") from None


@contextlib.contextmanager
def atomic_output_dir(target: str | Path, force: bool, *, tool: str, inputs: tuple = (),
                      what: str = "--save-dir", digested: dict | None = None) -> Iterator[Path]:
    """Yield a temporary folder that becomes ``target`` when the block finishes without error; ``target``'s lock
    is held throughout, and what makes it free (``check_target``) is decided under it. The manifest
    (naming ``tool``) is written last, before the folder is published; ``digested``: the manifest entries
    of files the block hashed itself once they were complete (filled in by the block)."""
    with atomic_dir(target, replace=force, what=what,
                    check=lambda t: check_target(t, force, inputs=inputs, what=what, writer=tool)) as tmp:
        yield tmp
        write_manifest(tmp, tool, known=digested)

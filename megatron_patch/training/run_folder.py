"""What training writes in OUTPUT_BASEPATH, and the rule that keeps it there: nothing is written through a link
that leads outside the folder.

A run folder travels (copied to a colleague, synced from a bucket, rerun to resume), and what it holds
decides where a resumed run writes. A symlink at a path training writes to (``log/metrics.jsonl`` ->
``~/.bashrc``, ``data_cache`` -> a shared folder) is refused in one line naming it, before anything starts; a
link that stays inside the folder is followed. A hard link cannot be told from the file it shares, but the
files a run appends to, ``log/metrics.jsonl`` and ``eval/results.jsonl``, are given an inode of their own
before the first append when another name shares it (``cp -al`` copies a folder that way): the copy keeps its
records, the other name is left as it was. Everything else is written to new names and renamed into place
(checkpoints, the tracker, ``log/throughput.json``, the dataset cache's manifest), which replaces a link instead
of writing through it; megatron-core's dataset cache is checked file by file (``training.data_cache``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
from pathlib import Path

from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME, read_manifest
from megatron_patch.errors import UserError
from megatron_patch.input_files import locale_names_it_otherwise
from megatron_patch.outputs.folders import write_file_replacing

LOG_DIR = "log"
METRICS = f"{LOG_DIR}/metrics.jsonl"
THROUGHPUT = f"{LOG_DIR}/throughput.json"
CHECKPOINT_DIR = "checkpoint"
# MP_EVAL_TASKS: one JSON line per task evaluation of the live model (training/evaluation_run.py)
EVAL_DIR = "eval"
EVAL_RESULTS = f"{EVAL_DIR}/results.jsonl"
FINAL_DIR = "final"
# Every path training writes into while it runs, under OUTPUT_BASEPATH, and what it must be (final/ is published
# whole, by a rename, never written into).
WRITTEN = ((LOG_DIR, "folder"), (METRICS, "file"), (THROUGHPUT, "file"), ("tensorboard", "folder"),
           ("data_cache", "folder"), (CHECKPOINT_DIR, "folder"), (EVAL_DIR, "folder"), (EVAL_RESULTS, "file"))
WRITTEN_FOLDERS = tuple(name for name, kind in WRITTEN if kind == "folder" and "/" not in name)
# Everything a run keeps at the top of OUTPUT_BASEPATH, each a folder, beside the hidden names its publishing
# uses (``.final.mpatch-partial.PID``): a folder holding anything else is not a run's.
RUN_FOLDER_ENTRIES = (*WRITTEN_FOLDERS, FINAL_DIR)


def final_export_tool(iteration: int) -> str:
    """What ``final/``'s manifest says wrote it: the iteration it holds, read back by ``exported_iteration``."""
    return f"mpatch train, final export of iteration {iteration}"


def exported_iteration(final: Path) -> int | None:
    """The iteration a run's ``final/`` holds, as its manifest records it; None where it records none or cannot be
    read (then the run exports again)."""
    try:
        tool = read_manifest(final / MANIFEST_NAME).get("tool")
    except (UserError, OSError):
        return None
    match = re.fullmatch(r"mpatch train, final export of iteration (\d{1,12})", tool) if isinstance(tool, str) else None
    return int(match.group(1)) if match else None


def export_command(final: Path, flags: str = "--save-dir HF_OUT") -> str:
    """The command that turns a run's exported model into an HF folder, its path quoted for a shell: what the
    run prints is meant to be pasted, and OUTPUT_BASEPATH may hold spaces, or start with a dash (argparse takes
    `--load-dir -run/final` for two options: ./-run/final)."""
    path = str(final)
    return f"mpatch convert mcore2hf --load-dir {shlex.quote('./' + path if path.startswith('-') else path)} {flags}"


def tensorboard_cannot_name(folder: Path) -> str | None:
    """Why TensorBoard's writer cannot write into ``folder``, or None: under a non-UTF-8 locale a run with a
    non-ASCII OUTPUT_BASEPATH died in an internal error (FileNotFoundError) at its first record (the env audit)."""
    why = locale_names_it_otherwise(folder)
    return None if why is None else f"TensorBoard cannot write {folder}: it {why}"


def require_folder(out: Path) -> None:
    """OUTPUT_BASEPATH, where something is at its name, is a folder: one refusal for every check of it."""
    if os.path.lexists(out) and not out.is_dir():
        raise UserError(f"OUTPUT_BASEPATH {out} exists and is not a folder: choose a folder (a new one, which is "
                        "made, or an earlier run's)")


def check_run_folder(output_basepath: str | Path) -> None:
    """Refuse, in one line, a path training writes to that leads outside OUTPUT_BASEPATH or is not what training
    writes there (a FIFO where the metrics go, a file where a folder goes)."""
    out = Path(output_basepath)
    require_folder(out)
    if not os.path.lexists(out):
        return
    root = out.resolve()
    for name, kind in WRITTEN:
        path = out / name
        if not os.path.lexists(path):
            continue
        target = path.resolve()
        if target != root and root not in target.parents:
            raise UserError(f"{path} leads outside OUTPUT_BASEPATH (to {target}), and training writes there: remove "
                            "the link (training makes its own), or point OUTPUT_BASEPATH at the folder you want")
        ok = target.is_dir() if kind == "folder" else stat.S_ISREG(os.stat(target).st_mode)
        if not ok:
            raise UserError(f"{path} is not a {'folder' if kind == 'folder' else 'regular file'}, and training writes "
                            "there: move it away")


def open_metrics(output_basepath: str | Path, name: str = METRICS, resumed: int = 0):
    """``log/metrics.jsonl`` (or another file the run appends to, ``name``) opened for appending by a run that
    starts after iteration ``resumed``, in a file no other name shares; and a note of what was dropped, or None.
    What a run logged past its last checkpoint before it stopped is trained again now, so those records go, as
    TensorBoard's purge_step drops its events; so does a line cut short (a crash or a full disk mid-write), which
    the next record would have run on from."""
    path = Path(output_basepath) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    note = None
    if path.is_file():
        kept, past, cut = _kept_records(path.read_bytes(), resumed)
        if past or cut:
            write_file_replacing(path, b"".join(kept))
            dropped = [f"{past} record(s) of iterations after {resumed}, trained again now"] if past else []
            note = f"{name}: dropped " + " and ".join(dropped + (["a line cut short"] if cut else []))
        elif os.stat(path).st_nlink > 1:
            write_file_replacing(path, path.read_bytes())
    return open(path, "a"), note


def _kept_records(data: bytes, resumed: int) -> tuple[list[bytes], int, int]:
    """(the lines to keep, how many records of iterations after ``resumed``, how many lines are no record)."""
    kept, past, cut = [], 0, 0
    for line in data.splitlines(keepends=True):
        try:
            record = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            record = None
        if not isinstance(record, dict):
            cut += 1
        elif isinstance(record.get("iteration"), int) and record["iteration"] > resumed:
            past += 1
        else:
            kept.append(line)
    return kept, past, cut

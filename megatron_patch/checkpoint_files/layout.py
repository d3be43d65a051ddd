"""The on-disk layout of Megatron checkpoints, shared by everything that reads or writes one.

    ROOT/latest_checkpointed_iteration.txt   "release" (converted or exported weights) or the newest
                                             complete iteration, one line
    ROOT/release/                            the weights of a converted or exported checkpoint
    ROOT/iter_0000010/                       one training checkpoint per saved iteration

Folders appear complete or not at all (``megatron_patch.outputs.folders``, re-exported here): everything
is written under a hidden sibling ``.NAME.mpatch-partial.PID``, under the output's lock, and renamed onto
its name once complete and fsynced; the tracker moves last. An interrupted run (even ``kill -9``) leaves
at most a folder whose name says it is partial, which the next holder of the lock removes.

Durability: the tracker is fsynced before its rename and its folder after, so that after a power loss
the tracker never names a folder whose contents were still only in the page cache. Readers do not
rely on that alone: ``latest_complete_iteration`` checks a training checkpoint before it is used
(missing or truncated files, an unreadable tracker) and falls back to the previous complete one.

Also here: the torch_dist model loader every reader uses, which tolerates the transformer-engine
``_extra_state`` objects a checkpoint written without TE does not hold.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Callable

from megatron_patch.checkpoint_files.torch_dist import (
    COMMON_STATE_OBJECT,
    TorchDistReader,
    metadata_files,
    read_metadata,
)
from megatron_patch.checkpoint_files.zipfmt import ZipFormatError, ZipIndex, check_crc
from megatron_patch.errors import UserError
from megatron_patch.input_files import MAX_JSON_NESTING, file_problem, json_nesting, read_input
from megatron_patch.outputs.folders import (  # noqa: F401 - the layout's folder helpers, one import for readers
    PARTIAL_TAG,
    atomic_dir,
    fsync_dir,
    fsync_file,
    fsync_tree,
    partial_dir,
    publish,
    remove_stale_partials,
    write_file_replacing,
)

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

TRACKER_NAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"
# What a training run of this project saves in each iteration beside megatron's files (training/run_state.py).
TRAIN_STATE = "train_state.json"
# The folder iteration_dir() and Megatron-LM (iter_{:07d}) name: 7 digits, more from iteration 10**7 on (without a
# leading zero, so that one iteration has one name), up to the tracker's 12.
ITERATION_DIR = re.compile(r"iter_([0-9]{7}|[1-9][0-9]{7,11})")
# An iteration number as a tracker or the environment gives it: ASCII digits, at most 12 of them.
WHOLE_NUMBER = re.compile(r"[0-9]{1,12}")


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def is_iteration_dir(folder: str | Path) -> bool:
    return ITERATION_DIR.fullmatch(Path(folder).name) is not None


# The most bytes each small file of a checkpoint holds: a tracker is one number, megatron's metadata.json a few
# keys, a sidecar or train_state.json a model's config. A file beyond its bound is damaged, not read.
TRACKER_BYTES = 64
SMALL_FILE_BYTES = 16 * 2**20


def read_small_file(path: str | Path, limit: int = SMALL_FILE_BYTES) -> bytes:
    """The bytes of a small file of a checkpoint or run folder, read only if it is a regular file of at most
    ``limit`` bytes in its own folder: ``input_files.read_input``, the one reader of small files (a FIFO or a device
    put in its place never stalls or floods the reader; a symlink leading out of the folder is not followed: a
    tracker linked to a private file was read, quoted in a warning and, holding a number, chose the resume point).
    One-line ``UserError`` otherwise."""
    return read_input(path, limit=limit, inside=Path(path).parent)


def read_small_json(path: str | Path, limit: int = SMALL_FILE_BYTES) -> dict:
    """A small JSON file holding an object (``read_small_file``); one-line ``UserError`` for anything else."""
    try:
        value = json.loads(read_small_file(path, limit))
    except UserError as exc:
        raise UserError(f"{path} is unreadable ({exc})") from None
    except (ValueError, RecursionError) as exc:
        raise UserError(f"{path} is unreadable ({' '.join(str(exc).split())[:200]})") from None
    if json_nesting(value) > MAX_JSON_NESTING:
        raise UserError(f"{path} is unreadable (its JSON nests deeper than {MAX_JSON_NESTING} levels, as no file of "
                        "its kind does)")
    if not isinstance(value, dict):
        raise UserError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


class ConvertedWeights(UserError):
    """A folder of converted weights (its tracker says ``release``) where a training run's checkpoints were looked
    for: its readers say where such a folder goes instead."""


def read_tracker(root: str | Path) -> int | str | None:
    """What ``root``'s tracker says: ``"release"``, an iteration number, or None without a tracker."""
    tracker = Path(root) / TRACKER_NAME
    if not os.path.lexists(tracker):
        return None
    try:
        text = read_small_file(tracker, TRACKER_BYTES).decode("ascii").strip()
    except (OSError, UnicodeDecodeError, UserError) as exc:
        raise UserError(f"{tracker} is unreadable ({exc}): the checkpoint is damaged")
    if text == RELEASE:
        return RELEASE
    if WHOLE_NUMBER.fullmatch(text):  # ASCII digits only: str.isdigit() also accepts '²', which int() refuses
        return int(text)
    raise UserError(f"{tracker} says {text[:40]!r}, neither 'release' nor an iteration number: the checkpoint is damaged")


def tracked_iteration_missing(root: str | Path, latest: int | str | None) -> str | None:
    """Why the iteration ``root``'s tracker names (``latest``, as ``read_tracker`` gives it) is not there, or None."""
    if not isinstance(latest, int) or iteration_dir(root, latest).is_dir():
        return None
    return f"{Path(root) / TRACKER_NAME} names iteration {latest}, but {iteration_dir(root, latest).name} is missing"


def write_tracker(root: str | Path, value: int | str) -> None:
    """Point ``root``'s tracker at an iteration or at ``"release"``; written aside, then renamed."""
    if value != RELEASE and not isinstance(value, int):
        raise ValueError(f"a tracker holds 'release' or an iteration number, not {value!r}")
    # as Megatron-LM writes it: no newline; never through a link planted at the tracker's name or its temporary's
    write_file_replacing(Path(root) / TRACKER_NAME, str(value), durable=True)


# --- which checkpoint is complete --------------------------------------------------------------------

def zip_problem(path: str | Path) -> str | None:
    """Why the torch.save file ``path`` is unusable, or None. torch.save writes a zip archive whose
    members carry CRC-32s: reading them all finds truncation and flipped bytes, not only a short file."""
    path = Path(path)
    if (problem := file_problem(path)) is not None:
        return problem
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as exc:
        return f"{path.name} is unreadable ({exc})"
    return f"{path.name} is damaged (its member {bad} fails its CRC check)" if bad else None


def torch_dist_problem(folder: str | Path, *, common: bool = True) -> str | None:
    """What makes the torch_dist checkpoint in ``folder`` unusable, or None when it is complete.

    Checked without reading the tensors (and without torch): megatron's ``metadata.json`` parses;
    torch's ``.metadata`` unpickles (``torch_dist.read_metadata``); every data file it names
    exists and is long enough for every record it points into (a truncated ``.distcp`` is found; a flipped
    byte inside one is found by ``archives_problem``, which reads every byte); with ``common``, megatron's common
    state is there: an intact ``common.pt`` archive, or (megatron-core >= 0.19) the ``common_state`` object.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder.name} is missing"
    config = folder / "metadata.json"
    if not os.path.lexists(config):
        return "metadata.json is missing"
    # every file it reads stays inside it: a .distcp, .metadata or common.pt linked to a file elsewhere was read
    # as the checkpoint's own (the sdoc audit; an HF folder's weights are refused alike)
    # (what is no regular file is named as such by the checks below)
    linked_out = next((name for name in ("metadata.json", ".metadata", "common.pt")
                       if file_problem(folder / name) is None and _leads_outside(folder, name)), None)
    if linked_out is not None:
        return _outside_line(folder, linked_out)
    try:
        said = read_small_json(config, 2**16)
    except UserError as exc:
        return str(exc).replace(str(config), config.name, 1)
    if (why := _backend_problem(said)) is not None:
        return why

    if os.path.lexists(folder / ".metadata") and (problem := file_problem(folder / ".metadata")) is not None:
        return problem  # a FIFO, a device, a dangling link: named as such, never read
    if not metadata_files(folder):
        return ".metadata is missing"

    try:
        metadata = read_metadata(folder / ".metadata")
    except UserError as exc:  # a refused pickle, a shape no checkpoint has: the reader's own line
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unusable file
        return f".metadata is unreadable ({type(exc).__name__}: {exc})"
    ends: dict[str, int] = {}
    for name, start, length, _ in metadata.storage.values():
        ends[name] = max(ends.get(name, 0), start + length)
    if not ends and (metadata.tensors or metadata.objects):
        return ".metadata lists tensors but no data files"
    for name, end in sorted(ends.items()):
        path = folder / name
        if (problem := file_problem(path)) is not None:
            return problem
        if (outside := outside_problem(folder, name)) is not None:
            return outside
        size = path.stat().st_size
        if size < end:
            return f"{name} is truncated ({size} bytes; its records end at byte {end})"
    if common:
        return _common_state_problem(folder, metadata)
    return None


def archives_problem(folder: str | Path) -> str | None:
    """The first stored record of a torch_dist checkpoint that fails what a load checks before torch reads it
    (``safe_torch.SafeFileSystemReader``): each archive's zip structure and the CRC-32 of every record in it.
    It reads every byte: the resume's choice of checkpoint runs it, so that a record torch would refuse
    mid-load makes the checkpoint incomplete here instead, and the one before it is taken."""
    folder = Path(folder)
    try:
        storage = read_metadata(folder / ".metadata").storage
    except UserError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means an unusable file
        return f".metadata is unreadable ({type(exc).__name__}: {exc})"
    for name, start, length, transforms in sorted(set(storage.values())):
        if transforms:  # decoded by torch's transform, which checks its own framing
            continue
        path = folder / name
        with open(path, "rb") as f:
            f.seek(start)
            if f.read(4) != b"PK\x03\x04":  # not an archive: torch reads these bytes as they are
                continue
        try:
            for where, offset, size, crc in ZipIndex(path, base=start, length=length).record_checks():
                check_crc(where, offset, size, crc, f"a record at byte {offset}")
        except (ZipFormatError, OSError, ValueError) as exc:
            return f"{name} is damaged (the archive at byte {start}: {exc})"
    return None


# megatron-core's CheckpointingConfig, as metadata.json holds it: 0.16 takes exactly these keys (another is a
# TypeError inside its load), and loads only the torch_dist backend, version 1 (another: a CheckpointingException)
CHECKPOINTING_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                        "common_backend_version": 1}


def _backend_problem(said) -> str | None:
    """What of metadata.json megatron-core's load would stop on, past what this project reads (an internal error in
    eval and at resume until the sdoc audit)."""
    other = sorted(set(said) - set(CHECKPOINTING_CONFIG))
    if other:
        return f"metadata.json holds {other[0]!r}, which megatron-core's checkpoint config has not"
    backend, version = said.get("sharded_backend"), said.get("sharded_backend_version", 1)
    if backend != "torch_dist" or version != 1:
        return (f"metadata.json names the sharded backend {backend!r} version {version!r}: only torch_dist version 1 "
                "is read (megatron-core's torch_dist checkpoints)")
    return None


def _leads_outside(folder: Path, name: str) -> bool:
    real, home = (folder / name).resolve(), folder.resolve()
    return home not in real.parents


LEADS_OUTSIDE = "leads outside the folder"  # what a checkpoint problem says of a link elsewhere, not damage


def outside_problem(folder: Path, name: str) -> str | None:
    """The line refusing ``folder / name`` where it is a link that leads out of ``folder``, else None."""
    return _outside_line(folder, name) if os.path.lexists(folder / name) and _leads_outside(folder, name) else None


def _outside_line(folder: Path, name: str) -> str:
    return f"{name} {LEADS_OUTSIDE} (to {(folder / name).resolve()}): refused"


def _common_state_problem(folder: Path, metadata) -> str | None:
    """megatron's common state: ``common.pt`` (megatron-core <= 0.16) must be an intact archive; from 0.19
    on it is the ``common_state`` object, whose data record was checked with the other records."""
    if (folder / "common.pt").exists() or COMMON_STATE_OBJECT not in metadata.objects:
        return zip_problem(folder / "common.pt")
    return None


def latest_complete_iteration(root: str | Path, problem: Callable[[Path], str | None] = torch_dist_problem,
                              ) -> tuple[int | None, list[str]]:
    """The newest complete iteration under a training run's checkpoint folder ``root``, and one warning
    for each thing skipped on the way (each names what was wrong).

    The tracker decides which iterations count: the one it names and older ones (a tracker moved back
    by hand is respected). An unreadable tracker, or none next to iteration folders, is skipped and
    every iteration folder is a candidate. ``problem(folder)`` says why a folder is unusable.

    Returns (None, []) when nothing was ever saved there. Raises ``UserError`` when checkpoints exist
    and none is complete: loading a damaged one is never an option.
    """
    root = Path(root)
    notes: list[str] = []
    tracker = root / TRACKER_NAME
    try:
        latest = read_tracker(root)
    except UserError as exc:
        notes.append(f"{exc}; looking for the newest complete iteration folder instead")
        latest = None
    if latest == RELEASE:
        raise ConvertedWeights(f"{tracker} says '{RELEASE}': {root} holds converted weights, not a training run's "
                               "checkpoints")
    found = sorted((int(m.group(1)) for p in (root.iterdir() if root.is_dir() else ())
                    if (m := ITERATION_DIR.fullmatch(p.name)) and p.is_dir()), reverse=True)
    if latest is None and not notes and not found:
        return None, []
    if latest is None and not notes:
        notes.append(f"{tracker} is missing; looking for the newest complete iteration folder instead")
    if isinstance(latest, int):
        missing = tracked_iteration_missing(root, latest)
        if missing:
            notes.append(missing)
        newer = [i for i in found if i > latest]
        if newer:  # a tracker moved back by hand is respected, and said: a newer folder is not taken silently
            notes.append(f"{tracker} names iteration {latest}, and {len(newer)} newer iteration folder(s) "
                         f"({iteration_dir(root, newer[0]).name}) are left as they are")
        found = [i for i in found if i <= latest]
    skipped = False
    for iteration in found:
        folder = iteration_dir(root, iteration)
        # an iteration folder linked elsewhere is another folder's checkpoint (the sdoc audit)
        why = _outside_line(root, folder.name) if _leads_outside(root, folder.name) else problem(folder)
        if why is None:
            if skipped:  # whatever reads it (an export, an evaluation, a resume) says which iteration it holds
                notes.append(f"iteration {iteration} ({folder.name}) is read instead")
            return iteration, notes
        notes.append(f"{folder} is incomplete or damaged: {why}")
        skipped = True
    # read by the converter and inspect as by resume: the advice fits each
    raise UserError(f"no complete checkpoint in {root} (" + "; ".join(notes) + "): move the damaged folders away to "
                    "read an older copy (mcore2hf and inspect: or --iteration N; a training run: or another "
                    "OUTPUT_BASEPATH, to start afresh)")


# --- torch_dist model weights ----------------------------------------------------------------------

def without_missing_extra_state(sharded: dict, stored_keys: set[str]) -> dict:
    """``sharded`` (a model's sharded state dict, possibly nested) without the transformer-engine
    ``_extra_state`` objects the checkpoint does not hold: they carry only FP8 bookkeeping, which
    starts afresh, and a checkpoint written with the local spec (on CPU) has none."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out = {}
    for key, value in sharded.items():
        if isinstance(value, dict):
            out[key] = without_missing_extra_state(value, stored_keys)
        elif not (isinstance(value, ShardedObject) and key.endswith("_extra_state") and value.unique_key not in stored_keys):
            out[key] = value
    return out


def model_sharded_state(model) -> dict:
    """A model chunk's sharded state dict. megatron-core 0.16's GPTModel reads ``metadata['dp_cp_group']`` for the
    copy of the embedding that a multi-token-prediction block on a later pipeline stage keeps, without filling it
    in from parallel_state as its submodules do: it is given here."""
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    return model.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))


def load_models_torch_dist(models: list, folder: str | Path) -> None:
    """Fill a rank's model chunks (GPTModels; one without a virtual pipeline) from the torch_dist
    weights in ``folder``, at whatever layout they were saved. All chunks load in one
    ``dist_checkpointing.load``: its integrity check wants the request of all ranks together to cover
    every stored shard, which one chunk alone does not."""
    # safe_torch imports torch and megatron-core: only a load into a live model needs them
    from megatron_patch.checkpoint_files.safe_torch import safe_dist_load

    stored = TorchDistReader(folder).keys()
    request = {f"model{i}": without_missing_extra_state(model_sharded_state(m), stored) for i, m in enumerate(models)}
    state = safe_dist_load(request, folder)
    for i, model in enumerate(models):
        missing, unexpected = model.load_state_dict(state[f"model{i}"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            where = f" (model chunk {i})" if len(models) > 1 else ""
            raise UserError(f"the torch_dist checkpoint in {folder} does not fit the model{where}: "
                            f"missing {missing[:5]}, unexpected {unexpected[:5]}")

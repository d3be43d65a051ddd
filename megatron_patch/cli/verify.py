"""`mpatch verify PATH`: check an output of this project against its manifest (every file's size and digest)."""

from __future__ import annotations

import re
from pathlib import Path

from megatron_patch.checkpoint_files.layout import ITERATION_DIR, RELEASE, read_tracker, tracked_iteration_missing
from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME, IntegrityError, verify_manifest
from megatron_patch.errors import UserError
from megatron_patch.input_files import kind_of
from megatron_patch.outputs.folders import PARTIAL_TAG
from megatron_patch.training.run_folder import CHECKPOINT_DIR, FINAL_DIR


# The folders of a training run or checkpoint folder that each carry a manifest: iterations, a conversion's
# release/, a run's final/.
_VOUCHED = re.compile(rf"{ITERATION_DIR.pattern}|{RELEASE}|{FINAL_DIR}")


def manifests_under(path: Path) -> tuple[list[Path], list[Path]]:
    """(the manifests that ``path`` names, the folders that should carry one and do not). ``path``: a manifest
    file itself, a folder's own, or (a training run's OUTPUT_BASEPATH or checkpoint folder) those of the folders
    in it, two levels down. A partial folder (a save that did not finish, which nothing reads) is neither."""
    if path.is_file():
        if path.suffix in (".bin", ".idx"):  # preprocessed data: the pair's manifest beside it
            pair = path.with_name(f"{path.stem}.{MANIFEST_NAME}")
            if pair.is_file():
                return [pair], []
        if not path.name.endswith(MANIFEST_NAME):
            raise UserError(f"{path} is neither a folder nor a manifest: give an output folder, a training run's "
                            f"folder, or a {MANIFEST_NAME} (preprocessed data: PREFIX.{MANIFEST_NAME})")
        return [path], []
    own = path / MANIFEST_NAME
    if own.is_file():
        return [own], []
    folders = [p for p in sorted(path.iterdir()) + sorted(path.glob("*/*"))
               if p.is_dir() and PARTIAL_TAG not in p.name and (p.parent == path or PARTIAL_TAG not in p.parent.name)]
    found = [p / MANIFEST_NAME for p in folders if (p / MANIFEST_NAME).is_file()]
    # a converted checkpoint's release/ is its parent's manifest's
    unvouched = [p for p in folders if _VOUCHED.fullmatch(p.name)
                 and not (p / MANIFEST_NAME).is_file() and not (p.parent / MANIFEST_NAME).is_file()]
    return found + sorted(path.glob(f"*.{MANIFEST_NAME}")), unvouched


def _tracked_iteration_missing(path: Path) -> str | None:
    """Why the iteration a training run's tracker names (``path``'s, or its ``checkpoint/``'s) is not there: the
    run's newest checkpoint lost, or the tracker edited. Every manifest left verified, and the run resumed, or was
    exported, from an older iteration (the tools audit)."""
    for root in (path, path / CHECKPOINT_DIR):
        # an unreadable tracker: one line
        missing = tracked_iteration_missing(root, read_tracker(root)) if root.is_dir() else None
        if missing:
            return f"{missing}: the run's newest checkpoint is not as written"
    return None


def run(args) -> int:
    if not args.path:  # an unset variable ("$CKPT"): Path("") is the working folder
        raise UserError("the path is empty: give an output folder, a training run's folder or a manifest")
    path = Path(args.path)
    # "." and "..", which have no name to put a prefix's suffix on (an internal error: the tools audit)
    prefix_manifest = path.with_name(f"{path.name}.{MANIFEST_NAME}") if path.name else None
    if not path.exists() and prefix_manifest is not None and prefix_manifest.is_file():
        path = prefix_manifest  # preprocessed data, named by its prefix as elsewhere
    if not path.exists():
        raise UserError(f"{path} does not exist")
    if not path.is_dir() and not path.is_file():  # a FIFO, a device, a socket: iterdir failed on it
        raise UserError(f"{path} is {kind_of(path.stat().st_mode)}, not an output folder or a manifest")
    manifests, unvouched = manifests_under(path)
    if not manifests and not unvouched:
        raise UserError(f"{path} has no mpatch_manifest.json: it was not written by this version of mpatch (or its "
                        "manifest was removed), so there is nothing to check it against")
    missing = _tracked_iteration_missing(path) if path.is_dir() else None
    if missing:
        raise IntegrityError(missing)
    if unvouched:
        more = f" (and {len(unvouched) - 1} more)" if len(unvouched) > 1 else ""
        raise IntegrityError(f"{unvouched[0]} has no {MANIFEST_NAME}{more}, so nothing vouches for its files: it was "
                             "not written by this version of mpatch, or its manifest was removed")
    total = 0
    for manifest in manifests:
        root, here = path.resolve(), manifest.parent.resolve()
        if path.is_dir() and here != root and root not in here.parents:
            raise IntegrityError(f"{manifest.parent} leads outside {path} (to {manifest.parent.resolve()}) through a "
                                 "symlink: an output's folders are its own")
        total += verify_manifest(manifest)  # IntegrityError: one line naming every problem, exit 2
        if not args.quiet:
            print(f"ok: {manifest}")
    print(f"verified {len(manifests)} manifest(s), {total / 2**20:.1f} MiB: every file is as written")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verify", help="check a checkpoint, HF export or preprocessed data against its manifest",
        description="Check an output of mpatch against its mpatch_manifest.json (converted checkpoints, HF exports, "
                    "training iterations and final/, preprocessed data): it holds exactly the files the manifest "
                    "lists (none added, none a symlink or leading outside the folder, the list not empty), and each "
                    "has the size and XXH3-128 digest recorded when it was written. Exit 0 when all match; 2, with "
                    "one line naming every file added, linked or missing, or the first that differs.")
    p.add_argument("path", metavar="PATH",
                   help="an output folder, a training run's OUTPUT_BASEPATH or checkpoint folder (every iteration is "
                        "checked), a preprocessed data prefix, or a manifest file")
    p.add_argument("--quiet", action="store_true", help="only the final line")
    p.set_defaults(run=run)

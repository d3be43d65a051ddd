"""`mpatch verify PATH`: check an output of this project against its manifest (every file's size and digest)."""

from __future__ import annotations

from pathlib import Path

from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME, IntegrityError, verify_manifest
from megatron_patch.errors import UserError


def manifests_under(path: Path) -> list[Path]:
    """The manifests that ``path`` names: a manifest file itself, a folder's own, or (a training run's
    OUTPUT_BASEPATH or checkpoint folder) those of the folders in it, two levels down."""
    if path.is_file():
        return [path]
    own = path / MANIFEST_NAME
    if own.is_file():
        return [own]
    found = sorted(path.glob(f"*/{MANIFEST_NAME}")) + sorted(path.glob(f"*/*/{MANIFEST_NAME}"))
    return found + sorted(path.glob(f"*.{MANIFEST_NAME}"))


def run(args) -> int:
    path = Path(args.path)
    if not path.exists():
        raise UserError(f"{path} does not exist")
    manifests = manifests_under(path)
    if not manifests:
        raise UserError(f"{path} has no mpatch_manifest.json: it was not written by this version of mpatch (or its "
                        "manifest was removed), so there is nothing to check it against")
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
                        "checked), or a manifest file")
    p.add_argument("--quiet", action="store_true", help="only the final line")
    p.set_defaults(run=run)

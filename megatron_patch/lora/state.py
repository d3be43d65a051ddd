"""What a LoRA run keeps on disk: the adapters (and any modules_to_save weights) with their optimizer
state, and the record of the base model they need.

Adapters are stored whole under layout-free keys (``plan.Adapter.key_a`` / ``key_b``): each rank's
ShardedTensor says which box of the whole tensor it holds (a column-parallel layer's B rows, a
row-parallel layer's A columns; replicated factors written once), so a checkpoint written at one
TP/PP/EP loads at any other. The base weights are not in a run's checkpoints: the sidecar's ``lora``
section names the base checkpoint by path and by a digest of its files, and resuming or exporting
finds it there, checks the digest, or says in one line what to give.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path

from megatron_patch.checkpoint.foreign import find_checkpoint
from megatron_patch.checkpoint_files.manifest import manifest_for, read_manifest
from megatron_patch.checkpoint_files.torch_dist import TorchDistReader
from megatron_patch.errors import UserError
from megatron_patch.input_files import checked_input, walk
from megatron_patch.lora.plan import KEY_PREFIX
from megatron_patch.models.shape.skeleton import cache_dir

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).

# -2 hashes hidden files too: -1 left them out, and with them torch_dist's .metadata, which says which bytes are
# which tensor (a base whose .metadata was edited passed the check).
DIGEST_FORMAT = "sha256-files-2"
HIDDEN_FILES_LEFT_OUT = "sha256-files-1"
MANIFEST_DIGEST = "sha256-manifest-1"


# --- the base model's record ------------------------------------------------------------------------------------

def _files(folder: Path) -> list[Path]:
    """Every file under ``folder``, hidden ones too; refused in one line: a link that leads outside it, anything
    but a regular file (a FIFO would block the hash, a device never ends)."""
    out = []
    for dirpath, dirnames, filenames in walk(folder, onerror=_walk_error):  # never into linked folders
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            checked_input(path, inside=folder, how="holds", limit=None)
            out.append(path)
    return out


def _walk_error(exc: OSError) -> None:
    raise UserError(f"cannot read {exc.filename} ({exc.strerror})")


def _digest_cache() -> Path:
    return cache_dir().parent / "digests"


def checkpoint_digest(folder: str | Path, fmt: str = DIGEST_FORMAT) -> str:
    """A digest of a base checkpoint's contents (a checkpoint folder: ``find_base`` checks that first).

    Where the checkpoint carries this project's manifest (every output written here does), the digest is of
    the manifest's table (each file's size and XXH3-128): cheap, and every load checks the files against
    that table (``checkpoint.loading.verify_before_load``). Otherwise sha256 over every file (relative path,
    size, content), hidden ones included: reading a 16 GB base takes a minute, so that answer is kept per folder
    (under the skeleton cache's parent) with each file's size and modification time."""
    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder")
    manifest = manifest_for(folder)
    if manifest is not None:
        table = json.dumps(read_manifest(manifest)["files"], sort_keys=True).encode()
        return f"{MANIFEST_DIGEST}:{hashlib.sha256(table).hexdigest()}"
    files = _files(folder)
    if fmt == HIDDEN_FILES_LEFT_OUT:  # a record of an older run: checked as it was made
        files = [p for p in files if not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    try:
        return _hashed(folder, files, fmt)
    except OSError as exc:  # a file removed or unreadable since it was listed
        raise UserError(f"cannot read {exc.filename or folder} ({exc.strerror}) to check that it is the base model")


def _hashed(folder: Path, files: list[Path], fmt: str) -> str:
    stamp = [(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    cache = _digest_cache() / (hashlib.sha256(str(folder).encode()).hexdigest() + ".json")
    try:
        saved = json.loads(cache.read_text())
        if saved.get("stamp") == [list(s) for s in stamp] and saved.get("format") == fmt:
            return saved["digest"]
    except (OSError, ValueError):
        pass
    total = hashlib.sha256()
    for p, (rel, size, _) in zip(files, stamp):
        h = hashlib.sha256()
        # without blocking: a file swapped for a FIFO since it was checked
        with os.fdopen(os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise UserError(f"{p} is not a regular file: refused")
            for block in iter(lambda: f.read(8 << 20), b""):
                h.update(block)
        total.update(f"{rel}\0{size}\0{h.hexdigest()}\n".encode())
    digest = f"{fmt}:{total.hexdigest()}"
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"format": fmt, "stamp": stamp, "digest": digest}))
        os.replace(tmp, cache)
    except OSError:
        pass
    return digest


def base_record(path: str | Path) -> dict:
    return {"path": str(Path(path).resolve()), "digest": checkpoint_digest(path)}


def find_base(record: dict, given: str | Path | None, what: str, flag: str | None) -> Path:
    """The base checkpoint a LoRA checkpoint needs: ``given`` (an override) or the one ``record`` names;
    it must be a checkpoint folder and its digest the record's, or one line says what to give (``flag``).

    The record comes from a checkpoint, which may come from anyone: its path is looked at as a checkpoint
    (``find_checkpoint``: a tracker, iteration folders, small files read through the checks) before any file
    under it is hashed, so a record naming / or a private folder makes no reader walk it."""
    path = Path(given) if given is not None else Path(record["path"])
    short = record["digest"].split(":")[-1][:12]
    # where no option can name another base (``flag`` None), the one way is the recorded place
    give = f"give that checkpoint with {flag}" if flag else f"put that checkpoint back at {record['path']}"
    if not path.is_dir():
        raise UserError(f"{what} was trained on the base model {record['path']} (digest {short}), which is not "
                        f"there{' (' + str(path) + ' is not a folder)' if given is not None else ''}: {give}")
    kind = record["digest"].split(":")[0]
    try:
        find_checkpoint(path)
    except UserError as exc:
        if given is not None:  # the user's folder, not the record's
            raise UserError(f"{flag} {path} is not a Megatron-Core checkpoint ({exc}): give the base {what} was "
                            f"trained on, {record['path']} (digest {short}), or its copy (an HF folder converts to "
                            "one with 'mpatch convert hf2mcore')")
        raise UserError(f"{what} names its base model {path}, which is not a checkpoint ({exc}): "
                        + (f"give the base it was trained on with {flag}" if flag else give))
    found = checkpoint_digest(path, HIDDEN_FILES_LEFT_OUT if kind == HIDDEN_FILES_LEFT_OUT else DIGEST_FORMAT)
    if found != record["digest"]:
        raise UserError(f"{path} is not the base model {what} was trained on (digest {found.split(':')[-1][:12]}, "
                        f"expected {short}): "
                        + (f"give the base it was trained on with {flag}" if flag else f"put it back at {path}"))
    if kind == HIDDEN_FILES_LEFT_OUT:  # a run of an older megatron_patch goes on; what it cannot vouch for is said
        print(f"note: {what} names its base by an older digest ({kind}) that leaves out hidden files, torch_dist's "
              ".metadata among them: that file of the base is not checked (a LoRA run's next checkpoint records the "
              "whole digest)", file=sys.stderr, flush=True)
    return path


# --- adapter tensors in a torch_dist checkpoint -----------------------------------------------------------------

def read_adapter_tensors(folder: str | Path) -> dict:
    """Every adapter tensor of a torch_dist weights folder, whole (model-free: each rank can read it)."""
    reader = TorchDistReader(folder)
    try:
        return {k: reader.read_block(k) for k in sorted(reader.tensor_keys()) if k.startswith(KEY_PREFIX)}
    finally:
        reader.close()


def load_adapters(containers: list, tensors: dict) -> None:
    """Fill every live adapter of a rank from whole tensors (by checkpoint key)."""
    for container in containers:
        for sa in container.sites:
            sa.load_whole(tensors)


def check_adapter_keys(sites: list, tensors: dict, where: str) -> None:
    """The tensors are exactly the plan's adapters, each of the shape its record gives (rank and width): one missing
    or one too many means another model's; another shape, a record that lies (a sidecar's rank 6 over rank-3 tensors
    merged at alpha/6, half the change the adapters compute: the lora audit)."""
    want = {k: shape for s in sites for a in s.adapters for k, shape in ((a.key_a, a.shape_a), (a.key_b, a.shape_b))}
    missing, extra = set(want) - set(tensors), set(tensors) - set(want)
    if missing or extra:
        name = sorted(missing or extra)[0]
        raise UserError(f"{where} {'lacks' if missing else 'has'} the adapter tensor {name}"
                        f"{'' if missing else ', which no adapter of this model takes'}: its adapters were made for "
                        "another model or other targets")
    wrong = next((k for k in sorted(want) if tuple(tensors[k].shape) != tuple(want[k])), None)
    if wrong is not None:
        raise UserError(f"{where}: the adapter tensor {wrong} is {list(tensors[wrong].shape)}, and the checkpoint's "
                        f"record of its LoRA settings (rank, targets) makes it {list(want[wrong])}: the sidecar is "
                        "damaged or was edited")


# --- the sharded state of a LoRA model chunk --------------------------------------------------------------------

def _dp_rank(expert: bool) -> int:
    from megatron.core import parallel_state as ps

    if expert:
        return ps.get_expert_data_parallel_rank()
    return ps.get_data_parallel_rank(with_context_parallel=True)


def adapter_sharded_state(chunk, container) -> dict:
    """{parameter name: ShardedTensor} of a chunk's trainable weights: every adapter (whole-tensor keys, this
    rank's box) and the modules_to_save weights (megatron-core's own sharded entries for them)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    names = {id(p): n for n, p in chunk.named_parameters()}
    out = {}
    for sa in container.sites:
        dp = _dp_rank(sa.expert)
        for i, a in enumerate(sa.site.adapters):
            p = sa.A[i]
            if sa.mode == "row":  # A's input columns: this rank's box
                out[names[id(p)]] = ShardedTensor.from_rank_offsets(
                    a.key_a, p, (1, sa.shard, sa.shards), replica_id=(0, dp))
            else:  # whole on every rank of the group: written by its first
                out[names[id(p)]] = ShardedTensor.from_rank_offsets(a.key_a, p, replica_id=(sa.group_rank, dp))
        for part, j in enumerate(sa.b_of_part):
            if j is None:
                continue
            p = sa.B[j]
            a = sa.site.adapters[sa.b_adapter[j]]
            rows = sa.b_slice(part)[0]
            local = rows.stop - rows.start
            total = a.shape_b[0]
            if total % local or rows.start % local:
                raise UserError(f"{a.key_b}: a block of {local} rows at {rows.start} does not tile its {total} rows")
            replica = 0 if sa.mode == "column" and not sa.b_whole else sa.group_rank
            out[names[id(p)]] = ShardedTensor.from_rank_offsets(
                a.key_b, p, (0, rows.start // local, total // local), replica_id=(replica, dp))
    trainable = {id(p) for p in chunk.parameters() if p.requires_grad} - {id(p) for p in container.parameters()}
    if trainable:
        for key, entry in chunk.sharded_state_dict().items():
            if id(getattr(entry, "data", None)) in trainable:
                out[names[id(entry.data)]] = entry
    return out

"""Megatron's legacy checkpoint layout: one ``model_optim_rng.pt`` per model-parallel rank.

    latest_checkpointed_iteration.txt            "release"
    release/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt
        {"model": {TE-spec name: tensor}, "checkpoint_version": 3.0, "iteration": 0}

The pipeline suffix appears only when PP > 1 and the expert suffix only when EP > 1, as Megatron-LM
names them; layer numbers restart at 0 on every pipeline stage. Dense parameters are repeated in
every expert-parallel rank's file of their (TP, PP) position.
"""

from __future__ import annotations

from pathlib import Path

from megatron_patch.checkpoint_files.pickles import TensorRef
from megatron_patch.checkpoint_files.torch_files import LazyTorchFile
from megatron_patch.checkpoint_files.torch_dist import wrapper_prefix_dropped
from megatron_patch.errors import UserError
from megatron_patch.models.mapping import RankCoord
from megatron_patch.models.mapping.naming import local_to_te_names
from megatron_patch.runtime.distributed import ParallelLayout

FILE_NAME = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0


def check_legacy_layout(layout: ParallelLayout) -> None:
    if layout.etp not in (None, layout.tp):
        raise UserError(f"the legacy format names files by TP, PP and EP rank only, so it needs ETP = TP "
                        f"(got ETP={layout.etp}, TP={layout.tp}): use --format torch_dist for ETP != TP")


def rank_dir_name(coord: RankCoord, layout: ParallelLayout) -> str:
    name = f"mp_rank_{coord.tp:02d}"
    if layout.pp > 1:
        name += f"_{coord.pp:03d}"
    if layout.ep > 1:
        name += f"_{coord.ep:03d}"
    return name


def rank_coords(layout: ParallelLayout) -> list[RankCoord]:
    """One coordinate per file; a file's expert shards are those of expert-TP rank = its TP rank."""
    return [RankCoord(tp=t, pp=p, ep=e, etp=t) for p in range(layout.pp) for e in range(layout.ep) for t in range(layout.tp)]


def rank_file(release_dir: str | Path, coord: RankCoord, layout: ParallelLayout) -> Path:
    return Path(release_dir) / rank_dir_name(coord, layout) / FILE_NAME


def open_rank_files(release_dir: str | Path, layout: ParallelLayout) -> dict[RankCoord, tuple[LazyTorchFile, dict[str, TensorRef]]]:
    """Every rank file and its model state dict, lazily; refuses missing or unexpected rank folders."""
    release_dir = Path(release_dir)
    if not release_dir.is_dir():
        raise UserError(f"{release_dir} is missing: the legacy checkpoint is incomplete")
    expected = {rank_dir_name(c, layout): c for c in rank_coords(layout)}
    present = {p.name for p in release_dir.iterdir() if p.name.startswith("mp_rank_")}
    if present - set(expected):
        raise UserError(f"{release_dir} holds rank folders {sorted(present - set(expected))[:3]} that a {layout} "
                        "checkpoint does not have: the sidecar and the files disagree")
    out = {}
    for name, coord in expected.items():
        path = release_dir / name / FILE_NAME
        if not path.exists():
            raise UserError(f"{path} is missing: the legacy checkpoint is incomplete")
        out[coord] = open_rank_file(path)
    return out


def open_rank_file(path: Path) -> tuple[LazyTorchFile, dict[str, TensorRef]]:
    """One rank file and its model weights under TE names, read lazily (no storage read, nothing in the
    file executed): TE's ``_extra_state`` entries are dropped and the local spec's names (Megatron-LM
    and Pai-Megatron-Patch write either) renamed."""
    lazy = LazyTorchFile(path)
    obj = lazy.obj
    if isinstance(obj, dict) and "model" not in obj and "model0" in obj:
        raise UserError(f"{path} holds virtual-pipeline chunks (model0, model1, ...): convert a checkpoint saved "
                        "without a virtual pipeline, or as torch_dist")
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        raise UserError(f"{path} has no 'model' state dict: it is not a Megatron model checkpoint")
    model = {k: v for k, v in obj["model"].items() if not k.endswith("_extra_state") and v is not None}
    bad = [k for k, v in model.items() if not isinstance(v, TensorRef)]
    if bad:
        raise UserError(f"{path}: model entry {bad[0]} is not a tensor")
    # every name under a wrapper's prefix (module., model.): read past it, as a torch_dist checkpoint's are (the
    # pdoc audit: refused as "tied output layer: config no, tensors yes")
    unwrapped = wrapper_prefix_dropped(model)
    model = {unwrapped.get(k, k): v for k, v in model.items()}
    names = local_to_te_names(model)
    renamed: dict[str, TensorRef] = {}
    for stored, name in names.items():
        if name in renamed:  # one tensor under both specs' names: which one the model holds is not known
            first = next(k for k, n in names.items() if n == name)
            raise UserError(f"{path} holds {first} and {stored}, both the model's {name}: a checkpoint holds one "
                            "of them; the file is damaged or was edited")
        renamed[name] = model[stored]
    return lazy, renamed

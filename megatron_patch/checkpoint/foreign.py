"""Megatron-Core checkpoints from anywhere: which files hold the weights, and what they hold.

``find_checkpoint(path)`` looks at a folder written by this project, Megatron-LM, NeMo /
Megatron-Bridge or Pai-Megatron-Patch and says which files hold the weights, in which format
(torch_dist or legacy, TE or local-spec names), at which iteration, with what tensors (as torch_dist
stores them: global, layers stacked or one key per layer), whether optimizer state and saved
Megatron-LM arguments are there and which tool wrote it; it reads no weights. A folder that is not a
checkpoint, a half-written one, or one whose layers don't add up is refused in one line.
``checkpoint.arch_source`` adds the model those tensors are (docs/foreign-checkpoints.md).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from megatron_patch.checkpoint.legacy import FILE_NAME, open_rank_file
from megatron_patch.checkpoint.outputs import command_of
from megatron_patch.checkpoint.sidecar import SIDECAR_NAME, Sidecar, read_sidecar
from megatron_patch.checkpoint_files.layout import (
    ITERATION_DIR,
    LEADS_OUTSIDE,
    RELEASE,
    TRACKER_NAME,
    is_iteration_dir,
    iteration_dir,
    latest_complete_iteration,
    read_tracker,
    torch_dist_problem,
    zip_problem,
)
from megatron_patch.checkpoint_files.manifest import (LOOK_DIGEST_LIMIT, MANIFEST_NAME, damage_against_manifest,
                                                     manifest_of, read_manifest, verify_manifest)
from megatron_patch.checkpoint_files.pickles import Record, TensorRef
from megatron_patch.checkpoint_files.torch_dist import TorchDistReader
from megatron_patch.checkpoint_files.torch_files import nbytes
from megatron_patch.errors import UserError
from megatron_patch.input_files import file_problem
from megatron_patch.runtime.distributed import ParallelLayout

# Tensors of a checkpoint that are training state, not weights, by megatron-core's key prefix (Adam moments and
# main parameters: "optimizer.state.exp_avg.<param>", "optimizer.distributed...."); a ChainedOptimizer (MoE: the
# dense and the expert parameters' optimizers apart) prefixes each one's keys with "chained_N.".
_TRAINING_STATE = re.compile(r"(chained_\d+\.)?optimizer\.")


def is_training_state(key: str) -> bool:
    return _TRAINING_STATE.match(key) is not None

_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_TE_EXPERT = re.compile(r"mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
# Parameters a TP rank holds a slice of, and the dimension sliced (of the unstacked parameter).
_TP_DIM = {"linear_qkv.weight": 0, "linear_qkv.bias": 0, "linear_fc1.weight": 0, "linear_fc1.bias": 0,
           "linear_proj.weight": 1, "linear_fc2.weight": 1, "word_embeddings.weight": 0, "output_layer.weight": 0}


@dataclass
class FoundCheckpoint:
    """A checkpoint folder as found on disk: no weights read."""

    root: Path                          # the folder with the tracker (or the one given)
    folder: Path                        # the iteration or release folder that holds the weights
    fmt: str                            # "torch_dist" | "legacy"
    iteration: int | str                # an iteration number or "release"
    iterations: list[int]               # every complete-looking iteration folder under root
    shapes: dict[str, tuple[int, ...]]  # model tensors as torch_dist stores them: global, layers stacked or apart
    dtype: str                          # the weights' dtype name (an fp32 router beside bf16 weights does not count)
    num_tensors: int                    # stored model tensors (legacy: over every rank file)
    num_bytes: int
    has_optimizer: bool
    args: dict | None                   # Megatron-LM's saved arguments, if any
    layout: ParallelLayout | None       # legacy: the TP/PP/EP its rank files are cut for
    layers_per_stage: list[int] = field(default_factory=list)
    sidecar_dir: Path | None = None     # where this project's sidecar lies, if there is one
    notes: list[str] = field(default_factory=list)
    # the model tensors stored in another dtype than ``dtype``: name -> dtype name
    other_dtypes: dict[str, str] = field(default_factory=dict)

    @property
    def sidecar(self) -> Sidecar | None:
        if self.sidecar_dir is None:
            return None
        return read_sidecar(self.sidecar_dir, release=self.sidecar_dir == self.root)

    @property
    def writer(self) -> str:
        """Which tool wrote it, as far as the files tell."""
        if self.sidecar_dir is not None:
            versions = self.sidecar.versions or {}
            return f"megatron_patch {versions.get('megatron_patch', '?')} ({self.sidecar.source or 'mpatch'})"
        if (self.folder / "run_config.yaml").exists() or (self.root / "latest_train_state.pt").exists():
            return "NeMo / Megatron-Bridge (run_config.yaml)"
        if self.args is not None:
            # Pai-Megatron-Patch adds its own tokenizer argument to Megatron-LM's.
            if "patch_tokenizer_type" in self.args:
                return "Pai-Megatron-Patch (Megatron-LM arguments with patch_tokenizer_type)"
            return "Megatron-LM (saved training arguments)"
        return "unknown (Megatron-Core layout without saved arguments)"

    @property
    def hf_config_beside(self) -> Path | None:
        """An HF config.json stored with the checkpoint (Pai-Megatron-Patch's converter copies one)."""
        for folder in (self.root, self.folder):
            if (folder / "config.json").is_file():
                return folder / "config.json"
        return None


# --- finding the weights ---------------------------------------------------------------------------

def _format(folder: Path) -> str | None:
    if (folder / ".metadata").exists() or (folder / "metadata.json").exists():
        return "torch_dist"
    if any(_RANK_DIR.fullmatch(p.name) for p in folder.iterdir() if p.is_dir()):
        return "legacy"
    return None


def checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` (an iteration or release folder) is not a complete checkpoint, or None."""
    if not folder.is_dir():
        return f"{folder.name} is missing"
    fmt = _format(folder)
    if fmt is None:
        return "it has neither torch_dist files (.metadata, *.distcp) nor legacy mp_rank_* folders"
    if fmt == "torch_dist":
        # common.pt is optional: Megatron-Bridge keeps its common state inside the .distcp files.
        return torch_dist_problem(folder, common=False) or (
            zip_problem(folder / "common.pt") if os.path.lexists(folder / "common.pt") else None)
    for rank_dir in sorted(p for p in folder.iterdir() if _RANK_DIR.fullmatch(p.name)):
        if (problem := file_problem(rank_dir / FILE_NAME)) is not None:
            return f"{rank_dir.name}/{problem}"
        real = (rank_dir / FILE_NAME).resolve()
        if folder.resolve() not in real.parents:  # a rank file (or its folder) linked elsewhere: not this one's
            return f"{rank_dir.name}/{FILE_NAME} {LEADS_OUTSIDE} (to {real}): refused"
    return None


def _sound_iteration_problem(folder: Path) -> str | None:
    """``checkpoint_problem``, then the folder's files against its manifest (sizes, small files' digests): a newest
    iteration whose train_state.json was edited or whose archive was cut short is skipped for the previous one."""
    why = checkpoint_problem(folder)
    manifest = manifest_of(folder) if why is None else None
    if manifest is not None:
        try:
            verify_manifest(manifest, LOOK_DIGEST_LIMIT)
        except UserError as exc:
            return str(exc)
    return why


def iteration_before(load_dir: str | Path, iteration: int | None = None) -> tuple[Path, int] | None:
    """For a run's checkpoint folder ``load_dir`` (not one of its iterations): the folder of the iteration a reader
    takes there (``iteration``, else the newest that passes the look), and the newest iteration before it that passes
    the look (``_sound_iteration_problem``), which a reader takes where that one fails as it is read. None otherwise."""
    found = find_checkpoint(load_dir, iteration)
    if not isinstance(found.iteration, int) or found.root.resolve() != Path(load_dir).resolve():
        return None
    older = sorted((int(m.group(1)) for p in found.root.iterdir() if (m := ITERATION_DIR.fullmatch(p.name))
                    and p.is_dir() and int(m.group(1)) < found.iteration), reverse=True)
    previous = next((i for i in older if _sound_iteration_problem(iteration_dir(found.root, i)) is None), None)
    return None if previous is None else (found.folder, previous)


def _locate(path: Path, iteration: int | None, verify: bool = True) -> tuple[Path, Path, int | str, list[str]]:
    """(root, weights folder, iteration or 'release', warnings); ``verify``: a run's newest iteration is also
    looked at against its manifest."""
    if not path.is_dir():
        raise UserError(f"{path} is not a folder: point at a Megatron checkpoint folder")
    other = _other_commands_output(path)
    if other:  # an eval output's iter_XXXXXXX folders were called a checkpoint's damaged iterations (the tools audit)
        raise UserError(f"{path} is an output of {other} (its {MANIFEST_NAME} says so), not a checkpoint")
    if is_iteration_dir(path) or (path.name == RELEASE and _format(path)):
        if iteration is not None:
            raise UserError(f"{path} is one iteration's folder: give its parent with --iteration, or this folder alone")
        label = RELEASE if path.name == RELEASE else int(path.name[len("iter_"):])
        return path.parent, path, label, []
    found = sorted(int(m.group(1)) for p in path.iterdir() if (m := ITERATION_DIR.fullmatch(p.name)) and p.is_dir())
    if iteration is not None:
        if iteration < 0:  # it read "iter_-000001 not found" (the tools audit)
            raise UserError(f"--iteration must be >= 0, got {iteration}")
        folder = iteration_dir(path, iteration)
        if not folder.is_dir() and not found and (path / RELEASE).is_dir():
            raise UserError(f"{path} holds converted weights ({RELEASE}/), not a training run's iterations: drop "
                            "--iteration")
        if not folder.is_dir():
            have = ", ".join(map(str, found)) or "none"
            raise UserError(f"{folder} not found: the iterations saved in {path} are {have}")
        return path, folder, iteration, []
    tracked = read_tracker(path)
    if tracked == RELEASE or (tracked is None and not found and (path / RELEASE).is_dir()):
        return path, path / RELEASE, RELEASE, []
    if tracked is None and not found:
        if _format(path):
            raise UserError(f"{path} holds checkpoint files but is not inside an iter_XXXXXXX or release folder: "
                            "point at the folder that holds latest_checkpointed_iteration.txt")
        raise UserError(f"{path} is not a Megatron checkpoint: it has no {TRACKER_NAME}, iter_XXXXXXX or release "
                        f"folder{_what_it_is_instead(path)}")
    latest, notes = latest_complete_iteration(path, _sound_iteration_problem if verify else checkpoint_problem)
    return path, iteration_dir(path, latest), latest, notes


# The commands whose outputs hold no checkpoint (their folders may still hold iter_XXXXXXX folders: eval's).
NOT_CHECKPOINTS = ("mpatch eval", "mpatch align", "mpatch demo")


def _other_commands_output(path: Path) -> str | None:
    """The command (``NOT_CHECKPOINTS``) whose output ``path`` is, by its manifest; None otherwise (a damaged manifest
    too: the checkpoint's own checks say what is wrong)."""
    if not (path / MANIFEST_NAME).is_file():
        return None
    try:
        tool = read_manifest(path / MANIFEST_NAME).get("tool")
    except UserError:  # IntegrityError included
        return None
    command = command_of(tool) if isinstance(tool, str) else None
    return command if command in NOT_CHECKPOINTS else None


def _what_it_is_instead(path: Path) -> str:
    """What a folder given as a checkpoint holds instead, where it is plain: a training run's folder (its model is in
    final/, its checkpoints in checkpoint/) or an HF model folder (to convert first); the line said neither (the
    newuser audit)."""
    final, checkpoints = path / "final", path / "checkpoint"
    if final.is_dir() and checkpoints.is_dir():
        return (f": it is a training run's folder (OUTPUT_BASEPATH); its exported model is {final}, its "
                f"checkpoints {checkpoints}")
    if final.is_dir():
        return f": it is a training run's folder (OUTPUT_BASEPATH); its exported model is {final}"
    if checkpoints.is_dir():  # a run stopped before its end (MP_EXIT_INTERVAL, a time limit): final/ is not there yet
        return (f": it is a training run's folder (OUTPUT_BASEPATH) with no exported model yet (final/ is written when "
                f"the run ends: launch it again to go on); its checkpoints are in {checkpoints}")
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return (f": it is a Hugging Face model folder; convert it first (mpatch convert hf2mcore --hf-dir {path} "
                "--save-dir CKPT)")
    return ""


def _saved_args(obj) -> dict | None:
    args = obj.get("args") if isinstance(obj, dict) else None
    if isinstance(args, Record):  # argparse.Namespace, unpickled as an inert record
        return dict(args.state) if isinstance(args.state, dict) else None
    return dict(args) if isinstance(args, dict) else None


def find_checkpoint(path: str | Path, iteration: int | None = None, verify: bool = True) -> FoundCheckpoint:
    """Look at a checkpoint folder (its root, or one iteration or release folder); reads no weights. ``verify``: a
    run's newest iteration whose files differ from its manifest (sizes, small files) is skipped, as a resume does."""
    root, folder, label, notes = _locate(Path(path), iteration, verify)
    given = Path(path).resolve()
    if folder.resolve() != given and given not in folder.resolve().parents:  # release/ or iter_N linked elsewhere
        raise UserError(f"{folder} leads outside {path} (to {folder.resolve()}): refused; point at that folder "
                        "itself if it is the checkpoint meant")
    problem = checkpoint_problem(folder)
    if problem and LEADS_OUTSIDE in problem:  # not damage: a link elsewhere, named as one
        raise UserError(f"{folder}: {problem}; copy the file into the folder if it belongs to the checkpoint")
    if problem:
        damage = damage_against_manifest(folder)
        if damage is not None:
            # a UserError, not an IntegrityError: no switch reads a file that cannot be read
            raise UserError(f"{folder} cannot be read: {damage}; restore it from a good copy")
        raise UserError(f"{folder} is not a complete checkpoint ({problem}): it is half-written, truncated or "
                        "corrupt; point at a finished one (or --iteration N for an older one)")
    fmt = _format(folder)
    found = _read_torch_dist(folder) if fmt == "torch_dist" else _read_legacy(folder)
    iterations = sorted(int(m.group(1)) for p in root.iterdir() if (m := ITERATION_DIR.fullmatch(p.name)))
    places = (root, folder) if label == RELEASE else (folder,)
    sidecar_dir = next((d for d in places if file_problem(d / SIDECAR_NAME) is None), None)
    if sidecar_dir is None:  # one there but no file to read is not "none": refused, not read around
        odd = next((f"{d}/{p}" for d in places if os.path.lexists(d / SIDECAR_NAME)
                    and (p := file_problem(d / SIDECAR_NAME)) is not None), None)
        if odd is not None:
            raise UserError(f"{odd}: the checkpoint's sidecar must be a file")
    # a tensor stored as integers is refused when read (convert's _check_floating), not announced as exported
    cast = {k: v for k, v in found["other_dtypes"].items() if v.startswith(("float", "bfloat"))}
    if sidecar_dir is None and cast:
        notes.append(_mixed_dtypes_note(folder, found["dtype"], cast))
    checkpoint = FoundCheckpoint(root=root, folder=folder, fmt=fmt, iteration=label, iterations=iterations,
                                 sidecar_dir=sidecar_dir, notes=notes, **found)
    if fmt == "legacy" and sidecar_dir is not None:
        # a whole lost stage or TP column leaves rank folders that look like a smaller layout: inspect described
        # it as complete, mcore2hf refused it (the tools audit)
        written, here = checkpoint.sidecar.parallel_layout, checkpoint.layout
        if (written.tp, written.pp, written.ep) != (here.tp, here.pp, here.ep):
            raise UserError(f"{folder} holds the rank folders of TP={here.tp} PP={here.pp} EP={here.ep}, and its "
                            f"sidecar records TP={written.tp} PP={written.pp} EP={written.ep}: the checkpoint is "
                            "incomplete (rank folders lost); restore it from a good copy")
    return checkpoint


def _mixed_dtypes_note(folder: Path, dtype: str, others: dict[str, str]) -> str:
    """Another tool's checkpoint whose weights are not all of one dtype (bf16 matrices beside fp32 norms, say):
    its model is described, and exported, in the weights' dtype, so the others are cast; said, not done silently."""
    kinds = sorted(set(others.values()))
    example = sorted(others)[0]
    keep = " (mcore2hf --dtype fp32 writes every tensor exactly)" if "float32" in kinds and dtype != "float32" else ""
    return (f"{folder} stores {len(others)} of its tensors in {'/'.join(kinds)} (such as {example}) beside its "
            f"{dtype} weights: they are read, and exported, as {dtype}{keep}")


def _read_torch_dist(folder: Path) -> dict:
    reader = TorchDistReader(folder)
    keys = reader.tensor_keys()
    model = sorted(k for k in keys if not is_training_state(k))
    shapes = {k: reader.global_shape(k) for k in model}
    common = reader.common_state()
    args = None if common is None else _saved_args(common)
    dtypes = {k: reader.dtype(k) for k in model}
    return dict(shapes=shapes, **_weights_dtype(dtypes), num_tensors=len(model),
                num_bytes=sum(nbytes(s, reader.dtype(k)) for k, s in shapes.items()),
                has_optimizer=len(model) < len(keys), args=args, layout=None)


def _weights_dtype(dtypes: dict[str, str]) -> dict:
    """{"dtype": the embedding's dtype, else the most common one (an fp32 router beside bf16 weights is not it),
    "other_dtypes": the tensors stored otherwise}."""
    if "embedding.word_embeddings.weight" in dtypes:
        dtype = dtypes["embedding.word_embeddings.weight"]
    else:
        values = list(dtypes.values()) or ["float32"]
        dtype = max(set(values), key=values.count)
    return {"dtype": dtype, "other_dtypes": {k: v for k, v in dtypes.items() if v != dtype}}


def _legacy_layout(folder: Path, files: dict[str, dict], args: dict | None) -> tuple[ParallelLayout, dict]:
    """The layout a legacy checkpoint's rank folders are cut for, and folder name -> (tp, pp, ep).

    Megatron-LM adds the pipeline suffix only when PP > 1 and the expert suffix only when EP > 1, so
    ``mp_rank_00_001`` is stage 1 or expert rank 1: the saved arguments say which, else the files
    (every expert rank holds the embedding, only the first stage does)."""
    parsed = {name: _RANK_DIR.fullmatch(name).groups() for name in files}
    two = {g[2] is not None for g in parsed.values()}
    one = {g[1] is not None for g in parsed.values()}
    if len(two) > 1 or len(one) > 1:
        raise UserError(f"{folder} mixes rank folder names of different layouts ({', '.join(sorted(files)[:4])}): "
                        "it is not one checkpoint")
    coords = {}
    for name, (tp, a, b) in parsed.items():
        if b is not None:
            coords[name] = (int(tp), int(a), int(b))
        elif a is None:
            coords[name] = (int(tp), 0, 0)
        else:
            if args and args.get("pipeline_model_parallel_size"):
                is_pp = args["pipeline_model_parallel_size"] > 1
            else:
                is_pp = not all("embedding.word_embeddings.weight" in sd for sd in files.values())
            coords[name] = (int(tp), int(a), 0) if is_pp else (int(tp), 0, int(a))
    tp, pp, ep = (max(c[i] for c in coords.values()) + 1 for i in range(3))
    # the layout the saved arguments give, where they give it: a whole lost stage or TP column leaves folders that
    # look like a smaller layout, described as complete (the tools audit)
    saved = [(args or {}).get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                           "expert_model_parallel_size")]
    tp, pp, ep = (max(n, s) if isinstance(s, int) and not isinstance(s, bool) and s > 0 else n
                  for n, s in zip((tp, pp, ep), saved))
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
               for t in range(tp) for p in range(pp) for e in range(ep) if (t, p, e) not in coords.values()]
    if missing:
        raise UserError(f"{folder} lacks rank folder(s) {', '.join(missing[:4])} of its TP={tp} PP={pp} EP={ep} "
                        "layout: the checkpoint is incomplete")
    return ParallelLayout(tp=tp, pp=pp, ep=ep), coords


def _read_legacy(folder: Path) -> dict:
    rank_dirs = sorted(p for p in folder.iterdir() if _RANK_DIR.fullmatch(p.name))
    opened = {d.name: open_rank_file(d / FILE_NAME) for d in rank_dirs}
    first = opened[rank_dirs[0].name][0].obj
    args = _saved_args(first)
    files = {name: sd for name, (_, sd) in opened.items()}
    layout, coords = _legacy_layout(folder, files, args)
    has_optimizer = (isinstance(first, dict) and bool(first.get("optimizer"))) or any(
        (d / "distrib_optim.pt").exists() for d in rank_dirs)
    by_coord = {coords[name]: sd for name, sd in files.items()}
    layers_per_stage = []
    for p in range(layout.pp):
        sets = {(t, e): sorted({int(m.group(1)) for k in by_coord[(t, p, e)] if (m := _LAYER.match(k))})
                for t in range(layout.tp) for e in range(layout.ep)}
        distinct = {tuple(s) for s in sets.values()}
        if len(distinct) > 1:
            raise UserError(f"{folder}: the ranks of pipeline stage {p} hold different layers ("
                            + "; ".join(f"TP {t} EP {e}: {len(s)}" for (t, e), s in sorted(sets.items())[:3])
                            + "): the layers don't add up")
        held = distinct.pop()
        if held != tuple(range(len(held))):
            raise UserError(f"{folder}: pipeline stage {p} holds layers {held[:6]}, not 0..{len(held) - 1} as "
                            "Megatron numbers them on each stage: the layers don't add up")
        layers_per_stage.append(len(held))
    shapes, per_layer, dtypes, count, total = {}, {}, {}, 0, 0
    for p in range(layout.pp):
        for (t, pp, e), sd in by_coord.items():
            if pp != p:
                continue
            count += len(sd)
            total += sum(nbytes(v.shape, v.storage.dtype) for v in sd.values())
            dtypes.update((k, v.storage.dtype) for k, v in sd.items())
            if t == 0 and e == 0:
                _add_global_shapes(shapes, per_layer, sd, layout, sum(layers_per_stage), sum(layers_per_stage[:p]))
    _stack_alike_layers(shapes, per_layer, sum(layers_per_stage))
    return dict(shapes=shapes, **_weights_dtype(dtypes), num_tensors=count, num_bytes=total,
                has_optimizer=has_optimizer, args=args, layout=layout, layers_per_stage=layers_per_stage)


def _add_global_shapes(shapes: dict, per_layer: dict, sd: dict[str, TensorRef], layout: ParallelLayout,
                       num_layers: int, first_layer: int) -> None:
    """The torch_dist-style global shape of each tensor of one (TP 0, EP 0) rank file of the stage whose first
    layer is ``first_layer``: TP slices scaled back up, experts (local-spec lists or TE ``weightN``) on a second
    axis of a stack of layers; a layer's other tensors go into ``per_layer`` (name -> layer -> shape), for
    ``_stack_alike_layers``."""
    for name, t in sd.items():
        shape = list(t.shape)
        for suffix, dim in _TP_DIM.items():
            if name.endswith(suffix):
                shape[dim] *= layout.tp
                break
        m = _LAYER.match(name)
        if not m:
            shapes[name] = tuple(shape)
            continue
        rest = m.group(2)
        expert = _TE_EXPERT.match(rest)
        if expert:
            key = f"decoder.layers.mlp.experts.experts.{expert.group(1)}.{expert.group(2)}"
            local = int(expert.group(3)) + 1
            if expert.group(1) == "linear_fc1":
                shape[0] *= layout.tp
            else:
                shape[-1] *= layout.tp
            prev = shapes.get(key, (num_layers, 0))
            shapes[key] = (num_layers, max(prev[1], local * layout.ep), *shape)
            continue
        per_layer.setdefault(rest, {})[first_layer + int(m.group(1))] = tuple(shape)


def _stack_alike_layers(shapes: dict, per_layer: dict, num_layers: int) -> None:
    """Each layer tensor as torch_dist stores it: stacked on a leading axis where every layer's is alike, one key per
    layer where they differ (Gemma 4's full-attention layers have heads of their own: stacked, the last layer's
    shape stood for all, and a sidecarless legacy Gemma 4 was refused as another model than its own config)."""
    for rest, by_layer in per_layer.items():
        if len(set(by_layer.values())) == 1:
            shapes[f"decoder.layers.{rest}"] = (num_layers, *next(iter(by_layer.values())))
        else:
            shapes.update((f"decoder.layers.{layer}.{rest}", shape) for layer, shape in sorted(by_layer.items()))


# Tensors of megatron-core's Gated DeltaNet layers: the hybrid stacks that have them (Qwen3-Next, Qwen3.5) give
# their full-attention layers an output gate (megatron-core's attention_output_gate), whose rows linear_qkv holds
# beside q's (models/qwen3_next/mapping.py, QKV_GATED: [q heads; gate heads; k; v] per query group).
_GATED_ATTENTION_COMPANIONS = ("self_attention.in_proj.", "self_attention.conv1d.")


def _decoder_layers(shapes: dict[str, tuple[int, ...]]) -> tuple[int, list[dict[str, tuple[int, ...]]]]:
    """(the decoder's layer count, its tensors in groups of name within a layer -> one layer's shape).

    megatron-core stores the tensors of a stack whose layers are alike stacked, ``decoder.layers.<name>`` with
    the layers on dim 0 (one group for all of them; legacy files are read so too), and those of a stack whose
    layers differ (dense first layers of DeepSeek-V3 or GLM-4.5, Qwen3-MoE's mlp_only_layers, hybrid attention)
    one key per layer, ``decoder.layers.<N>.<name>`` (a group each), as Megatron-LM does too."""
    stacked: dict[str, tuple[int, ...]] = {}
    numbered: dict[int, dict[str, tuple[int, ...]]] = {}
    count = 0
    for key, shape in shapes.items():
        if not key.startswith("decoder.layers."):
            continue
        m = _LAYER.match(key)
        if m:
            numbered.setdefault(int(m.group(1)), {})[m.group(2)] = shape
            count = max(count, int(m.group(1)) + 1)
        elif shape:
            stacked[key[len("decoder.layers."):]] = shape[1:]
            count = max(count, shape[0])
    return count, ([stacked] if stacked else []) + [numbered[n] for n in sorted(numbered)]


def tensor_facts(shapes: dict[str, tuple[int, ...]]) -> dict:
    """What the stored tensors say about the model (torch_dist key names, global shapes; layers stacked or one
    key per layer, ``_decoder_layers``)."""
    facts: dict = {}
    emb = shapes.get("embedding.word_embeddings.weight")
    if emb:
        facts["hidden size"], facts["embedding rows"] = emb[1], emb[0]
    count, layers = _decoder_layers(shapes)
    if count:
        facts["layers"] = count

    def first(name: str) -> tuple[int, ...] | None:
        return next((layer[name] for layer in layers if name in layer), None)

    gated = any(name.startswith(_GATED_ATTENTION_COMPANIONS) for layer in layers for name in layer)
    widths = Counter((proj[-1], qkv[0] - proj[-1] * (2 if gated else 1)) for layer in layers
                     if (qkv := layer.get("self_attention.linear_qkv.weight"))
                     and (proj := layer.get("self_attention.linear_proj.weight")))
    if widths:
        # Layers whose attention has a shape of its own (Gemma 4's full attention) are the fewer.
        facts["attention width"], facts["key/value width"] = widths.most_common(1)[0][0]
    fc1 = first("mlp.linear_fc1.weight")
    if fc1:
        facts["MLP size"] = fc1[0] // 2
    experts = first("mlp.router.weight") or first("mlp.experts.experts.linear_fc1.weight")
    facts["experts"] = experts[0] if experts else 0
    facts["tied output layer"] = "output_layer.weight" not in shapes
    facts["qk norm"] = first("self_attention.q_layernorm.weight") is not None
    facts["linear biases"] = first("self_attention.linear_qkv.bias") is not None
    return facts

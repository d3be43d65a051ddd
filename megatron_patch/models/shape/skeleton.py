"""What the MCore model of an ``Arch`` looks like, without weights: ``describe_model``.

A conversion needs, for the model of a config.json (at TP=PP=EP=1: a torch_dist checkpoint holds
global tensors, so these single-rank entries describe it completely, whatever TP/PP/EP it is later
loaded at):

- the shape of every parameter, to check each HF tensor against config.json before any byte is
  read, and
- every entry of ``model.sharded_state_dict()``: the torch_dist key, global shape and offset of each
  tensor chunk (layers stacked on a leading axis, experts on a second one, the SwiGLU ``linear_fc1``
  as [gate; up]), and the ``_extra_state`` objects a model asks for when loading;
- the shape of every HF tensor that config implies (the family's weight table run backwards from
  those parameters), having checked that the table writes every parameter and nothing else.

``describe_model`` derives it from the family's weight table and config by megatron-core's rules
(``derived_skeleton``: milliseconds, no megatron-core import) wherever those rules describe the model,
and otherwise asks megatron-core itself: it builds the GPTModel once with uninitialised storage (nothing
is written to it, so it costs no resident memory) and reads the same from it. Tests check that the two
agree for every family.

The model is built in a helper process: building one needs megatron's process groups and, without
CUDA, the CPU compatibility layer, which patches torch process-wide (transformers models loaded
afterwards in the same process are not reliable). The caller's process stays untouched.

Importing megatron-core and building the model takes 5-10 s, and the answer depends only on
config.json (with the MTP layers and a checkpoint's own vocabulary padding) and the code. So what
megatron-core says is kept on disk (``~/.cache/megatron_patch/skeletons``, or ``$MPATCH_CACHE_DIR``),
keyed by a hash of those, the megatron-core and torch versions, and the source of every module that
shapes the model (``models/``, this file among them, and ``runtime/``): anything that could change the
answer changes the key. A cached skeleton is the helper's own result read back (tests compare the
two); a damaged or foreign cache file is ignored and rewritten.

It lives with the models, not the converter: the parameter counts, FLOPs and memory plan
(``models/shape/model_shape.py``) read the same shapes, from megatron-core (``describe_models``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import json
import os
from pathlib import Path

import megatron_patch
from megatron_patch.errors import UserError
from megatron_patch.models.description.arch import Arch
from megatron_patch.models.description.registry import parse_arch
from megatron_patch.models.mapping.naming import local_to_te_names
from megatron_patch.models.shape.derived_skeleton import NotDerivable, derive_skeleton
from megatron_patch.models.shape.skeleton_entries import (  # noqa: F401 - the skeleton's types, used from here
    SKELETON_FORMAT,
    ChunkEntry,
    ModelSkeleton,
    ObjectEntry,
    expected_hf_shapes,
)
from megatron_patch.runtime import ParallelLayout, init_model_parallel
from megatron_patch.runtime.machine import installed_version
from megatron_patch.runtime.launch import run_local

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).
# So is blocks.builder, which imports torch at its top: only where megatron-core builds the model.


def _ensure_single_rank_state() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps


    if dist.is_initialized() and dist.get_world_size() > 1:
        raise UserError("checkpoint conversion runs in a single process: do not launch it with torchrun")
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() == 1 \
            and ps.get_pipeline_model_parallel_world_size() == 1 and ps.get_expert_model_parallel_world_size() == 1:
        return
    init_model_parallel(ParallelLayout())


def _key(arch: Arch, layers: tuple[int, ...] | None) -> tuple:
    return json.dumps(arch.hf_config, sort_keys=True), arch.mtp_layers, arch.vocab_padded_to, layers


def describe_model(arch: Arch, *, use_cache: bool = True, layers: tuple[int, ...] | None = None) -> ModelSkeleton:
    """The skeleton of ``arch``'s MCore model (independent of dtype and layout): derived from the family's
    weight table, or, where that derivation does not describe the model, from the disk cache or computed
    by megatron-core in a helper process (and then cached). ``use_cache=False``: computed by megatron-core.

    ``layers`` builds only those decoder layers of the model, in that order (``models/shape/model_shape.py`` asks
    for one layer of each kind, so that a 671B model's shapes cost what two of its layers cost)."""
    key = _key(arch, layers)
    if not use_cache:
        return _compute([key])[0]
    if layers is None:
        derived = _derived(*key[:3])
        if derived is not None:
            return derived
    return _describe_cached(*key)


@functools.lru_cache(maxsize=32)
def _derived(hf_config_json: str, mtp_layers: int, vocab_padded_to: int | None) -> ModelSkeleton | None:
    """``derive_skeleton`` of the arch the key stands for (as the helper rebuilds it), None where the rules
    do not describe it."""
    try:
        return derive_skeleton(_arch_of(hf_config_json, mtp_layers, vocab_padded_to))
    except NotDerivable:
        return None


def _arch_of(hf_config_json: str, mtp_layers: int, vocab_padded_to: int | None) -> Arch:
    return dataclasses.replace(parse_arch(json.loads(hf_config_json)), mtp_layers=mtp_layers,
                               vocab_padded_to=vocab_padded_to)


def describe_models(requests: list[tuple[Arch, tuple[int, ...] | None]]) -> list[ModelSkeleton]:
    """``describe_model`` of each (arch, layers), with every cache miss computed in one helper process
    (megatron-core is imported once, not once per model)."""
    keys = [_key(arch, layers) for arch, layers in requests]
    missing = [k for k in dict.fromkeys(keys) if _read_cache(*k) is None]
    if missing:
        for key, skeleton in zip(missing, _compute(missing)):
            path = cache_path(*key)
            if path is not None:
                _store(path, skeleton)
    return [_describe_cached(*k) for k in keys]


def _read_cache(hf_config_json: str, mtp_layers: int, vocab_padded_to: int | None,
                layers: tuple[int, ...] | None) -> ModelSkeleton | None:
    path = cache_path(hf_config_json, mtp_layers, vocab_padded_to, layers)
    if path is not None and path.is_file():
        try:
            return ModelSkeleton.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # damaged or foreign: computed again and rewritten
    return None


@functools.lru_cache(maxsize=32)
def _describe_cached(hf_config_json: str, mtp_layers: int, vocab_padded_to: int | None,
                     layers: tuple[int, ...] | None) -> ModelSkeleton:
    key = (hf_config_json, mtp_layers, vocab_padded_to, layers)
    skeleton = _read_cache(*key)
    if skeleton is None:
        skeleton = _compute([key])[0]
        path = cache_path(*key)
        if path is not None:
            _store(path, skeleton)
    return skeleton


def _compute(keys: list[tuple]) -> list[ModelSkeleton]:
    return run_local(_describe_worker, 1, keys)[0]


def cache_dir() -> Path:
    root = os.environ.get("MPATCH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "megatron_patch")
    return Path(root) / "skeletons"


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """Hash of every source file that decides what megatron builds for a config (and of the versions)."""
    package = Path(megatron_patch.__file__).resolve().parent
    files = sorted(p for sub in ("models", "runtime") for p in (package / sub).rglob("*.py"))
    h = hashlib.sha256()
    for dist in ("megatron-core", "torch"):
        h.update(f"{dist}={installed_version(dist) or 'none'}\n".encode())
    for p in files:
        h.update(str(p.relative_to(package)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def cache_path(hf_config_json: str, mtp_layers: int, vocab_padded_to: int | None = None,
               layers: tuple[int, ...] | None = None) -> Path | None:
    """Where the skeleton of this config (with ``mtp_layers`` MTP layers, the embedding padded to
    ``vocab_padded_to`` rows, None: the config's own padding, and only the decoder ``layers`` given, None:
    all) is cached; None if the code cannot be hashed."""
    only = "" if layers is None else f"layers={','.join(map(str, layers))}\0"
    try:
        key = hashlib.sha256(f"{SKELETON_FORMAT}\0{_code_digest()}\0{mtp_layers}\0{vocab_padded_to}\0{only}"
                             f"{hf_config_json}".encode()).hexdigest()
    except OSError:
        return None
    return cache_dir() / f"{key}.json"


def _store(path: Path, skeleton: ModelSkeleton) -> None:
    """Written aside and renamed, so concurrent conversions never read half a file; failures are ignored
    (the cache only saves time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(skeleton.to_json()))
        os.replace(tmp, path)
    except OSError:
        pass


def _describe_worker(keys: list[tuple]) -> list[ModelSkeleton]:
    # Asked from inside a training rank (its memory plan, with no cache yet), the helper inherits the
    # attention-backend variables megatron-core set there for that run's spec; they do not apply to
    # this build, and megatron asserts on them.
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(name, None)
    out = []
    for hf_config_json, mtp_layers, vocab_padded_to, layers in keys:
        arch = _arch_of(hf_config_json, mtp_layers, vocab_padded_to)
        out.append(describe_model_here(only_layers(arch, layers) if layers is not None else arch))
    return out


def only_layers(arch: Arch, layers: tuple[int, ...]) -> Arch:
    """``arch`` with only the decoder ``layers`` given (each keeping its kind), renumbered from 0."""
    if not layers or any(not 0 <= i < arch.num_layers for i in layers):
        raise ValueError(f"layers {layers} are not layers of a {arch.num_layers}-layer model")
    return dataclasses.replace(arch, num_layers=len(layers),
                               dense_layers=tuple(j for j, i in enumerate(layers) if i in arch.dense_layers),
                               layer_types=tuple(arch.layer_types[i] for i in layers) if arch.layer_types else (),
                               family_config=arch.family_config and arch.family_config.only_layers(layers))


def describe_model_here(arch: Arch) -> ModelSkeleton:
    """``describe_model`` in this process (sets up a world of one and megatron's CPU layer)."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    from megatron_patch.models.blocks.builder import build_model

    _ensure_single_rank_state()
    # Storage is allocated but never touched (no initialisation), so it never becomes resident.
    model = build_model(arch, _single_layout(), torch.float32, use_te=False, pre_process=True, post_process=True,
                        perform_initialization=False, use_cpu_initialization=True)
    local_state = model.state_dict()
    te_name = local_to_te_names(local_state)
    shapes = {te_name[k]: tuple(v.shape) for k, v in local_state.items() if not k.endswith("_extra_state") and v is not None}
    parameters = {name for name, _ in model.named_parameters()}
    buffers = frozenset(te_name[k] for k in local_state if te_name[k] in shapes and k not in parameters)
    chunks: list[ChunkEntry] = []
    objects: list[ObjectEntry] = []
    for sd_name, entry in model.sharded_state_dict().items():
        factory = isinstance(entry, ShardedTensorFactory)
        built = entry.build() if factory else entry
        for item in built if isinstance(built, list) else [built]:
            if isinstance(item, ShardedTensor):
                if item.flattened_range is not None:
                    raise UserError("flattened sharded tensors are not expected in a model state dict")
                prepend = item.prepend_axis_num
                piece = factory and item.key != entry.key  # a part of the parameter under a key of its own
                chunks.append(ChunkEntry(
                    name=te_name.get(sd_name, sd_name), key=item.key, global_shape=tuple(item.global_shape),
                    global_offset=tuple(item.global_offset), local_shape=(1,) * prepend + tuple(item.local_shape),
                    prepend=prepend, position=_position_in(entry.data, item.data) if piece else None))
            elif isinstance(item, ShardedObject):
                buf = io.BytesIO()
                torch.save([item.data], buf)  # megatron stores a list of the objects sharing a key
                objects.append(ObjectEntry(item.unique_key, buf.getvalue()))
            else:
                raise UserError(f"unexpected entry {type(item).__name__} in the model's sharded state dict")
    del model
    return ModelSkeleton(shapes, chunks, objects, expected_hf_shapes(arch, shapes), buffers)


def _position_in(whole, part) -> tuple[int, ...]:
    """Where the view ``part`` of the parameter ``whole`` starts, index by index."""
    offset, out = part.storage_offset() - whole.storage_offset(), []
    for stride in whole.stride():
        out.append(offset // stride)
        offset %= stride
    return tuple(out)


def _single_layout():
    return ParallelLayout()

"""Every node of a job runs the same launcher line: each rank resolves its own (a node's job script may be another
copy), so right after the ranks join, before any group or collective that a difference would hang or split, they
compare what they resolved. A difference (another LR on one node, another TP, another data set or checkpoint) is
refused on every rank in one line naming the option and both nodes; a path spelled otherwise that names the same
files (a link, a relative path) is taken on every rank as rank 0 spells it, made absolute, since megatron-core names
its data cache after the spelling.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket

import torch.distributed as dist

from megatron_patch.errors import UserError
from megatron_patch.runtime.distributed import init_process_group
from megatron_patch.training.launcher_options import DERIVED, OPTIONS

# What may differ between nodes: injected faults (a test's, on one node) and the notes each launcher printed.
PER_NODE = ("faults", "notes")
# Fields naming files: compared by what they resolve to, used as rank 0 spells them.
PATHS = ("dataset_path", "valid_dataset_path", "pretrain_checkpoint", "output_basepath", "tokenizer",
         "eval_include_path", "offload_probe_script", "lora_init", "checkpoint_tokenizer")
# The option a differing field comes from (fields read from several options, or derived, by their main one).
_OPTION_OF_FIELD = {
    **{f: o.name for o in OPTIONS for f in ((o.field,) if isinstance(o.field, str) else o.field or ())},
    "dataset_path": "DATASET_PATH", "dataset_weights": "DATASET_PATH", "valid_dataset_path": "VALID_DATASET_PATH",
    "valid_dataset_weights": "VALID_DATASET_PATH", "train_iters": "TRAIN_TOKENS_OR_ITERS",
    "warmup_iters": "WARMUP_TOKENS_OR_ITERS", "lr_decay_iters": "TRAIN_TOKENS_OR_ITERS", "launcher": "the launcher",
    "nproc_per_node": "GPUS_PER_NODE", "nnodes": "WORLD_SIZE", "world_size": "the world size",
    "lora": "MP_LORA_RANK/ALPHA/DROPOUT/TARGETS", "lora_init": "MP_LORA_INIT", "dsa": "MP_DSA_*",
    "checkpoint_tokenizer": "PRETRAIN_CHECKPOINT_PATH"}


def agree_on_launch(cfg):
    """``cfg`` once every rank resolved the same settings (their paths spelled as rank 0's), else a UserError."""
    if dist.get_world_size() == 1:
        return cfg
    mine = (socket.gethostname(), _comparable(cfg), {f: getattr(cfg, f) for f in PATHS})
    absolute = {f: _absolute(f, getattr(cfg, f)) for f in PATHS}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (*mine, absolute, _processes_here()))
    first_problem = _nodes_of_other_sizes(everyone) or _a_refusal(everyone)
    if first_problem:
        raise UserError(first_problem)
    host0, reference, spelled, spelled_absolute, _ = everyone[0]
    for rank, (host, theirs, _, _, _) in enumerate(everyone):
        differs = next((k for k in reference if theirs.get(k) != reference[k]), None)
        if differs is None:
            continue
        what = (f"the model's config.json ({DERIVED['hf_config']}) differs between rank 0 ({host0}) and rank {rank} "
                f"({host}): {_config_difference(reference[differs], theirs[differs])}" if differs == "hf_config" else
                f"{_OPTION_OF_FIELD.get(differs, differs)} is {_shown(reference[differs])} on rank 0 ({host0}) and "
                f"{_shown(theirs[differs])} on rank {rank} ({host})")
        raise UserError(f"the nodes were not given the same launcher line: {what}: run the same line, with the same "
                        "environment options, on every node")
    if all(theirs == spelled for _, _, theirs, _, _ in everyone):
        return cfg
    # spelled otherwise somewhere: every rank takes rank 0's spelling, absolute (a relative one is rank 0's folder's),
    # where it names the same files here
    elsewhere = next((f for f, value in spelled_absolute.items()
                      if _comparable_path(f, value) != _comparable_path(f, getattr(cfg, f))), None)
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, elsewhere and (socket.gethostname(), elsewhere))
    rank, problem = next(((r, p) for r, p in enumerate(problems) if p), (None, None))
    if problem is not None:
        host, field = problem
        raise UserError(f"the nodes name {_OPTION_OF_FIELD.get(field, field)} alike, but rank 0's path "
                        f"{_shown(spelled_absolute[field])} names other files on rank {rank} ({host}): give every node "
                        "the same absolute path")
    return dataclasses.replace(cfg, **spelled_absolute)


def _processes_here() -> int | None:
    """This node's processes, as torchrun counts them (GPUS_PER_NODE)."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(value) if value.isdigit() else None


def _nodes_of_other_sizes(everyone: list) -> str | None:
    """Nodes started with another GPUS_PER_NODE: the first thing to say, since every rank's world then differs
    from what its own line planned (a node refusing GLOBAL_BATCH_SIZE for the other node's processes, the mn audit).
    ``everyone``: each rank's gathered tuple, or its refusal (a dict); each ends with, or holds, its process count."""
    def said(entry) -> tuple[str, int | None]:
        return (entry["host"], entry.get("processes")) if isinstance(entry, dict) else (entry[0], entry[-1])

    host0, per_node0 = said(everyone[0])
    for rank, entry in enumerate(everyone):
        host, per_node = said(entry)
        if per_node != per_node0:
            return (f"the nodes were not given the same launcher line: GPUS_PER_NODE is {per_node0} on rank 0 "
                    f"({host0}) and {per_node} on rank {rank} ({host}): run the same line, with the same environment "
                    "options, on every node")
    return None


def _a_refusal(everyone: list) -> str | None:
    refused = next(((r, e) for r, e in enumerate(everyone) if isinstance(e, dict)), None)
    if refused is None:
        return None
    rank, said = refused
    return f"rank {rank} ({said['host']}) refused its node's launcher line: {said['refused']}"


def _config_difference(mine: dict, theirs: dict) -> str:
    """The config.json keys two nodes' models differ in, with each node's value: "num_hidden_layers 4 and 1"."""
    keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
    shown = [f"{k} {_shown(mine.get(k))} and {_shown(theirs.get(k))}" for k in keys[:3]]
    return ", ".join(shown) + (f" (and {len(keys) - 3} more keys)" if len(keys) > 3 else "")


def _comparable(cfg) -> dict:
    settings = {k: v for k, v in cfg.to_dict().items() if k not in PER_NODE}
    for field in PATHS:
        settings[field] = _comparable_path(field, getattr(cfg, field))
    settings["hf_config"] = json.loads(json.dumps(cfg.hf_config, sort_keys=True, default=str))  # named where it differs
    return settings


def _comparable_path(field: str, value):
    """A path field (a path, a list of them, or None) by the files it names; the run's folder, which a rank may not
    see made yet, by where it would be."""
    if isinstance(value, list):
        return [_comparable_path(field, v) for v in value]
    if not isinstance(value, str):
        return value
    return os.path.realpath(value) if field == "output_basepath" else _resolved(value)


def _absolute(field: str, value):
    """A path field with its paths made absolute: those that exist, and the run's folder (a value that names
    nothing here, such as a tokenizer's hub name, as it is)."""
    if isinstance(value, list):
        return [_absolute(field, v) for v in value]
    return os.path.abspath(value) if isinstance(value, str) and (_exists(value) or field == "output_basepath") else value


def _exists(path: str) -> bool:
    return os.path.exists(path) or os.path.exists(path + ".bin")  # a data prefix by its .bin file


def _resolved(path: str) -> str:
    """The file a path names, through links; a data prefix by its .bin file where it has one; a value that names
    nothing here as it is."""
    if not _exists(path):
        return path
    data = path + ".bin"
    return os.path.realpath(data)[:-4] if os.path.exists(data) else os.path.realpath(path)


def _shown(value) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value, default=str)


def refuse_with_the_others(message: str, timeout_minutes: float) -> str | None:
    """A rank that refuses its node's line before the job forms (another GPUS_PER_NODE, a path missing there) joins
    the job anyway for ``agree_on_launch``'s one collective, saying why, so that every rank refuses in that line
    instead of waiting for it until MP_DIST_TIMEOUT_MIN. Called in a rank of a job of several only
    (``cli.train._one_of_several_ranks``: elsewhere joining would make this process a world of one). Whatever fails
    here leaves the refusal as it was. Returns the line to say instead of ``message``: nodes of other sizes."""
    try:
        init_process_group(timeout_minutes)
        if dist.get_world_size() > 1:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, {"refused": message, "host": socket.gethostname(),
                                              "processes": _processes_here()})
            return _nodes_of_other_sizes(everyone)
    except Exception:  # noqa: BLE001 - the others then time out as before; this rank's own line stands
        pass
    return None

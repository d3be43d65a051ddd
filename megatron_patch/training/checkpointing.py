"""Training checkpoints: torch_dist with model, optimizer, scheduler, RNG and data position.

Layout under ``OUTPUT_BASEPATH/checkpoint``::

    latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint
    iter_0000010/                       torch_dist (model + optimizer shards, megatron's common state with the
                                        scheduler, iteration and consumed samples), rng/rank_*.pt,
                                        train_state.json

A save writes into a partial folder (``checkpoint_files.layout``), renamed to ``iter_XXXXXXX`` only after
every rank has finished and everything in it is fsynced, and only then is the latest marker replaced.
A run killed mid-save leaves the previous checkpoint as the latest. A save that fails (a full disk,
any OSError) stops the run with one line and removes its partial folder; the previous checkpoint is
untouched. At resume, the newest complete checkpoint is taken (``run_state.iteration_problem`` says what
makes one incomplete), with a warning for each newer one skipped.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import re
import resource
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_patch.checkpoint.foreign import find_checkpoint
from megatron_patch.checkpoint.loading import load_checkpoint_into_model
from megatron_patch.checkpoint.outputs import carried_files, copy_carried
from megatron_patch.checkpoint.sidecar import Sidecar
from megatron_patch.checkpoint_files.layout import (
    RELEASE,
    fsync_file,
    iteration_dir,
    latest_complete_iteration,
    model_sharded_state,
    partial_dir,
    publish,
    remove_stale_partials,
    write_tracker,
)
from megatron_patch.checkpoint_files.manifest import (
    IntegrityError,
    digests,
    naming_the_switch,
    unlisted_files,
    write_manifest,
)
from megatron_patch.errors import UserError
from megatron_patch.input_files import checked_input, folder_bytes, is_tokenizer_file, read_input
from megatron_patch.lora.state import adapter_sharded_state, base_record
from megatron_patch.tokenizer import class_picking_config
from megatron_patch.runtime import watchdog
from megatron_patch.runtime.launch import LAUNCHER_WARNED
from megatron_patch.training.lora_run import cfg_base
from megatron_patch.training.run_folder import FINAL_DIR, export_command, final_export_tool
from megatron_patch.training.run_state import (NO_VERIFY, TRAIN_STATE, iteration_problem, latest_iteration,
                                              read_train_state, training_data, training_rules)

# megatron-core (2.3 s to import after torch on 2 cores) is imported inside the functions that use it: the
# processes that import this module without building a megatron-core model (align's main process) do not pay for
# it. The launcher's resume checks, before any rank starts, need neither torch nor this module
# (``training.run_state``).

# megatron-core 0.16's default distributed-optimizer format is rejected by its own dist_checkpointing;
# fully_reshardable also reloads at another TP/PP/DP (see docs/cpu-runtime.md).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def load_starting_weights(cfg, chunks: list, folder) -> None:
    """A checkpoint (PRETRAIN_CHECKPOINT_PATH, a LoRA run's base) into this rank's model chunks, its files checked
    against its manifest unless MP_NO_VERIFY says otherwise."""

    try:
        load_checkpoint_into_model(chunks, folder, cfg.layout, hf_config=cfg.hf_config, verify=not cfg.no_verify)
    except IntegrityError as exc:
        raise naming_the_switch(exc, NO_VERIFY) from None


def resume_iteration(root: str | Path, log=print, verify: bool | str = True) -> int | None:
    """``latest_iteration``, decided by rank 0 and the same on every rank (warnings logged once)."""
    holder: list = [None]
    if dist.get_rank() == 0:
        try:
            holder = [latest_iteration(root, verify)]
        except UserError as exc:
            holder = [exc]
    dist.broadcast_object_list(holder, src=0)
    if isinstance(holder[0], UserError):
        raise UserError(str(holder[0]))
    iteration, notes = holder[0]
    if dist.get_rank() == 0:
        said = _launcher_warned()
        for note in notes:
            if note not in said:
                log(f"warning: {note}")
    return iteration


def _launcher_warned() -> list:
    try:
        said = json.loads(os.environ.get(LAUNCHER_WARNED) or "[]")
    except ValueError:
        return []
    return said if isinstance(said, list) else []


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state, path: Path) -> None:
    """The random state a rank saved (``_rng_state``), from ``path``; one line where it holds none this process can
    take (it was an internal error deep in torch: "Expected a CPUGeneratorImplState of size 5056")."""
    from megatron.core import tensor_parallel

    try:
        random.setstate(state["random"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError) as exc:
        said = " ".join(str(exc).split())[:160]
        raise UserError(f"{path} holds no random state a run can resume with ({type(exc).__name__}: {said}): the "
                        "checkpoint is damaged; move its iteration folder away to resume from the one before") from None


def _model_keys(models: list) -> list[str]:
    """Megatron-LM's names for the model part of a checkpoint: 'model', or 'model0', 'model1'... per chunk."""
    return ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]


def _torch_adams(optimizer):
    """The torch Adam optimizers inside megatron-core's wrappers (the offload's keeps a state of its own)."""
    import torch

    for part in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(part, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            yield inner


def _step_zero(group: dict, param):
    import torch

    on_device = group.get("fused") or group.get("capturable")
    return torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")


def start_adam_state(optimizer) -> None:
    """Adam's state as its first step makes it (zero moments, step 0), where no step has succeeded yet: an fp16 run
    whose first steps overflowed, saved then. torch makes the state lazily, so the save wrote a checkpoint without it,
    which the resume refused as "not written for this model", and the distributed optimizer's save failed on the
    missing step, an internal error (the equiv2 audit). The step that follows computes what it would have."""
    import torch

    for inner in _torch_adams(optimizer):
        if any(inner.state.values()):
            continue  # it has stepped: its state is whole
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                state["step"] = _step_zero(group, p)
                for name in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ()):
                    state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _steps_of_zero_restored(saved_optimizer: dict) -> None:
    """megatron-core saves no common Adam step of 0 (``if step:``), so a checkpoint of ``start_adam_state``'s state
    held moments without a step, which torch's Adam refuses at load (a KeyError): step 0 put back, as it was."""
    import torch

    for table in _tables_in(saved_optimizer):
        per_param = table.get("state")
        if not isinstance(per_param, dict) or "common_step" in per_param:
            continue
        for entry in per_param.values():
            if isinstance(entry, dict) and "exp_avg" in entry and "step" not in entry:
                entry["step"] = torch.tensor(0.0)


def _sharded_state(models: list, optimizer, is_loading: bool) -> dict:
    """Each chunk's sharded state dict under its Megatron-LM key; the optimizer's built from all of them.

    The sharded tensors carry global names (layer numbers with the chunk's offset), so the stored
    shards do not depend on how the layers were split into stages and chunks.
    """
    state = {key: _model_state(m.module) for key, m in zip(_model_keys(models), models)}
    state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading, metadata=OPTIMIZER_METADATA)
    return state


def _model_state(chunk) -> dict:
    """A chunk's sharded state: the whole model, or for a LoRA run only what it trains (the adapters under
    layout-free keys, any modules_to_save weights): the frozen base stays in the checkpoint it came from."""
    lora = getattr(chunk, "lora", None)
    if lora is None:
        return model_sharded_state(chunk)

    return adapter_sharded_state(chunk, lora)


def _lora_record(cfg) -> dict | None:
    """The sidecar's ``lora`` section of a LoRA run's checkpoints: the spec and the base they need."""
    if cfg.lora is None:
        return None
    return {"spec": cfg.lora, "base": base_record(cfg_base(cfg))}


def _param_gather_hooks(cfg, models: list, enable: bool) -> None:
    if cfg.overlap_param_gather:
        for m in models:
            # disabling finishes the pending parameter all-gather first
            m.enable_forward_pre_hook() if enable else m.disable_forward_pre_hook()


# Where each file a run's checkpoints carry comes from: (folder, names) pairs.
SideFiles = list[tuple[Path, list[str]]]


def side_files_source(cfg, resume_iteration: int | None) -> SideFiles:
    """Where the tokenizer, chat template and generation files that each of the run's checkpoints carries come
    from (so that 'mpatch convert mcore2hf' of any iteration, not only of final/, is a whole HF folder): the
    iteration it resumes, which carries them already (the folder the run started from may be gone by now). Else
    the tokenizer's files come from the MP_TOKENIZER folder the run reads (a chat template given there is the one
    its SFT records were rendered with, and the one the export must carry), the model's (generation config,
    carried HF tensors) from PRETRAIN_CHECKPOINT_PATH; each falls back on the other folder's. Empty when none
    holds any."""
    if resume_iteration is not None:
        resumed = iteration_dir(cfg.checkpoint_dir, resume_iteration)
        if carried_files(resumed):
            return [(resumed, carried_files(resumed))]
    model = _pretrain_side_files_folder(cfg)
    tokenizer = Path(cfg.tokenizer) if cfg.tokenizer and Path(cfg.tokenizer).is_dir() else None

    def group(of_tokenizer: bool, *folders) -> tuple[Path | None, list[str]]:
        for folder in folders:
            names = [n for n in carried_files(folder) if is_tokenizer_file(n) == of_tokenizer] if folder else []
            if names:
                return folder, names
        return None, []

    plan: SideFiles = []
    for folder, names in (group(True, tokenizer, model), group(False, model, tokenizer)):
        same = next((entry for entry in plan if entry[0].resolve() == folder.resolve()), None) if names else None
        if same is not None:
            same[1].extend(names)
        elif names:
            plan.append((folder, names))
    # what each save copies, checked now: a FIFO or a link out of the folder refused before the first iteration,
    # not at the first save
    for folder, names in plan:
        for name in names:
            checked_input(folder / name, inside=folder, how="has a side file", limit=None)
    return plan


def _pretrain_side_files_folder(cfg) -> Path | None:
    if not cfg.pretrain_checkpoint:
        return None
    found = find_checkpoint(cfg.pretrain_checkpoint)
    return found.sidecar_dir or found.root


def side_files_folder(side_files: SideFiles, name: str) -> Path | None:
    """The folder ``side_files`` takes ``name`` from (a tokenizer file: any of the tokenizer's)."""
    wanted = is_tokenizer_file if is_tokenizer_file(name) else (lambda n: n == name)
    return next((folder for folder, names in side_files if any(map(wanted, names))), None)


def carried_tokenizer_notes(side_files: SideFiles, cfg) -> list[str]:
    """What a launch says of the tokenizer its checkpoints carry where it is not simply PRETRAIN_CHECKPOINT_PATH's."""
    if replaced := replaced_tokenizer_files(side_files, cfg):
        return [f"checkpoints carry MP_TOKENIZER's tokenizer files ({cfg.tokenizer}), which the run reads, not "
                f"PRETRAIN_CHECKPOINT_PATH's: {', '.join(replaced)} differ"]
    carried = side_files_folder(side_files, "tokenizer.json")
    if cfg.tokenizer and Path(cfg.tokenizer).is_file() and carried is not None:
        whose = "PRETRAIN_CHECKPOINT_PATH's" if carried == _pretrain_side_files_folder(cfg) else "the"
        return [f"note: MP_TOKENIZER {cfg.tokenizer} is a tiktoken file, which the run reads and its checkpoints do "
                f"not carry: they carry {whose} tokenizer files ({carried}), which the export and 'mpatch eval' read; "
                "they must encode as the file does"]
    return []


def replaced_tokenizer_files(side_files: SideFiles, cfg) -> list[str]:
    """The tokenizer files of PRETRAIN_CHECKPOINT_PATH that ``side_files`` replaces by MP_TOKENIZER's where their
    bytes differ (or one folder lacks them): said at launch, as the export carries the ones the run read."""
    model, tokenizer = _pretrain_side_files_folder(cfg), side_files_folder(side_files, "tokenizer.json")
    if model is None or tokenizer is None or model.resolve() == tokenizer.resolve():
        return []
    names = {n for n in carried_files(model) + carried_files(tokenizer) if is_tokenizer_file(n)}
    return sorted(n for n in names if not _same_bytes(model, tokenizer, n))


def _same_bytes(folder: Path, other: Path, name: str) -> bool:
    if not (os.path.lexists(folder / name) and os.path.lexists(other / name)):
        return False
    return read_input(folder / name, inside=folder, limit=None) == read_input(other / name, inside=other, limit=None)


def carry_side_files(side_files: SideFiles | None, folder: Path, cfg) -> dict:
    """The files copied, and the record's note of the config that picks their tokenizer's class (Sidecar's
    ``tokenizer_model_config``: a tokenizer folder of its own keeps being read by its files alone)."""
    carried = sorted(n for source, names in side_files or [] for n in copy_carried(source, folder, names))
    tokenizer = side_files_folder(side_files or [], "tokenizer.json")
    picking = class_picking_config(tokenizer) if tokenizer is not None else None

    def picks(config: dict) -> tuple:
        return config.get("model_type"), config.get("tokenizer_class")

    same = picking is None or (picking and picks(picking) == picks(cfg.hf_config))
    return {"carried_files": carried, "tokenizer_model_config": None if same else picking}


def save(cfg, iteration: int, models: list, optimizer, scheduler, side_files: SideFiles | None = None) -> Path:
    """``models``: this rank's DDP-wrapped model chunks (one without a virtual pipeline); ``side_files``: where the
    tokenizer and generation files the checkpoint carries come from (``side_files_source``)."""
    from megatron.core import dist_checkpointing

    root = cfg.checkpoint_dir
    final = iteration_dir(root, iteration)
    rank = dist.get_rank()
    watchdog.set_phase(f"saving {final.name}")
    tmp = _shared_partial_dir(final)
    start = time.time()
    with _stop_on_write_error(final, tmp, rank):
        _param_gather_hooks(cfg, models, enable=False)
        start_adam_state(optimizer)
        state = _sharded_state(models, optimizer, is_loading=False)
        state.update(scheduler=scheduler.state_dict(), iteration=iteration,
                     consumed_samples=iteration * cfg.global_batch_size)
        dist_checkpointing.save(state, str(tmp))
        (tmp / "rng").mkdir(exist_ok=True)
        rng_file = tmp / "rng" / f"rank_{rank:05d}.pt"
        torch.save(_rng_state(), rng_file)
        # Each rank makes its own file durable: on several nodes, rank 0's fsync of the folder
        # would not reach another node's cache. (megatron's writer fsyncs the .distcp files.)
        fsync_file(rng_file)
        _param_gather_hooks(cfg, models, enable=True)
        dist.barrier()
        if rank == 0:
            (tmp / TRAIN_STATE).write_text(json.dumps(
                {"iteration": iteration, "consumed_samples": iteration * cfg.global_batch_size,
                 "world_size": dist.get_world_size(), "family": cfg.family, "hf_config": cfg.hf_config,
                 "config": cfg.to_dict(), "data": training_data(cfg), "rules": training_rules(cfg)}, indent=2,
                default=str) + "\n")
            # The converter's sidecar too, and the tokenizer files, so that 'mpatch convert mcore2hf' of any
            # iteration folder is a whole HF folder.
            from megatron_patch.checkpoint.sidecar import Sidecar

            Sidecar.create("torch_dist", cfg.arch, cfg.layout, cfg.precision.dtype,
                           **carry_side_files(side_files, tmp, cfg),
                           source=f"mpatch train, iteration {iteration}", lora=_lora_record(cfg)).write(tmp)
        _write_shared_manifest(tmp, f"mpatch train, iteration {iteration}")
        if rank == 0:
            publish(tmp, final)  # fsyncs everything in it first
            write_tracker(root, iteration)  # the marker moves last
        dist.barrier()
    if rank == 0:
        print(f"saved checkpoint {final} in {time.time() - start:.1f}s", flush=True)
    return final


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (a full disk, a lost mount): the run stops, the previous one stays."""


_ERRNO = re.compile(r"\[Errno (\d+)\] ([^:'\]\n]+)(?:: '([^']*)')?")
# What torch.save's C++ writer says when the bytes do not reach the disk (it does not pass on the errno).
_STREAM_WRITE = re.compile(r"PytorchStreamWriter failed|inline_container\.cc|file write failed")


def _exceptions(exc: BaseException):
    """``exc``, its causes, and (torch's CheckpointException) each rank's failure, once each."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # {rank: (exception, traceback)}
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


class _WriterLog(logging.Handler):
    """The errors megatron-core's checkpoint writer logs during one save.

    megatron-core 0.19's writer catches the OSError of a failed write, logs it ("Local worker 0
    encountered an error: [Errno 28] ...") and raises a RuntimeError that names only an exception type;
    the log is where the errno survives."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _write_failure_text(exc: BaseException, logged: list[str] = ()) -> str | None:
    """One line for a failure to get the checkpoint's bytes onto the disk, or None for anything else
    (a bug keeps its traceback).

    An OSError is named by its errno; one raised in megatron's writer processes reaches the
    coordinator pickled inside a RuntimeError ("Worker failure: [Errno 28] ..."), its cause lost on
    the way, so its text is read. torch.save's own writer reports a short write without an errno
    ("unexpected pos 704 vs 598"): that is taken as a write failure too.
    """

    # A CheckpointException's own text is its ranks' tracebacks: read its failures instead.
    found = [e for e in _exceptions(exc) if not isinstance(e, CheckpointException)]
    for e in found:
        if isinstance(e, OSError) and e.errno:
            return f"[Errno {e.errno}] {e.strerror}" + (f" ({e.filename})" if e.filename else "")
    for text in [str(e) for e in found] + list(logged):
        m = _ERRNO.search(text)
        if m:
            return f"[Errno {m.group(1)}] {m.group(2).strip()}" + (f" ({m.group(3)})" if m.group(3) else "")
    for text in [str(e) for e in found] + list(logged):
        m = _STREAM_WRITE.search(text)
        if m:
            return "a file could not be written (" + " ".join(text[m.start():].split())[:200] + ")"
    return None


def _write_remedy(what: str, folder: Path) -> str:
    """What to do about a failed write: a file-size limit (EFBIG, or torch.save's errno-less short write under a
    finite `ulimit -f`) is raised, not freed."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if what.startswith(f"[Errno {errno.EFBIG}]") or (
            limit != resource.RLIM_INFINITY and what.startswith("a file could not be written")):
        shown = "" if limit == resource.RLIM_INFINITY else f": {limit} bytes here"
        return (f"a file reached the largest size allowed (`ulimit -f`{shown}, or the filesystem's limit): raise the "
                "limit (or choose another OUTPUT_BASEPATH on a filesystem without it)")
    return f"free space in {folder} (or choose another OUTPUT_BASEPATH)"


@contextlib.contextmanager
def _stop_on_write_error(final: Path, tmp: Path, rank: int, checkpoints: Path | None = None):
    """A save that fails to write (a full disk, any OSError) stops the run with one line; its partial
    folder goes (it may hold most of the free space) and the previous checkpoint is left as it was.
    ``checkpoints``: the run's checkpoint folder, where ``final`` is the export outside it (OUTPUT_BASEPATH/final).

    torch's CheckpointException (a BaseException) is raised on every rank after one broadcast, with the
    details on the coordinator only: the ranks share them here (a collective every rank is ready
    for), so whichever rank the launcher hears from first says what failed. A rank whose own write
    failed elsewhere exits alone; the launcher stops the others (they cannot leave a collective they
    are already in)."""

    writer_log = _WriterLog()
    logger = logging.getLogger("megatron.core.dist_checkpointing")
    logger.addHandler(writer_log)
    try:
        yield
    except (Exception, CheckpointException) as exc:
        what, where = _write_failure_text(exc, writer_log.messages), rank
        if isinstance(exc, CheckpointException):
            failed = sorted(exc.failures)
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, None if what is None else (failed[0] if failed else rank, what))
            where, what = next((x for x in everyone if x), (rank, None))
        if what is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        root = final.parent if checkpoints is None else checkpoints
        try:
            previous = latest_complete_iteration(root, iteration_problem)[0]
        except UserError:
            previous = None
        if previous is None:
            kept, room = "no complete earlier checkpoint exists", ""
        else:
            kept = f"{iteration_dir(root, previous)} is intact and a rerun resumes from it"
            free, size = shutil.disk_usage(root).free, folder_bytes(iteration_dir(root, previous))
            room = (f" (the disk is full: {free / 2**20:.1f} MiB free, a checkpoint takes {size / 2**20:.1f} MiB)"
                    if free < size else "")
        doing, stopped = ((f"saving {final.name}", "training stopped, ") if checkpoints is None else
                          (f"exporting {final}", "the export stopped, "))
        raise CheckpointWriteError(f"{doing} failed on rank {where}: {what}{room}; {stopped}{kept}: "
                                   f"{_write_remedy(what, final.parent)} and rerun") from None
    finally:
        logger.removeHandler(writer_log)


def _take_the_launch_schedule(state, cfg) -> None:
    """The saved param groups' peak and floor learning rates made this launch's, in place: a resumed run follows
    the launch's schedule (run_state's SCHEDULE says so), and megatron-core 0.19 pairs saved groups with the
    current ones by a key holding ``max_lr`` and ``min_lr``, so another LR failed the load as an internal error.
    Every group of this project's optimizers has the run's LR (no per-group overrides), so they all take it."""
    for table in _tables_in(state):
        groups = table.get("param_groups")
        for group in groups if isinstance(groups, list) else ():
            if isinstance(group, dict):
                for key, value in (("max_lr", cfg.lr), ("min_lr", cfg.min_lr)):
                    if key in group:
                        group[key] = value


def _tables_in(state):
    """Every dict in ``state``'s nest of dicts, lists and tuples, ``state`` included (without recursion)."""
    pending = [state]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            yield item
            pending.extend(v for v in item.values() if isinstance(v, (dict, list, tuple)))
        elif isinstance(item, (list, tuple)):
            pending.extend(item)


def _check_adam_steps(state, iteration: int, folder: Path) -> None:
    """Every Adam step the saved optimizer state holds (torch's per parameter, transformer-engine's per group,
    megatron-core's ``common_step``) is a whole number from 0 to the iteration (a step skipped for an fp16 overflow
    counts no step): another value is a damaged file, which would divide by zero, stop the step as an internal error,
    or train with a bias correction that is not the run's."""
    for table in _tables_in(state):
        for key in ("step", "common_step"):
            step = _whole_step(table[key]) if key in table else 0
            if step is None or not 0 <= step <= iteration:
                raise UserError(f"{folder} holds an Adam step of {_shown(table[key])} for iteration {iteration} (a "
                                f"whole number from 0 to {iteration} is due): the checkpoint is damaged")


def _whole_step(value) -> int | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (
            float("inf"), float("-inf")) or value != int(value):
        return None
    return int(value)


def _shown(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}" if value.numel() != 1 else repr(value.item())
    return repr(value)[:80]


# What a param group holds of the run's state rather than its settings: its parameters, transformer-engine's Adam
# step, and what the scheduler sets before each step
_GROUP_STATE = frozenset({"params", "step", "lr", "weight_decay"})


def _load_with_the_launch_hyperparameters(optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, its param groups' settings (Adam's betas and eps, megatron-core's
    multipliers) kept as this launch built them: torch takes a saved group's settings over the optimizer's own, so
    a saved file's betas trained on, the launch's unsaid (the schedule is the launch's too, as run_state says)."""
    launched = [{k: v for k, v in group.items() if k not in _GROUP_STATE} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, settings in zip(optimizer.param_groups, launched):
        group.update(settings)


def load(cfg, iteration: int, models: list, optimizer, scheduler) -> int:
    """Restore everything saved at ``iteration``; returns the consumed samples."""
    # megatron-core is imported here, not at the top: the launcher reads this module's tracker helpers
    # before any rank starts, and should not pay for it.
    from megatron_patch.checkpoint_files.safe_torch import load_torch_file, safe_dist_load

    folder = iteration_dir(cfg.checkpoint_dir, iteration)
    watchdog.set_phase(f"loading {folder.name}")
    state = safe_dist_load(_sharded_state(models, optimizer, is_loading=True), folder)
    for key, m in zip(_model_keys(models), models):
        if getattr(m.module, "lora", None) is None:
            m.module.load_state_dict(state[key])
            continue
        unexpected = m.module.load_state_dict(state[key], strict=False).unexpected_keys
        if unexpected:
            raise UserError(f"{folder} holds {unexpected[0]}, which this LoRA model does not train: resume with the "
                            "MP_LORA_* settings the run was started with")
    _take_the_launch_schedule(state["optimizer"], cfg)
    _check_adam_steps(state["optimizer"], iteration, folder)
    _steps_of_zero_restored(state["optimizer"])
    _load_with_the_launch_hyperparameters(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    saved = read_train_state(folder)
    rng = folder / "rng" / f"rank_{dist.get_rank():05d}.pt"
    if saved.get("world_size") == dist.get_world_size() and rng.is_file():
        _set_rng_state(load_torch_file(rng, inside=folder), rng)
    elif dist.get_rank() == 0:
        print(f"note: {folder} was written by {saved.get('world_size')} processes; random state starts afresh",
              flush=True)
    if state["iteration"] != iteration:
        raise UserError(f"{folder} holds iteration {state['iteration']}, not {iteration}: the checkpoint is damaged")
    return int(state["consumed_samples"])


def _write_shared_manifest(tmp: Path, tool: str) -> None:
    """The folder's manifest, once megatron's saver has returned on every rank and before anything moves: the
    ranks hash a share of the files each (and fsync them), rank 0 writes the whole."""
    dist.barrier()  # every file is written, rank 0's included
    rank, world = dist.get_rank(), dist.get_world_size()
    names = unlisted_files(tmp)  # every file, torch_dist's hidden .metadata too: the manifest covers the folder
    mine = digests(tmp, names[rank::world])
    shares: list = [None] * world
    dist.all_gather_object(shares, mine)
    if rank == 0:
        write_manifest(tmp, tool, files={k: v for share in shares for k, v in share.items()})


def _shared_partial_dir(final: Path, inner: str = "") -> Path:
    """Rank 0 makes a fresh partial folder for ``final`` (and its sub-folder ``inner``) and tells every
    rank its name."""
    holder = [None]
    if dist.get_rank() == 0:
        remove_stale_partials(final)
        tmp = partial_dir(final)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)  # the checkpoint folder, at the first save
        tmp.mkdir()  # a new folder, never one found at the name (a symlink's target)
        if inner:
            (tmp / inner).mkdir()
        holder = [str(tmp)]
    dist.broadcast_object_list(holder, src=0)
    return Path(holder[0])


def export_model(cfg, iteration: int, models: list, dtype: torch.dtype, side_files: SideFiles | None = None) -> Path:
    """The trained weights alone, in the layout 'mpatch convert hf2mcore' writes (``OUTPUT_BASEPATH/final``).

    'mpatch convert mcore2hf --load-dir OUTPUT_BASEPATH/final' turns it into an HF folder, and it can be
    the PRETRAIN_CHECKPOINT_PATH of the next run (e.g. SFT after pretraining), at any TP/PP.
    The files ``side_files`` names (``side_files_source``) are carried along.
    """
    from megatron.core import dist_checkpointing


    final = Path(cfg.output_basepath) / FINAL_DIR
    watchdog.set_phase(f"exporting {final}")
    rank = dist.get_rank()
    tmp = _shared_partial_dir(final, inner=RELEASE)
    with _stop_on_write_error(final, tmp, rank, checkpoints=cfg.checkpoint_dir):
        _param_gather_hooks(cfg, models, enable=False)
        # One state dict, as hf2mcore writes it. What is stored is named by each sharded tensor's global
        # key; the dict keys only need to be distinct, and chunks reuse local module names
        # ("decoder.layers.0..."), hence the chunk prefix.
        if len(models) == 1:
            state = _model_state(models[0].module)
        else:
            state = {f"chunk{i}.{k}": v for i, m in enumerate(models) for k, v in _model_state(m.module).items()}
        dist_checkpointing.save(state, str(tmp / RELEASE))
        _param_gather_hooks(cfg, models, enable=True)
        dist.barrier()
        if rank == 0:
            Sidecar.create("torch_dist", cfg.arch, cfg.layout, dtype, **carry_side_files(side_files, tmp, cfg),
                           source=f"mpatch train, iteration {iteration}, {cfg.output_basepath}",
                           lora=_lora_record(cfg)).write(tmp)
            write_tracker(tmp, RELEASE)
        _write_shared_manifest(tmp, final_export_tool(iteration))
        if rank == 0:
            publish(tmp, final)
            how = " --lora-adapter (or --merge-lora)" if cfg.lora is not None else " ..."
            print(f"exported the trained {'adapters' if cfg.lora is not None else 'model'} to {final} "
                  f"({export_command(final, '--save-dir OUT' + how)})", flush=True)
    dist.barrier()
    return final

"""A run folder's checkpoints as the launcher reads them before it starts any rank, without torch: the newest
complete checkpoint a run resumes from (``latest_iteration``, ``iteration_problem``), whether the run is complete
already (``finished_run``), and whether OUTPUT_BASEPATH is a folder a run may write (``check_output_basepath``).

The ranks read the same through ``training.checkpointing``, which saves and loads. Kept apart from it because that
module imports torch and its distributed checkpointing (``PYTHONPATH=. python scripts/bench_imports.py``: about a
second beyond torch on 2 cores, paid by every launch and every test that launches), which nothing here needs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import types
import typing
from pathlib import Path

from megatron_patch.checkpoint.outputs import replace_refusal
from megatron_patch.checkpoint_files.layout import (
    ConvertedWeights,
    TRACKER_NAME,
    TRAIN_STATE,
    archives_problem,
    iteration_dir,
    latest_complete_iteration,
    outside_problem,
    read_small_json,
    torch_dist_problem,
    zip_problem,
)
from megatron_patch.checkpoint_files.manifest import (LOOK_DIGEST_LIMIT, IntegrityError, manifest_of, naming_the_switch,
                                                     verify_manifest)
from megatron_patch.errors import UserError
from megatron_patch.runtime.machine import experts_grouped_whenever_etp_differs
from megatron_patch.input_files import read_input
from megatron_patch.lora.spec import LoraSpec
from megatron_patch.training import data_files
from megatron_patch.training.data_files import inferred_weights
from megatron_patch.training.launcher_args import get_launcher
from megatron_patch.training.megatron_settings import moe_balancing
from megatron_patch.training.run_config import RunConfig
from megatron_patch.training.run_folder import (FINAL_DIR, RUN_FOLDER_ENTRIES, export_command, exported_iteration,
                                                 require_folder)

# What a launch sets to read its checkpoints (PRETRAIN_CHECKPOINT_PATH, the run's own) without checking their files
# against their manifests: the same switch as the commands' --no-verify, for a checkpoint edited on purpose.
NO_VERIFY = "MP_NO_VERIFY=true"



def iteration_problem(folder: Path, verify: bool | str = True) -> str | None:
    """Why the training checkpoint ``folder`` cannot be resumed from, or None: torch_dist's files
    (checkpoint_files.layout.torch_dist_problem), train_state.json, every rank's random state, and (``verify``)
    every file against the folder's manifest, where it has one, and every archive's CRC-32s
    (``archives_problem``): whatever a load would refuse as damaged is found here, where the previous
    checkpoint can still be taken. ``verify="small"``: the launcher's look, the manifest's sizes and the digests
    of its small files (``LOOK_DIGEST_LIMIT``), no CRC-32s. ``verify="archives"`` (the ranks under
    MP_NO_VERIFY=true): the CRC-32s without the manifest, which an edit on purpose no longer matches; a record
    failing its CRC is refused by the load whatever the switch says, so it is skipped here as without it."""
    why = torch_dist_problem(folder)
    if why:
        return why
    manifest = manifest_of(folder)
    if verify in (True, "small") and manifest is not None:
        try:
            verify_manifest(manifest, LOOK_DIGEST_LIMIT if verify == "small" else None)
        except IntegrityError as exc:
            return str(naming_the_switch(exc, NO_VERIFY))
        except UserError as exc:
            return str(exc)
    if verify in (True, "archives"):  # a manifest rewritten after the damage, or none, left them to the load
        why = archives_problem(folder)
        if why:
            return why
    try:
        state = read_train_state(folder)
        iteration, world = state["iteration"], state["world_size"]
    except FileNotFoundError:
        return f"{TRAIN_STATE} is missing"
    except UserError as exc:
        return str(exc).replace(str(folder / TRAIN_STATE), TRAIN_STATE, 1)
    if iteration_dir(folder.parent, iteration).name != folder.name:
        return f"{TRAIN_STATE} says iteration {iteration}"
    for rank in range(world):
        name = f"rng/rank_{rank:05d}.pt"
        if (outside := outside_problem(folder, name)) is not None:  # read at resume as the iteration's own
            return outside
        why = zip_problem(folder / name)
        if why:
            return f"rng/{why}"
    return None


# The most processes a run can have: a bound before anything loops over train_state.json's world size.
MAX_WORLD_SIZE = 2**20


def read_train_state(folder: Path) -> dict:
    """An iteration folder's train_state.json, read bounded and held to its types: a whole ``iteration``, a
    ``world_size`` of 1 to ``MAX_WORLD_SIZE`` processes (one RNG file each is checked), a whole ``consumed_samples``
    where present. FileNotFoundError when it is missing, one-line UserError for anything else."""
    path = folder / TRAIN_STATE
    if not os.path.lexists(path):
        raise FileNotFoundError(path)
    state = read_small_json(path)
    for name in ("iteration", "world_size", "consumed_samples"):
        if name == "consumed_samples" and name not in state:  # optional: other tools' checkpoints may lack it
            continue
        value = state.get(name)
        whole = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        if not whole or (name == "world_size" and not 1 <= value <= MAX_WORLD_SIZE):
            raise UserError(f"{path} is unreadable ('{name}' is {json.dumps(value)[:40]}, not a number of "
                            f"{'processes' if name == 'world_size' else 'iterations or samples'})")
    config = state.get("config")
    wrong = _saved_config_problem(config) if isinstance(config, dict) else None
    if wrong or not isinstance(config, (dict, type(None))):
        raise UserError(f"{path} is unreadable (its run's config {wrong or 'is not a JSON object'}, not as a run "
                        "saves it)")
    return state


def _saved_config_problem(config: dict) -> str | None:
    """The first field of a saved run's config that a resume reads (``RESUME_READS``) whose value is not of its
    RunConfig (or LoraSpec) type as JSON writes it, as "'tp' is \"2\""; None where they all are. A digest is no
    signature: a config edited beside a rewritten manifest reached the resume's arithmetic (an internal error)."""
    run, adapters = _saved_config_types()
    for name in RESUME_READS:
        value = config.get(name)
        if name not in config or (name == "lora" and value is None):
            continue
        if name == "lora":
            if not isinstance(value, dict):
                return f"'lora' is {json.dumps(value)[:40]}"
            inner = next((k for k, v in value.items() if k in adapters and not _as_json_of(v, adapters[k])), None)
            if inner is not None:
                return f"'lora' has '{inner}' {json.dumps(value[inner])[:40]}"
        elif not _as_json_of(value, run[name]):
            return f"'{name}' is {json.dumps(value)[:40]}"
    return None


@functools.cache
def _saved_config_types() -> tuple[dict, dict]:
    """RunConfig's and LoraSpec's field types, read once (every iteration folder a resume looks at is checked)."""
    return typing.get_type_hints(RunConfig), typing.get_type_hints(LoraSpec)


# The saved config's fields a resume computes with (resume_notes), beyond comparing them.
RESUME_READS = ("tp", "ep", "etp", "train_iters", "micro_batch_size", "global_batch_size", "sft", "sft_loss", "lora",
                "dsa")


def _as_json_of(value, hint) -> bool:
    """Whether ``value``, read from JSON, is what JSON makes of a value of type ``hint`` (tuples become lists, an
    int may stand for a float); types this does not know are taken."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_as_json_of(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint is dict or origin is dict:
        return isinstance(value, dict)
    if hint in (list, tuple) or origin in (list, tuple):
        item = args[0] if args else None
        return isinstance(value, list) and (item is None or all(_as_json_of(v, item) for v in value))
    return True


def resume_look(no_verify: bool) -> bool | str:
    """How the ranks look at the run's checkpoints at resume: every check, or under MP_NO_VERIFY=true all but the
    manifest's (a record failing its CRC-32 is refused by the load whatever the switch says)."""
    return "archives" if no_verify else True


def latest_iteration(root: str | Path, verify: bool | str = True) -> tuple[int | None, list[str]]:
    """The newest complete checkpoint under ``root`` (None: nothing saved yet) and a warning for each
    newer one skipped. UserError when checkpoints exist and none is complete. ``verify``: as ``iteration_problem``
    takes it (True the ranks, ``"small"`` the launcher's early look, ``"archives"`` the ranks under MP_NO_VERIFY)."""
    try:
        return latest_complete_iteration(root, lambda folder: iteration_problem(folder, verify))
    except ConvertedWeights as exc:  # a garbage tracker's message names 'release' too: not this advice
        raise UserError(f"{exc}; give it as PRETRAIN_CHECKPOINT_PATH and choose another OUTPUT_BASEPATH") from None


def check_iterations_left(cfg, latest: int | None) -> None:
    """A launch of fewer iterations than its run folder's run has trained cannot resume it: it said "resuming from
    iteration 4 of 3", trained nothing, exported nothing and exited 0, at every rerun."""
    if latest is not None and latest > cfg.train_iters:
        raise UserError(f"the run in {cfg.output_basepath} has trained {latest} iterations, more than the "
                        f"{cfg.train_iters} this launch asks for (TRAIN_TOKENS_OR_ITERS): relaunch with at least "
                        f"{latest} to resume it, or choose another OUTPUT_BASEPATH to start afresh")


def finished_run(cfg, latest: int | None) -> str | None:
    """What to say, instead of training, when OUTPUT_BASEPATH holds a run that is already complete (nothing left
    to train and, with saving on, its last checkpoint exported); None otherwise. A ``final/`` of an earlier
    iteration (a run extended, then stopped in its export) is not the run's model: the ranks export again."""
    final = Path(cfg.output_basepath) / FINAL_DIR
    if latest is None or latest < cfg.train_iters or (cfg.save and exported_iteration(final) != latest):
        return None
    where = (f"its model is in {final} ({export_command(final)})" if cfg.save
             else f"its checkpoints are in {cfg.checkpoint_dir}")
    return (f"the run in {cfg.output_basepath} is complete (iteration {latest} of {cfg.train_iters}): {where}; "
            "nothing to train (choose another OUTPUT_BASEPATH or more iterations to train further)")


# What a resumed run must share with the run that saved the checkpoint: (RunConfig field, the launch's name for it,
# why). The checkpoint's optimizer state and data position are shaped by them; the model's shape is checked apart.
MUST_MATCH = (
    ("precision", "PR", "the optimizer's state (master weights, loss scale) is kept per precision"),
    ("distributed_optimizer", "DO", "the optimizer's state is saved sharded with it and whole without"),
    ("global_batch_size", "GLOBAL_BATCH_SIZE", "the data's position is counted in its batches"),
    ("seed", "MP_SEED", "the data's order follows it (megatron-core shuffles the samples with it)"),
)
# The learning-rate schedule: this launch's rules, as Megatron-LM's --override-opt_param-scheduler (a run extended
# to more iterations decays over them), and what changed is said.
SCHEDULE = (("lr", "LR"), ("min_lr", "MIN_LR"), ("warmup_iters", "warm-up iterations"),
            ("lr_decay_iters", "decay iterations"), ("weight_decay", "MP_WEIGHT_DECAY"))


def _saved_and_now(cfg, folder: Path) -> tuple[dict, dict | None, dict]:
    """(the train state saved in ``folder``, its run's config or None where it records none, this launch's config
    as it would be saved: through JSON)."""
    try:
        saved = read_train_state(folder)
    except FileNotFoundError:
        return {}, None, {}
    then = saved.get("config")
    return saved, then if isinstance(then, dict) else None, json.loads(json.dumps(cfg.to_dict(), default=str))


def resume_notes(cfg, folder: Path) -> list[str]:
    """Checks a launch against the checkpoint it resumes (``folder``, an iteration folder of its own run): a change
    the checkpoint cannot follow is refused in one line, before any rank starts (a rank would fail on it with a
    traceback); a change of the learning-rate schedule is returned as a note."""
    saved, then, now = _saved_and_now(cfg, folder)
    if then is None:
        return []
    start_afresh = "or start afresh in another OUTPUT_BASEPATH"
    for field, name, why in MUST_MATCH:
        if field in then and then[field] != now[field]:
            raise UserError(f"{folder} was trained with {name}={_shown(then[field])}, and this launch asks "
                            f"{name}={_shown(now[field])}: {why}. Resume with {name}={_shown(then[field])}, "
                            f"{start_afresh}")
    grouped = _experts_apart(cfg, then), _experts_apart(cfg, now)
    if grouped[0] != grouped[1]:
        # the layout that decides it: EP, and on megatron-core 0.19 ETP against TP (a TP change alone can flip it)
        by_etp = experts_grouped_whenever_etp_differs()
        apart = "EP > 1" + (" or ETP other than TP" if by_etp else "")
        together = "EP=1" + (" and ETP equal to TP" if by_etp else "")
        raise UserError(f"{folder} was trained at {_expert_layout(then)}, this launch asks {_expert_layout(now)}: "
                        f"megatron-core keeps the experts' optimizer state apart from the rest's at {apart} "
                        f"({'there and not here' if grouped[0] else 'here and not there'}: its chained optimizer), "
                        f"and the saved state does not load across that. Resume with "
                        f"{apart if grouped[0] else together}, or start from its weights: a new OUTPUT_BASEPATH with "
                        f"PRETRAIN_CHECKPOINT_PATH={cfg.checkpoint_dir}")
    lora = _lora_change(then, now)
    if lora:
        raise UserError(f"{folder} was trained with LoRA {lora[0]}, and this launch asks {lora[1]}: the weights and "
                        f"optimizer state saved there are that run's. Resume with its MP_LORA_* settings, "
                        f"{start_afresh}")
    dsa = _dsa_change(then, now)
    if dsa:
        raise UserError(f"{folder} was trained with {dsa[0]}, and this launch asks {dsa[1]}: which parameters train, "
                        f"and the optimizer state saved for them, follow those. Resume with its MP_DSA_* settings, "
                        f"{start_afresh}")
    # compared as saved: through JSON, where a preset's tuples became lists
    model, building = saved.get("hf_config"), json.loads(json.dumps(cfg.hf_config, default=str))
    if isinstance(model, dict) and model != building:
        changed = sorted(k for k in set(model) | set(building) if model.get(k) != building.get(k))
        shown = ", ".join(f"{k} {_shown(model.get(k))} -> {_shown(building.get(k))}" for k in changed[:3])
        raise UserError(f"{folder} holds another model than this launch builds ({shown}"
                        f"{', ...' if len(changed) > 3 else ''}): resume with the MODEL_SIZE and MP_NUM_LAYERS it "
                        f"was started with, {start_afresh}")
    changed = [f"{name} {_shown(then[field])} -> {_shown(now[field])}" for field, name in SCHEDULE
               if field in then and then[field] != now[field]]
    notes = [f"the learning-rate schedule follows this launch, not the checkpoint's: {', '.join(changed)}"] \
        if changed else []
    if "train_iters" in then and then["train_iters"] != now["train_iters"] and not cfg.sft:
        # megatron-core (as Megatron-LM) builds the pretraining sample order for the run's whole length: another
        # number of epochs shuffles the documents and samples anew, and the data position counts into that new
        # order. SFT's samples come in the same order for any length (epochs repeat in order).
        moved = _order_moved(cfg, then["train_iters"], now["train_iters"])
        if moved:
            notes.append(f"iterations {then['train_iters']} -> {now['train_iters']}: {moved}, and megatron-core "
                         "builds the data's sample order for the run's whole length: the coming iterations are not "
                         "the continuation of the first launch's order (some samples seen again, some not at all)")
    if "micro_batch_size" in then and then["micro_batch_size"] != now["micro_batch_size"]:
        # MP_SFT_LOSS=token: the loss is the mean of each micro-batch's token mean (Megatron-LM's default), and SFT's
        # micro-batches hold uneven numbers of trained tokens, so regrouping them reweights the tokens; with
        # MP_SFT_LOSS=record each record weighs alike however they are grouped (the tdoc audit)
        how = ("reweights the trained tokens (each micro-batch's mean counts alike), so the steps differ from an "
               "uninterrupted run's" if now.get("sft") and now.get("sft_loss") == "token" else
               "adds them in another order, so the losses differ from an uninterrupted run's in their last digits")
        notes.append(f"BATCH_SIZE {then['micro_batch_size']} -> {now['micro_batch_size']}: the same samples in other "
                     f"micro-batches, which {how}")
    return notes


def _order_moved(cfg, iterations_then: int, iterations_now: int) -> str | None:
    """What of the data's sample order another length changes (``data_files.sample_order``), in words; None where
    both lengths read the same order (within one epoch of each prefix, say: the tdoc audit found every extension
    told it might not continue)."""
    lengths = (iterations_then * cfg.global_batch_size, iterations_now * cfg.global_batch_size)
    try:
        weights = [cfg.dataset_weights or inferred_weights(cfg, samples) for samples in lengths]
        then, now = (data_files.sample_order(cfg, samples, w) for samples, w in zip(lengths, weights))
    except (UserError, OSError):  # the data itself is checked, in one line, after these notes
        return "the data may now run to another number of epochs"
    if (weights[0] is None) != (weights[1] is None):  # a list without weights, past its one epoch or back within it
        return "the prefixes listed without weights are now blended " + (
            "by their samples over more than one epoch" if weights[1] else "as one epoch of each")
    for (prefix, epochs_then, apart_then), (_, epochs_now, apart_now) in zip(then, now):
        if epochs_then != epochs_now:
            return f"{prefix} now runs to {epochs_now} epoch{'s' * (epochs_now > 1)} (it ran to {epochs_then})"
        if apart_then != apart_now:
            return (f"the last of the {epochs_now} epochs of {prefix} is now "
                    f"{'shuffled apart from' if apart_now else 'shuffled with'} the others")
    return None


def _experts_apart(cfg, config: dict) -> bool:
    """Whether a run of ``config`` (a saved RunConfig, as JSON) keeps its experts' optimizer state in an optimizer of
    their own: an MoE model at EP > 1, or with ETP other than TP where megatron-core groups those (0.19)."""
    if not cfg.arch.is_moe:
        return False
    tp, etp = config.get("tp", 1), config.get("etp")
    return config.get("ep", 1) > 1 or (etp not in (None, tp) and experts_grouped_whenever_etp_differs())


def _expert_layout(config: dict) -> str:
    tp = config.get("tp", 1)
    etp = config.get("etp")
    return f"TP={tp} EP={config.get('ep', 1)} ETP={tp if etp is None else etp}"


def _lora_change(then: dict, now: dict) -> tuple[str, str] | None:
    """(the saved run's LoRA, this launch's), as the launch names them, where they differ in what the saved
    adapters are (anything but their dropout, which a resumed run may change); None where they agree."""
    if "lora" not in then:
        return None
    # dropout aside (a resumed run may change it), and targets in any order (the same adapters: the lora audit)
    old, new = ({k: (sorted(v) if k == "targets" and isinstance(v, (list, tuple)) else v) for k, v in spec.items()
                 if k != "dropout"} if isinstance(spec, dict) else spec for spec in (then["lora"], now["lora"]))
    if old == new:
        return None
    return _lora_shown(then["lora"]), _lora_shown(now["lora"])


def _dsa_change(then: dict, now: dict) -> tuple[str, str] | None:
    """(the saved run's MP_DSA_* settings, this launch's) where they train other parameters: the indexer-only mode,
    or an indexer loss switched on or off (which trains the indexer or freezes it; the dsa audit: off resumed
    silently, dropping the indexer's optimizer state, on was a rank's refusal blaming the checkpoint). Another
    scale of the same loss is the launch's, as a learning rate is."""
    old, new = then.get("dsa"), now.get("dsa")
    if not isinstance(old, dict) or not isinstance(new, dict):
        return None

    def trains(dsa: dict) -> tuple:
        return bool(dsa.get("indexer_only")), bool(dsa.get("loss_scale"))
    if trains(old) == trains(new):
        return None
    return tuple(f"MP_DSA_INDEXER_ONLY={str(bool(d.get('indexer_only'))).lower()} "
                 f"MP_DSA_INDEXER_LOSS_SCALE={_shown(d.get('loss_scale'))}" for d in (old, new))


def _lora_shown(spec) -> str:
    if not isinstance(spec, dict):
        return "off (MP_LORA_RANK=0: every weight trains)"
    targets = spec.get("targets")
    shown = [f"MP_LORA_RANK={spec.get('rank')}", f"MP_LORA_ALPHA={spec.get('alpha')}",
             f"MP_LORA_TARGETS={','.join(map(str, targets)) if isinstance(targets, list) else targets}"]
    shown_apart = ("rank", "alpha", "targets", "dropout")
    rest = sorted(k for k in spec if k not in shown_apart and spec[k] not in (None, {}, [], False))
    return " ".join(shown) + (f" ({', '.join(f'{k} {spec[k]}' for k in rest)})" if rest else "")


def training_data(cfg) -> dict:
    """What the run trains on, as each checkpoint's train_state.json records it (``data``) for a later launch into
    the same OUTPUT_BASEPATH to compare (``check_same_job``): each DATASET_PATH entry's real path (symlinks and
    the working folder resolved) with the sizes of its files (a JSON file; an idxmap's .bin and .idx), and the
    blend's weights."""
    files = []
    for path in cfg.dataset_path:
        names = [path] if cfg.dataset_type == "raw" else [path + ".bin", path + ".idx"]
        files.append({"path": os.path.realpath(path), "bytes": [_size(name) for name in names]})
        digests = None if cfg.dataset_type == "raw" else data_files.recorded_digests(path)
        if digests:  # mpatch preprocess's: a pair rebuilt with the same sizes is told apart by them
            files[-1]["digests"] = digests
    out = {"files": files, "weights": cfg.dataset_weights}
    if cfg.split:  # MP_SPLIT: another split trains on other documents
        out["split"] = cfg.split
    if cfg.sft and cfg.dataset_type == "raw" and cfg.tokenizer:
        out["tokenizer"] = tokenizer_digest(cfg.tokenizer)  # JSON records become other ids with another tokenizer
    return out


# What of a tokenizer folder decides the ids and loss mask of SFT records: the vocabulary, the end-of-document
# token (tokenizer_config.json, config.json) and the chat template (tokenizer_config.json, or a file of its own).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja",
                   "chat_template.json", "tiktoken.model")


@functools.lru_cache(maxsize=4)
def tokenizer_digest(path: str) -> str | None:
    """sha256 over the files of ``path`` (a tokenizer folder's ``TOKENIZER_FILES``, or a tiktoken file) that
    decide how records tokenize; None where none can be read. Once per process: every checkpoint of a run records
    the tokenizer its records were tokenized with as it started."""
    p = Path(path)
    # a tiktoken file's special tokens and end-of-document token come from the folder's files beside it
    files = [p / name for name in TOKENIZER_FILES] if p.is_dir() else [p, p.parent / "tokenizer_config.json",
                                                                       p.parent / "config.json"]
    digest, found = hashlib.sha256(), False
    for file in files:
        if not os.path.lexists(file):
            continue
        # a FIFO or a link out of the folder is refused, not read
        data = read_input(file, inside=p if p.is_dir() else None if file == p else p.parent)
        digest.update(f"{file.name}:{len(data)}:".encode() + data)
        found = True
    return digest.hexdigest() if found else None


def _size(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _sample_length(config: dict) -> tuple[str, object]:
    """(the launch's name, value) of what one sample holds, from a RunConfig's dict: PAD_LEN for SFT on JSON
    records, else SEQ_LEN (``RunConfig.sample_length``)."""
    if config.get("sft") and config.get("dataset_type") == "raw":
        return "PAD_LEN", config.get("pad_len")
    return "SEQ_LEN", config.get("seq_len")


def check_same_job(cfg, folder: Path) -> list[str]:
    """A launch into an OUTPUT_BASEPATH that holds a run resumes it (docs/coming-from-pai.md), so a launch of
    another job there (SFT after pretraining, other data, another sample length) would go on from that run's
    iteration, optimizer state and place in its data. Refused in one line, before any rank starts, naming what
    changed and what to do instead. Checked against the checkpoint ``folder`` resumed from; a run folder saved
    before its checkpoints recorded their data (``training_data``) is compared on the rest alone. Returns notes:
    the same data found at another path (its files' sizes unchanged) or changed in place."""
    saved, then, now = _saved_and_now(cfg, folder)
    if then is None:
        return []
    changed, notes = [], []
    if "sft" in then and then["sft"] != now["sft"]:
        changed.append(f"SFT {_shown(then['sft'])} -> {_shown(now['sft'])}")
    else:
        (old_name, old), (name, new) = _sample_length(then), _sample_length(now)
        if old is not None and old_name == name and old != new:
            changed.append(f"{name} {old} -> {new}")
        if "sft_packing" in then and then["sft_packing"] != now["sft_packing"]:
            changed.append(f"MP_SFT_PACKING {_shown(then['sft_packing'])} -> {_shown(now['sft_packing'])}")
    started, starting = then.get("pretrain_checkpoint"), now.get("pretrain_checkpoint")
    if "pretrain_checkpoint" in then and starting and not _same_place(started, starting):
        # a resume reads the run's own checkpoint, never this one: another starting model is another job, told
        # (it was dropped without a word; the paisft audit). One that is gone from where the run began (moved) is
        # said, as data found elsewhere is.
        if started is None or os.path.exists(started):
            changed.append(f"PRETRAIN_CHECKPOINT_PATH {started or 'none'} -> {starting}")
        else:
            notes.append(f"PRETRAIN_CHECKPOINT_PATH {starting} is not read: the run resumes its own checkpoint (it "
                         f"started from {started}, no longer there)")
    data = saved.get("data")
    if isinstance(data, dict) and isinstance(data.get("files"), list):
        here = training_data(cfg)
        old_paths = [f.get("path") if isinstance(f, dict) else None for f in data["files"]]
        new_paths = [f["path"] for f in here["files"]]
        old_sizes = [f.get("bytes") if isinstance(f, dict) else None for f in data["files"]]
        new_sizes = [f["bytes"] for f in here["files"]]
        sized = None not in old_sizes and all(None not in sizes for sizes in new_sizes)
        if old_paths != new_paths and not (sized and old_sizes == new_sizes):
            changed.append(f"DATASET_PATH {' '.join(map(str, old_paths))} -> {' '.join(new_paths)}")
        elif old_paths != new_paths:
            notes.append(f"DATASET_PATH {' '.join(new_paths)} is taken as the data the run trained on at "
                         f"{' '.join(map(str, old_paths))} (its files have the same sizes)")
        elif sized and old_sizes != new_sizes:
            notes.append(f"DATASET_PATH's files changed size since {folder.name} was saved: the run goes on over "
                         "them as they are now")
        elif _rebuilt(data["files"], here["files"]):
            notes.append(f"DATASET_PATH's files changed since {folder.name} was saved (rebuilt: the same sizes, other "
                         "digests in their manifests): the run goes on over them as they are now, in a sample order "
                         "built for them")
        if data.get("split") != here.get("split"):
            changed.append(f"MP_SPLIT {data.get('split') or 'unset'} -> {here.get('split') or 'unset'}")
        if data.get("weights") != here["weights"] and (data.get("weights") or here["weights"]):
            changed.append(f"DATASET_PATH's blend weights {data.get('weights')} -> {here['weights']}")
        if data.get("tokenizer") and here.get("tokenizer") and data["tokenizer"] != here["tokenizer"]:
            changed.append(f"MP_TOKENIZER: {cfg.tokenizer} is another tokenizer than the one the run's records were "
                           "tokenized with")
    if changed:
        out = Path(cfg.output_basepath)
        start = out / FINAL_DIR if (out / FINAL_DIR / TRACKER_NAME).is_file() else cfg.checkpoint_dir
        raise UserError(f"OUTPUT_BASEPATH {out} holds another job's run ({'; '.join(changed)}), and a launch into it "
                        f"resumes that run (from {folder.name}, with its optimizer state and its place in its data): "
                        f"give this job a new OUTPUT_BASEPATH, with PRETRAIN_CHECKPOINT_PATH={start} to start from "
                        "that run's weights; or relaunch that run as it was to resume it")
    return notes


def _rebuilt(saved: list, now: list[dict]) -> bool:
    """Whether a prefix both records digests of differs by them (data preprocessed again with the same sizes)."""
    return any(isinstance(old, dict) and old.get("digests") and new.get("digests") and old["digests"] != new["digests"]
               for old, new in zip(saved, now))


def _same_place(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


# A run's rules: what a release decides for a run that its config does not record (a default that a later release
# may change), saved in train_state.json (``training_rules``) and kept, or told, at a resume (``rules_at_resume``).
RULES_VERSION = 1  # raised by a release that changes a rule; the runs saved under an older one are told what changed
# What releases changed before they recorded their rules (2026-12-08) that a run saved earlier trains otherwise when
# resumed here (the upgrade audit): whether it concerns a launch, and in words.
UNRECORDED_CHANGES = (
    (lambda cfg: cfg.sft, "2026-12-05: an SFT record's 'system' field and 'tools' are rendered into its conversation "
                          "(they were left out)"),
    (lambda cfg: len(cfg.dataset_path) > 1 and not cfg.dataset_weights,
     "2026-12-06: prefixes listed without weights, read past one epoch, are blended by their samples (one epoch's "
     "order was read again and again)"),
    (lambda cfg: cfg.moe_aux_loss is None and _balanced_as_pais_script(cfg),
     "2026-12-07: Pai's Mistral and Qwen2 scripts balance experts as Pai's own do (Mixtral 0.01, was 0.001; "
     "Qwen2-MoE per sequence; the Qwen script's A14B none): MP_MOE_AUX_LOSS keeps another coefficient"),
)


def _balanced_as_pais_script(cfg) -> bool:
    """Whether the launch is one of Pai's scripts that give the experts' load balancing themselves."""
    launcher = get_launcher(cfg.launcher)
    return cfg.arch.is_moe and (launcher.moe_aux_loss(cfg.arch.family) is not None
                                or launcher.moe_balancing(cfg.arch.family) is not None)


def training_rules(cfg) -> dict:
    return {"version": RULES_VERSION, "moe_balancing": moe_balancing(cfg)}


def rules_at_resume(cfg, folder: Path) -> tuple[list[str], float | None]:
    """(notes for the launch, the MP_MOE_AUX_LOSS to keep or None) for a resume from ``folder``: a run keeps the
    load-balancing coefficient it trained with where this release's launcher would give another and MP_MOE_AUX_LOSS
    does not say one, and refuses another balancing type; a run saved before rules were recorded is told what
    changed since then that concerns it."""
    saved, then, _ = _saved_and_now(cfg, folder)
    if then is None:
        return [], None
    rules = saved.get("rules")
    if rules is None:
        changed = [words for concerns, words in UNRECORDED_CHANGES if concerns(cfg)]
        return ([f"{folder} was saved by a megatron_patch that recorded no training rules (before 2026-12-08); if the "
                 "run started before one of these changes, it trains otherwise from here: " + "; ".join(changed)]
                if changed else []), None
    before, now = rules.get("moe_balancing") if isinstance(rules, dict) else "?", moe_balancing(cfg)
    if before is not None and not (isinstance(before, dict) and _is_coefficient(before.get("coeff"))
                                   and isinstance(before.get("type"), (str, type(None)))):
        raise UserError(f"{folder / TRAIN_STATE} records its rules as {json.dumps(rules)[:80]}, which no release "
                        "writes: the checkpoint is damaged or edited")
    if before is None or now is None or before == now:
        return [], None
    if before["type"] != now["type"]:  # MP_MOE_AUX_LOSS sets the coefficient, not the type
        raise UserError(f"{folder} was trained with the experts balanced by {before['type'] or 'the family default'}, "
                        f"and this launch balances them by {now['type'] or 'the family default'}: resume with the "
                        "release that started the run, or start afresh in another OUTPUT_BASEPATH")
    if cfg.moe_aux_loss is not None:
        return [], None
    return [f"MP_MOE_AUX_LOSS={before['coeff']}: the load-balancing coefficient this run trained with (this "
            f"launcher's is {now['coeff']}; MP_MOE_AUX_LOSS changes it from here)"], before["coeff"]


def _is_coefficient(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")


def kept_sft_loss(cfg, folder: Path) -> str | None:
    """The SFT loss weighting (MP_SFT_LOSS) the run resumed from ``folder`` trained with, where this launch's
    differs: a run saved before the option existed weighed tokens. The launch keeps it unless MP_SFT_LOSS is given,
    so that a resumed run does not change its loss midway."""
    saved, then, now = _saved_and_now(cfg, folder)
    if not cfg.sft or then is None or not then.get("sft"):
        return None
    before = then.get("sft_loss") or "token"
    return before if before != cfg.sft_loss else None


def _shown(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_output_basepath(out: Path) -> None:
    """The one output rule for a training run (docs/outputs.md), decided by the launcher under the lock:
    OUTPUT_BASEPATH is new or empty, or an earlier run's folder, which this run resumes. A folder holding
    anything a run does not write is refused, and so is a ``final/`` that mpatch did not export (the run's
    export replaces it)."""
    require_folder(out)
    if not os.path.lexists(out):
        return
    for entry in sorted(out.iterdir()):
        name = entry.name
        if name in RUN_FOLDER_ENTRIES and entry.is_dir():
            continue
        if any(name.startswith(f".{ours}.mpatch-") for ours in RUN_FOLDER_ENTRIES):
            continue
        raise UserError(f"OUTPUT_BASEPATH {out} holds {name}, which a training run does not write there: it is "
                        f"neither new nor an earlier run's folder (which a rerun resumes); move {name} away or "
                        "choose a new or empty OUTPUT_BASEPATH")
    final = out / FINAL_DIR
    if final.is_dir() and any(final.iterdir()):
        why = replace_refusal(final)
        if why is not None:
            raise UserError(f"{final} {why}; the run's export would replace it: move it away or choose another "
                            "OUTPUT_BASEPATH")

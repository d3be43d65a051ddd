"""`mpatch train FAMILY ARGS...`: the positional launchers' engine (examples/<family>/run_mcore_<family>.sh).

Validates everything first (``training.validation``), then: MP_DRY_RUN=1 prints the resolved
configuration and the command; otherwise it runs torchrun (in this process, ``runtime.launch``), which
starts this command again once per rank, and each of those trains its rank. ENV=cpu and dsw: one
node (``--standalone``); dlc: this node of WORLD_SIZE nodes (PAI-DLC's variables). A failed job ends
with one line saying why (``runtime.launch.explain_failures``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import json
import os
import shlex
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from megatron_patch.checkpoint_files.layout import WHOLE_NUMBER, iteration_dir
from megatron_patch.cli import (DEBUG_VARIABLE, EXIT_BROKEN_PIPE, internal_error, reader_gone,
                                went_to_a_gone_reader)
from megatron_patch.cli.common import quiet_interrupts_in_finalizers
from megatron_patch.errors import UserError
from megatron_patch.models.shape.model_shape import model_shape
from megatron_patch.outputs.folders import write_file_replacing
from megatron_patch.outputs.full_disk import full_disk_error, unwritten_line
from megatron_patch.outputs.lock import OutputLock, live_ranks, register_rank, release_rank
from megatron_patch.runtime import watchdog
from megatron_patch.runtime.launch import (LAUNCHER_COMPLETE, LAUNCHER_PID, LAUNCHER_REFUSED, LAUNCHER_WARNED,
                                           JobFailed, agent_log_folder, die_with_launcher, die_with_parent,
                                           forked_ranks, helpers_die_with_rank, name_this_process, quiet_cpu_warnings,
                                           refusal_reported, run_torchrun)
from megatron_patch.runtime.machine import Capabilities
from megatron_patch.training.data_files import check_data_settings, check_training_data
from megatron_patch.training.launcher_args import get_launcher, launched_rank, launchers
from megatron_patch.training.launcher_options import dry_run_options, read_option, usage
from megatron_patch.training import fp8_run
from megatron_patch.training.lora_run import check_lora_launch
from megatron_patch.training.machine_checks import (attention_kernel, check_machine, core_attention, launch_environment,
                                                    machine_problems)
from megatron_patch.training.memory_plan import plan_memory
from megatron_patch.training.run_folder import check_run_folder
from megatron_patch.training.run_state import (check_iterations_left, check_output_basepath, check_same_job,
                                               finished_run, kept_sft_loss, latest_iteration, resume_notes,
                                               rules_at_resume)
from megatron_patch.training.validation import check_starting_checkpoint_layout, resolve

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch` and the launcher's checks start without them (the dry run
# imports megatron-core to build the settings it prints).
# So are the modules that bring torch in: training.megatron_settings, training.checkpointing,
# training.loop (the resume checks read training.run_state, which needs neither).

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # `torchrun`, with this interpreter


def rank_entry() -> list[str]:
    """What each rank runs: the checkout's mpatch.py by its path, whose folder Python puts first on sys.path. With
    ``-m megatron_patch`` Python puts the working folder first: started from inside another checkout (an older
    release kept beside the new one), the ranks ran that one's code without a word (the upgrade audit). ``-m`` where
    the package has no mpatch.py beside it (installed apart from it)."""
    script = Path(__file__).resolve().parents[2] / "mpatch.py"
    return [str(script)] if script.is_file() else ["-m", "megatron_patch"]


def launch_command(cfg, argv: list[str], here: bool = True) -> list[str]:
    """The torchrun command line that runs the job (on this node). ``here``: also check what only this node can
    (MASTER_ADDR resolves, node 0's MASTER_PORT is free); a dry run plans the line on any machine."""
    tail = [*rank_entry(), "train", cfg.launcher, *argv]
    restarts = [f"--max-restarts={cfg.max_restarts}"] if cfg.max_restarts else []
    if cfg.env in ("cpu", "dsw"):
        # A rendezvous on a free local port: several jobs can share a machine.
        return [*TORCHRUN, "--standalone", "--nnodes=1", f"--nproc_per_node={cfg.nproc_per_node}", *restarts, *tail]
    return [*TORCHRUN, *_node_arguments(cfg.nproc_per_node, cfg.nnodes, cfg.dist_timeout_min, here), *restarts, *tail]


def _node_arguments(nproc: int, nnodes: int, timeout_min: float, here: bool) -> list[str]:
    """torchrun's arguments that make this node (ENV=dlc: RANK, MASTER_ADDR, MASTER_PORT, checked) one of ``nnodes``
    with ``nproc`` processes."""
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise UserError(f"ENV=dlc reads {var} (with WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT) from the "
                            "environment, and it is not set: set it, or use ENV=dsw on one node")
    node = _int_env("RANK")
    if node >= nnodes:
        raise UserError(f"RANK={node} is this node's rank among WORLD_SIZE={nnodes} nodes: it must be below {nnodes}")
    _check_rendezvous(os.environ["MASTER_ADDR"], _int_env("MASTER_PORT"), node, here)
    # a node that never joins fails the rendezvous within MP_DIST_TIMEOUT_MIN (torchrun's default waits 10 min,
    # then retries), as a rank that goes silent later fails its collective
    return [f"--nproc_per_node={nproc}", f"--nnodes={nnodes}", f"--node_rank={node}",
            f"--master_addr={os.environ['MASTER_ADDR']}", f"--master_port={os.environ['MASTER_PORT']}",
            f"--rdzv_conf=timeout={max(1, round(timeout_min * 60))}"]


def _check_rendezvous(address: str, port: int, node: int, here: bool) -> None:
    """MASTER_ADDR and MASTER_PORT as torchrun's rendezvous needs them: a port it can use, an address this node
    resolves, and on node 0 (which serves the rendezvous) a port nothing else listens on. torchrun itself reports
    these as tracebacks, or waits (an unresolvable address, port 0)."""
    if not 1 <= port <= 65535:
        raise UserError(f"ENV=dlc: MASTER_PORT must be a port from 1 to 65535, got {port}")
    if not address.strip():
        raise UserError("ENV=dlc: MASTER_ADDR is empty: set it to node 0's address")
    if not here:
        return
    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UserError(f"ENV=dlc: MASTER_ADDR {address} does not resolve on this node ({exc}): set it to node 0's "
                        "address") from None
    if node != 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed run's TIME_WAIT does not count
        try:
            probe.bind(("", port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(f"ENV=dlc: MASTER_PORT {port} is in use on this node (node 0 serves the rendezvous "
                                "there): choose another port, the same on every node") from None
            raise UserError(f"ENV=dlc: node 0 serves the rendezvous on MASTER_PORT {port} and cannot listen there "
                            f"([Errno {exc.errno}] {exc.strerror}): choose another port (above 1023 without "
                            "privileges), the same on every node") from None


def _int_env(name: str) -> int:
    raw = os.environ[name]
    if not WHOLE_NUMBER.fullmatch(raw):
        raise UserError(f"ENV=dlc: {name} must be a whole number, got '{raw}'")
    return int(raw)


def _jsonable(value):
    if hasattr(value, "name") and hasattr(value, "value"):  # enums (AttnBackend)
        return value.name
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def dry_run_report(cfg, argv: list[str]) -> dict:
    from megatron_patch.training.megatron_settings import megatron_settings

    caps = Capabilities.detect(import_torchao=cfg.precision.fp8)
    arch = cfg.arch
    plan = plan_memory(cfg, caps=caps)
    shape = model_shape(arch)
    problems = machine_problems(cfg, caps) + ([plan.problem()] if plan.problem() else [])
    compiled = _compile_report(cfg, caps) if cfg.compile_layers else None
    if compiled is not None and "refused" in compiled:
        problems.append(compiled["refused"])
    try:
        command = launch_command(cfg, argv, here=False)
    except UserError as exc:
        command = [f"<{exc}>"]
    launcher = get_launcher(cfg.launcher)
    return {
        "launcher": launcher.script,
        "family": cfg.family,
        "arguments": dict(zip(launcher.arg_names(launcher.layout_of(argv)), argv)),
        "resolved": cfg.to_dict(),
        "options": dry_run_options(cfg, os.environ),
        "model": {"hidden_size": arch.hidden_size, "num_layers": arch.num_layers, "num_heads": arch.num_heads,
                  "num_kv_heads": arch.num_kv_heads, "ffn_hidden_size": arch.ffn_hidden_size,
                  "num_experts": arch.num_experts, "padded_vocab_size": arch.padded_vocab_size(),
                  "params_total": shape.params(), "params_active": shape.params(active=True),
                  "train_flops_per_token": shape.flops_per_token(cfg.sample_length)},
        "megatron_core": _jsonable(megatron_settings(cfg)),
        "attention_kernel": attention_kernel(cfg, caps),
        "fp8": fp8_run.summary(cfg, caps),
        "compile": compiled,
        "machine_problems": problems,
        "memory_plan": plan.to_dict(),
        "memory_plan_lines": plan.lines(),
        "environment": launch_environment(cfg, caps),
        "command": command,
        "processes": cfg.world_size,
        # What the model trains on: the first sample with its loss mask.
        "sft_sample": _sft_sample(cfg) if cfg.sft else None,
    }


def _compile_report(cfg, caps) -> dict:
    """MP_COMPILE's dry-run entry: what is compiled of each kind of layer of the run's family, whole or apart and
    why (its tiny model: the same layer code), built with the run's precision, float8 and attention; or why that
    could not be found out here, or the one line that refuses the family."""
    from megatron_patch.models.blocks.compiled_layers import family_compile_report  # torch: MP_COMPILE only

    impl = fp8_run.implementation(cfg, caps) if cfg.precision.fp8 else None
    fp8 = (fp8_run.recipe(cfg, impl), cfg.fp8_filter) if impl == fp8_run.TORCHAO else None
    try:
        report = family_compile_report(cfg.family, "bfloat16" if cfg.precision.fp8 else cfg.precision.dtype_name,
                                       fp8, core_attention(cfg, caps) or "sdpa")
        return {**report, "unlike_the_run": _compile_caveats(cfg, fp8 is not None)}
    except UserError as exc:
        return {"refused": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the dry run reports what it could not measure and goes on
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}


def _compile_caveats(cfg, float8: bool) -> list[str]:
    """What of the run the tiny model (TP=1, no recompute) does not show: where the run's layers break apart
    (measured on CPU: the fp8 audit, tiny Llama)."""
    caveats = []
    row_float8 = float8 and (cfg.fp8_filter in ("auto", "all") or {"proj", "fc2"} & set(cfg.fp8_filter))
    # torchao's float8 column-parallel linears gather the sequence themselves, synchronously (models/blocks/float8.py)
    column_float8 = float8 and (cfg.fp8_filter == "all" or cfg.fp8_filter != "auto" and {"qkv", "fc1"} <= set(
        cfg.fp8_filter))
    if cfg.tp > 1 and not cfg.sequence_parallel:
        caveats.append(f"at TP={cfg.tp} without SP megatron-core's tensor-parallel linears break a layer's graph (the "
                       "column-parallel linears' asynchronous all-reduce" + (
                           ", and torchao's float8 GEMM of the row-parallel ones, which then run eagerly"
                           if row_float8 else "") + "), so whole layers compile apart there")
    elif cfg.tp > 1 and not column_float8:  # the cmp audit: linear_qkv and linear_fc1 eager, the MLP apart
        caveats.append(f"at TP={cfg.tp} with SP megatron-core's column-parallel linears (those not in float8) break a "
                       "layer's graph (their backward's asynchronous all-gather, and their warning where "
                       "CUDA_DEVICE_MAX_CONNECTIONS is not 1), so whole layers compile apart there")
    if cfg.activation_checkpointing == "sel":
        caveats.append("AC=sel's recompute of core attention breaks the graph (torch.get_rng_state), so whole layers "
                       "compile apart there")
    if cfg.sft_packing:  # the cmp audit: first break at rope_utils' _local_scalar_dense
        caveats.append("MP_SFT_PACKING's packed sequences break the graph (RoPE and attention per document read each "
                       "document's length), so whole layers compile apart there")
    return caveats


def _sft_sample(cfg) -> dict:
    """The first SFT sample as the model sees it, or why it cannot be rendered (a dry run lists what a run would
    refuse, as it lists the machine's problems, and goes on)."""
    from megatron_patch.training.sft_data import preview  # torch: only an SFT dry run needs it

    try:
        return preview(cfg)
    except UserError as exc:
        return {"error": str(exc)}


def print_dry_run(report: dict) -> None:
    cfg = report["resolved"]
    print(f"dry run of {report['launcher']} ({report['family']}; MP_DRY_RUN=1): nothing is started")
    print("arguments:")
    for i, (k, v) in enumerate(report["arguments"].items(), 1):
        print(f"  {i:2d} {k:<25} {v}")
    print("resolved:")
    print(f"  layout      TP={cfg['tp']} PP={cfg['pp']} CP={cfg['cp']} EP={cfg['ep']} ETP={cfg['etp'] or cfg['tp']} "
          + (f"VP={cfg['virtual_pipeline']} " if cfg['virtual_pipeline'] else "")
          + f"DP={cfg['world_size'] // (cfg['tp'] * cfg['pp'] * cfg['cp'])}; {cfg['world_size']} processes "
          f"({cfg['nproc_per_node']} per node x {cfg['nnodes']})")
    print(f"  schedule    {cfg['train_iters']} iterations, {cfg['warmup_iters']} warm-up, cosine {cfg['lr']} -> "
          f"{cfg['min_lr']} by iteration {cfg['lr_decay_iters']}; weight decay {cfg['weight_decay']}; "
          f"{report['megatron_core']['num_microbatches']} micro-batches/step")
    print(f"  model       {json.dumps(report['model'])}")
    print(f"  attention   {report['attention_kernel']}")
    for line in (report["fp8"] or {}).get("lines", []):
        print(f"  fp8         {line}")
    compiled = report["compile"]
    if compiled is not None and "lines" in compiled:
        print(f"  compile     per kind of layer, as the tiny {report['family']} model's first step decides it (a run "
              "decides on its own layers, at its first step):" + "".join(f"\n    {line}" for line in compiled["lines"])
              + "".join(f"\n    unlike this run's layers: {line}" for line in compiled.get("unlike_the_run", [])))
    elif compiled is not None:
        print(f"  compile     each decoder layer, whole or apart; what compiles could not be found out here: "
              f"{compiled.get('refused') or compiled['error']}")
    for note in cfg["notes"]:
        print(f"  note        {note}")
    print("environment options (* set here):")
    for name, option in report["options"].items():
        print(f"  {'*' if option['set'] else ' '} {name:<33} {option['value']}")
    print("megatron-core settings:")
    for section in ("transformer_config", "ddp", "optimizer", "scheduler"):
        items = " ".join(f"{k}={v}" for k, v in report["megatron_core"][section].items())
        print(f"  {section:<19}{items}")
    for line in report["memory_plan_lines"]:
        print(line)
    sample = report["sft_sample"]
    if sample is not None and "error" in sample:
        print(f"SFT data: the first sample cannot be rendered, and training would stop there: {sample['error']}")
    elif sample is not None:
        print(f"SFT data: {sample['format']}")
        longer = sample["tokens"] > sample["sample_length"] + 1  # a sample's tokens and the label of its last
        kept = "" if not longer else f"; {sample['kept_loss_tokens']} within the sample" + (
            ": it trains nothing, raise SEQ_LEN/PAD_LEN or shorten the prompt" if not sample["kept_loss_tokens"] else "")
        print(f"  sample      {sample['source']}: {sample['tokens']} tokens (samples are {sample['sample_length']}"
              + ("; training cuts the rest" if longer else "") + f"), the loss on {sample['loss_tokens']} of them"
              + kept + ", between [[ and ]]" + (f" (the first {len(sample['text'])} characters)" if sample["cut"] else "")
              + ":")
        for line in sample["text"].split("\n"):
            print(f"    {line}")
    problems = report["machine_problems"]
    print("machine check: " + ("ok" if not problems else "this machine would refuse: " + "; ".join(problems)))
    env = " ".join(f"{k}={v}" for k, v in report["environment"].items())
    print("command: " + (env + " " if env else "") + " ".join(shlex.quote(c) for c in report["command"]))


def run(args) -> int:
    name, argv = args.launcher, list(args.args)
    if name not in launchers():
        raise UserError(f"no launcher '{name}': choose one of {', '.join(launchers())}")
    if any(a in ("-h", "--help") for a in argv) or not argv:
        print(usage(name))
        return 0 if argv else 2
    dry = read_option("MP_DRY_RUN", os.environ)
    if launched_rank(os.environ) and not dry:
        return _rank(name, argv)
    if dry:
        cfg = resolve(name, argv)
        kept = _kept_weighting(cfg)
        # what the launch will train with, as the note below says (the list said record: the rdoc audit)
        shown = cfg if kept is None else resolve(name, argv, env={**os.environ, "MP_SFT_LOSS": kept})
        report = dry_run_report(shown, argv)
        if dry == "json":
            print(json.dumps(report, indent=2, default=str))
        else:
            print_dry_run(report)
        # The launch's checks of the run folder, its checkpoints and a LoRA run's base, and whether it resumes.
        # Not the machine's (only reported: a dry run plans a GPU job on any machine), nor the data's contents
        # (read at launch; a dry run plans a size before the corpus exists).
        _checked_start(cfg, out=sys.stderr if dry == "json" else sys.stdout, would=True)
        launch_command(cfg, argv, here=False)  # a line the launch refuses is refused here too, exit 2
        return 0
    # torch's C++ warnings print their own stack trace (a TCPStore read of a node that went away: 15 lines before
    # the rank's one line, the mn audit); a rank's errors still print. Read as torch loads: set before anything
    # imports it. The launcher's torch logs at FATAL: its errors are its rendezvous's, which its one line says (a
    # node whose peers never came printed c10d's timed-out connections and a page of C++ frames above it, the dlc
    # audit); its ranks' at ERROR (``_launch``). TORCH_CPP_LOG_LEVEL=WARNING shows them all again.
    ranks_cpp_log = None if "TORCH_CPP_LOG_LEVEL" in os.environ else "ERROR"
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    with contextlib.ExitStack() as held:
        with _other_nodes_told(name, argv):
            cfg = resolve(name, argv)
            check_run_folder(cfg.output_basepath)  # in the launcher and again in each rank: a few lstat calls
            needed = _check_machine(cfg)
            command = launch_command(cfg, argv)
            held.enter_context(_run_lock(cfg))  # another job writing the run folder: told as well (the s63 audit)
            if not _checked_start(cfg, out=sys.stdout, would=False):
                return _compared_with_the_other_nodes(name, argv)
        return _launch(cfg, command, argv, needed, ranks_cpp_log)


@contextlib.contextmanager
def _other_nodes_told(name: str, argv: list[str]):
    """A refusal of this node's line in a job of several nodes (ENV=dlc) is told to the other nodes before it is
    raised: their ranks would wait for this node until MP_DIST_TIMEOUT_MIN, then blame the rendezvous (the mn audit:
    a data path missing on one node). The node says its line at once, then joins the job with ranks that only
    refuse (``_rank``: MP_LAUNCHER_REFUSED), as a rank refusing its line does (node_agreement)."""
    try:
        yield
    except UserError as exc:
        command = _joining_command(name, argv)
        if command is None:
            raise
        print(f"mpatch train: error: {exc}", file=sys.stderr, flush=True)
        print("note: this node joins the job to tell the other nodes why it stops (at most MP_DIST_TIMEOUT_MIN; "
              "Ctrl-C ends it)", flush=True)
        # its ranks only refuse
        _join_the_job(command, {LAUNCHER_REFUSED: str(exc)})
        raise SystemExit(2) from None


def _compared_with_the_other_nodes(name: str, argv: list[str]) -> int:
    """A node that finds the run complete, in a job of several: its line is compared with the other nodes' before
    it says so with exit 0. It exited at once, and a node given a longer run waited for it until MP_DIST_TIMEOUT_MIN,
    then blamed the rendezvous, while this one had said the run was complete (the fail audit). Its ranks only take
    part in the launch's comparison (``_rank``: MP_LAUNCHER_COMPLETE); a difference is the one line every node says."""
    command = _joining_command(name, argv)
    if command is None:
        return 0
    print("note: this node joins the job to compare its line with the other nodes' (at most MP_DIST_TIMEOUT_MIN; "
          "Ctrl-C ends it)", flush=True)
    rc, said = _join_the_job(command, {LAUNCHER_COMPLETE: "1"})
    if rc == 0:
        return 0
    print(f"mpatch train: error: {said}" if said else "mpatch train: error: the job did not form to compare this "
          "node's line with the other nodes' (this node's run is complete)", file=sys.stderr, flush=True)
    return 2 if said else 1


def _join_the_job(command: list[str], env: dict) -> tuple[int, str | None]:
    """torchrun's ``command`` with ``env`` added, in a child of its own: its rendezvous blocks in C++, where Ctrl-C
    reached it only at its timeout (the s63 audit). Its ranks end with it, their parent, and it with this process;
    its output is left out. Returns its exit status and the one line a rank of it refused with (bad input), if any."""
    env = {**{k: v for k, v in os.environ.items() if k != LAUNCHER_PID}, **env}
    with agent_log_folder() as log_dir:
        joining = subprocess.Popen([*TORCHRUN, "--log-dir", log_dir, *command], env=env, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   preexec_fn=functools.partial(die_with_parent, os.getpid(), "its launcher"))
        try:
            joining.wait()
        finally:
            if joining.poll() is None:
                joining.kill()
                joining.wait()
        return joining.returncode, refusal_reported(log_dir)


def _compared_line(cfg) -> int:
    """A rank of a node whose run is complete: it takes part in the launch's comparison of the nodes' lines (the
    training ranks' first collective, ``loop.train``) and ends; a difference is a UserError in every rank."""
    # torch: a rank has it already; the launcher's own checks start without it
    import torch.distributed as dist

    # these import torch too
    from megatron_patch.runtime.distributed import init_process_group
    from megatron_patch.training.node_agreement import agree_on_launch

    init_process_group(cfg.dist_timeout_min)
    agree_on_launch(cfg)
    dist.destroy_process_group()
    return 0


def _joining_command(name: str, argv: list[str]) -> list[str] | None:
    """torchrun's arguments that join this node to the job with the processes its line asks for, or None where this
    is no node of a job of several, or where the rendezvous itself is what is wrong (then nothing can join)."""
    env = os.environ
    try:
        launcher = get_launcher(name)
        given = dict(zip(launcher.arg_names(launcher.layout_of(argv)), argv))
        nodes = int(env.get("WORLD_SIZE", "1")) if env.get("WORLD_SIZE", "1").isdigit() else 1
        if given.get("ENV") != "dlc" or nodes < 2:
            return None
        try:
            timeout = read_option("MP_DIST_TIMEOUT_MIN", env) or 10.0
        except UserError:
            timeout = 10.0
        per_node = next((int(env[k]) for k in ("GPUS_PER_NODE", "KUBERNETES_CONTAINER_RESOURCE_GPU")
                         if env.get(k, "").isdigit() and int(env[k]) > 0), None) or _visible_gpus() or 1
        return [*_node_arguments(per_node, nodes, timeout, here=True), *rank_entry(), "train", name, *argv]
    except (UserError, ValueError):
        return None


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _kept_weighting(cfg) -> str | None:
    """The SFT loss weighting a run in OUTPUT_BASEPATH trained with, where this launch does not say one and would
    resume it (``_checked_start`` says so and keeps it); None otherwise, or where the folder is refused there."""
    if "MP_SFT_LOSS" in os.environ:
        return None
    try:
        latest, _ = latest_iteration(cfg.checkpoint_dir, verify=False if cfg.no_verify else "small")
        return None if latest is None else kept_sft_loss(cfg, iteration_dir(cfg.checkpoint_dir, latest))
    except UserError:
        return None


def _checked_start(cfg, *, out, would: bool) -> bool:
    """The launch's checks of its inputs, in order, each refusing in one line (UserError): the run folder, the
    checkpoint folder (holding checkpoints but no complete one), a LoRA run's base, and (not ``would``, a dry
    run) the training data. Says that a finished run is complete (False: nothing to start) or which iteration it
    resumes from (True: a run to start or resume)."""
    check_run_folder(cfg.output_basepath)
    if would:  # the launch checks it under the run's lock (_run_lock)
        check_output_basepath(run_folder_identity(cfg.output_basepath))
    # Refuse a checkpoint folder that holds checkpoints but no complete one now, not after every rank
    # has started (the ranks decide again for themselves: a restart comes back to them, not here).
    latest, skipped = latest_iteration(cfg.checkpoint_dir, verify=False if cfg.no_verify else "small")
    # a LoRA run's base, and the one its checkpoints name (a dry run plans a LoRA run before its base exists)
    if not (would and cfg.pretrain_checkpoint is None and latest is None):
        check_lora_launch(cfg, None if latest is None else iteration_dir(cfg.checkpoint_dir, latest))
    else:
        try:  # planned; said as the machine check says what this machine would refuse
            check_lora_launch(cfg, None)
        except UserError as exc:
            print(f"launch check: a launch would refuse this line: {exc}", file=out, flush=True)
    # another job (SFT, other data) into a run's folder is refused before a finished run is said to be complete
    same_data = [] if latest is None else check_same_job(cfg, iteration_dir(cfg.checkpoint_dir, latest))
    # and a change it cannot follow (GLOBAL_BATCH_SIZE's fewer iterations read as "complete, iteration 6 of 3")
    changes = [] if latest is None else resume_notes(cfg, iteration_dir(cfg.checkpoint_dir, latest))
    if latest is not None and "MP_SFT_LOSS" not in os.environ:
        kept = kept_sft_loss(cfg, iteration_dir(cfg.checkpoint_dir, latest))
        if kept is not None:
            changes.append(f"MP_SFT_LOSS={kept}: the loss weighting this run trained with (MP_SFT_LOSS={cfg.sft_loss} "
                           "changes it from here)")
            if not would:
                os.environ["MP_SFT_LOSS"] = kept  # the ranks read the settings from the environment
    if latest is not None:
        notes, coefficient = rules_at_resume(cfg, iteration_dir(cfg.checkpoint_dir, latest))
        changes.extend(notes)
        if coefficient is not None and not would:
            os.environ["MP_MOE_AUX_LOSS"] = repr(coefficient)
    check_iterations_left(cfg, latest)
    done = finished_run(cfg, latest)
    if done:
        print(done, file=out, flush=True)
        return False
    for note in skipped:  # said once: the ranks leave out what the launcher said (LAUNCHER_WARNED)
        print(f"warning: {note}", file=out, flush=True)
    if not would:
        os.environ[LAUNCHER_WARNED] = json.dumps(skipped)
    if latest is not None:
        # Pai-Megatron-Patch starts a rerun into the same folder afresh; here it resumes, and says so first.
        verb = "would resume" if would else "resuming"
        print(f"{verb} from iteration {latest} of {cfg.train_iters}: {iteration_dir(cfg.checkpoint_dir, latest)} "
              "(OUTPUT_BASEPATH holds this run's checkpoints; another OUTPUT_BASEPATH starts afresh)", file=out,
              flush=True)
        for note in same_data + changes:
            print(f"note: {note}", file=out, flush=True)
    if latest is None:
        check_starting_checkpoint_layout(cfg)
        if would:  # said as "would resume" is: a dry run into a new folder left it unsaid (the tdoc audit)
            start = cfg.pretrain_checkpoint or "the random initialisation (PRETRAIN_CHECKPOINT_PATH none)"
            print(f"would start afresh from {start}: {cfg.checkpoint_dir} holds no checkpoint of this run", file=out,
                  flush=True)
    if not would:
        data_notes = check_training_data(cfg)  # once, here: the ranks of this launcher do not read it again
    else:
        data_notes = check_data_settings(cfg)  # the dry run reads the index, not every token
    for note in data_notes:
        print(f"note: {note}", file=out, flush=True)
    return True


@contextlib.contextmanager
def _run_lock(cfg):
    """OUTPUT_BASEPATH's lock for the whole run: one launcher per run folder, and none while a rank of an
    earlier run still lives (its launcher gone, the rank not yet: named by PID). On several nodes the first
    node's launcher holds it for the job; every node's ranks mark themselves (``_train_here``)."""
    if cfg.env == "dlc" and os.environ.get("RANK", "0") != "0":
        yield
        return
    out = run_folder_identity(cfg.output_basepath)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"OUTPUT_BASEPATH {out}: cannot create its folder ({exc.strerror or exc}): choose another")
    with OutputLock(out, "OUTPUT_BASEPATH"):
        alive = live_ranks(out)
        if alive:
            raise UserError(f"ranks of an earlier run still write {out}: {', '.join(alive)}; wait for them to end or "
                            "stop them (kill PID), then rerun")
        check_output_basepath(out)
        try:
            yield
        finally:
            live_ranks(out)  # the ranks are gone: their marks go too, so nothing of the run is left beside it


def run_folder_identity(output_basepath: str | Path) -> Path:
    """The path the run folder's lock and rank marks are kept by: symlinks resolved, since a run writes through
    them, so that two launches reaching one folder by different names are one writer, not two."""
    return Path(output_basepath).resolve()


def _launch(cfg, command: list[str], argv: list[str], needed: dict, ranks_cpp_log: str | None = None) -> int:
    """The ranks started through torchrun (``ranks_cpp_log``: their TORCH_CPP_LOG_LEVEL, where the launcher set its
    own: what it starts, the fork server and the ranks, reads the environment as it is then)."""
    os.environ[LAUNCHER_PID] = str(os.getpid())
    if ranks_cpp_log:
        importlib.import_module("torch")  # the launcher's own, at the level run() set, before the ranks' is set
        os.environ["TORCH_CPP_LOG_LEVEL"] = ranks_cpp_log
    for k, v in needed.items():
        if os.environ.get(k, v) != v:
            print(f"note: {k}={os.environ[k]} replaced by {v} (needed for TP/CP communication overlap)", flush=True)
    os.environ.update(needed)
    for note in cfg.notes:
        print(f"note: {note}", flush=True)
    if cfg.nproc_per_node > 1:
        # torchrun's own default, set here so it does not print a banner about it.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    print("+ " + " ".join(f"{k}={v}" for k, v in needed.items()) + (" " if needed else "")
          + " ".join(shlex.quote(c) for c in command), flush=True)

    # Without a CUDA device (ENV=cpu, or ENV=dlc on a CPU node, which trains over gloo as ENV=cpu does; ENV=dsw is
    # refused there), each rank is forked with torch and megatron-core imported, running the command's own call
    forked = (_forked_rank_main, (cfg.launcher, argv)) if forked_ranks() else None
    try:
        run_torchrun(command[len(TORCHRUN):], forked)
    except JobFailed as exc:
        if exc.code == 2:
            raise UserError(str(exc))
        if exc.code == EXIT_BROKEN_PIPE:
            return reader_gone()
        print(f"mpatch train: {'' if exc.kind == 'internal' else 'error: '}{exc}", file=sys.stderr, flush=True)
        return exc.code
    print(f"done: checkpoints in {cfg.checkpoint_dir}" if cfg.save else "done (MP_SAVE=false: no checkpoint written)",
          flush=True)
    return 0


def _forked_rank_main(launcher: str, argv: list[str]) -> int:
    """A forked rank's whole life: what ``python mpatch.py train LAUNCHER ARGV...`` runs."""
    from megatron_patch.cli import main  # imported here: megatron_patch.cli imports this module

    return main(["train", launcher, *argv])


def _check_machine(cfg) -> dict:
    """What this machine can run, refused in one line; returns the environment the ranks need."""
    caps = Capabilities.detect(import_torchao=cfg.precision.fp8)
    check_machine(cfg, caps)
    problem = plan_memory(cfg, caps=caps).problem()
    if problem:
        raise UserError(problem)
    return launch_environment(cfg, caps)


def _rank(launcher: str, argv: list[str]) -> int:
    """One rank of the job. Every failure ends as one line in torchrun's error file, which the launcher prints
    once: bad input, a full disk or an output folder it cannot write (exit 2); a collective that timed out or
    a rank that went away (1, naming the rank); anything else is an internal error (1), whose traceback goes
    to the run's log, ``OUTPUT_BASEPATH/log/rank<R>-error.log``, not to the terminal N times."""
    # torch's checkpointing reports any rank's failure in a save or load, a Ctrl-C's KeyboardInterrupt included, as
    # this, a BaseException: without it here, it left the rank with a traceback on the terminal.
    from torch.distributed.checkpoint.api import CheckpointException

    quiet_cpu_warnings()
    die_with_launcher()
    helpers_die_with_rank()
    _full_disk_said_once()
    quiet_interrupts_in_finalizers()
    rank, timeout_min = int(os.environ.get("RANK", "0")), 10.0
    name_this_process(f"mpatch-rank{rank}")
    out = Path(argv[-1] or ".").absolute()  # OUTPUT_BASEPATH is the last argument of every launcher
    mark = None
    try:
        try:
            if os.environ.get(LAUNCHER_REFUSED):  # started only to tell the other nodes (_other_nodes_told)
                raise UserError(os.environ[LAUNCHER_REFUSED])
            cfg = resolve(launcher, argv)
            timeout_min = cfg.dist_timeout_min
            if os.environ.get(LAUNCHER_COMPLETE):  # started only to compare lines (_compared_with_the_other_nodes)
                return _compared_line(cfg)
            check_run_folder(cfg.output_basepath)
            needed = _check_machine(cfg)
            wrong = {k: v for k, v in needed.items() if os.environ.get(k) != v}
            if wrong:
                k, v = next(iter(wrong.items()))
                raise UserError(f"TP={cfg.tp} CP={cfg.cp} on this GPU needs {k}={v} in every rank's environment (the "
                                f"launcher sets it; found {os.environ.get(k)!r}): export {k}={v} before torchrun")
            mark = register_rank(run_folder_identity(out))  # held until this rank ends, however it ends
            if LAUNCHER_PID not in os.environ and rank == 0:
                for note in check_training_data(cfg):  # a torchrun started by hand: no launcher has checked the data
                    print(f"note: {note}", flush=True)
        except UserError as exc:
            if _one_of_several_ranks(os.environ):  # the other ranks would wait for this one
                # torch: a rank has it already; the launcher's own checks start without it
                from megatron_patch.training.node_agreement import refuse_with_the_others

                instead = refuse_with_the_others(str(exc), _timeout_of(timeout_min))
                if instead:
                    raise UserError(instead) from None
            raise
        from megatron_patch.training.loop import train

        train(cfg)
        return 0
    except KeyboardInterrupt:  # the agent passes a SIGINT on to its ranks; the launcher says it once for the job
        return 130
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - every failure becomes one line for the launcher
        if _interrupted(exc):  # the SIGINT came during a checkpoint's save or load
            return 130
        if went_to_a_gone_reader(exc):  # `| head`: the launcher ends quietly, as every command does (docs/outputs.md)
            watchdog.report_failure("the reader of the output went away", "pipe")
            return reader_gone()
        kind, message = _rank_failure(exc, rank, timeout_min, out)
        if not watchdog.report_failure(message, kind):  # not under torchrun: nobody else will say it
            print(f"mpatch train: {'' if kind == 'internal' else 'error: '}{message}", file=sys.stderr, flush=True)
        if kind == "user":
            _leave_the_job()
        return 2 if kind == "user" else 1
    finally:
        watchdog.stop()
        if mark is not None:
            release_rank(run_folder_identity(out), mark)


def _full_disk_said_once() -> None:
    """A writer's thread that met a full disk (TensorBoard's event file writer) printed its traceback above the
    rank's line; that writer raises the same error at the rank's next write through it (tensorboard's
    ``_check_worker_status``), which the rank says in one line. Other threads' failures print as before."""
    printed = threading.excepthook

    def hook(args) -> None:
        if full_disk_error(args.exc_value) is None:
            printed(args)

    threading.excepthook = hook


def _leave_the_job() -> None:
    """A rank that refused, once its line is reported: its process group closed now, while the other nodes' ranks
    are still leaving too. Left to the interpreter's exit, a node's rank sometimes printed "terminate called without
    an active exception" before the node's one line when another node refused (the s63 audit; here 2 of 12 two-node
    refusals before, none of 16 after)."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the refusal is reported; leaving quietly is all this adds
        pass


def _one_of_several_ranks(env) -> bool:
    """Whether this process is a rank of a job of several that torchrun started: its rendezvous is all set."""
    return all(env.get(k) for k in ("RANK", "MASTER_ADDR", "MASTER_PORT")) and env.get("WORLD_SIZE", "1") not in ("", "1")


def _timeout_of(resolved: float) -> float:
    """MP_DIST_TIMEOUT_MIN where the line failed before its settings were all read."""
    try:
        return read_option("MP_DIST_TIMEOUT_MIN", os.environ) or resolved
    except UserError:
        return resolved


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's checkpoint failure that a KeyboardInterrupt on some rank caused (its ``failures``:
    rank -> (exception, traceback summary))."""
    failures = getattr(exc, "failures", None)
    return isinstance(failures, dict) and any(isinstance(exception, KeyboardInterrupt)
                                              for exception, _ in failures.values())


# What an output folder the job cannot write gives (besides a full disk): it is bad input, not a bug.
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.ENOSPC, errno.EDQUOT)


def _rank_failure(exc: Exception, rank: int, timeout_min: float, out: Path) -> tuple[str, str]:
    """(kind, one line) for what stopped this rank; an internal error's traceback is written to the run's log."""
    if isinstance(exc, UserError):
        return "user", str(exc)
    message = watchdog.explain(exc, rank, timeout_min)
    if message is not None:
        return ("hang" if watchdog.failure_kind(exc) == "timeout" else "lost"), message
    unwritable = _output_error(exc, out)
    if unwritable is not None:
        return "user", (f"rank {rank} cannot write {unwritable.filename} in OUTPUT_BASEPATH ([Errno {unwritable.errno}] "
                        f"{unwritable.strerror}): make {out} a folder this job can write to and that has room, or "
                        "choose another OUTPUT_BASEPATH")
    full = full_disk_error(exc)
    if full is not None:  # a write that carries no file's name (an append's flush, TensorBoard's event file)
        return "user", (f"rank {rank} stopped: {unwritten_line(full, {'OUTPUT_BASEPATH': str(out)})}; a rerun "
                        "resumes from the run's last complete checkpoint")
    where = _write_traceback(exc, out, rank)
    if os.environ.get(DEBUG_VARIABLE) == "1" or where is None:
        traceback.print_exception(exc)
    return "internal", (f"{internal_error(exc)} on rank {rank} (a bug: please report it; the traceback is "
                        + (f"in {where})" if where else "above)"))


def _output_error(exc: BaseException, out: Path) -> OSError | None:
    """The OSError of writing inside ``out`` that ``exc`` is or was caused by (megatron-core wraps its own), or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _UNWRITABLE and isinstance(exc.filename, (str, bytes)):
            name = Path(os.fsdecode(exc.filename)).absolute()
            if name == out or out in name.parents:
                return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _write_traceback(exc: BaseException, out: Path, rank: int) -> Path | None:
    """``exc``'s traceback appended to ``out/log/rank<R>-error.log`` (never through a symlink), or None where it
    cannot be written."""
    path = out / "log" / f"rank{rank}-error.log"
    head = (f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank}, pid {os.getpid()} on {socket.gethostname()}, "
            f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        st = os.lstat(path) if os.path.lexists(path) else None
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            # shared with another run's folder by a hard link (a `cp -al` copy): an inode of its own first, as the
            # metrics get (training.run_folder.open_metrics); a copy's crash was appended to the original's log
            write_file_replacing(path, path.read_bytes())
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "a") as f:
            f.write(head + "".join(traceback.format_exception(exc)))
    except OSError:
        return None
    return path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="train with the positional launcher arguments (run_mcore_<family>.sh)",
        description="Train a model on megatron.core with the Pai-Megatron-Patch positional arguments. "
                    "'mpatch train LAUNCHER --help' lists them. MP_DRY_RUN=1 (or =json) prints the resolved "
                    "configuration and the command instead of training.",
        add_help=True)
    p.add_argument("launcher", help="a family's launcher, or one of Pai-Megatron-Patch's scripts by its path under "
                                    "examples/: " + " | ".join(launchers()))
    p.add_argument("args", nargs="...", help="the launcher's positional arguments")
    p.set_defaults(run=run)

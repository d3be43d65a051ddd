"""`mpatch train FAMILY ARGS...`: the positional launchers' engine (examples/<family>/run_mcore_<family>.sh).

Validates everything first (``training.arguments``), then: MP_DRY_RUN=1 prints the resolved
configuration and the command; ENV=cpu starts TP*PP*CP*DP local gloo processes; ENV=dsw/dlc re-executes
itself under torchrun (one process per GPU), and each torchrun child trains its rank.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

from megatron_patch.errors import UserError


def launch_command(cfg, family: str, argv: list[str]) -> list[str]:
    tail = ["-m", "megatron_patch", "train", family, *argv]
    if cfg.env == "cpu":
        return [sys.executable, *tail]
    if cfg.env == "dsw":
        return ["torchrun", f"--nproc_per_node={cfg.nproc_per_node}", "--nnodes=1", "--node_rank=0",
                "--master_addr=localhost", f"--master_port={os.environ.get('MASTER_PORT', '6000')}", *tail]
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise UserError(f"ENV=dlc reads {var} (with WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT) from the "
                            "environment, and it is not set: set it, or use ENV=dsw on one node")
    return ["torchrun", f"--nproc_per_node={cfg.nproc_per_node}", f"--nnodes={cfg.nnodes}",
            f"--node_rank={os.environ['RANK']}", f"--master_addr={os.environ['MASTER_ADDR']}",
            f"--master_port={os.environ['MASTER_PORT']}", *tail]


def _jsonable(value):
    if hasattr(value, "name") and hasattr(value, "value"):  # enums (AttnBackend)
        return value.name
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def dry_run_report(cfg, family: str, argv: list[str]) -> dict:
    from megatron_patch.training.arguments import (
        Capabilities, arg_names, attention_kernel, launch_environment, machine_problems, megatron_settings)

    from megatron_patch.training.memory_plan import plan_memory

    caps = Capabilities.detect()
    arch = cfg.arch
    plan = plan_memory(cfg)
    problems = machine_problems(cfg, caps) + ([plan.problem()] if plan.problem() else [])
    try:
        command = launch_command(cfg, family, argv)
    except UserError as exc:
        command = [f"<{exc}>"]
    return {
        "family": family,
        "arguments": dict(zip(arg_names(family), argv)),
        "resolved": cfg.to_dict(),
        "model": {"hidden_size": arch.hidden_size, "num_layers": arch.num_layers, "num_heads": arch.num_heads,
                  "num_kv_heads": arch.num_kv_heads, "ffn_hidden_size": arch.ffn_hidden_size,
                  "num_experts": arch.num_experts, "padded_vocab_size": arch.padded_vocab_size()},
        "megatron_core": _jsonable(megatron_settings(cfg)),
        "attention_kernel": attention_kernel(cfg, caps),
        "machine_problems": problems,
        "memory_plan": plan.to_dict(),
        "memory_plan_lines": plan.lines(),
        "environment": launch_environment(cfg, caps),
        "command": command,
        "processes": cfg.world_size,
    }


def print_dry_run(report: dict) -> None:
    cfg = report["resolved"]
    print(f"dry run of the {report['family']} launcher (MP_DRY_RUN=1): nothing is started")
    print("arguments:")
    for i, (k, v) in enumerate(report["arguments"].items(), 1):
        print(f"  {i:2d} {k:<25} {v}")
    print("resolved:")
    print(f"  layout      TP={cfg['tp']} PP={cfg['pp']} CP={cfg['cp']} EP={cfg['ep']} ETP={cfg['etp'] or cfg['tp']} "
          + (f"VP={cfg['virtual_pipeline']} " if cfg['virtual_pipeline'] else "")
          + f"DP={cfg['world_size'] // (cfg['tp'] * cfg['pp'] * cfg['cp'])}; {cfg['world_size']} processes "
          f"({cfg['nproc_per_node']} per node x {cfg['nnodes']})")
    print(f"  schedule    {cfg['train_iters']} iterations, {cfg['warmup_iters']} warm-up, cosine {cfg['lr']} -> "
          f"{cfg['min_lr']}; {report['megatron_core']['num_microbatches']} micro-batches/step")
    print(f"  model       {json.dumps(report['model'])}")
    print(f"  attention   {report['attention_kernel']}")
    for note in cfg["notes"]:
        print(f"  note        {note}")
    print("megatron-core settings:")
    for section in ("transformer_config", "ddp", "optimizer", "scheduler"):
        items = " ".join(f"{k}={v}" for k, v in report["megatron_core"][section].items())
        print(f"  {section:<19}{items}")
    for line in report["memory_plan_lines"]:
        print(line)
    problems = report["machine_problems"]
    print("machine check: " + ("ok" if not problems else "this machine would refuse: " + "; ".join(problems)))
    env = " ".join(f"{k}={v}" for k, v in report["environment"].items())
    print("command: " + (env + " " if env else "") + " ".join(shlex.quote(c) for c in report["command"]))


def run(args) -> int:
    from megatron_patch.training.arguments import (
        Capabilities, check_machine, launch_environment, launched_rank, launchers, resolve, usage)

    family, argv = args.family, list(args.args)
    if family not in launchers():
        raise UserError(f"no launcher for '{family}': choose one of {', '.join(launchers())}")
    if any(a in ("-h", "--help") for a in argv) or not argv:
        print(usage(family))
        return 0 if argv else 2
    cfg = resolve(family, argv)
    dry = os.environ.get("MP_DRY_RUN", "")
    if dry not in ("", "0"):
        report = dry_run_report(cfg, family, argv)
        if dry == "json":
            print(json.dumps(report, indent=2, default=str))
        else:
            print_dry_run(report)
        return 0
    caps = Capabilities.detect()
    check_machine(cfg, caps)
    from megatron_patch.training.memory_plan import plan_memory

    problem = plan_memory(cfg).problem()
    if problem:
        raise UserError(problem)
    needed = launch_environment(cfg, caps)
    if launched_rank(os.environ):
        wrong = {k: v for k, v in needed.items() if os.environ.get(k) != v}
        if wrong:
            k, v = next(iter(wrong.items()))
            raise UserError(f"TP={cfg.tp} CP={cfg.cp} on this GPU needs {k}={v} in every rank's environment (the "
                            f"launcher sets it; found {os.environ.get(k)!r}): export {k}={v} before torchrun")
        return _train_here(cfg)
    if cfg.env == "cpu":
        return _train_local(cfg)
    command = launch_command(cfg, family, argv)
    for k, v in needed.items():
        if os.environ.get(k, v) != v:
            print(f"note: {k}={os.environ[k]} replaced by {v} (needed for TP/CP communication overlap)", flush=True)
    env = {**os.environ, **needed}
    print("+ " + " ".join(f"{k}={v}" for k, v in needed.items()) + (" " if needed else "")
          + " ".join(shlex.quote(c) for c in command), flush=True)
    os.execvpe(command[0], command, env)
    return 1  # not reached


def _train_here(cfg) -> int:
    from megatron_patch.training.loop import train

    train(cfg)
    return 0


def _train_local(cfg) -> int:
    from megatron_patch.runtime.launch import run_local
    from megatron_patch.training.loop import train_worker

    print(f"ENV=cpu: starting {cfg.world_size} local gloo processes", flush=True)
    results = run_local(train_worker, cfg.world_size, cfg, timeout=float(os.environ.get("MP_CPU_TIMEOUT", "3600")))
    last = results[-1]
    print(f"done: iteration {last['iteration']}, checkpoints in {cfg.checkpoint_dir}")
    return 0


def register(subparsers) -> None:
    from megatron_patch.models.registry import families

    p = subparsers.add_parser(
        "train", help="train with the positional launcher arguments (run_mcore_<family>.sh)",
        description="Train a model on megatron.core with the Pai-Megatron-Patch positional arguments. "
                    "'mpatch train FAMILY --help' lists them. MP_DRY_RUN=1 (or =json) prints the resolved "
                    "configuration and the command instead of training.",
        add_help=True)
    p.add_argument("family", help=" | ".join(families()))
    p.add_argument("args", nargs="...", help="the launcher's positional arguments")
    p.set_defaults(run=run)

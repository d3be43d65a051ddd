#!/usr/bin/env python3
"""The Python side of scripts/gpu_suite.sh: each subcommand is one step's work (or its dry-run check).

    install  --wheels DIR [--also DIR] --site DIR --pins "NAME==V ..." [--dry-run]
    needs                                        why this machine lacks each need a step can have
    prepare  --work DIR [--checkpoints] [--layers --seq N --gbs N --cap N]
                                                 the corpus, tiny HF checkpoints of every family, and the layers
                                                 of Llama-3.1-8B that fit this GPU (memory plan), capped
    parity   --work DIR --json FILE              fp32 logit parity of every family's tiny model
    align    --work DIR --out DIR [--ablate F]   bf16 alignment of every family (ablations for family F)
    dry-check --queue FILE --results FILE        every queued mpatch command checked in one process
    v4-checkpoint --work DIR --seq N [--reduced] the corpus and the small DeepSeek-V4 (random weights, V4_CONFIG;
                                                 --reduced: V4_REDUCED's widths, for a dry run on CPU), converted
                                                 with mpatch convert hf2mcore (bf16) into WORK/v4/mcore
    train-summary OUT DEST LOG LAYERS [--model-config FILE]
                                                 a training step's throughput.json, with its layer count (and, for a
                                                 model whose FLOPs the formula cannot count, no TFLOP/s or MFU)
    pack     --work DIR --out DIR --phases N.. [--dry-run]
                                                 each phase's summary.md from its steps.tsv, then one tar.gz
                                                 (<= 15 MiB) and a copy of the summary per phase

In a dry run (``GPU_SUITE_SIMULATE=lent``) the machine is taken to be the lent one (docs/gpu.md): one H100 (78 GiB
usable), CUDA 13, megatron-core's local spec, no transformer-engine, no flash-attn.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TAR_LIMIT = 15 * 2**20  # the device tool brings back files of at most 16 MiB
LENT_GPU_GIB = 78  # what torch reports of an 80 GB H100, less a margin


def earlier_checkpoint_kept(work: Path, raw: dict) -> bool:
    """Whether ``work`` holds what an earlier run of a prepare step made of the config ``raw``: its ``made.json``
    (written after the conversion) equal to ``raw``, and the conversion's manifest (written last). If not, whatever
    is there of ``hf`` and ``mcore`` is cleared for this run to make."""
    made = work / "made.json"
    if made.is_file() and json.loads(made.read_text()) == raw and (work / "mcore" / "mpatch_manifest.json").is_file():
        return True
    made.unlink(missing_ok=True)
    for name in ("hf", "mcore"):
        shutil.rmtree(work / name, ignore_errors=True)
    return False


def simulated() -> bool:
    return os.environ.get("GPU_SUITE_SIMULATE") == "lent"


def capabilities():
    """This machine's capabilities, or the lent machine's in a simulation."""
    from megatron_patch.runtime.machine import Capabilities

    if simulated():
        # torchao: its wheel is one of the pins the suite installs (docs/fp8.md)
        return Capabilities(cuda=True, transformer_engine=False, fp8=False, flash_attention_3=False,
                            flash_attention_2=False, compute_capability=(9, 0), cuda_version="13.0", torchao=True,
                            torch_version="2.11.0+cu130")
    return Capabilities.detect()


@contextlib.contextmanager
def as_this_machine():
    """The launcher's view of the machine: in a simulation, the lent GPU's capabilities and memory."""
    if not simulated():
        yield
        return
    from megatron_patch.runtime.machine import Capabilities

    caps = capabilities()
    detect = Capabilities.__dict__["detect"]
    Capabilities.detect = classmethod(lambda cls, **asked: caps)  # whatever it is asked to look at: the lent GPU
    saved = os.environ.get("MP_GPU_MEMORY_GB")
    os.environ["MP_GPU_MEMORY_GB"] = saved or str(LENT_GPU_GIB)
    try:
        yield
    finally:
        Capabilities.detect = detect
        if saved is None:
            os.environ.pop("MP_GPU_MEMORY_GB", None)


# --- install ---------------------------------------------------------------------------------------------

def _wheel_name(path: Path) -> tuple[str, str]:
    """(normalised distribution name, version) from a wheel's file name."""
    name, version = path.name.split("-")[:2]
    return re.sub(r"[-_.]+", "-", name).lower(), version


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.split("[")[0]).lower()


def install(args) -> int:
    """Each wheel of --wheels (and of --also: a phase's own folder) on its own, --no-deps, into --site; each pinned
    package without a wheel there is skipped with the reason (the steps that need it are skipped later, saying so).
    Without --wheels, the pins missing here come from the package index."""
    from megatron_patch.runtime.machine import installed_version

    bad = [p for p in args.pins.split() if "==" not in p]
    if bad:
        print(f"GPU_SUITE_PINS: '{bad[0]}' is not NAME==VERSION")
        return 1
    pins = dict(p.split("==", 1) for p in args.pins.split())
    if not args.wheels:
        missing = [f"{n}=={v}" for n, v in pins.items() if installed_version(_normalise(n)) != v]
        for n, v in pins.items():
            if f"{n}=={v}" not in missing:
                print(f"present: {n} {v}")
        if not missing:
            return 0
        if args.dry_run:
            print(f"would install from the package index: {' '.join(missing)}")
            return 0
        return subprocess.call([sys.executable, "-m", "pip", "install", "--no-build-isolation", *missing])
    folder = Path(args.wheels)
    if not folder.is_dir():
        print(f"--wheels {folder} is not a folder")
        return 1
    searched = [folder, *map(Path, args.also)]
    wheels = [w for f in searched if f.is_dir() for w in sorted(f.glob("*.whl"))]  # a phase's folder may be absent
    found = {_wheel_name(w)[0]: w for w in wheels}
    for name, version in pins.items():
        if _normalise(name) not in found and installed_version(_normalise(name)) != version:
            print(f"skipped: {name}=={version}: no wheel in {' or '.join(map(str, searched))} (steps that need it "
                  "are skipped; docs/gpu.md)")
    failed = 0
    for wheel in wheels:
        name, version = _wheel_name(wheel)
        if installed_version(name) == version:
            print(f"present: {name} {version}")
            continue
        if args.dry_run:
            ok = zipfile.is_zipfile(wheel)
            print(f"would install {wheel.name} (--no-deps) into {args.site}" + ("" if ok else ": NOT a wheel (zip)"))
            failed += not ok
            continue
        failed += _install_one(wheel, Path(args.site))
    return 1 if failed else 0


def _install_one(wheel: Path, site: Path) -> int:
    site.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(site), str(wheel)]
    if subprocess.call([sys.executable, "-m", "pip", "--version"], stdout=subprocess.DEVNULL) == 0:
        if subprocess.call(pip) == 0:
            print(f"installed {wheel.name}")
            return 0
        print(f"FAILED: pip could not install {wheel.name}")
        return 1
    # No pip on this python: a wheel is a zip laid out for site-packages.
    zipfile.ZipFile(wheel).extractall(site)
    print(f"installed {wheel.name} (unzipped: no pip here)")
    return 0


# --- what a step needs -----------------------------------------------------------------------------------

def needs(args) -> int:
    """One line per need a step can have: its name, a tab, and why this machine lacks it (empty: it has it)."""
    import importlib.util

    te = capabilities().transformer_engine
    if simulated() and args.wheels:
        # the lent machine has none of these and cannot reach a package index: what it gets is a wheel carried in
        # --wheels (the fdoc audit: phase 5's dry run passed on this machine's torchao, and the GPU call would skip);
        # without --wheels the pins come from the package index, as install() says, so this machine's stand for them
        carried = {_wheel_name(w)[0] for f in (args.wheels, *args.also) if f and Path(f).is_dir()
                   for w in Path(f).glob("*.whl")}
        wheels = {"mcore": ("megatron-core", "--wheels"), "torchao": ("torchao", "--wheels"),
                  "lmeval": ("lm-eval", "WHEELS/eval")}
        for name, (dist, where) in wheels.items():
            print(f"{name}\t" + ("" if dist in carried else f"{dist} is not on the lent machine, and no wheel of it is "
                                 f"carried in {where} (docs/gpu.md says how to download it)"))
        print(f"te\t{'' if te else 'needs transformer-engine, which the lent machine lacks (docs/gpu.md)'}")
        print("local\t")
        return 0
    reasons = {
        "mcore": "" if importlib.util.find_spec("megatron") and importlib.util.find_spec("megatron.core") else
        "megatron-core is not importable here (carry its wheel with --wheels: docs/gpu.md)",
        "te": "" if te else "needs transformer-engine, which this machine lacks (its PyTorch extension is built "
                            "from source: docs/gpu.md)",
        "local": "times megatron-core's local spec, and this machine runs transformer-engine's" if te else "",
        "torchao": "" if importlib.util.find_spec("torchao") else
        "PR=fp8 without transformer-engine runs torchao, which is not importable here (carry its wheel: docs/fp8.md)",
        "lmeval": "" if importlib.util.find_spec("lm_eval") else
        "lm-eval is not importable here (carry its wheel in WHEELS/eval: docs/gpu.md)",
    }
    for name, reason in reasons.items():
        print(f"{name}\t{reason}")
    return 0


# --- inputs ----------------------------------------------------------------------------------------------

def prepare(args) -> int:
    """The corpus (and, with --checkpoints, a tiny HF checkpoint of every family), once per work folder."""
    from megatron_patch.models.description.registry import families
    from megatron_patch.demo_data import make_texts, make_tokenizer
    from megatron_patch.training.preprocess import preprocess

    work = Path(args.work)
    marker = work / "data" / ".prepared"
    if not marker.is_file():
        texts = make_texts(1000, seed=0)  # megatron's dataset repeats it for as many samples as training reads
        tok = make_tokenizer(work / "data" / "tokenizer", texts, vocab_size=200)
        with open(work / "data" / "corpus.jsonl", "w") as out:
            for t in texts:
                out.write(json.dumps({"text": t}) + "\n")
        preprocess(work / "data" / "corpus.jsonl", str(work / "data" / "corpus"), tok, progress=False, force=True)
        marker.write_text("corpus\n")
    print(f"corpus: {work / 'data' / 'corpus_text_document'}")
    if args.checkpoints:
        from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

        for name in families():
            if not (work / "hf" / name / "config.json").is_file():
                make_tiny_hf_checkpoint(name, work / "hf" / name, seed=0)
        print(f"tiny checkpoints: {', '.join(families())}")
    return layers(args) if args.layers else 0


def train_args(work: Path, layers: int, seq: int, gbs: int, iters: int, pr: str, fl: str, ac: str, offload: str,
               out: Path) -> list[str]:
    """The 25 positional arguments of a suite training run: ENV=dsw on one GPU, Llama-3.1-8B's shape, random
    initialisation, no checkpoints."""
    return ["dsw", "8B", "1", str(gbs), "1e-4", "1e-5", str(seq), str(seq), pr, "1", "1", "1", "false", "false", fl,
            "false", ac, offload, "1000", str(work / "data" / "corpus_text_document"), "none", "none",
            str(iters * gbs * seq), str(gbs * seq), str(out)]


def layers(args) -> int:
    """Llama-3.1-8B's shape with as many layers as this GPU holds (the memory plan, for the spec and attention
    this machine runs) up to --cap, which keeps every training step inside its time limit on an H100 and an
    H200 alike."""
    from megatron_patch.errors import UserError
    from megatron_patch.training.memory_plan import plan_memory
    from megatron_patch.training.validation import resolve

    work = Path(args.work)
    (work / "layers").unlink(missing_ok=True)
    caps = capabilities()
    fixed = os.environ.get("GPU_SUITE_LAYERS")
    if fixed:
        chosen, why = int(fixed), f"{fixed} layers (GPU_SUITE_LAYERS)"
    elif not caps.cuda:
        chosen, why = 2, "no GPU here: 2 layers"
    else:
        chosen, plan = 0, None
        with as_this_machine():
            for n in range(args.cap, 0, -1):
                env = {**os.environ, "GPUS_PER_NODE": "1", "MP_NUM_LAYERS": str(n)}
                argv = train_args(work, n, args.seq, args.gbs, 6, "bf16", "false", "sel", "false", work / "probe")
                try:
                    plan = plan_memory(resolve("llama3_1", argv, env=env, check_paths=False), caps=caps)
                except UserError as exc:
                    print(f"layers: {exc}")
                    return 1
                if plan.problem() is None:
                    chosen = n
                    break
        if not chosen:
            print(f"not even one layer of Llama-3.1-8B fits: {plan.problem()}")
            return 1
        why = (f"{chosen} layers (cap {args.cap}) fit in {plan.capacity / 2**30:.0f} GiB ({plan.capacity_source}; "
               f"{plan.spec} layers" + (f", {plan.attention} attention" if plan.attention else "") + ")")
    (work / "layers").write_text(f"{chosen}\n")
    print(f"training model: Llama-3.1-8B shape, {why}")
    return 0


# --- correctness ----------------------------------------------------------------------------------------

def parity(args) -> int:
    """fp32 logit parity of every family's tiny model with the model this package builds here (one process
    start for all of them)."""
    from megatron_patch.align.parity import check_parity_all
    from megatron_patch.models.description.registry import families

    work = Path(args.work)
    names = list(args.families or families())
    results = check_parity_all([work / "hf" / n for n in names])
    rows = {n: {k: (float(v) if not isinstance(v, bool) else v) for k, v in r.items()} for n, r in zip(names, results)}
    Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    failed = [n for n, r in rows.items() if not r["passed"]]
    for n, r in rows.items():
        print(f"  {n:<12} rel_l2 {r['rel_l2']:.1e}  kl {r['kl']:.1e}  {'PASS' if r['passed'] else 'FAIL'}")
    print(f"parity: {len(names) - len(failed)}/{len(names)} families pass" + (f"; FAILED: {', '.join(failed)}"
                                                                             if failed else ""))
    return 1 if failed else 0


def align(args) -> int:
    """bf16 layer-by-layer alignment of every family or of --families (with the ablations for --ablate), one report
    each. Each family is one start of its ranks, spawned on a GPU (about 15 s there), so the suite aligns one dense
    and one MoE family; parity covers them all in one start."""
    from megatron_patch.align.alignment import AlignSettings, run_alignment
    from megatron_patch.align.report import write_report
    from megatron_patch.models.description.registry import families

    work, out = Path(args.work), Path(args.out)
    verdicts = {}
    for name in args.families or families():
        s = AlignSettings(hf_dir=str(work / "hf" / name), dtype="bf16", ablate=name == args.ablate)
        result = run_alignment(s, log=lambda msg: None)
        write_report(result, out / name, command=f"gpu_suite_steps.py align ({name})")
        verdicts[name] = result["verdict"]["aligned"]
        print(f"  {name:<12} {'PASS' if verdicts[name] else 'FAIL'}  attention: {result['attention']}", flush=True)
    failed = [n for n, ok in verdicts.items() if not ok]
    print(f"align: {len(verdicts) - len(failed)}/{len(verdicts)} families pass in bf16"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


# --- a small DeepSeek-V4 (issue 39) ----------------------------------------------------------------------

_S, _CSA, _HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# DeepSeek-V4-Flash's structure at a quarter of its width, small enough for one GPU and for transformers to build on
# the lent machine's CPU in seconds: 6 layers, two sliding-window ones and then CSA and HCA alternating, the first
# three hash-routed and the rest top-k, as Flash begins; Flash's heads of 512 (16 of them, 4 output groups), its
# window (128), compression rates (CSA 4, HCA 128), RoPE and 4 hyper-connection streams; 32 experts of 512, top 4,
# and the shared one; a vocabulary of 32768. At 4096 tokens a CSA layer has 1024 compressed entries and its indexer
# keeps 512 of them, an HCA layer 32: both compress and select (v4_config checks it for the sequence given).
# 440M parameters (176M active), 0.85 GiB in bf16; the memory plan puts a GPU's share at 12 GiB of 78, and the
# attention's score matrices (16 heads x s x (s + entries), bf16, about 0.7 GiB each) add a few GiB per layer in flight.
V4_CONFIG = {
    "vocab_size": 32768, "hidden_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 16, "head_dim": 512,
    "partial_rotary_factor": 64 / 512, "q_lora_rank": 512, "o_groups": 4, "o_lora_rank": 256, "sliding_window": 128,
    "layer_types": [_S, _S, _CSA, _HCA, _CSA, _HCA], "compress_rates": {_CSA: 4, _HCA: 128},
    "index_n_heads": 16, "index_head_dim": 128, "index_topk": 512,
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * 3, "n_routed_experts": 32, "num_experts_per_tok": 4,
    "moe_intermediate_size": 512,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                        "beta_fast": 32.0, "beta_slow": 1.0},
    "max_position_embeddings": 1_048_576,
}
# The dry run's stand-in (CPU, seconds): the same layers, heads, window, compression, indexer top-k and sequence, at
# narrow widths, so that its launcher check reads a real converted V4 checkpoint; the memory plan is checked for
# V4_CONFIG itself (dry-check's GPU_SUITE_FULL_CONFIG).
V4_REDUCED = {"vocab_size": 1024, "hidden_size": 64, "head_dim": 64, "q_lora_rank": 32, "o_lora_rank": 16,
              "index_n_heads": 4, "index_head_dim": 16, "n_routed_experts": 8, "moe_intermediate_size": 32}


def v4_config(seq: int, reduced: bool = False) -> dict:
    """The small V4's config.json (the family's tiny config under V4_CONFIG), refused in one line where ``seq`` would
    leave its compression or index top-k idle."""
    from megatron_patch.models.description.tiny import tiny_config

    raw = copy.deepcopy(tiny_config("deepseek_v4", **{**V4_CONFIG, **(V4_REDUCED if reduced else {})}))
    rates = raw["compress_rates"]
    if seq // rates[_CSA] <= raw["index_topk"]:
        raise SystemExit(f"v4: at {seq} tokens a CSA layer has {seq // rates[_CSA]} compressed entries, not more than "
                         f"the index top-k {raw['index_topk']}: GPU_SUITE_SEQ_LEN must be over "
                         f"{raw['index_topk'] * rates[_CSA]}")
    if seq <= max(rates[_HCA], raw["sliding_window"]):
        raise SystemExit(f"v4: {seq} tokens fit one HCA window or the sliding window: nothing would be compressed")
    return raw


def v4_checkpoint(args) -> int:
    """The corpus, then the small V4's HF checkpoint (random weights) converted with mpatch convert hf2mcore into
    WORK/v4/mcore, each timed; kept for a rerun on the same machine when the config is the same."""
    from megatron_patch.models.deepseek_v4.config import parameter_count
    from megatron_patch.models.description.registry import parse_arch
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    if prepare(argparse.Namespace(work=args.work, checkpoints=False, layers=False)):
        return 1
    work = Path(args.work) / "v4"
    made = work / "made.json"
    try:
        raw = v4_config(args.seq, args.reduced)
        full = parse_arch(v4_config(args.seq))  # the GPU's model: its config checked in a dry run too
    except BaseException:
        # no earlier run's checkpoint left for train-v4 to train as if this step had made it
        made.unlink(missing_ok=True)
        shutil.rmtree(work / "mcore", ignore_errors=True)
        raise
    arch = parse_arch(raw)
    short = {_S: "sliding", _CSA: "CSA", _HCA: "HCA", "hash_moe": "hash", "moe": "top-k"}
    what = (f"{arch.num_layers} layers of {arch.hidden_size} (attention {' '.join(short[t] for t in arch.layer_types)}; "
            f"MoE {' '.join(short[t] for t in arch.family_config.mlp_layer_types)}), {arch.num_experts} experts top "
            f"{arch.moe_topk}, {parameter_count(arch) / 1e6:.1f}M parameters")
    if args.reduced:
        what += (f" (the dry run's narrow stand-in for {full.num_layers} layers of {full.hidden_size}, "
                 f"{parameter_count(full) / 1e6:.1f}M parameters)")
    work.mkdir(parents=True, exist_ok=True)
    (work / "gpu-config.json").write_text(json.dumps(v4_config(args.seq), indent=1) + "\n")  # dry-check's
    if earlier_checkpoint_kept(work, raw):
        print(f"small DeepSeek-V4: {what}: the checkpoint of an earlier run, kept")
        return 0
    t0 = time.time()
    make_tiny_hf_checkpoint("deepseek_v4", work / "hf", seed=0, **copy.deepcopy(raw))  # transformers fills in dicts
    built = time.time() - t0
    t0 = time.time()
    if subprocess.call([sys.executable, "-m", "megatron_patch", "convert", "hf2mcore", "--hf-dir", str(work / "hf"),
                        "--save-dir", str(work / "mcore"), "--dtype", "bf16", "--quiet"]):
        print("v4: mpatch convert hf2mcore failed (above)")
        return 1
    converted = time.time() - t0
    made.write_text(json.dumps(raw, indent=1) + "\n")
    print(f"small DeepSeek-V4: {what}: HF checkpoint made in {built:.1f} s, converted (bf16) in {converted:.1f} s")
    return 0


# --- dry-run checks of mpatch command lines -------------------------------------------------------------

def dry_check(args) -> int:
    """Every queued command in this one process: ``mpatch train`` runs with MP_DRY_RUN=json (what the launcher
    runs) and must be runnable on this (or the simulated) machine; any other command is parsed."""
    from megatron_patch.cli import build_parser, main

    results = {}
    for line in Path(args.queue).read_text().splitlines():
        step, env, joined = line.split("\t")  # written by gpu_suite.sh's dry_check
        check = {"step": step, "env": dict(a.split("=", 1) for a in env.split())}
        # the model the GPU trains, where the dry run's checkpoint is a narrow stand-in (the small V4's)
        full_config = check["env"].pop("GPU_SUITE_FULL_CONFIG", None)
        saved = dict(os.environ)
        os.environ.update(check["env"])
        out, err = io.StringIO(), io.StringIO()
        argv = joined.split("\x1f")
        full_plan = None
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), as_this_machine():
                if argv[0] == "train":
                    code = main(argv)
                    full_plan = _full_size_plan(argv, full_config) if code == 0 and full_config else None
                else:
                    build_parser().parse_args(argv)
                    code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
        except Exception as exc:  # noqa: BLE001 (the full-size plan's: a step's verdict, not the whole check's end)
            code = 2
            err.write(f"{type(exc).__name__}: {exc}\n")
        finally:
            os.environ.clear()
            os.environ.update(saved)
        if code != 0:
            results[check["step"]] = f"error (exit {code}): " + (err.getvalue().strip().splitlines() or ["?"])[-1]
        elif argv[0] == "train":
            r = json.loads(out.getvalue())
            problems = r["machine_problems"]
            verdict = "ok" if not problems else "error"
            results[check["step"]] = (f"{verdict}: {r['model']['num_layers']} layers, attention {r['attention_kernel']}, "
                                      f"{r['resolved']['train_iters']} iterations, memory plan "
                                      f"{r['memory_plan']['spec']}/{r['memory_plan']['attention']}; on this machine: "
                                      + ("; ".join(problems) or "runnable"))
            if full_plan is not None:
                fits = full_plan.problem() is None
                results[check["step"]] = ("ok" if fits and not problems else "error") + (
                    f": at the GPU run's size {full_plan.stages[0].device / 2**30:.1f} GiB planned of "
                    f"{full_plan.capacity / 2**30:.0f} ({'fits' if fits else full_plan.problem()}); the dry run's "
                    "narrow stand-in:" + results[check["step"]].split(":", 1)[1])
        else:
            results[check["step"]] = "ok: mpatch " + " ".join(argv)
    Path(args.results).write_text("".join(f"{k}\t{v.replace(chr(9), ' ')}\n" for k, v in results.items()))
    return 0


def _full_size_plan(argv: list[str], config_file: str):
    """The memory plan of ``argv``'s launch for the model ``config_file`` describes instead of its checkpoint's."""
    import dataclasses

    from megatron_patch.training.memory_plan import plan_memory
    from megatron_patch.training.validation import resolve

    cfg = resolve(argv[1], argv[2:], env=dict(os.environ), check_paths=False)
    full = dataclasses.replace(cfg, hf_config=json.loads(Path(config_file).read_text()))
    return plan_memory(full, caps=capabilities())


def train_summary(args) -> int:
    out, dest, log, n_layers = Path(args.out), Path(args.dest), Path(args.log), int(args.layers)
    summary = json.loads((out / "log" / "throughput.json").read_text())
    summary["layers"] = n_layers
    text = log.read_text(errors="replace") if log.is_file() else ""
    # transformer-engine's word on the attention backend it chose (NVTE_DEBUG runs), when logged; else ours
    picked = [ln.strip() for ln in text.splitlines() if re.search(r"[Ss]elected backend|backend =", ln)]
    summary["attention_backend_log"] = picked[-1][-160:] if picked else None
    ours = [ln.strip() for ln in text.splitlines() if "; attention " in ln]
    summary["attention"] = ours[-1].split("; attention ", 1)[1][:120] if ours else None
    compiled = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("torch.compile:")]
    summary["compiled"] = compiled[-1] if compiled else None
    float8 = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("float8 (torchao")]
    summary["float8"] = float8[-1] if float8 else None
    if args.model_config:
        # a model whose attention the FLOPs formula cannot count: its TFLOP/s and MFU would be wrong, so none
        from megatron_patch.models.description.registry import parse_arch
        from megatron_patch.models.shape.model_shape import flops_uncounted

        why = flops_uncounted(parse_arch(args.model_config))
        if why:
            summary.update(tflops_per_gpu=None, mfu=None, flops_not_counted=why)
    metrics = out / "log" / "metrics.jsonl"
    records = [json.loads(ln) for ln in metrics.read_text().splitlines()] if metrics.is_file() else []
    summary["losses"] = [r["loss"] for r in records if "loss" in r]  # every iteration's, warm-up included
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


# --- results ---------------------------------------------------------------------------------------------

def summary(results: Path, phase: str, dry_run: bool) -> None:
    rows = list(csv.DictReader(open(results / "steps.tsv"), delimiter="\t"))
    info = json.loads((results / "info.json").read_text()) if (results / "info.json").is_file() else {}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip() or "none"
    except (OSError, subprocess.SubprocessError):
        smi = "none (no nvidia-smi)"
    failed = sum(r["status"] == "FAILED" for r in rows)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lines = [f"# GPU suite, phase {phase}{' (dry run)' if dry_run else ''}, {when}", ""]
    lines.append(f"**{failed} step(s) FAILED**" if failed else "All steps passed (or were skipped with a reason).")
    features = info.get("features", {})
    lines += ["", f"- GPU: {smi}" + (" (dry run: the lent machine simulated)" if simulated() else ""),
              "- versions: " + ", ".join(f"{k} {info.get(k)}" for k in ("python", "torch", "megatron_core",
                                                                       "transformers")),
              f"- transformer-engine {features.get('transformer_engine_version')}; features "
              f"{json.dumps({k: v for k, v in features.items() if k != 'transformer_engine_version'})}",
              "", "| step | status | s | result |", "| --- | --- | ---: | --- |"]
    for r in rows:
        status = f"**{r['status']}**" if r["status"] == "FAILED" else r["status"]
        result = r["note"].replace("|", "/")
        train = results / "train" / f"{r['step'][len('train-'):]}.json"
        if r["step"].startswith("train-") and train.is_file():
            t = json.loads(train.read_text())
            mfu = f"{t['mfu']:.1%}" if t.get("mfu") is not None else "n/a"
            flops = (f"TFLOP/s and MFU not counted ({t['flops_not_counted']})" if t.get("flops_not_counted") else
                     f"{t['tflops_per_gpu']:.1f} TFLOP/s, MFU {mfu}")
            result = (f"{t['layers']} layers: {t['tokens_per_s']:.0f} tokens/s, {flops}, peak "
                      f"{t['peak_memory_gib']:.1f} GiB (iterations {t['iterations'][0]}-{t['iterations'][1]})")
            for key, label in (("attention", "attention"), ("attention_backend_log", "TE"), ("compiled", ""),
                               ("float8", "")):
                if t.get(key):
                    result += f"; {label + ': ' if label else ''}{t[key]}"
        lines.append(f"| {r['step']} | {status} | {r['seconds']} | {result} |")
    lines += _fp8_losses(results)
    lines += _eval_speed(results)
    lines += ["", "Logs: logs/STEP.log; training throughput excludes the warm-up iteration (train/MODE.json)."]
    (results / "summary.md").write_text("\n".join(lines) + "\n")


def _fp8_losses(results: Path) -> list[str]:
    """Phase 5: each fp8 run's losses against the compiled bf16 run's over the same iterations (same data, same
    start), the difference that says whether float8 trains as bf16 does."""
    bf16 = results / "train" / "bf16-compiled-50.json"
    if not bf16.is_file():
        return []
    base = json.loads(bf16.read_text()).get("losses") or []
    out = ["", "| fp8 run | iterations | last loss (bf16's) | largest abs. difference from bf16 | mean abs. difference |",
           "| --- | ---: | --- | ---: | ---: |"]
    for mode in ("fp8-tensorwise-compiled", "fp8-rowwise-compiled"):
        path = results / "train" / f"{mode}.json"
        losses = json.loads(path.read_text()).get("losses") if path.is_file() else None
        if not losses or not base:
            continue
        diffs = [abs(a - b) for a, b in zip(losses, base)]
        out.append(f"| {mode} | {len(diffs)} | {losses[len(diffs) - 1]:.4f} ({base[len(diffs) - 1]:.4f}) | "
                   f"{max(diffs):.4f} | {sum(diffs) / len(diffs):.4f} |")
    return out


def _eval_speed(results: Path) -> list[str]:
    """Phase 6: scripts/bench_eval_1b.py's numbers (its JSON files), as tables."""
    out = []
    path = results / "eval_loglikelihood.json"
    if path.is_file():
        r = json.loads(path.read_text())
        out += ["", f"Log-likelihoods: {r['model']}; {r['device']}, {r['dtype']}, batch {r['batch_size']}; lm-eval "
                    f"{r.get('lm_eval')} HF backend (attention {r.get('hf_attention')}) against mpatch's lm-eval model "
                    f"(attention {r.get('mpatch_attention')}).", "",
                "| requests | tokens each (mean) | mpatch req/s | HF backend req/s | mpatch's time / HF's | relative "
                "difference (median, max) | same is_greedy |", "| --- | ---: | ---: | ---: | ---: | --- | ---: |"]
        for name, row in r["sets"].items():
            if "mpatch_s" not in row:  # the HF side done, then stopped
                out.append(f"| {name}: {row['requests']} | {row['mean_tokens']} | not run | "
                           f"{row['hf_requests_per_s']} | | | |")
                continue
            out.append(f"| {name}: {row['requests']} | {row['mean_tokens']} | {row['mpatch_requests_per_s']} | "
                       f"{row['hf_requests_per_s']} | {row['ratio']:.2f}x | {row['relative_difference_median']:.1e}, "
                       f"{row['relative_difference_max']:.1e} | {row['same_is_greedy']}/{row['requests']} |")
    path = results / "eval_generation.json"
    if path.is_file():
        r = json.loads(path.read_text())
        out += ["", f"Generation: {r['model']}; {r['device']}, {r['dtype']}, batch {r['batch']}, greedy, "
                    f"{r['new_tokens']} new tokens.", "",
                "| prompt tokens | tokens/s with the KV cache | without | speed-up | first tokens alike |",
                "| ---: | ---: | ---: | ---: | ---: |"]
        out += [f"| {c['prompt']} | {c['with_cache']} | {c['without_cache']} | "
                f"{c['with_cache'] / c['without_cache']:.1f}x | {c['first_tokens_alike']}/{r['new_tokens']} |"
                for c in r["contexts"]]
    return out


def pack(args) -> int:
    """Per phase, one tar.gz of its results and a copy of its summary: two files for the device tool to bring
    back. Logs are cut to their last MiB where the whole would not fit."""
    failed = 0
    for phase in args.phases:
        results = Path(args.work) / f"phase{phase}"
        summary(results, phase, args.dry_run)
        failed += _pack_phase(results, Path(args.out), phase)
    return 1 if failed else 0


def _pack_phase(results: Path, out: Path, phase: str) -> int:
    out.mkdir(parents=True, exist_ok=True)
    name = f"gpu-suite-phase{phase}"
    tar_path = out / f"{name}.tar.gz"
    for keep in (None, 2**20, 64 * 2**10):
        partial = tar_path.with_name(tar_path.name + ".partial")
        with tarfile.open(partial, "w:gz") as tar:
            for path in sorted(results.rglob("*")):
                if not path.is_file() or "work" in path.relative_to(results).parts[:1]:
                    continue
                arcname = f"{name}/{path.relative_to(results)}"
                if keep is not None and path.suffix == ".log" and path.stat().st_size > keep:
                    data = path.read_bytes()[-keep:]
                    info = tarfile.TarInfo(arcname)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                else:
                    tar.add(path, arcname=arcname)
        partial.replace(tar_path)
        if tar_path.stat().st_size <= TAR_LIMIT:
            break
    (out / f"{name}.md").write_bytes((results / "summary.md").read_bytes())
    size = tar_path.stat().st_size
    print(f"results: {tar_path} ({size / 2**20:.1f} MiB) and {out / (name + '.md')}")
    return 0 if size <= TAR_LIMIT else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install")
    p.add_argument("--wheels", default="")
    p.add_argument("--also", action="append", default=[], help="another folder of wheels (a phase's own)")
    p.add_argument("--site", required=True)
    p.add_argument("--pins", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(run=install)
    p = sub.add_parser("needs")
    p.add_argument("--wheels", default="")
    p.add_argument("--also", action="append", default=[], help="another folder of wheels (a phase's own)")
    p.set_defaults(run=needs)
    p = sub.add_parser("prepare")
    p.add_argument("--work", required=True)
    p.add_argument("--checkpoints", action="store_true")
    p.add_argument("--layers", action="store_true")
    for flag in ("--seq", "--gbs", "--cap"):
        p.add_argument(flag, type=int)
    p.set_defaults(run=prepare)
    p = sub.add_parser("parity")
    p.add_argument("--work", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--families", nargs="*", default=None, help="these families only (default: every family)")
    p.set_defaults(run=parity)
    p = sub.add_parser("align")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ablate", default=None)
    p.add_argument("--families", nargs="*", default=None, help="these families only (default: every family)")
    p.set_defaults(run=align)
    p = sub.add_parser("dry-check")
    p.add_argument("--queue", required=True)
    p.add_argument("--results", required=True)
    p.set_defaults(run=dry_check)
    p = sub.add_parser("train-summary")
    for name in ("out", "dest", "log", "layers"):
        p.add_argument(name)
    p.add_argument("--model-config", default=None, help="the trained model's config.json: no TFLOP/s or MFU where "
                                                       "the FLOPs formula cannot count its attention")
    p.set_defaults(run=train_summary)
    p = sub.add_parser("v4-checkpoint")
    p.add_argument("--work", required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--reduced", action="store_true")
    p.set_defaults(run=v4_checkpoint)
    p = sub.add_parser("pack")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--phases", nargs="+", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(run=pack)
    args = ap.parse_args()
    from megatron_patch.runtime.known_warnings import quiet_known_warnings  # neither torch nor megatron-core

    quiet_known_warnings()  # as mpatch does: each step's log holds what the step says, not torchao's import notices
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

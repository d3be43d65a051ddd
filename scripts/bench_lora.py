#!/usr/bin/env python
"""LoRA against full fine-tuning, measured through the launcher, and the memory plan's figures for large models.

    PYTHONPATH=. python scripts/bench_lora.py [--models tiny,smol135m] [--iters 20] [--seq 512] [--rank 16]
                                              [--json FILE] [--plan-only]

Training (ENV=cpu, fp32, TP=1, one process; what a laptop runs): for each model, a random HF checkpoint made
here (``tiny``: the Llama-3.1 family's tiny config; ``smol135m``: SmolLM2-135M's shape, a Llama-architecture
model of 135M parameters with tied embeddings) converted with ``mpatch convert hf2mcore``, then the Llama-3.1
launcher trains it on a local corpus for ``--iters`` iterations of 4 sequences of ``--seq`` tokens, once with
every weight trained and once with LoRA (``MP_LORA_RANK``, targets qkv,proj,fc1,fc2). Per run: trainable and
frozen parameters, gradient and optimizer-state bytes (the memory plan, which tests/test_lora.py holds equal to
what a run allocates), the peak resident set the run logged, and the median seconds per iteration (the first
iteration left out).

Memory plan (no training): Llama-3.1-8B and 70B on 80 GiB GPUs with transformer-engine layers, bf16, the
distributed optimizer, 4K-token micro-batches, full fine-tuning against LoRA rank 16: per rank parameters,
gradients, optimizer state, activations and the device total, and whether it fits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from cli_types import comma_list, positive_int  # scripts/, beside this one

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SMOL135M = {  # SmolLM2-135M's config.json values (hub: HuggingFaceTB/SmolLM2-135M)
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 0,
}


def make_model(name: str, root: Path) -> Path:
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    hf = root / f"{name}_hf"
    if name == "tiny":
        make_tiny_hf_checkpoint("llama3_1", hf, max_position_embeddings=1024)
    else:  # SmolLM2-135M's own config.json values, random weights (no download)
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SMOL135M), dtype=torch.float32)
        model.save_pretrained(hf, safe_serialization=True)
    base = root / f"{name}_mcore"
    subprocess.run([sys.executable, "-m", "megatron_patch", "convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir",
                    str(base), "--quiet"], check=True, env=_env())
    return base


def _env(extra: dict | None = None) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable, **(extra or {})}


def train(base: Path, corpus: str, out: Path, iters: int, seq: int, lora_rank: int | None) -> dict:
    from megatron_patch.training.launcher_args import arg_names

    values = dict(ENV="cpu", MODEL_SIZE="auto", BATCH_SIZE="1", GLOBAL_BATCH_SIZE="4", LR="1e-4", MIN_LR="1e-5",
                  SEQ_LEN=str(seq), PAD_LEN=str(seq), PR="fp32", TP="1", PP="1", CP="1", SP="false", DO="false",
                  FL="false", SFT="false", AC="none", OPTIMIZER_OFFLOAD="false", SAVE_INTERVAL="1000",
                  DATASET_PATH=corpus, VALID_DATASET_PATH="none", PRETRAIN_CHECKPOINT_PATH=str(base),
                  TRAIN_TOKENS_OR_ITERS=str(iters * 4 * seq), WARMUP_TOKENS_OR_ITERS=str(4 * seq),
                  OUTPUT_BASEPATH=str(out))
    args = [values[n] for n in arg_names("llama3_1")]
    extra = {"MP_SAVE": "false", "MP_LOG_INTERVAL": "5"}
    if lora_rank:
        extra["MP_LORA_RANK"] = str(lora_rank)
    launcher = REPO / "examples" / "llama3_1" / "run_mcore_llama3_1.sh"
    dry = subprocess.run(["bash", str(launcher), *args], env=_env({**extra, "MP_DRY_RUN": "json"}), capture_output=True,
                         text=True)
    if dry.returncode:
        raise SystemExit(dry.stderr[-2000:])
    plan = json.loads(dry.stdout[dry.stdout.index("{"):])["memory_plan"]["stages"][0]
    run = subprocess.run(["bash", str(launcher), *args], env=_env(extra), capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(run.stdout[-3000:] + run.stderr[-3000:])
    records = [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    steady = [r["iteration_s"] for r in records[1:]]
    return {"trainable": plan["trainable"], "frozen": plan["frozen"], "grads_bytes": plan["grads"],
            "optimizer_bytes": plan["optimizer_device"] + plan["optimizer_host"], "params_bytes": plan["params"],
            "peak_rss_gib": max(r["memory_gib"] for r in records), "s_per_iteration": statistics.median(steady),
            "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"], "iterations": len(records)}


def memory_plans() -> list[dict]:
    from megatron_patch.training.launcher_args import arg_names
    from megatron_patch.training.memory_plan import plan_memory
    from megatron_patch.training.validation import resolve

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "c_text_document"
        for suffix in (".bin", ".idx"):
            prefix.with_name(prefix.name + suffix).write_bytes(b"")
        for size, tp, pp in (("8B", 1, 1), ("8B", 2, 1), ("70B", 8, 1), ("70B", 8, 4)):
            for rank in (None, 16):
                values = dict(ENV="dsw", MODEL_SIZE=size, BATCH_SIZE="1", GLOBAL_BATCH_SIZE="64", LR="1e-4",
                              MIN_LR="1e-5", SEQ_LEN="4096", PAD_LEN="4096", PR="bf16", TP=str(tp), PP=str(pp), CP="1",
                              SP=str(tp > 1).lower(), DO="true", FL="false", SFT="false", AC="sel",
                              OPTIMIZER_OFFLOAD="false", SAVE_INTERVAL="100", DATASET_PATH=str(prefix),
                              VALID_DATASET_PATH="none", PRETRAIN_CHECKPOINT_PATH="none", TRAIN_TOKENS_OR_ITERS="1e9",
                              WARMUP_TOKENS_OR_ITERS="1e8", OUTPUT_BASEPATH=str(Path(tmp) / "out"))
                env = {"GPUS_PER_NODE": str(tp * pp), "MP_GPU_MEMORY_GB": "80"}
                if rank:
                    env["MP_LORA_RANK"] = str(rank)
                cfg = resolve("llama3_1", [values[n] for n in arg_names("llama3_1")], env=env)
                plan = plan_memory(cfg, "te")
                st = plan.worst
                rows.append({"model": f"Llama-3.1-{size}", "layout": f"TP={tp} PP={pp}", "mode": f"LoRA r{rank}" if rank
                             else "full", "trainable": st.trainable, "frozen": st.frozen, "params": st.params,
                             "grads": st.grads, "optimizer": st.optimizer_device, "activations": st.activations,
                             "device": st.device, "fits": plan.problem() is None, "stage": st.pp_rank})
    return rows


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.1f} MiB"


def main() -> None:
    from megatron_patch.runtime.known_warnings import quiet_known_warnings

    quiet_known_warnings()  # as mpatch does (torchao's import notices, megatron-core's fallbacks)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=comma_list(("tiny", "smol135m")), default="tiny,smol135m")
    p.add_argument("--iters", type=positive_int, default=20)
    p.add_argument("--seq", type=positive_int, default=512)
    p.add_argument("--rank", type=positive_int, default=16)
    p.add_argument("--json", default=None)
    p.add_argument("--plan-only", action="store_true")
    args = p.parse_args()
    results = {"plans": memory_plans(), "training": []}
    print("| model | layout | mode | trainable / rank | frozen / rank | params | grads | optimizer | activations | "
          "device (worst stage) | fits 80 GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results["plans"]:
        print(f"| {r['model']} | {r['layout']} | {r['mode']} | {r['trainable']:,} | {r['frozen']:,} | {gib(r['params'])} | "
              f"{gib(r['grads'])} | {gib(r['optimizer'])} | {gib(r['activations'])} | {gib(r['device'])} | "
              f"{'yes' if r['fits'] else 'no'} |")
    if not args.plan_only:
        from tests.training_helpers import make_corpus

        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            corpus = make_corpus(root / "corpus", 2000)["prefix"]
            print("\n| model | mode | trainable | frozen | grads | optimizer state | peak RSS | s / iteration | loss "
                  f"(iteration 1 -> {args.iters}) |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            for name in args.models:
                base = make_model(name, root)
                for rank in (None, args.rank):
                    r = train(base, corpus, root / f"{name}_{rank}", args.iters, args.seq, rank)
                    r.update(model=name, mode=f"LoRA r{rank}" if rank else "full")
                    results["training"].append(r)
                    print(f"| {name} | {r['mode']} | {r['trainable']:,} | {r['frozen']:,} | {gib(r['grads_bytes'])} | "
                          f"{gib(r['optimizer_bytes'])} | {r['peak_rss_gib']:.2f} GiB | {r['s_per_iteration']:.2f} | "
                          f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

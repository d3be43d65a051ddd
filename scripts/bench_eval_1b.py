#!/usr/bin/env python
"""Evaluation speed of a 1B-class model on this machine's GPU (docs/performance.md, "Evaluation"; the GPU suite's
phase 6 runs it): Llama-3.2-1B's shape with random weights, bf16, TP=1, one process.

    PYTHONPATH=. python scripts/bench_eval_1b.py prepare       --work DIR [--reduced]
    PYTHONPATH=. python scripts/bench_eval_1b.py loglikelihood --work DIR [--json FILE] [--batch-size 8] [--reduced]
    PYTHONPATH=. python scripts/bench_eval_1b.py generation    --work DIR [--json FILE] [--new-tokens 64] [--reduced]

prepare: a tokenizer trained on the demo corpus, the config.json of the llama3_1 family's 1B preset (Llama-3.2-1B:
hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, tied embeddings, a vocabulary of 128256, 1.24B parameters),
an HF checkpoint of it with random weights made on the device in bf16, and its conversion with `mpatch convert
hf2mcore --dtype bf16`. The tokenizer's few hundred ids are a subset of the model's vocabulary, which stays
Llama-3.2-1B's: the output layer and the log-softmax over 128256 words are a large part of a log-likelihood's cost.
No model hub is needed (the lent GPU machine has no network).

loglikelihood: the same hand-built requests (lm-eval `Instance`s; no task, no dataset) through lm-eval's HF backend
(`lm_eval.models.huggingface.HFLM`, dtype bfloat16) and through this project's lm-eval model (`MpatchLM`, built as
lm-eval builds it from `--model_args load_dir=...`, dtype bf16), at one batch size, each side warmed up first on other
requests of the same shapes; the model's loading is not counted. Two sets: short requests (arithmetic questions with
four choices, as mpatch_arithmetic_choice asks them) and long ones (1024 tokens of demo text, then a sentence to
score). Requests per second each, and mpatch's time over the HF backend's (the goal: at most 1.5x).

generation: generated tokens/s of this project's runner, greedy, a batch of one, with and without the KV cache,
after a random prompt of 128 and of 1024 tokens, each warmed up on its prompt first (scripts/bench_generation_cache.py's
timing).

--reduced: a narrow stand-in of the same layout (2 layers of 64, a vocabulary of 1024), fewer and shorter requests:
what the GPU suite's dry run runs on CPU, seconds. Each command writes its JSON as each part finishes, and prints
one line of results last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

PRESET = "1B"  # the llama3_1 family's preset: Llama-3.2-1B's config.json
REDUCED = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024}
# (arithmetic questions, long requests, tokens of context per long request, generation prompt lengths, new tokens)
FULL_SIZES = (100, 64, 1024, (128, 1024))
REDUCED_SIZES = (6, 4, 96, (16, 48))


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def write_json(path: str | None, record: dict) -> None:
    if path:
        partial = Path(path).with_name(Path(path).name + ".partial")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(record, indent=1) + "\n")
        partial.replace(path)


# --- the model ---------------------------------------------------------------------------------------------

def model_config(reduced: bool) -> dict:
    """Llama-3.2-1B's config.json (or the stand-in's), with the demo tokenizer's special tokens."""
    from megatron_patch.models.description.registry import get_family

    raw = {**get_family("llama3_1").presets[PRESET], "bos_token_id": 1, "eos_token_id": 2}  # <s>, </s>
    return {**raw, **REDUCED} if reduced else raw


def prepare(args) -> int:
    """The tokenizer, the HF checkpoint (random weights, made on the device in bf16) and its conversion; kept for a
    rerun when the config is the same."""
    import torch
    import transformers

    from megatron_patch.demo_data import make_texts, make_tokenizer
    from megatron_patch.models.description.registry import parse_arch

    work = Path(args.work)
    raw = model_config(args.reduced)
    parse_arch(model_config(False))  # the GPU's model: its config checked by the family in a dry run too
    from gpu_suite_steps import earlier_checkpoint_kept

    if earlier_checkpoint_kept(work, raw):
        print(f"{_what(raw, args.reduced)}: the checkpoint of an earlier run, kept")
        return 0
    t0 = time.time()
    make_tokenizer(work / "hf", make_texts(200, seed=0), vocab_size=300)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device(device()):  # random weights drawn on the GPU: seconds, where the CPU takes a minute
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(work / "hf", safe_serialization=True)
    del model
    built = time.time() - t0
    t0 = time.time()
    if subprocess.call([sys.executable, "-m", "megatron_patch", "convert", "hf2mcore", "--hf-dir", str(work / "hf"),
                        "--save-dir", str(work / "mcore"), "--dtype", "bf16", "--quiet", "--force"]):
        print("mpatch convert hf2mcore failed (above)")
        return 1
    converted = time.time() - t0
    (work / "made.json").write_text(json.dumps(raw, indent=1) + "\n")
    print(f"{_what(raw, args.reduced)}, {parameters / 1e6:.1f}M parameters: HF checkpoint (bf16, random weights, made "
          f"on {device()}) in {built:.1f} s, converted (bf16) in {converted:.1f} s")
    return 0


def _what(raw: dict, reduced: bool) -> str:
    full = model_config(False)
    what = (f"Llama-3.2-1B's shape: {raw['num_hidden_layers']} layers of {raw['hidden_size']}, "
            f"{raw['num_attention_heads']}/{raw['num_key_value_heads']} heads, FFN {raw['intermediate_size']}, "
            f"vocabulary {raw['vocab_size']}, tied embeddings")
    if reduced:
        what += (f" (the dry run's narrow stand-in for {full['num_hidden_layers']} layers of {full['hidden_size']}, "
                 f"vocabulary {full['vocab_size']})")
    return what


def _checkpoint(work: Path) -> Path:
    mcore = work / "mcore"
    if not (mcore / "mpatch_manifest.json").is_file():
        raise SystemExit(f"missing {mcore} (the prepare command makes it)")
    return mcore


# --- log-likelihoods ---------------------------------------------------------------------------------------

def loglikelihood_requests(tokenizer, reduced: bool, warm: int) -> dict[str, tuple[list, list]]:
    """{set: (warm-up requests, timed requests)}: lm-eval Instances, as a task would make them."""
    from lm_eval.api.instance import Instance

    from megatron_patch.demo_data import make_texts

    questions, long_count, context_tokens, _ = REDUCED_SIZES if reduced else FULL_SIZES
    rng = random.Random(0)
    short = []
    for q in range(warm + questions):  # distinct questions: a repeated one would be scored once by both sides
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        choices = [a + b, a + b + 1, a + b - 10, a + b + 11]
        short.append([Instance("loglikelihood", {}, (f"Question: What is {a} + {b}?\nAnswer:", f" {c}"), i)
                      for i, c in enumerate(choices)])
    sentences = [s.strip() + "." for t in make_texts(400, seed=3) for s in t.split(".") if s.strip()]
    long = []
    for start in rng.sample(range(len(sentences)), warm + long_count):  # distinct requests, as above
        ids, parts = 0, []
        while ids < context_tokens:
            parts.append(sentences[(start + len(parts)) % len(sentences)])
            ids += len(tokenizer.encode(" " + parts[-1], add_special_tokens=False))
        nxt = sentences[(start + len(parts)) % len(sentences)]
        long.append([Instance("loglikelihood", {}, (" ".join(parts), " " + nxt), 0)])
    flat = lambda groups: [i for g in groups for i in g]  # noqa: E731
    return {"short": (flat(short[:warm]), flat(short[warm:])), "long": (flat(long[:warm]), flat(long[warm:]))}


def _timed(lm, requests: dict) -> dict:
    """Each set's requests through ``lm`` after its warm-up: seconds and answers."""
    import torch

    out = {}
    for name, (warm_up, timed) in requests.items():
        lm.loglikelihood(warm_up, disable_tqdm=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        answers = lm.loglikelihood(timed, disable_tqdm=True)
        out[name] = (time.perf_counter() - started, answers)
    return out


def loglikelihood(args) -> int:
    import torch
    from transformers import AutoTokenizer

    work = Path(args.work)
    mcore = _checkpoint(work)
    tokenizer = AutoTokenizer.from_pretrained(str(work / "hf"))
    requests = loglikelihood_requests(tokenizer, args.reduced, warm=args.batch_size)
    lengths = {name: sum(len(tokenizer.encode(r.args[0] + r.args[1])) for r in timed) / len(timed)
               for name, (_, timed) in requests.items()}
    record = {"model": _what(model_config(args.reduced), args.reduced), "device": device_name(), "dtype": "bf16",
              "batch_size": args.batch_size, "torch": torch.__version__, "sets": {}}

    # lm-eval's HF backend first, then this project's model in the same process (its process group, a world of one)
    from lm_eval import __version__ as lm_eval_version
    from lm_eval.models.huggingface import HFLM

    record["lm_eval"] = lm_eval_version
    hf = HFLM(pretrained=str(work / "hf"), device=device(), dtype="bfloat16", batch_size=args.batch_size)
    record["hf_attention"] = getattr(hf.model.config, "_attn_implementation", None)
    hf_results = _timed(hf, requests)
    del hf
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for name, (seconds, _) in hf_results.items():
        n = len(requests[name][1])
        record["sets"][name] = {"requests": n, "mean_tokens": round(lengths[name], 1), "hf_s": round(seconds, 4),
                                "hf_requests_per_s": round(n / seconds, 2)}
    write_json(args.json, record)

    from megatron_patch.evaluation.harness import MpatchLM
    from megatron_patch.runtime.distributed import destroy

    ours = MpatchLM(load_dir=str(mcore), dtype="bf16", batch_size=args.batch_size)
    record["mpatch_attention"] = _attention_of(ours.runner.model)
    our_results = _timed(ours, requests)
    for name, (seconds, answers) in our_results.items():
        row, reference = record["sets"][name], hf_results[name][1]
        n = row["requests"]
        diffs = sorted(abs(a[0] - b[0]) / max(abs(b[0]), 1e-9) for a, b in zip(answers, reference))
        row.update(mpatch_s=round(seconds, 4), mpatch_requests_per_s=round(n / seconds, 2),
                   ratio=round(seconds / row["hf_s"], 3),
                   # bf16 both, each its own arithmetic: a check that both scored the same requests, not an equality
                   relative_difference_median=float(f"{diffs[len(diffs) // 2]:.2e}"),
                   relative_difference_max=float(f"{diffs[-1]:.2e}"),
                   same_is_greedy=sum(a[1] == b[1] for a, b in zip(answers, reference)))
    write_json(args.json, record)
    destroy()  # the process group this process joined as a world of one (NCCL warns at exit otherwise)
    print("; ".join(f"{name} ({row['requests']} requests of {row['mean_tokens']:.0f} tokens, batch {args.batch_size}): "
                    f"mpatch {row['mpatch_requests_per_s']:.1f} req/s, HF {row['hf_requests_per_s']:.1f} req/s, "
                    f"{row['ratio']:.2f}x HF's time" for name, row in record["sets"].items())
          + f" ({record['device']}, bf16)")
    return 0


def _attention_of(model) -> str:
    """The core attention class this project's model runs (SDPA on a GPU without transformer-engine)."""
    names = {type(m).__name__ for n, m in model.named_modules() if n.endswith("core_attention")}
    return ", ".join(sorted(names)) or "?"


# --- generation --------------------------------------------------------------------------------------------

def generation(args) -> int:
    import torch
    from bench_generation_cache import time_generation

    from megatron_patch.evaluation.loading import load_model, open_for_evaluation
    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.runtime.distributed import ParallelLayout, destroy

    contexts = REDUCED_SIZES[3] if args.reduced else FULL_SIZES[3]
    args.new_tokens = args.new_tokens or (4 if args.reduced else 64)
    layout = ParallelLayout()
    checkpoint = open_for_evaluation(_checkpoint(Path(args.work)), layout)
    init_model_parallel(layout)
    (model,) = load_model(checkpoint, layout, "bf16")
    model.eval()
    arch = checkpoint.arch
    record = {"model": _what(model_config(args.reduced), args.reduced), "device": device_name(), "dtype": "bf16",
              "batch": 1, "new_tokens": args.new_tokens, "torch": torch.__version__, "contexts": []}
    for context in contexts:  # one prompt length at a time, each written as it is done
        speeds = time_generation(model, arch.vocab_size, arch.max_position_embeddings, [context], args.new_tokens)
        record["contexts"].append({"prompt": context, "with_cache": round(speeds[(context, True)], 2),
                                   "without_cache": round(speeds[(context, False)], 2),
                                   "first_tokens_alike": speeds[(context, "same")]})
        write_json(args.json, record)
    destroy()  # the process group this process joined as a world of one (NCCL warns at exit otherwise)
    print("; ".join(f"after {c['prompt']} tokens: {c['with_cache']:.1f} tokens/s with the KV cache, "
                    f"{c['without_cache']:.1f} without ({c['with_cache'] / c['without_cache']:.1f}x)"
                    for c in record["contexts"]) + f" (batch 1, {args.new_tokens} new tokens, {record['device']}, bf16)")
    return 0


def main() -> int:
    from megatron_patch.runtime.known_warnings import quiet_known_warnings

    quiet_known_warnings()  # as mpatch does (torchao's import notices, megatron-core's fallbacks)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, run in (("prepare", prepare), ("loglikelihood", loglikelihood), ("generation", generation)):
        p = sub.add_parser(name)
        p.add_argument("--work", required=True, help="where the tokenizer, HF checkpoint and conversion go")
        p.add_argument("--reduced", action="store_true", help="the narrow stand-in (the suite's dry run, CPU)")
        if name != "prepare":
            p.add_argument("--json", default=None, help="write the results here too")
        if name == "loglikelihood":
            p.add_argument("--batch-size", type=int, default=8, help="both sides' (default 8)")
        if name == "generation":
            p.add_argument("--new-tokens", type=int, default=None,
                           help="tokens generated per timing (default 64; --reduced: 4)")
        p.set_defaults(run=run)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

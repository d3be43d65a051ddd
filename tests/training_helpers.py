"""Local text, tokenizers and launcher arguments for the training tests (nothing from a model hub).

The corpus is English-like text from a small grammar: it has structure a tiny model learns within a
few dozen steps, so "the loss falls" is a real check. The tokenizer is a BPE trained on it with the
``tokenizers`` library, small enough (<= 200 ids) for the tiny model presets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_patch.demo_data import make_texts, make_tokenizer  # noqa: F401 - re-exported

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(args: list[str], env: dict | None = None, family: str = "llama3_1") -> subprocess.CompletedProcess:
    """The real launcher script, as a user runs it."""
    script = os.path.join(REPO, "examples", family, f"run_mcore_{family}.sh")
    full_env = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", script, *args], env=full_env, capture_output=True, text=True, timeout=480)


def read_metrics(out: Path) -> list[dict]:
    """The per-iteration records of a run's log/metrics.jsonl."""
    return [json.loads(l) for l in (Path(out) / "log" / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]


def make_tiktoken_file(path: str | Path, merges: list[bytes]) -> Path:
    """A tiktoken BPE ranks file: the 256 single bytes, then ``merges`` (each a pair of earlier tokens)."""
    import base64

    tokens = [bytes([i]) for i in range(256)] + merges
    Path(path).write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return Path(path)


def make_corpus(root: str | Path, documents: int, seed: int = 0) -> dict:
    """A local corpus under ``root``: its texts, a BPE tokenizer trained on them (<= 200 ids, within every
    tiny model's vocabulary) and the corpus preprocessed into mmap data (``prefix``)."""
    from megatron_patch.training.preprocess import preprocess

    root = Path(root)
    texts = make_texts(documents, seed=seed)
    tok = make_tokenizer(root / "tok", texts)
    write_jsonl(root / "corpus.jsonl", [{"text": t} for t in texts])
    report = preprocess(root / "corpus.jsonl", str(root / "corpus"), tok, progress=False)
    return {"root": root, "texts": texts, "tok": tok, "prefix": report.output_prefix}


def hf_loss_on_first_batch(hf_dir: str | Path, family: str, args: list[str], documents_apart_at: int | None = None
                           ) -> float:
    """transformers' loss on the first global batch of a launcher run, read the way training reads it:
    a run that starts from a checkpoint of that model must log this as its first loss. ``documents_apart_at``: an
    end-of-document id after which each sample is cut, each piece run alone (pretraining with MP_SFT_PACKING)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_patch.training.validation import resolve
    from megatron_patch.training.data import build_pretraining_datasets, micro_batches

    cfg = resolve(family, args, env={})
    train, _ = build_pretraining_datasets(cfg, cfg.train_iters * cfg.global_batch_size, 0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in micro_batches(train, 0, cfg, 0, 1):
            for tokens, labels, mask in zip(b["tokens"], b["labels"], b["loss_mask"]):
                ends = [] if documents_apart_at is None else (tokens[:-1] == documents_apart_at).nonzero().flatten()
                bounds = [0, *(int(e) + 1 for e in ends), len(tokens)]
                for a, z in zip(bounds[:-1], bounds[1:]):
                    logits = model(input_ids=tokens[None, a:z]).logits[0]
                    ce = torch.nn.functional.cross_entropy(logits, labels[a:z], reduction="none")
                    total += float((ce * mask[a:z]).sum())
                    count += int(mask[a:z].sum())
    return total / count


def write_jsonl(path: str | Path, records: list) -> Path:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return Path(path)


def launcher_args(family: str = "llama3_1", layout: tuple[str, ...] | None = None, **over) -> list[str]:
    """A valid argument list for ``family``'s launcher (``layout``: the parallel sizes after CP, where it takes more
    than one set; None its first); keyword arguments override by name."""
    from megatron_patch.training.launcher_args import get_launcher

    base = dict(ENV="cpu", MODEL_SIZE="tiny", BATCH_SIZE="2", GLOBAL_BATCH_SIZE="8", LR="1e-3", MIN_LR="1e-4",
                SEQ_LEN="64", PAD_LEN="64", PR="fp32", TP="1", PP="1", CP="1", EP="1", ETP="1", SP="false",
                DO="false", FL="false", SFT="false", AC="none", OPTIMIZER_OFFLOAD="false", SAVE_INTERVAL="10",
                DATASET_PATH="none", VALID_DATASET_PATH="none", PRETRAIN_CHECKPOINT_PATH="none",
                TRAIN_TOKENS_OR_ITERS=str(20 * 8 * 64), WARMUP_TOKENS_OR_ITERS=str(2 * 8 * 64),
                OUTPUT_BASEPATH="/tmp/mpatch-out")
    base.update(over)
    return [str(base[n]) for n in get_launcher(family).arg_names(layout)]


CHATML = ("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_chat_tokenizer(folder: str | Path, base: str | Path, template: str = CHATML,
                        special_tokens: tuple[str, ...] = ("<|im_start|>", "<|im_end|>")) -> Path:
    """``base`` (a make_tokenizer folder) plus special tokens (ChatML's) and a chat template in tokenizer_config.json.

    Pieces are encoded with no leading-space marker (Metaspace prepend_scheme 'never'), so
    encoding a rendered conversation in pieces gives the same ids as encoding it whole.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(Path(base) / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Metaspace(prepend_scheme="never")
    tok.add_special_tokens(list(special_tokens))
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((Path(base) / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


# The training tests' default run: ITERS iterations of GBS sequences of SEQ tokens.
ITERS, GBS, SEQ = 20, 8, 64


def pretrain_args(corpus, out, **over) -> list[str]:
    """The Llama launcher's arguments for the default run on ``corpus``, writing to ``out``."""
    base = dict(DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out), LR="3e-3", MIN_LR="3e-4",
                GLOBAL_BATCH_SIZE=str(GBS), SEQ_LEN=str(SEQ), TRAIN_TOKENS_OR_ITERS=str(ITERS * GBS * SEQ),
                WARMUP_TOKENS_OR_ITERS=str(2 * GBS * SEQ), SAVE_INTERVAL="10")
    base.update(over)
    return launcher_args("llama3_1", **base)


def read_tensors(folder) -> dict:
    """Every tensor of a torch_dist folder, whole, in its stored dtype."""
    from megatron_patch.checkpoint_files.torch_dist import TorchDistReader

    return TorchDistReader(folder).read_all()


def train_converted(family: str, hf_dir: Path, corpus: dict, root: Path, layout: tuple[str, ...] | None = None,
                    env: dict | None = None, iters: int = 6, **over) -> tuple[subprocess.CompletedProcess, list]:
    """``hf_dir`` (a tiny model, given the corpus's tokenizer) converted by hf2mcore into ``root``/mcore and trained
    ``iters`` iterations of 4 x 32 tokens from it by ``family``'s launcher into ``root``/out, saving at the end:
    the launcher's process and the losses it logged."""
    args = _converted_args(family, hf_dir, corpus, root, root / "out", layout, iters, **{"SAVE_INTERVAL": str(iters),
                                                                                        **over})
    proc = launch(args, env, family=family)
    return proc, [m["loss"] for m in read_metrics(root / "out")] if proc.returncode == 0 else []


def _converted_args(family: str, hf_dir: Path, corpus: dict, root: Path, out: Path, layout, iters: int,
                    **over) -> list[str]:
    """The launcher line that trains ``hf_dir``, converted into ``root``/mcore, ``iters`` iterations into ``out``."""
    import shutil

    from megatron_patch.cli import main

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(corpus["tok"] / name, Path(hf_dir) / name)
    mcore = Path(root) / "mcore"
    Path(root).mkdir(parents=True, exist_ok=True)
    if not mcore.exists():
        assert main(["convert", "hf2mcore", "--hf-dir", str(hf_dir), "--save-dir", str(mcore), "--quiet"]) == 0
    gbs, seq = 4, 32
    return launcher_args(family, layout, **{
        "MODEL_SIZE": "auto", "PRETRAIN_CHECKPOINT_PATH": str(mcore), "DATASET_PATH": corpus["prefix"],
        "OUTPUT_BASEPATH": str(out), "LR": "3e-3", "MIN_LR": "3e-4", "GLOBAL_BATCH_SIZE": str(gbs),
        "BATCH_SIZE": "2", "SEQ_LEN": str(seq), "PAD_LEN": str(seq), "TRAIN_TOKENS_OR_ITERS": str(iters * gbs * seq),
        "WARMUP_TOKENS_OR_ITERS": str(gbs * seq), **over})


def assert_a_killed_run_resumes_as_the_whole(family: str, hf_dir: Path, corpus: dict, root: Path,
                                             env: dict | None = None, elsewhere: tuple[dict, dict] | None = None,
                                             **over) -> None:
    """``hf_dir`` converted and trained 4 iterations by ``family``'s launcher, saving every 2: once whole, once killed
    as iteration 3 starts and launched again. The resumed run logs the whole run's losses and grad norms; resumed
    ``elsewhere`` (the relaunch's launcher arguments, and its environment in place of ``env``: another layout), its
    losses within 1e-3 (the other reduction order's rounding)."""
    def run(out: Path, fault: dict | None = None, layout: tuple[dict, dict] | None = None) -> subprocess.CompletedProcess:
        arguments, environment = layout or ({}, env or {})  # elsewhere's environment in place of ``env``
        args = _converted_args(family, hf_dir, corpus, root, out, None, 4, SAVE_INTERVAL="2", **{**over, **arguments})
        return launch(args, {**environment, **(fault or {})}, family=family)

    whole = run(root / "whole")
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    killed = run(root / "resumed", {"MP_INJECT_FAULT": "kill@3"})
    assert killed.returncode != 0 and (root / "resumed" / "checkpoint" / "iter_0000002").is_dir()
    resumed = run(root / "resumed", layout=elsewhere)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    a, b = ({m["iteration"]: m for m in read_metrics(root / name)} for name in ("whole", "resumed"))
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    if elsewhere is None:
        assert all(a[i][k] == b[i][k] for i in a for k in ("loss", "grad_norm")), (a, b)
    else:
        assert all(abs(a[i]["loss"] - b[i]["loss"]) < 1e-3 for i in a), (a, b)


def node_settings_worker(lines_by_rank: list[tuple]):
    """On each rank (a "node"): resolve its own launcher line (args, environment options, working folder), as every
    rank of a job does, then agree with the others (training.node_agreement); returns the paths it goes on with."""
    import torch.distributed as dist

    from megatron_patch.runtime.distributed import init_process_group
    from megatron_patch.training.node_agreement import agree_on_launch
    from megatron_patch.training.validation import resolve

    init_process_group()
    args, env, cwd = lines_by_rank[dist.get_rank()]
    os.chdir(cwd)
    cfg = agree_on_launch(resolve("llama3_1", args, env=env))
    return {"dataset_path": cfg.dataset_path, "output_basepath": cfg.output_basepath, "lora_init": cfg.lora_init}


def node_data_worker(args_by_rank: list[list[str]]):
    """On each rank: build the training data from its own line's OUTPUT_BASEPATH (rank 0 builds the cache first)."""
    import torch.distributed as dist

    from megatron_patch.runtime.distributed import init_process_group
    from megatron_patch.training.data import build_pretraining_datasets
    from megatron_patch.training.validation import resolve

    init_process_group()
    cfg = resolve("llama3_1", args_by_rank[dist.get_rank()], env={})
    return len(build_pretraining_datasets(cfg, cfg.train_iters * cfg.global_batch_size, 0)[0])


def node_sizes_worker(processes_by_rank: list[int]):
    """Each rank refuses its own line, as the ranks of nodes started with another GPUS_PER_NODE each do (each node
    plans another world): what each would say instead (training.node_agreement.refuse_with_the_others)."""
    from megatron_patch.training.node_agreement import refuse_with_the_others

    rank = int(os.environ["RANK"])
    os.environ["LOCAL_WORLD_SIZE"] = str(processes_by_rank[rank])
    return refuse_with_the_others(f"rank {rank}'s own refusal", 1.0)


def node_complete_worker(lines: list[list[str]]):
    """Rank 1's launcher found its run complete: its rank only compares its line (``cli.train._compared_line``);
    rank 0 agrees with the others as training does. Returns what each ends with."""
    import torch.distributed as dist

    from megatron_patch.cli.train import _compared_line
    from megatron_patch.runtime.distributed import init_process_group
    from megatron_patch.training.node_agreement import agree_on_launch
    from megatron_patch.training.validation import resolve

    cfg = resolve("llama3_1", lines[int(os.environ["RANK"])], env={})
    if int(os.environ["RANK"]) == 1:
        return _compared_line(cfg)
    init_process_group(1.0)
    return agree_on_launch(cfg).train_iters if dist.get_rank() == 0 else None


def node_refusing_worker(line: list[str], refusal: str):
    """Rank 1 refuses its node's line before the job forms (training.node_agreement.refuse_with_the_others); rank 0,
    whose line is sound, agrees with the others as training does."""
    import torch.distributed as dist

    from megatron_patch.runtime.distributed import init_process_group
    from megatron_patch.training.node_agreement import agree_on_launch, refuse_with_the_others
    from megatron_patch.training.validation import resolve

    if int(os.environ["RANK"]) == 1:
        refuse_with_the_others(refusal, 1.0)
        return "refused"
    init_process_group(1.0)
    return agree_on_launch(resolve("llama3_1", line, env={})).lr if dist.get_rank() == 0 else None

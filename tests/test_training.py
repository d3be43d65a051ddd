"""Training end to end on CPU (ENV=cpu: torchrun, gloo processes) on a locally made corpus and tokenizer.

- preprocessing round trip: decode(tokens) == text, bad lines named by line number;
- TP=2 (sequence parallel, distributed optimizer): the loss falls on real text, and a run stopped
  after a checkpoint and restarted gives the same loss at every iteration as an uninterrupted run;
- PP=2 from a checkpoint converted at TP=2: the first loss equals transformers' loss on the same
  samples (the weights really arrived), and training goes on from there;
- SFT: loss only on response tokens, packing keeps samples apart; NaN loss stops the run;
- multi-node and failures: two ENV=dlc "nodes" on 127.0.0.1 (DP, then TP, across them) give the
  one-node losses; a SIGKILLed rank is restarted (MP_MAX_RESTARTS) and the run resumes to the same
  losses; a SIGSTOPped rank fails the job naming it; damaged checkpoints are skipped (or refused when
  none is complete); a full disk stops the run and leaves the previous checkpoint resumable.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_patch.checkpoint_files.layout import partial_dir
from megatron_patch.checkpoint_files.torch_dist import TorchDistReader
from megatron_patch.cli import main
from megatron_patch.errors import UserError
from tests.training_helpers import (GBS, ITERS, SEQ, hf_loss_on_first_batch, launch, launcher_args,
                                    make_chat_tokenizer, make_texts, make_tiktoken_file, make_tokenizer, read_metrics,
                                    write_jsonl)
from tests.training_helpers import pretrain_args as _pretrain_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- preprocessing -----------------------------------------------------------------------------------

def test_preprocess_round_trip_and_bad_lines(corpus, tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_patch.tokenizer import load_tokenizer

    texts = corpus["texts"][:50] + ["Unicode too: café, naïve, 東京."]
    lines = [json.dumps({"content": t}) for t in texts[:10]] + ["{not json", '{"text": "wrong key"}', '[1, 2]',
                                                                 '{"content": 7}'] + [json.dumps({"content": t}) for t in texts[10:]]
    write_jsonl(tmp_path / "in.jsonl", lines)
    code = main(["preprocess", "--input", str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "p"),
                 "--tokenizer", str(corpus["tok"]), "--json-key", "content", "--workers", "2", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for lineno in (11, 12, 13, 14):
        assert f"in.jsonl:{lineno}: skipped" in captured.err
    assert "4 bad lines skipped" in captured.out
    tok = load_tokenizer(corpus["tok"])
    ds = IndexedDataset(str(tmp_path / "p_content_document"))
    assert len(ds) == len(texts)
    for i, text in enumerate(texts[:-1]):
        assert int(ds[i][-1]) == tok.eod
        assert tok.decode(ds[i][:-1]) == text
    assert not list(tmp_path.glob("*.partial*"))


def test_preprocess_tiktoken_file_round_trip(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_patch.checkpoint_files.manifest import read_manifest
    from megatron_patch.tokenizer import load_tokenizer, vocabulary_digest
    from megatron_patch.training.data_files import manifest_path
    from megatron_patch.training.preprocess import preprocess

    bpe = make_tiktoken_file(tmp_path / "tiny.tiktoken", [b"th", b"the", b" the", b"in", b"ing"])
    texts = ["the thing in the east", "Nothing, then \u00e9t\u00e9 \U0001F600 everything"]
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    report = preprocess(tmp_path / "in.jsonl", str(tmp_path / "t"), bpe, progress=False)
    tok = load_tokenizer(bpe)
    ds = IndexedDataset(report.output_prefix)
    assert tok.vocab_size == 262 and tok.eod == 261
    assert [tok.decode(ds[i][:-1]) for i in range(2)] == texts
    assert 258 in ds[0].tolist()  # the merges were used, " the"
    assert report.tokens < sum(len(t.encode()) for t in texts) + 2
    # the manifest records the file's vocabulary: the same merges in another order are another tokenizer
    record = read_manifest(manifest_path(report.output_prefix))["tokenizer"]
    assert record == {"path": str(bpe.resolve()), "vocabulary_sha256": vocabulary_digest(tok), "ids": 262,
                      "end_of_document": {"id": 261, "token": "<|endoftext|>"}}
    reordered = make_tiktoken_file(tmp_path / "reordered.tiktoken", [b"in", b"ing", b"th", b"the", b" the"])
    assert vocabulary_digest(load_tokenizer(reordered)) != record["vocabulary_sha256"]
    assert vocabulary_digest(load_tokenizer(make_tiktoken_file(tmp_path / "same.tiktoken", [
        b"th", b"the", b" the", b"in", b"ing"]))) == record["vocabulary_sha256"]


def test_a_tiktoken_file_ends_documents_with_the_eos_its_folder_names(tmp_path):
    """Kimi-K2's folder has no tokenizer.json: a tiktoken file whose tokenizer_config.json puts [BOS] right after the
    ranks and [EOS] after it. Every document ended with the id past the ranks, [BOS], called <|endoftext|>."""
    from megatron_patch.tokenizer import load_tokenizer

    folder = tmp_path / "kimi_like"
    folder.mkdir()
    make_tiktoken_file(folder / "tiktoken.model", [b"th", b"he", b"the"])
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "[EOS]",
        "added_tokens_decoder": {"259": {"content": "[BOS]", "special": True},
                                 "260": {"content": "[EOS]", "special": True}}}))
    for given in (folder, folder / "tiktoken.model"):  # the folder itself is taken too
        tok = load_tokenizer(given)
        assert (tok.eod, tok.vocab_size, tok.decode([tok.eod])) == (260, 261, "[EOS]")
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {
        "12": {"content": "[BOS]"}}}))
    with pytest.raises(UserError, match="takes id 12, which tiktoken.model's 259 ranks use"):
        load_tokenizer(folder)


def test_a_tokenizer_saved_with_truncation_or_padding_writes_documents_whole(tmp_path):
    """tokenizer.json keeps the truncation and padding of the call it was saved after; transformers applies
    neither unless asked. Every document was cut to max_length (or padded to a fixed length), without a word."""
    from megatron_patch.tokenizer import load_tokenizer

    texts = make_texts(40, seed=3)
    base = make_tokenizer(tmp_path / "base", texts, vocab_size=190)
    whole = load_tokenizer(base)
    saved = json.loads((base / "tokenizer.json").read_text())
    for setting in ({"truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}},
                    {"padding": {"strategy": {"Fixed": 300}, "direction": "Right", "pad_to_multiple_of": None,
                                 "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}}):
        (base / "tokenizer.json").write_text(json.dumps({**saved, **setting}))
        tok = load_tokenizer(base)
        assert [tok.encode(t) for t in texts[:5]] == [whole.encode(t) for t in texts[:5]], setting
        assert max(len(tok.encode(t)) for t in texts[:5]) > 8


def test_preprocess_takes_a_list_of_sentences_as_one_document(tmp_path):
    """Pai's and Megatron-LM's preprocessing take {"text": ["s1", "s2"]} (their --split-sentences output) as one
    document of the sentences tokenized one by one; every such line was skipped as 'not a string'."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_patch.tokenizer import load_tokenizer
    from megatron_patch.training.preprocess import preprocess

    texts = make_texts(30, seed=5)
    tok_dir = make_tokenizer(tmp_path / "tok", texts, vocab_size=190)
    tok = load_tokenizer(tok_dir)
    write_jsonl(tmp_path / "in.jsonl", [{"text": texts[:3]}, {"text": texts[3]}, {"text": [1, 2]}])
    report = preprocess(tmp_path / "in.jsonl", str(tmp_path / "t"), tok_dir, progress=False)
    ds = IndexedDataset(report.output_prefix)
    assert len(ds) == 2
    assert ds[0].tolist() == [i for t in texts[:3] for i in tok.encode(t)] + [tok.eod]
    assert ds[1].tolist() == tok.encode(texts[3]) + [tok.eod]


@pytest.mark.slow
def test_validation_runs_at_its_interval_and_after_the_last_iteration(corpus, tmp_path):
    """Megatron-LM's pretrain(), which Pai runs, validates once more after its loop: a 3-iteration run with
    MP_EVAL_INTERVAL=2 validated after iteration 2 only (and with the default 10000, never)."""
    out = tmp_path / "out"
    args = _pretrain_args(corpus, out, TRAIN_TOKENS_OR_ITERS=str(3 * GBS * SEQ), WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ),
                          VALID_DATASET_PATH=corpus["prefix"])
    proc = launch(args, {"MP_EVAL_INTERVAL": "2", "MP_EVAL_ITERS": "1", "MP_SAVE": "false"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "valid_loss" in r] == [2, 3]
    assert "the validation loss is not held out" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_mp_split_validates_on_documents_training_never_reads(corpus, tmp_path):
    """Pai's pretraining launcher holds 1% of DATASET_PATH out for validation (--split 99,1,0), and ignores
    VALID_DATASET_PATH (its README gives the same prefix): MP_SPLIT does so here."""
    from megatron_patch.training.data import build_pretraining_datasets
    from megatron_patch.training.validation import resolve

    out = tmp_path / "out"
    args = _pretrain_args(corpus, out, TRAIN_TOKENS_OR_ITERS=str(3 * GBS * SEQ), WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ),
                          VALID_DATASET_PATH=corpus["prefix"])
    env = {"MP_SPLIT": "98,2,0", "MP_EVAL_INTERVAL": "2", "MP_EVAL_ITERS": "1", "MP_SAVE": "false"}
    cfg = resolve("llama3_1", args, env=env)
    train, valid = build_pretraining_datasets(cfg, cfg.train_iters * cfg.global_batch_size,
                                              cfg.eval_iters * cfg.global_batch_size)
    held, trained = set(valid.indices.tolist()), set(train.indices.tolist())
    assert len(held) == 40 and not held & trained and len(held | trained) == 2000
    assert set(valid.document_index.tolist()) <= held and set(train.document_index.tolist()) <= trained

    # a weighted blend, each prefix split alike (megatron-core refused the unsized test share of a weighted blend)
    from megatron_patch.training.preprocess import preprocess

    write_jsonl(tmp_path / "more.jsonl", [{"text": t} for t in corpus["texts"][:300]])
    more = preprocess(tmp_path / "more.jsonl", str(tmp_path / "more"), corpus["tok"], progress=False).output_prefix
    args = _pretrain_args(corpus, out, TRAIN_TOKENS_OR_ITERS=str(3 * GBS * SEQ), WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ),
                          DATASET_PATH=f"0.7 {corpus['prefix']} 0.3 {more}")
    proc = launch(args, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "not held out" not in proc.stdout + proc.stderr
    records = [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "valid_loss" in r] == [2, 3]


def test_mp_split_takes_shares_and_refuses_other_validation_data(corpus, tmp_path, monkeypatch, capsys):
    from megatron_patch.training.validation import resolve

    def refusal(env, **over):
        with pytest.raises(UserError) as err:
            resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out", **over), env=env)
        return str(err.value)

    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                         parse_and_normalize_split)

    from megatron_patch.training.data_files import check_training_data, split_counts
    from megatron_patch.training.preprocess import preprocess

    cfg = resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out"), env={"MP_SPLIT": "99/1"})
    assert cfg.split == "99,1,0" and cfg.valid_dataset_path is None
    # megatron-core reads the string's digits alone: no exponent
    assert resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out"), env={"MP_SPLIT": "1,1e-5"}).split == \
        "1,0.00001,0"
    assert "holds nothing out for validation" in refusal({"MP_SPLIT": "100,0,0"})
    assert "leaves nothing to train on" in refusal({"MP_SPLIT": "0,1,0"})
    # elements per share as megatron-core's builder cuts them
    for split in ("99,1,0", "98,1,1", "1,1,1", "7,2,1"):
        matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
        for n in (1, 10, 49, 50, 51, 2000):
            want = [0 if b is None else int(round(b[1] * n)) - int(round(b[0] * n)) for b in matrix]
            assert split_counts(split, n) == want, (split, n)
    # a corpus too small for a validation document: refused before launch (megatron-core looped forever)
    write_jsonl(tmp_path / "ten.jsonl", [{"text": t} for t in corpus["texts"][:10]])
    ten = preprocess(tmp_path / "ten.jsonl", str(tmp_path / "ten"), corpus["tok"], progress=False).output_prefix
    with pytest.raises(UserError, match="MP_SPLIT=99,1,0 leaves none of the 10 documents of .* for validation"):
        check_training_data(resolve("llama3_1", _pretrain_args(corpus, tmp_path / "o", DATASET_PATH=ten),
                                    env={"MP_SPLIT": "99,1,0"}))
    monkeypatch.setenv("MP_SPLIT", "99,1,0")  # the dry run says so too
    monkeypatch.setenv("MP_DRY_RUN", "1")
    assert main(["train", "llama3_1", *_pretrain_args(corpus, tmp_path / "dry", DATASET_PATH=ten)]) == 2
    assert "leaves none of the 10 documents" in capsys.readouterr().err
    assert "takes train,valid,test shares" in refusal({"MP_SPLIT": "99,1,0,0"})
    assert "takes train,valid,test shares" in refusal({"MP_SPLIT": "a,b"})
    other = refusal({"MP_SPLIT": "99,1,0"}, VALID_DATASET_PATH=f"0.5 {corpus['prefix']}")
    assert "VALID_DATASET_PATH names other data" in other
    # the same blend written otherwise (weights scaled, entries reordered) is DATASET_PATH, held out
    for data, valid in ((f"0.5 {corpus['prefix']} 0.5 {ten}", f"1 {ten} 1 {corpus['prefix']}"),
                        (f"{corpus['prefix']} {ten}", f"{ten} {corpus['prefix']}")):
        args = _pretrain_args(corpus, tmp_path / "out", DATASET_PATH=data, VALID_DATASET_PATH=valid)
        assert resolve("llama3_1", args, env={"MP_SPLIT": "90,10,0"}).valid_dataset_path is None
    # data listed twice: megatron-core reads both copies in the same order, each sample twice in a row
    for name in ("DATASET_PATH", "VALID_DATASET_PATH"):
        for listed in (f"{corpus['prefix']} {corpus['prefix']}", f"1 {corpus['prefix']} 1 {corpus['prefix']}"):
            assert refusal({}, **{name: listed}) == (
                f"{name} lists {corpus['prefix']} twice: megatron-core would read both in the same order, each sample "
                "twice in a row; give it once, with a larger weight to read it more ('W1 P1 W2 P2 ...')")
    # DATASET_PATH's own files, spelled relative or through a link, are DATASET_PATH: held out with MP_SPLIT, and
    # said to be training data without it (compared as strings, they were other data, and no note said so)
    (tmp_path / "link").symlink_to(Path(corpus["prefix"]).parent)
    monkeypatch.chdir(Path(corpus["prefix"]).parent.parent)
    for same in (os.path.relpath(corpus["prefix"]), str(tmp_path / "link" / Path(corpus["prefix"]).name)):
        assert resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out", VALID_DATASET_PATH=same),
                       env={"MP_SPLIT": "99,1,0"}).valid_dataset_path is None
        notes = resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out", VALID_DATASET_PATH=same), env={}).notes
        assert any(n.startswith("VALID_DATASET_PATH is training data") for n in notes), notes
    sft = refusal({"MP_SPLIT": "99,1,0", "MP_TOKENIZER": str(corpus["tok"])}, SFT="true",
                  DATASET_PATH=str(write_jsonl(tmp_path / "r.jsonl", [{"prompt": "a", "response": "b"}])))
    assert "with SFT=true give the validation records as VALID_DATASET_PATH" in sft


def test_mp_split_counts_sequences_as_megatron_core_splits_gpt_data(corpus, tmp_path):
    """megatron-core's GPTDataset splits a prefix by sequence (``numel_low_level_dataset``): on Megatron-LM's and
    Pai's sentence-split data (here 50 documents of 10 sequences) MP_SPLIT=99,1,0 holds out 5 sequences, and the
    check, counting 50 documents, refused it as leaving none for validation."""
    import numpy
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    from megatron_patch.training.data_files import check_training_data, split_counts
    from megatron_patch.training.validation import resolve

    def sentences(name: str, documents: int) -> str:
        prefix = str(tmp_path / name)
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy.int32)
        for d in range(documents):
            for s in range(10):
                builder.add_item(torch.full((20,), 10 + (10 * d + s) % 150, dtype=torch.int32))
            builder.end_document()
        builder.finalize(prefix + ".idx")
        return prefix

    def checked(prefix: str):
        return check_training_data(resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out", DATASET_PATH=prefix),
                                           env={"MP_SPLIT": "99,1,0"}))

    fifty = sentences("fifty", 50)
    elements = GPTDataset.numel_low_level_dataset(IndexedDataset(fifty))
    assert elements == 500 and split_counts("99,1,0", elements)[1] == 5
    checked(fifty)
    with pytest.raises(UserError, match=r"MP_SPLIT=99,1,0 leaves none of the 50 sequences \(5 documents\) of .*five "
                                        "for validation"):
        checked(sentences("five", 5))


def _prefixes(corpus, root: Path, **documents: slice) -> dict[str, str]:
    """Prefixes of ``mpatch preprocess`` output, each of the corpus's documents ``documents[name]``."""
    from megatron_patch.training.preprocess import preprocess

    made = {}
    for name, part in documents.items():
        write_jsonl(root / f"{name}.jsonl", [{"text": t} for t in corpus["texts"][part]])
        made[name] = preprocess(root / f"{name}.jsonl", str(root / name), corpus["tok"], progress=False).output_prefix
    return made


@contextlib.contextmanager
def _world_of_one(tmp_path: Path):
    """A gloo group of this process alone, which megatron-core's BlendedDataset asks its rank of (an earlier test of
    this worker may have left one, which serves as well)."""
    ours = not torch.distributed.is_initialized()
    if ours:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                                             world_size=1)
    try:
        yield
    finally:
        if ours:
            torch.distributed.destroy_process_group()


def test_a_list_without_weights_read_past_its_epoch_is_blended_by_its_samples(corpus, tmp_path):
    """megatron-core builds one epoch of prefixes listed without weights (Megatron-LM stops when it runs out): a run
    that reads more read that epoch again and again in the same order. They are blended by each prefix's samples of
    that epoch instead, each prefix repeated as one prefix alone is."""
    from megatron_patch.training.data import BLEND_SOURCE, build_pretraining_datasets
    from megatron_patch.training.data_files import one_epoch
    from megatron_patch.training.validation import resolve

    made = _prefixes(corpus, tmp_path, a=slice(0, 20), b=slice(20, 35))
    epoch = [one_epoch(made[name], SEQ)[1] for name in "ab"]
    iters = 3 * sum(epoch) // GBS + 1
    cfg = resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out", DATASET_PATH=f"{made['a']} {made['b']}",
                                             TRAIN_TOKENS_OR_ITERS=str(iters * GBS * SEQ)), env={})
    trained = iters * GBS
    with _world_of_one(tmp_path):
        train, _ = build_pretraining_datasets(cfg, trained, 0)
        within = resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out", DATASET_PATH=f"{made['a']} {made['b']}",
                                                    TRAIN_TOKENS_OR_ITERS=str(3 * GBS * SEQ)), env={})
        one = build_pretraining_datasets(within, 3 * GBS, 0)[0]
    assert len(train) >= trained  # megatron-core's one epoch held sum(epoch) samples, read over and over
    samples = [train[i] for i in range(trained)]
    from_a = sum(int(s[BLEND_SOURCE]) == 0 for s in samples)
    assert abs(from_a - trained * epoch[0] / sum(epoch)) <= 1, (from_a, epoch)
    tokens = [tuple(s["tokens"].tolist()) for s in samples]
    first = tokens[:sum(epoch)]
    assert tokens[sum(epoch):2 * sum(epoch)] != first and len(set(first)) > 0.9 * len(first)

    # within one epoch megatron-core's own blend by lengths is kept, as Megatron-LM's
    assert [len(d) for d in one.datasets] == epoch and len(one) == 3 * GBS


def test_two_lengths_read_the_same_sample_order_exactly_where_the_resume_says_so(corpus, tmp_path):
    """A run extended to more iterations was told its order might not continue even within one epoch (the tdoc
    audit): whether it does is now worked out from each prefix's epochs (``data_files.sample_order``). Checked
    against the orders megatron-core builds, for one prefix, MP_SPLIT, a weighted blend and a list without weights,
    at lengths within, across and past epochs: the same key exactly where the shorter run's samples come first."""
    from megatron_patch.training.data import build_pretraining_datasets
    from megatron_patch.training.data_files import inferred_weights, one_epoch, sample_order
    from megatron_patch.training.validation import resolve

    made = _prefixes(corpus, tmp_path, a=slice(0, 20), b=slice(20, 35))
    iterations = range(1, math.ceil(4 * one_epoch(made["a"], SEQ)[1] / GBS) + 1)  # every length to 4 epochs of a
    cases = {"one": (made["a"], {}), "split": (made["a"], {"MP_SPLIT": "90,10,0"}),
             "one weighted": (f"2 {made['a']}", {}), "weighted": (f"1 {made['a']} 2 {made['b']}", {}),
             "weighted split": (f"1 {made['a']} 2 {made['b']}", {"MP_SPLIT": "90,10,0"}),
             "unweighted": (f"{made['a']} {made['b']}", {})}
    told, seen = 0, set()
    with _world_of_one(tmp_path):
        for name, (data, env) in cases.items():
            orders = {}
            for n in iterations:
                cfg = resolve("llama3_1", _pretrain_args(corpus, tmp_path / name, DATASET_PATH=data,
                                                         TRAIN_TOKENS_OR_ITERS=str(n * GBS * SEQ),
                                                         WARMUP_TOKENS_OR_ITERS="0"), env=env)
                samples = n * GBS
                key = sample_order(cfg, samples, cfg.dataset_weights or inferred_weights(cfg, samples))
                train = build_pretraining_datasets(cfg, samples, GBS if env else 0)[0]
                orders[n] = (key, [tuple(train[i]["tokens"].tolist()) for i in range(samples)])
            for short, long in itertools.combinations(iterations, 2):
                (key_short, short_order), (key_long, long_order) = orders[short], orders[long]
                same = long_order[:len(short_order)] == short_order
                assert (key_short == key_long) == same, (name, short, long, key_short, key_long)
                told += not same
                seen.add(same)
    assert seen == {True, False} and told >= 20, told  # both cases met, in more than one setting


@pytest.mark.slow
def test_a_run_past_the_epoch_of_a_list_without_weights_says_how_it_blends_it(corpus, tmp_path):
    made = _prefixes(corpus, tmp_path, a=slice(0, 20), b=slice(20, 35))
    out = tmp_path / "out"
    proc = launch(_pretrain_args(corpus, out, DATASET_PATH=f"{made['a']} {made['b']}",
                                 TRAIN_TOKENS_OR_ITERS=str(5 * GBS * SEQ), WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ)),
                  {"MP_SAVE": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from megatron_patch.training.data_files import one_epoch

    a, b = (one_epoch(made[name], SEQ)[1] for name in "ab")
    assert a + b < 5 * GBS
    assert (f"note: DATASET_PATH lists 2 prefixes without weights, whose one epoch holds {a + b} samples, and the run "
            f"trains {5 * GBS}: they are blended by the samples of that epoch ({a} {made['a']} {b} {made['b']})"
            in proc.stdout), proc.stdout[-3000:]
    assert [r["iteration"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]


def test_a_prefix_without_one_sample_in_a_list_without_weights_is_refused(corpus, tmp_path):
    """It would weigh 0 in megatron-core's blend by lengths, whose BlendedDataset stopped on it (an internal error);
    alone, or weighted, it is repeated over epochs."""
    from megatron_patch.training.data_files import check_data_settings, one_epoch
    from megatron_patch.training.validation import resolve

    made = _prefixes(corpus, tmp_path, big=slice(0, 200), small=slice(200, 201))
    small_tokens = one_epoch(made["small"], SEQ)[0]
    assert small_tokens <= SEQ

    def check(env=None, **over):
        check_data_settings(resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out", **over), env=env or {}))

    for name in ("DATASET_PATH", "VALID_DATASET_PATH"):
        with pytest.raises(UserError, match=rf"^{name} lists 2 prefixes without weights, .* and {made['small']} "
                                            rf"holds {small_tokens} tokens: not one sample of SEQ_LEN {SEQ} \+ 1"):
            check(**{name: f"{made['big']} {made['small']}"})
        check(**{name: f"0.9 {made['big']} 0.1 {made['small']}"})
    check(DATASET_PATH=made["small"])
    # MP_SPLIT: each share of each prefix is blended by its samples
    with pytest.raises(UserError, match=r"its MP_SPLIT=90,10,0 validation share holds 74 tokens: not one sample"):
        ten = _prefixes(corpus, tmp_path, ten=slice(300, 310))["ten"]  # one document held out: 74 tokens
        check({"MP_SPLIT": "90,10,0"}, DATASET_PATH=f"{made['big']} {ten}", SEQ_LEN="128")


def _swapped_tokenizer(base: Path, folder: Path, eos: str | None = None) -> Path:
    """``base``'s tokenizer with two merged tokens' ids swapped (the same size, other ids: another tokenizer), or
    with ``eos``, its vocabulary untouched, as the end-of-document token."""
    shutil.copytree(base, folder)
    if eos is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": "<s>"}))
        return folder
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def test_data_preprocessed_with_another_tokenizer_of_the_same_size_is_refused(corpus, tmp_path, monkeypatch,
                                                                               capsys):
    """Its ids stand for other tokens, which the vocabulary's size (all the launch checked) does not show: the
    model trained on other text than the corpus without a word. The manifest records the tokenizer's vocabulary;
    the launch compares it with the run's tokenizer (MP_TOKENIZER, else the checkpoint's) and refuses another."""
    from tokenizers import Tokenizer

    from megatron_patch.checkpoint_files.manifest import read_manifest
    from megatron_patch.training.data_files import check_data_settings, check_training_data, manifest_path
    from megatron_patch.training.preprocess import preprocess
    from megatron_patch.training.validation import resolve

    swapped = _swapped_tokenizer(Path(corpus["tok"]), tmp_path / "swapped")
    write_jsonl(tmp_path / "part.jsonl", [{"text": t} for t in corpus["texts"][:300]])
    ours = preprocess(tmp_path / "part.jsonl", str(tmp_path / "ours"), corpus["tok"], progress=False).output_prefix
    other = preprocess(tmp_path / "part.jsonl", str(tmp_path / "other"), swapped, progress=False).output_prefix

    def notes(prefix, tokenizer=corpus["tok"], check=check_data_settings):
        env = {"MP_TOKENIZER": str(tokenizer)} if tokenizer else {}
        return check(resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out", DATASET_PATH=prefix), env=env))

    assert notes(ours) == [] and notes(other, swapped) == []
    for check in (check_data_settings, check_training_data):  # the dry run's check and the launch's
        with pytest.raises(UserError, match=rf"^{other} was preprocessed with the tokenizer of {swapped}, whose ids "
                                            rf"do not all stand for the same tokens in MP_TOKENIZER {corpus['tok']} "
                                            r"\(both \d+ ids\): the model would train on other text"):
            notes(other, check=check)
    with pytest.raises(UserError, match=rf"^{ours} was preprocessed .* in MP_TOKENIZER {swapped}"):
        notes(f"{other} {ours}", swapped)  # each prefix of a list; a validation prefix too
    with pytest.raises(UserError, match=rf"^{other} was preprocessed"):
        check_data_settings(resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out", VALID_DATASET_PATH=other),
                                    env={"MP_TOKENIZER": str(corpus["tok"])}))
    # without a tokenizer to compare with, or without a record (another tool's data, an older mpatch's), a note
    assert notes(other, None) == ["the data's tokenizer is not compared with the model's: the run has none (set "
                                  "MP_TOKENIZER, or give a PRETRAIN_CHECKPOINT_PATH that carries tokenizer.json)"]
    manifest = manifest_path(other)
    recorded, unrecorded = manifest.read_text(), read_manifest(manifest)
    del unrecorded["tokenizer"]
    manifest.write_text(json.dumps(unrecorded))
    assert notes(other) == [f"{other}: no record of the tokenizer the data was preprocessed with (another tool's "
                            "data, or mpatch preprocess's before it kept one), so its ids are checked against the "
                            "model's vocabulary size only"]
    manifest.write_text(json.dumps({**unrecorded, "tokenizer": {"path": "x", "ids": "200"}}))
    with pytest.raises(UserError, match=r"'tokenizer' record is malformed: the manifest is damaged"):
        notes(other)
    manifest.write_text(recorded)
    # the same vocabulary with another end-of-document token: trains, with a note of what documents end with
    eos = _swapped_tokenizer(Path(corpus["tok"]), tmp_path / "eos", eos="<s>")
    assert notes(ours, eos) == [f"the documents of {ours} end with '</s>' (id 2), the end-of-document token of the "
                                f"tokenizer it was preprocessed with; MP_TOKENIZER {eos} ends a document with '<s>' "
                                "(id 1)"]
    # the launcher's dry run shows the note; the launch refuses the other tokenizer's data before any rank starts
    monkeypatch.setenv("MP_TOKENIZER", str(eos))
    monkeypatch.setenv("MP_DRY_RUN", "1")
    assert main(["train", "llama3_1", *_pretrain_args(corpus, tmp_path / "dry", DATASET_PATH=ours)]) == 0
    assert f"note: the documents of {ours} end with '</s>'" in capsys.readouterr().out
    monkeypatch.setenv("MP_DRY_RUN", "0")
    assert main(["train", "llama3_1", *_pretrain_args(corpus, tmp_path / "run", DATASET_PATH=other)]) == 2
    assert f"{other} was preprocessed with the tokenizer of {swapped}" in capsys.readouterr().err
    monkeypatch.delenv("MP_TOKENIZER")
    # a run's checkpoint/ folder carries its tokenizer in the iteration it loads: compared from there too (the data
    # audit: "the run has none", and the other tokenizer's data trained)
    run_checkpoint = _a_runs_checkpoint_folder(Path(corpus["tok"]), tmp_path / "earlier")
    from_run = resolve("llama3_1", _pretrain_args(corpus, tmp_path / "out", DATASET_PATH=other,
                                                  PRETRAIN_CHECKPOINT_PATH=str(run_checkpoint), MODEL_SIZE="auto"))
    with pytest.raises(UserError, match=rf"^{other} was preprocessed .* in the tokenizer of PRETRAIN_CHECKPOINT_PATH "
                                        rf"{run_checkpoint / 'iter_0000003'} \("):
        check_data_settings(from_run)
    # a tokenizer that extends the data's (a pad token added past its ids) gives each of the data's ids the same
    # token: accepted (it was refused); data of the extended one is refused with the base's
    extended = tmp_path / "extended"
    shutil.copytree(corpus["tok"], extended)
    pad = Tokenizer.from_file(str(extended / "tokenizer.json"))
    assert pad.add_special_tokens(["<pad>"]) == 1
    pad.save(str(extended / "tokenizer.json"))
    assert notes(ours, extended) == []
    with_pad = preprocess(tmp_path / "part.jsonl", str(tmp_path / "with_pad"), extended,
                          progress=False).output_prefix
    with pytest.raises(UserError, match=rf"^{with_pad} was preprocessed .* \((\d+) ids against (?!\1)\d+\)"):
        notes(with_pad)


def _a_runs_checkpoint_folder(tokenizer: Path, root: Path) -> Path:
    """A training run's ``checkpoint/`` folder (tracker and ``iter_0000003/``, whose files carry the tokenizer) of
    a tiny Llama, made from a conversion without training."""
    from megatron_patch.checkpoint_files.layout import TRACKER_NAME
    from megatron_patch.checkpoint_files.manifest import write_manifest
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime import ParallelLayout

    hf = make_tiny_hf_checkpoint("llama3_1", root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, hf / name)
    hf_to_mcore(hf, root / "converted", ParallelLayout(), progress=False)
    iteration = root / "checkpoint" / "iter_0000003"
    shutil.copytree(root / "converted" / "release", iteration)
    for name in ("tokenizer.json", "tokenizer_config.json", "mpatch_checkpoint.json"):
        shutil.copy(root / "converted" / name, iteration / name)
    write_manifest(iteration, "mpatch train")
    (root / "checkpoint" / TRACKER_NAME).write_text("3")
    return root / "checkpoint"


# --- pretraining at TP=2: the loss falls, and a resumed run is the same run ----------------------------

@pytest.fixture(scope="module")
def tp2_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tp2") / "out"
    args = _pretrain_args(corpus, out, TP="2", SP="true", DO="true")
    proc = launch(args, {"MP_TP_COMM_OVERLAP": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"out": out, "args": args, "stdout": proc.stdout}


@pytest.mark.slow
def test_tp2_loss_falls_on_real_text(tp2_run):
    m = read_metrics(tp2_run["out"])
    losses = [x["loss"] for x in m]
    assert [x["iteration"] for x in m] == list(range(1, ITERS + 1))
    assert 5.0 < losses[0] < 6.0, losses  # about ln(256) at initialisation
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    for key in ("grad_norm", "tokens_per_s", "tflops_per_gpu", "memory_gib"):
        assert all(x[key] is not None and x[key] > 0 for x in m), key
    assert m[0]["loss_tokens"] == GBS * SEQ
    # Each record's rate is the one its update applied: megatron-core's schedule after the steps before it, so the
    # first warm-up update runs at 0 and the last one step short of MIN_LR (the num audit: records showed the next
    # iteration's rate, as Megatron-LM's log does).
    saved = json.loads((tp2_run["out"] / "checkpoint" / f"iter_{ITERS:07d}" / "train_state.json").read_text())["config"]
    warmup, decay, top, low = saved["warmup_iters"], saved["lr_decay_iters"], saved["lr"], saved["min_lr"]
    assert 0 < warmup < ITERS == decay, saved

    def scheduled(steps: int) -> float:
        if steps <= warmup:
            return top * steps / warmup
        return low + 0.5 * (math.cos(math.pi * (steps - warmup) / (decay - warmup)) + 1) * (top - low)

    assert [x["lr"] for x in m] == pytest.approx([scheduled(i - 1) for i in range(1, ITERS + 1)], rel=1e-9, abs=0)
    assert m[0]["lr"] == 0.0 and m[-1]["lr"] > low
    assert "iter     20/20 | loss" in tp2_run["stdout"] and "| TFLOP/s/proc " in tp2_run["stdout"]
    assert " TFLOP/s per process, peak memory" in tp2_run["stdout"]  # a CPU rank is no GPU, in the summary too
    # The first iteration is the warm-up, left out of the throughput summary.
    assert [x["warmup"] for x in m] == [True] + [False] * (ITERS - 1)
    summary = json.loads((tp2_run["out"] / "log" / "throughput.json").read_text())
    steady = m[1:]
    assert summary["iterations"] == [2, ITERS] and summary["warmup_excluded"] == 1
    assert abs(summary["tokens_per_s"] - GBS * SEQ * len(steady) / sum(x["iteration_s"] for x in steady)) < 1e-6
    assert "throughput over iterations 2..20 (1 warm-up iteration(s) left out)" in tp2_run["stdout"]
    assert list((tp2_run["out"] / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_checkpoints_are_complete_and_marked(tp2_run):
    ckpt = tp2_run["out"] / "checkpoint"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "20"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000010", "iter_0000020", "latest_checkpointed_iteration.txt"]
    it = ckpt / "iter_0000020"
    assert (it / "metadata.json").exists()
    # megatron's common state (common.pt up to megatron-core 0.16, an object in the .distcp files from 0.19).
    common = TorchDistReader(it).common_state()
    assert common["iteration"] == 20 and common["consumed_samples"] == 20 * GBS
    assert sorted(p.name for p in (it / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    state = json.loads((it / "train_state.json").read_text())
    assert state["iteration"] == 20 and state["consumed_samples"] == 20 * GBS


@pytest.mark.slow
def test_stop_after_checkpoint_and_restart_gives_the_same_losses(tp2_run, corpus, tmp_path):
    out = tmp_path / "out"
    args = _pretrain_args(corpus, out, TP="2", SP="true", DO="true")
    first = launch(args, {"MP_TP_COMM_OVERLAP": "false", "MP_EXIT_INTERVAL": "10"})
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoint" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    assert len(read_metrics(out)) == 10
    # A save that died half-way must not be mistaken for a checkpoint.
    dead = subprocess.Popen(["true"])
    dead.wait()
    (partial_dir(out / "checkpoint" / "iter_0000015", pid=dead.pid) / "model").mkdir(parents=True)
    second = launch(args, {"MP_TP_COMM_OVERLAP": "false"})
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "iter_0000010" in second.stdout
    resumed = read_metrics(out)
    reference = read_metrics(tp2_run["out"])
    assert [x["iteration"] for x in resumed] == list(range(1, ITERS + 1))
    assert [x["iteration"] for x in resumed if x["warmup"]] == [1, 11]  # each process's first iteration
    for a, b in zip(resumed, reference):
        assert abs(a["loss"] - b["loss"]) < 1e-6, (a["iteration"], a["loss"], b["loss"])
        assert abs(a["lr"] - b["lr"]) < 1e-12 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-5


# --- PP=2 from a converted checkpoint --------------------------------------------------------------------

@pytest.fixture(scope="module")
def converted(corpus, tmp_path_factory):
    """A tiny random Llama-3.1 HF model with the corpus's tokenizer, and its hf2mcore conversion at TP=2
    (torch_dist)."""
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("converted")
    hf = make_tiny_hf_checkpoint("llama3_1", root / "hf", seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(corpus["tok"] / name, hf / name)
    (hf / "LICENSE").write_text("LLAMA 3.1 COMMUNITY LICENSE AGREEMENT")
    mc = root / "mcore"
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(mc), "--tp", "2", "--quiet"]) == 0
    return {"hf": hf, "mcore": mc}


def _from_converted_args(corpus, converted, out, **over):
    return _pretrain_args(corpus, out, PP="2", MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(converted["mcore"]),
                          LR="1e-3", TRAIN_TOKENS_OR_ITERS=str(6 * GBS * SEQ), WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ),
                          **over)


@pytest.fixture(scope="module")
def pp2_run(corpus, converted, tmp_path_factory):
    out = tmp_path_factory.mktemp("pp2") / "out"
    args = _from_converted_args(corpus, converted, out)
    proc = launch(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"out": out, "args": args, "stdout": proc.stdout}


@pytest.mark.slow
def test_pp2_starts_from_converted_checkpoint(pp2_run, converted, tmp_path):
    hf, out, args, stdout = converted["hf"], pp2_run["out"], pp2_run["args"], pp2_run["stdout"]
    assert "loaded pretrained weights" in stdout
    losses = [x["loss"] for x in read_metrics(out)]
    assert len(losses) == 6 and losses[-1] < losses[0]

    # The first global batch, read the way training reads it, through transformers' model.
    before = hf_loss_on_first_batch(hf, "llama3_1", args)
    assert abs(losses[0] - before) < 1e-4, (losses[0], before)

    # The trained model goes back to HF through the converter and has learned: lower loss on that batch.
    back = tmp_path / "hf_trained"
    assert main(["convert", "mcore2hf", "--load-dir", str(out / "final"), "--save-dir", str(back), "--quiet"]) == 0
    after = hf_loss_on_first_batch(back, "llama3_1", args)
    assert after < before - 0.05, (after, before)


@pytest.mark.slow
def test_pretraining_with_documents_kept_apart_trains_each_document_alone(corpus, converted, tmp_path):
    """Pai's pretraining launcher with MP_SFT_PACKING=true (``--reset-position-ids``, THD): each document of a sample
    attends within itself. At PP=2 the first loss is transformers' on each document of the first batch run alone."""
    from megatron_patch.tokenizer import load_tokenizer

    out = tmp_path / "out"
    args = _from_converted_args(corpus, converted, out)
    proc = launch(args, {"MP_SFT_PACKING": "true"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    eod = load_tokenizer(converted["hf"]).eod
    assert f"positions restarting after each end-of-document token (id {eod}," in proc.stdout
    losses = [x["loss"] for x in read_metrics(out)]
    apart = hf_loss_on_first_batch(converted["hf"], "llama3_1", args, documents_apart_at=eod)
    together = hf_loss_on_first_batch(converted["hf"], "llama3_1", args)
    assert abs(losses[0] - apart) < 1e-4, (losses[0], apart)
    assert abs(together - apart) > 1e-3, (together, apart)  # the first batch holds documents that were cut
    assert losses[-1] < losses[0]


def test_pretraining_documents_kept_apart_need_data_that_marks_their_ends(corpus, tmp_path):
    """MP_SFT_PACKING=true in pretraining cuts documents after each end-of-document token: data preprocessed without
    it (--no-append-eod) had none kept apart, while the run said each sample's documents were. Refused before launch
    now; the tokenizer may be a tiktoken folder (Kimi-K2's), which was refused as missing."""
    from megatron_patch.training.data_files import check_training_data, end_of_document
    from megatron_patch.training.preprocess import preprocess
    from megatron_patch.training.validation import resolve

    write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in corpus["texts"][:40]])
    without = preprocess(tmp_path / "docs.jsonl", str(tmp_path / "bare"), corpus["tok"], append_eod=False,
                         progress=False).output_prefix
    env = {"MP_SFT_PACKING": "true", "MP_TOKENIZER": str(corpus["tok"])}
    check_training_data(resolve("llama3_1", _pretrain_args(corpus, tmp_path / "a"), env=env))
    with pytest.raises(UserError, match=r"40 of the 40 documents of .*bare_text_document do not end with the "
                                        r"end-of-document token \d+ .*preprocess them with it appended"):
        check_training_data(resolve("llama3_1", _pretrain_args(corpus, tmp_path / "b", DATASET_PATH=without), env=env))

    kimi = tmp_path / "kimi"
    kimi.mkdir()
    make_tiktoken_file(kimi / "tiktoken.model", [b"th", b"he"])
    (kimi / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "[EOS]", "added_tokens_decoder": {"258": {"content": "[EOS]", "special": True}}}))
    cfg = resolve("llama3_1", _pretrain_args(corpus, tmp_path / "c"), env={**env, "MP_TOKENIZER": str(kimi)})
    assert end_of_document(cfg) == (258, "[EOS]")


@pytest.mark.slow
def test_every_checkpoint_of_a_run_exports_with_its_tokenizer(pp2_run, converted, tmp_path, capsys):
    """Not only final/: each iteration a run saves carries the tokenizer, generation and licence files of the
    checkpoint it started from, so 'mpatch convert mcore2hf' of the run's checkpoint folder (or an older iteration)
    is a whole HF folder."""
    hf, ckpt = converted["hf"], pp2_run["out"] / "checkpoint"
    side = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "LICENSE")
    for i, folder in enumerate((ckpt, ckpt / "iter_0000006")):
        back = tmp_path / f"back{i}"
        assert main(["convert", "mcore2hf", "--load-dir", str(folder), "--save-dir", str(back), "--quiet"]) == 0
        assert all((back / n).read_bytes() == (hf / n).read_bytes() for n in side), sorted(p.name for p in back.iterdir())
    assert "no tokenizer files" not in capsys.readouterr().err


def _load_balancing_loss_of_first_batch(hf_dir: Path, args: list[str]) -> float:
    """Megatron-LM's load-balancing loss (Switch Transformer's E * sum_i f_i * P_i, from a softmax router's top-k),
    computed from transformers' router logits on the first global batch: the mean over MoE layers and
    micro-batches."""
    from transformers import AutoModelForCausalLM

    from megatron_patch.training.data import build_pretraining_datasets, micro_batches
    from megatron_patch.training.validation import resolve

    cfg = resolve("qwen3_moe", args, env={})
    train, _ = build_pretraining_datasets(cfg, cfg.train_iters * cfg.global_batch_size, 0)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    experts, top = model.config.num_experts, model.config.num_experts_per_tok
    per_batch = []
    with torch.no_grad():
        for batch in micro_batches(train, 0, cfg, 0, 1):
            layers = model(input_ids=batch["tokens"], output_router_logits=True).router_logits
            losses = []
            for logits in layers:
                scores = torch.softmax(logits.float(), -1)
                routed = torch.zeros_like(scores).scatter(1, scores.topk(top, -1).indices, 1.0)
                losses.append(float(experts * (routed.mean(0) / top * scores.mean(0)).sum()))
            per_batch.append(sum(losses) / len(losses))
    return sum(per_batch) / len(per_batch)


@pytest.mark.slow
def test_the_load_balancing_loss_is_logged_as_megatron_lm_computes_it(corpus, tmp_path):
    """An MoE run's log/metrics.jsonl and console carry the routers' load-balancing loss (without its coefficient,
    the mean over MoE layers, as Megatron-LM logs it): at PP=2 with the first stage all dense, the first iteration's
    is the one transformers' router logits give."""
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from tests.training_helpers import train_converted

    hf = make_tiny_hf_checkpoint("qwen3_moe", tmp_path / "hf", seed=3, mlp_only_layers=[0, 1])
    proc, _ = train_converted("qwen3_moe", hf, corpus, tmp_path, None, {"MP_NPROC": "2"}, iters=3, PP="2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(tmp_path / "out")
    assert re.search(r"iter +1/3 \| loss [\d.]+ \| load balancing loss [\d.]+ \|", proc.stdout), proc.stdout[-2000:]
    args = launcher_args("qwen3_moe", **{
        "MODEL_SIZE": "auto", "PRETRAIN_CHECKPOINT_PATH": str(tmp_path / "mcore"), "DATASET_PATH": corpus["prefix"],
        "OUTPUT_BASEPATH": str(tmp_path / "unused"), "GLOBAL_BATCH_SIZE": "4", "BATCH_SIZE": "2", "SEQ_LEN": "32",
        "PAD_LEN": "32", "TRAIN_TOKENS_OR_ITERS": str(3 * 4 * 32), "WARMUP_TOKENS_OR_ITERS": str(4 * 32), "PP": "2"})
    expected = _load_balancing_loss_of_first_batch(hf, args)
    assert abs(records[0]["load_balancing_loss"] - expected) < 1e-5, (records[0]["load_balancing_loss"], expected)
    # each step's own, where megatron-core's tracker would sum the steps (1 for balanced routing, E at worst)
    assert all(0.9 < r["load_balancing_loss"] < 1.5 for r in records), [r["load_balancing_loss"] for r in records]


# --- virtual pipeline (MP_VP_CHUNKS): PP=2 x 2 chunks is the same computation as PP=2 ------------------------------

@pytest.mark.slow
def test_vp2_matches_pp2_and_resumes(pp2_run, corpus, converted, tmp_path):
    """4 layers at PP=2, VP=2: rank 0 holds layers 1 and 3, rank 1 layers 2 and 4 (interleaved 1F1B).

    From the same converted checkpoint on the same data, each iteration's loss must equal the plain
    PP=2 run's; the run is stopped after its checkpoint at iteration 3 (chunks saved as model0/model1)
    and restarted, so iterations 4-6 also check the resume; the exported model equals PP=2's.
    """
    out = tmp_path / "out"
    args = _from_converted_args(corpus, converted, out, SAVE_INTERVAL="3")
    first = launch(args, {"MP_VP_CHUNKS": "2", "MP_EXIT_INTERVAL": "3"})
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "loaded pretrained weights" in first.stdout and "PP=2 EP=1 VP=2" in first.stdout
    assert (out / "checkpoint" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    second = launch(args, {"MP_VP_CHUNKS": "2"})
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout and "iter_0000003" in second.stdout
    vp, ref = read_metrics(out), read_metrics(pp2_run["out"])
    assert [x["iteration"] for x in vp] == list(range(1, 7))
    assert abs(vp[0]["loss"] - ref[0]["loss"]) < 1e-5, (vp[0]["loss"], ref[0]["loss"])
    for a, b in zip(vp, ref):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a["iteration"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * b["grad_norm"], (a["iteration"], a["grad_norm"], b["grad_norm"])
    assert vp[-1]["loss"] < vp[0]["loss"] - 0.1, [x["loss"] for x in vp]

    # final/ (the chunks merged into the hf2mcore layout) converts to the same HF weights as PP=2's.
    from safetensors.torch import load_file

    for name, src in (("vp", out), ("pp", pp2_run["out"])):
        assert main(["convert", "mcore2hf", "--load-dir", str(src / "final"), "--save-dir", str(tmp_path / name),
                     "--quiet"]) == 0
    a, b = load_file(tmp_path / "vp" / "model.safetensors"), load_file(tmp_path / "pp" / "model.safetensors")
    assert a.keys() == b.keys() and len(a) == 39
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


# --- SFT ---------------------------------------------------------------------------------------------------

SFT_RECORDS = [
    {"prompt": "Where does the cat sit?", "response": "The cat sits on the warm mat."},
    {"messages": [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A green apple."},
                  {"role": "user", "content": "And a colour?"}, {"role": "assistant", "content": "A blue house."}]},
    {"instruction": "Describe the river.", "output": "A quiet river by the sea."},
]


def test_sft_loss_only_on_responses(corpus, tmp_path):
    from megatron_patch.tokenizer import load_tokenizer
    from megatron_patch.training.sft_data import SFTDataset

    tok = load_tokenizer(corpus["tok"])
    write_jsonl(tmp_path / "sft.jsonl", SFT_RECORDS)
    ds = SFTDataset(tmp_path / "sft.jsonl", tok, 128)
    expected = [["The cat sits on the warm mat."], ["A green apple.", "A blue house."], ["A quiet river by the sea."]]
    # Exactly the response tokens (each assistant turn is rendered as its text and a newline without a
    # chat template) plus the closing EOD: nothing of the prompts, not a token more or less.
    counts = [len(tok.encode("The cat sits on the warm mat.")) + 1,
              len(tok.encode("A green apple.\n")) + len(tok.encode("A blue house.\n")) + 1,
              len(tok.encode("A quiet river by the sea.")) + 1]
    for sample, answers, count in zip(ds.samples, expected, counts):
        labels, mask = sample["labels"], sample["loss_mask"]
        trained = labels[mask.bool()].tolist()
        assert int(mask.sum()) == len(trained) == count
        assert trained[-1] == tok.eod  # the model learns to stop
        text = tok.decode(trained[:-1])
        for a in answers:
            assert a.strip() in text
        assert "Where does" not in text and "Name a fruit" not in text and "user" not in text
        assert mask[labels == tok.eod].sum() == 1  # padding (eod ids after the end) carries no loss
        # The labels are the tokens shifted by one.
        n = int((sample["tokens"] != tok.eod).sum())
        assert torch.equal(sample["tokens"][1:n], labels[:n - 1])


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "A green apple."}, {"role": "user", "content": "And a colour?"},
        {"role": "assistant", "content": "A blue house."}]


def test_sft_chat_template_renders_and_masks_assistant_turns(corpus, tmp_path):
    """A tokenizer folder with a chat template: records are rendered by it, loss only on the assistant turns."""
    from transformers import AutoTokenizer

    from megatron_patch.tokenizer import load_tokenizer
    from megatron_patch.training.sft_data import SFTDataset, tokenize_record

    folder = make_chat_tokenizer(tmp_path / "chat_tok", corpus["tok"])
    tok = load_tokenizer(folder)
    assert tok.chat_template is not None
    ids, trained = tokenize_record(tok, {"messages": CHAT}, "r1")
    # Exactly what transformers' apply_chat_template makes of the same folder: the template's own ending, no EOD.
    reference = AutoTokenizer.from_pretrained(folder).apply_chat_template(CHAT, tokenize=True)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert ids == list(reference)
    assert tok.decode(ids).startswith("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    on = tok.decode([i for i, t in zip(ids, trained) if t])
    assert on == "A green apple.<|im_end|>\nA blue house.<|im_end|>\n", on
    off = tok.decode([i for i, t in zip(ids, trained) if not t])
    assert off == ("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a fruit.<|im_end|>\n"
                   "<|im_start|>assistant\n<|im_start|>user\nAnd a colour?<|im_end|>\n<|im_start|>assistant\n"), off

    # A conversation ending with a user turn trains its assistant turn only.
    ids2, trained2 = tokenize_record(tok, {"messages": CHAT[:4]}, "r2")
    assert trained2[-1] == 0 and tok.decode([i for i, t in zip(ids2, trained2) if t]) == "A green apple.<|im_end|>\n"
    # Prompt/response records are a user and an assistant turn of the same template; a folder without a
    # template keeps the plain formats.
    ids3, trained3 = tokenize_record(tok, SFT_RECORDS[0], "r3")
    assert tok.decode(ids3) == "<s><|im_start|>user\nWhere does the cat sit?<|im_end|>\n<|im_start|>assistant\n" \
                               "The cat sits on the warm mat.<|im_end|>\n"
    assert tok.decode([i for i, t in zip(ids3, trained3) if t]) == "The cat sits on the warm mat.<|im_end|>\n"
    plain_ids, _ = tokenize_record(load_tokenizer(corpus["tok"]), {"messages": CHAT}, "r4")
    assert "<|user|>" in load_tokenizer(corpus["tok"]).decode(plain_ids) and "<|im_start|>" not in tok.decode(plain_ids)

    # Through the dataset: labels under the loss mask are the assistant spans.
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}, SFT_RECORDS[0]])
    sample = SFTDataset(tmp_path / "chat.jsonl", tok, 128).samples[0]
    assert tok.decode(sample["labels"][sample["loss_mask"].bool()].tolist()) == on


def test_sft_chat_template_that_is_not_incremental_is_refused(corpus, tmp_path):
    from megatron_patch.errors import UserError
    from megatron_patch.tokenizer import load_tokenizer
    from megatron_patch.training.sft_data import tokenize_record

    # Numbers the conversation's turns up front: an earlier part is not a prefix of the whole.
    template = "{{ messages | length }} turns\n{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tok = load_tokenizer(make_chat_tokenizer(tmp_path / "t1", corpus["tok"], template))
    with pytest.raises(UserError, match="does not render message 3 as an extension"):
        tokenize_record(tok, {"messages": CHAT}, "rec 1")
    broken = load_tokenizer(make_chat_tokenizer(tmp_path / "t2", corpus["tok"], "{% if %}"))
    with pytest.raises(UserError, match="chat template of .* failed"):
        tokenize_record(broken, {"messages": CHAT}, "rec 1")


def test_sft_packing_keeps_samples_apart(corpus, tmp_path):
    from megatron_patch.tokenizer import load_tokenizer
    from megatron_patch.training.sft_data import SFTDataset

    tok = load_tokenizer(corpus["tok"])
    write_jsonl(tmp_path / "sft.jsonl", SFT_RECORDS * 4)
    plain = SFTDataset(tmp_path / "sft.jsonl", tok, 64)
    packed = SFTDataset(tmp_path / "sft.jsonl", tok, 64, packing=True)
    assert len(packed) < len(plain)
    assert sum(float(s["loss_mask"].sum()) for s in packed.samples) == sum(float(s["loss_mask"].sum()) for s in plain.samples)
    multi = [s for s in packed.samples if int((s["position_ids"] == 0).sum()) >= 2]
    assert multi, "no sample holds two records"
    s = multi[0]
    starts = (s["position_ids"] == 0).nonzero().flatten().tolist()
    assert starts[0] == 0
    # Each record starts a THD segment (attention and RoPE restart there; tests/test_training_gpu_path.py
    # checks that the packed loss equals the unpacked loss).
    assert s["doc_start"].nonzero().flatten().tolist() == starts
    from megatron_patch.training.packing import thd_batch

    _, thd = thd_batch({k: v.unsqueeze(0) for k, v in s.items()})
    assert thd["cu_seqlens"].tolist() == starts + [64]


@pytest.mark.slow
def test_sft_training_run(corpus, tmp_path):
    write_jsonl(tmp_path / "sft.jsonl", SFT_RECORDS * 8)
    out = tmp_path / "out"
    args = launcher_args("llama3_1", SFT="true", DATASET_PATH=str(tmp_path / "sft.jsonl"), OUTPUT_BASEPATH=str(out),
                         PAD_LEN="48", TRAIN_TOKENS_OR_ITERS="6", WARMUP_TOKENS_OR_ITERS="1", LR="3e-3",
                         SAVE_INTERVAL="100", GLOBAL_BATCH_SIZE="4")
    proc = launch(args, {"MP_TOKENIZER": str(corpus["tok"]), "MP_SFT_PACKING": "true"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = read_metrics(out)
    assert len(m) == 6 and m[-1]["loss"] < m[0]["loss"]
    assert all(x["loss_tokens"] < 4 * 48 for x in m)  # only response tokens count
    samples = int(re.search(r"SFT data: (\d+) samples, 24 trained in 6 steps: ", proc.stdout).group(1))
    assert f"{24 / samples:.2f} epochs" in proc.stdout and "fewer than one global batch" not in proc.stdout

    # three records and a global batch of 8: each step repeats records, which is said
    write_jsonl(tmp_path / "three.jsonl", SFT_RECORDS[:3])
    small = launch(launcher_args("llama3_1", SFT="true", DATASET_PATH=str(tmp_path / "three.jsonl"),
                                 OUTPUT_BASEPATH=str(tmp_path / "small"), PAD_LEN="48", TRAIN_TOKENS_OR_ITERS="2",
                                 WARMUP_TOKENS_OR_ITERS="0", SAVE_INTERVAL="100", GLOBAL_BATCH_SIZE="8"),
                   {"MP_TOKENIZER": str(corpus["tok"]), "MP_SAVE": "false"})
    assert small.returncode == 0, small.stdout[-3000:] + small.stderr[-3000:]
    assert "SFT data: 3 samples, 16 trained in 2 steps: 5.33 epochs" in small.stdout
    assert "note: the 3 SFT samples are fewer than one global batch (8): each step trains some of them more than " \
           "once" in small.stdout


# SFT records whose answers train 2 to 29 tokens: the two weightings of MP_SFT_LOSS differ on them
UNEVEN_SFT = [{"prompt": f"Say {n}.", "response": " ".join(["the cat sits"] * (1 + 4 * (n % 3)))} for n in range(16)]


def _sft_first_step_reference(hf_dir: Path, args: list[str], env: dict) -> dict[str, tuple[float, float]]:
    """transformers' first SFT step, computed apart from the project's loss: {weighting: (the loss the run logs,
    the gradient norm)}. ``record``: each record's mean over its trained tokens, averaged over the global batch's
    records (Pai's); ``token``: each micro-batch's token mean, averaged over micro-batches (Megatron-LM's), logged
    as the global batch's token mean. Packed records run each alone, as their attention keeps them."""
    from transformers import AutoModelForCausalLM

    from megatron_patch.training.data import micro_batches
    from megatron_patch.training.sft_data import build_sft_datasets
    from megatron_patch.training.validation import resolve

    cfg = resolve("llama3_1", args, env=env)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    train, _, _ = build_sft_datasets(cfg, model.config.vocab_size)
    batches = micro_batches(train, 0, cfg, 0, 1)  # the whole global batch, the data-parallel ranks' in order
    records, micro = [], []  # each record's (loss sum, trained tokens); each micro-batch's
    for batch in batches:
        sums = []
        for row in range(batch["tokens"].shape[0]):
            starts = batch["doc_start"][row].nonzero().flatten().tolist() if "doc_start" in batch else []
            bounds = sorted({0, *starts, batch["tokens"].shape[1]})
            for a, z in zip(bounds[:-1], bounds[1:]):
                logits = model(input_ids=batch["tokens"][row:row + 1, a:z]).logits[0]
                ce = torch.nn.functional.cross_entropy(logits, batch["labels"][row, a:z], reduction="none")
                mask = batch["loss_mask"][row, a:z].float()
                if mask.sum() > 0:
                    sums.append(((ce * mask).sum(), mask.sum()))
        records += sums
        micro.append((sum(x for x, _ in sums), sum(n for _, n in sums)))
    out = {}
    for weighting, loss, logged in (
            ("record", sum(x / n for x, n in records) / len(records), None),
            ("token", sum(x / n for x, n in micro) / len(micro), sum(x for x, _ in micro) / sum(n for _, n in micro))):
        model.zero_grad()
        loss.backward(retain_graph=True)
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
        out[weighting] = (float(loss if logged is None else logged), float(norm))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True], ids=["one-record-a-sample", "packed"])
def test_sft_weighs_each_record_alike_as_pai_does(corpus, converted, tmp_path, packing):
    """MP_SFT_LOSS=record (the default): a step's loss is the mean over the global batch's records of each record's
    mean over its trained tokens, as Pai-Megatron-Patch's SFT weighs them; MP_SFT_LOSS=token keeps Megatron-LM's
    token means. At DP=2 from a converted checkpoint, each run's first logged loss and gradient norm are
    transformers' under that weighting, and the two weightings' gradients differ on records of uneven lengths."""
    write_jsonl(tmp_path / "sft.jsonl", UNEVEN_SFT)
    env = {"MP_TOKENIZER": str(corpus["tok"]), "MP_SFT_PACKING": str(packing).lower(), "MP_SAVE": "false",
           "MP_NPROC": "2"}
    runs = {}
    for weighting in ("record", "token"):
        out = tmp_path / weighting
        args = launcher_args("llama3_1", SFT="true", DATASET_PATH=str(tmp_path / "sft.jsonl"), OUTPUT_BASEPATH=str(out),
                             MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(converted["mcore"]), PAD_LEN="64",
                             TRAIN_TOKENS_OR_ITERS="2", WARMUP_TOKENS_OR_ITERS="0", GLOBAL_BATCH_SIZE="8")
        proc = launch(args, env if weighting == "record" else {**env, "MP_SFT_LOSS": "token"})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"(MP_SFT_LOSS={weighting}" in proc.stdout
        first = read_metrics(out)[0]
        runs[weighting] = (first["loss"], first["grad_norm"])
    reference = _sft_first_step_reference(converted["hf"], args, env)
    for weighting, (loss, norm) in runs.items():
        want_loss, want_norm = reference[weighting]
        assert abs(loss - want_loss) < 1e-4 and abs(norm - want_norm) < 1e-4 * want_norm, (weighting, runs, reference)
    # 100 times the tolerance above: each run is told apart from the other weighting
    assert abs(reference["record"][1] - reference["token"][1]) > 0.01 * reference["token"][1], reference


@pytest.mark.slow
def test_a_run_saved_before_mp_sft_loss_resumes_with_the_token_weighting_it_trained_with(corpus, tmp_path):
    """MP_SFT_LOSS=record became SFT's default; a run saved before (its checkpoints record no weighting) trained
    token means, and resuming it under the new default would change its loss midway. It keeps its weighting, says
    so, and MP_SFT_LOSS given on the relaunch changes it."""
    from megatron_patch.checkpoint_files.layout import TRAIN_STATE

    write_jsonl(tmp_path / "sft.jsonl", UNEVEN_SFT)
    env = {"MP_TOKENIZER": str(corpus["tok"])}
    out = tmp_path / "out"

    def args(iterations):
        return launcher_args("llama3_1", SFT="true", DATASET_PATH=str(tmp_path / "sft.jsonl"), OUTPUT_BASEPATH=str(out),
                             PAD_LEN="64", TRAIN_TOKENS_OR_ITERS=str(iterations), WARMUP_TOKENS_OR_ITERS="0",
                             GLOBAL_BATCH_SIZE="4", SAVE_INTERVAL="1")

    first = launch(args(1), env)
    assert first.returncode == 0 and "(MP_SFT_LOSS=record" in first.stdout, first.stdout[-2000:] + first.stderr[-2000:]
    state = out / "checkpoint" / "iter_0000001" / TRAIN_STATE
    saved = json.loads(state.read_text())
    del saved["config"]["sft_loss"]  # as an earlier version saved it
    state.write_text(json.dumps(saved))
    env["MP_NO_VERIFY"] = "true"  # the file no longer matches the checkpoint's manifest
    resumed = launch(args(2), env)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "note: MP_SFT_LOSS=token: the loss weighting this run trained with (MP_SFT_LOSS=record changes it from " \
           "here)" in resumed.stdout
    weighting = re.compile(r"SFT data: \d+ samples, .* epochs; the loss is .*\(MP_SFT_LOSS=(\w+)")
    assert weighting.findall(resumed.stdout) == ["token"], resumed.stdout[-2000:]
    # the dry run lists what the launch trains with, beside its note (it listed record: the rdoc audit)
    dry = launch(args(3), {**env, "MP_DRY_RUN": "json"})
    report = json.loads(dry.stdout)
    assert report["options"]["MP_SFT_LOSS"]["value"] == report["resolved"]["sft_loss"] == "token", dry.stderr[-2000:]
    assert "note: MP_SFT_LOSS=token: the loss weighting this run trained with" in dry.stderr, dry.stderr[-2000:]
    changed = launch(args(3), {**env, "MP_SFT_LOSS": "record"})
    assert changed.returncode == 0 and weighting.findall(changed.stdout) == ["record"], changed.stdout[-2000:]
    assert "note: MP_SFT_LOSS" not in changed.stdout


@pytest.mark.slow
def test_a_resume_keeps_the_load_balancing_its_run_trained_with(corpus, tmp_path):
    """A release changed what Pai's MoE scripts pass as the load-balancing coefficient (Mixtral 0.001 -> 0.01), and a
    run resumed by it trained with the new one midway, without a word: its checkpoints recorded MP_MOE_AUX_LOSS as
    unset, not the coefficient (the upgrade audit). The train state records the run's rules now; a resume keeps its
    coefficient, says so, and refuses another balancing type; a run saved before the rules were recorded is told what
    changed since where something did (tests/test_run_folder.py)."""
    from megatron_patch.checkpoint_files.layout import TRAIN_STATE

    out = tmp_path / "out"

    def args(iterations):
        return launcher_args("qwen3_moe", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out), GLOBAL_BATCH_SIZE="4",
                             SEQ_LEN="32", PAD_LEN="32", TRAIN_TOKENS_OR_ITERS=str(iterations * 4 * 32),
                             WARMUP_TOKENS_OR_ITERS="0", SAVE_INTERVAL="1")

    first = launch(args(1), family="qwen3_moe")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    state = out / "checkpoint" / "iter_0000001" / TRAIN_STATE
    saved = json.loads(state.read_text())
    assert saved["rules"] == {"version": 1, "moe_balancing": {"coeff": 0.001, "type": None}}, saved["rules"]
    saved["rules"]["moe_balancing"]["coeff"] = 0.25  # what another release's launcher gave this run
    state.write_text(json.dumps(saved))
    env = {"MP_NO_VERIFY": "true"}  # the file no longer matches the checkpoint's manifest
    resumed = launch(args(2), env, family="qwen3_moe")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "note: MP_MOE_AUX_LOSS=0.25: the load-balancing coefficient this run trained with (this launcher's is " \
           "0.001; MP_MOE_AUX_LOSS changes it from here)" in resumed.stdout
    later = json.loads((out / "checkpoint" / "iter_0000002" / TRAIN_STATE).read_text())
    assert later["config"]["moe_aux_loss"] == 0.25 and later["rules"]["moe_balancing"]["coeff"] == 0.25

    later["rules"]["moe_balancing"]["type"] = "seq_aux_loss"
    (out / "checkpoint" / "iter_0000002" / TRAIN_STATE).write_text(json.dumps(later))
    refused = launch(args(3), {**env, "MP_MOE_AUX_LOSS": "0.25"}, family="qwen3_moe")  # the coefficient, not the type
    assert refused.returncode == 2 and "was trained with the experts balanced by seq_aux_loss, and this launch " \
        "balances them by the family default" in refused.stderr, refused.stderr[-2000:]
    del later["rules"]  # as a release before the rules were recorded saved it
    (out / "checkpoint" / "iter_0000002" / TRAIN_STATE).write_text(json.dumps(later))
    told = launch(args(3), env, family="qwen3_moe")  # no change since concerns this launcher's MoE runs
    assert told.returncode == 0, told.stdout[-2000:] + told.stderr[-2000:]
    assert "recorded no training rules" not in told.stdout and "note: MP_MOE_AUX_LOSS" not in told.stdout


@pytest.mark.slow
def test_nan_loss_stops_the_run(corpus, tmp_path):
    out = tmp_path / "out"
    proc = launch(_pretrain_args(corpus, out, LR="1e30", MIN_LR="0"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    # LR=1e30: the gradients overflow before the loss does, and the run stops before that update
    assert ("loss is" in err or "the gradients hold inf/nan" in err) and "training stopped before its update" in err, err
    # before its first checkpoint: nothing to name but where a rerun starts
    assert "no checkpoint was saved yet: a rerun starts again from the random initialisation" in err, err
    assert not math.isnan(read_metrics(out)[0]["loss"])


@pytest.mark.slow
def test_a_launch_whose_reader_goes_away_ends_quietly_and_one_without_stdout_trains(corpus, tmp_path):
    """`launcher | head -1`: rank 0's next line met a reader gone, and the launcher blamed the network ("rank 0 lost
    its connection to another rank ... can reach MASTER_ADDR"), exit 1; it ends as every command does, 141 and
    nothing said. Started with stdout closed (`>&-`, a cron job), the launch failed before training with an internal
    error (sys.stdout was None); it trains, its output going nowhere, and leaves no torchrun log folder in TMPDIR
    (torchelastic_*, one per launch before; the env audit)."""
    script = os.path.join(REPO, "examples", "llama3_1", "run_mcore_llama3_1.sh")
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.Popen(["bash", script, *_pretrain_args(corpus, tmp_path / "gone")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()  # `head -1`
    err = proc.stderr.read()
    assert (proc.wait(timeout=480), err) == (141, ""), (first, err[-3000:])

    out, tmp = tmp_path / "no stdout", tmp_path / "tmp"
    tmp.mkdir()
    done = subprocess.run(["bash", script, *_pretrain_args(corpus, out)], env={**env, "TMPDIR": str(tmp)},
                          stdout=None, stderr=subprocess.PIPE, text=True, timeout=480, preexec_fn=lambda: os.close(1))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["iteration"] for m in read_metrics(out)] == list(range(1, ITERS + 1))
    # torch's compile cache (torchinductor_<user>, docs/outputs.md) is the one thing a launch keeps there
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")] == []


# --- multi-node and failures -----------------------------------------------------------------------------

# Two data-parallel ranks (ENV=cpu, MP_NPROC=2), checkpoints at 6, 12, 18, 24: the reference of the
# two-node, restart, damaged-checkpoint and full-disk tests.
DP_ITERS, DP_SAVE = 24, 6


def _dp2_args(corpus, out, **over):
    return _pretrain_args(corpus, out, TRAIN_TOKENS_OR_ITERS=str(DP_ITERS * GBS * SEQ), SAVE_INTERVAL=str(DP_SAVE),
                          **over)


@pytest.fixture(scope="module")
def dp2_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp2") / "out"
    proc = launch(_dp2_args(corpus, out), {"MP_NPROC": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DP=2 on 2 CPU process(es)" in proc.stdout
    # said once, by rank 0, once it has published final/ (every rank said it, the others before it was there)
    assert proc.stdout.count("exported the trained model to") == 1, proc.stdout
    return {"out": out}


def _last_records(out: Path) -> dict[int, dict]:
    """Each iteration's last record: after a restart, the iterations since the checkpoint appear twice."""
    return {m["iteration"]: m for m in read_metrics(out)}


def _assert_same_losses(got: dict[int, dict], want: dict[int, dict], iterations) -> float:
    worst = 0.0
    for i in iterations:
        diff = abs(got[i]["loss"] - want[i]["loss"])
        worst = max(worst, diff)
        assert diff < 1e-6, (i, got[i]["loss"], want[i]["loss"])
        assert abs(got[i]["grad_norm"] - want[i]["grad_norm"]) < 1e-5 * want[i]["grad_norm"], i
    return worst


def _start(args, env, log: Path, family="llama3_1", session: bool = False) -> subprocess.Popen:
    """The launcher script in the background, its output in LOG.out / LOG.err (``session``: in a process group of its
    own, as a terminal's job, which Ctrl-C signals as a whole)."""
    script = os.path.join(REPO, "examples", family, f"run_mcore_{family}.sh")
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        return subprocess.Popen(["bash", script, *args], env={**os.environ, "PYTHON": sys.executable, **env},
                                stdout=out, stderr=err, start_new_session=session)


def _output(log: Path) -> tuple[str, str]:
    return log.with_suffix(".out").read_text(), log.with_suffix(".err").read_text()


def _run_nodes(args, env: dict, tmp_path: Path, nodes: int = 2) -> list[tuple[int, str, str]]:
    """``nodes`` launcher invocations on 127.0.0.1, as PAI-DLC starts one per node: WORLD_SIZE nodes, RANK
    this node's, MASTER_ADDR/MASTER_PORT node 0's; one process per node (GPUS_PER_NODE=1)."""
    from megatron_patch.runtime.distributed import free_port

    port = str(free_port())
    # All "nodes" share this machine's cores: one thread per process, as on a node with one rank per core.
    base = {"WORLD_SIZE": str(nodes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "GPUS_PER_NODE": "1",
            "OMP_NUM_THREADS": "1", **env}
    procs = [(_start(args, {**base, "RANK": str(n)}, tmp_path / f"node{n}"), tmp_path / f"node{n}") for n in range(nodes)]
    results = []
    try:
        for proc, log in procs:
            proc.wait(timeout=600)
            results.append((proc.returncode, *_output(log)))
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
    return results


@pytest.mark.slow
def test_two_nodes_train_one_model_with_dp_across_them(dp2_run, corpus, tmp_path):
    """ENV=dlc on a machine without GPUs (gloo): node 0 and node 1 hold one data-parallel rank each, and
    train the one-node run's model: the same losses, and a checkpoint written from both nodes."""
    from megatron_patch.training.run_state import iteration_problem

    out = tmp_path / "out"
    results = _run_nodes(_dp2_args(corpus, out, ENV="dlc"), {"MP_EXIT_INTERVAL": str(DP_SAVE)}, tmp_path)
    for code, stdout, stderr in results:
        assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "--nnodes=2 --node_rank=1" in results[1][1]
    assert "DP=2 on 2 CPU process(es)" in results[0][1]
    got = _last_records(out)
    assert sorted(got) == list(range(1, DP_SAVE + 1))
    worst = _assert_same_losses(got, _last_records(dp2_run["out"]), range(1, DP_SAVE + 1))
    print(f"two nodes DP=2 vs one node DP=2: largest loss difference {worst:.3g} over {DP_SAVE} iterations")
    assert iteration_problem(out / "checkpoint" / f"iter_{DP_SAVE:07d}") is None


@pytest.mark.slow
def test_a_node_that_goes_away_ends_the_other_in_one_line(corpus, tmp_path):
    """Node 0 (the job's store) SIGKILLed mid-training: node 1 stops with its one line, where torch's C++ client
    printed a 15-line stack trace of the store read before it (the mn audit)."""
    import signal

    out = tmp_path / "out"
    args = _pretrain_args(corpus, out, ENV="dlc", TRAIN_TOKENS_OR_ITERS=str(200 * GBS * SEQ), SAVE_INTERVAL="1000")
    base = _two_node_base()
    nodes = [_start(args, {**base, "RANK": str(n)}, tmp_path / f"node{n}") for n in (0, 1)]
    try:
        deadline = time.time() + 300
        while not (out / "log" / "metrics.jsonl").exists() or len(read_metrics(out)) < 3:
            assert time.time() < deadline and all(p.poll() is None for p in nodes), _output(tmp_path / "node1")
            time.sleep(0.05)
        os.kill(nodes[0].pid, signal.SIGKILL)
        code = nodes[1].wait(timeout=180)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    stderr = _output(tmp_path / "node1")[1]
    assert code not in (0, None) and stderr.count("\n") == 1, stderr[-3000:]
    assert stderr.startswith("mpatch train: error: rank 1 lost its connection to another rank"), stderr


def _two_node_base() -> dict:
    """Two ENV=dlc "nodes" of one process on 127.0.0.1, failing within a minute."""
    from megatron_patch.runtime.distributed import free_port

    return {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "GPUS_PER_NODE": "1",
            "OMP_NUM_THREADS": "1", "MP_DIST_TIMEOUT_MIN": "1"}


def _ended(nodes: list[subprocess.Popen]) -> list[int]:
    """Each launcher's exit status, once all have ended (at most 5 minutes; killed then)."""
    try:
        return [p.wait(timeout=300) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()


@pytest.mark.slow
@pytest.mark.parametrize("refusal", ["data missing on node 1", "run folder locked"])
def test_a_node_whose_launcher_refuses_its_line_tells_the_others(corpus, tmp_path, refusal):
    """Node 1's DATASET_PATH missing there: its launcher refused before torchrun and never joined, and node 0 waited
    out the rendezvous, then blamed it (the mn audit; 10 minutes by default); so did node 1 when node 0 found the run
    folder locked by another job (the s63 audit). The refusing node says its line at once and joins with ranks that
    only refuse, so the other refuses naming its reason."""
    from megatron_patch.outputs.lock import OutputLock

    out = tmp_path / "out"
    lines = [_pretrain_args(corpus, out, ENV="dlc")] * 2
    if refusal == "data missing on node 1":
        missing = str(tmp_path / "elsewhere" / "corpus_text_document")
        lines[1] = _pretrain_args(corpus, out, ENV="dlc", DATASET_PATH=missing)
        refusing, reason = 1, f"mmap data {missing}.bin not found"
    else:
        refusing, reason = 0, f"{out} is being written by pid {os.getpid()}"
    base = _two_node_base()
    with OutputLock(out) if refusal == "run folder locked" else contextlib.nullcontext():
        codes = _ended([_start(lines[n], {**base, "RANK": str(n)}, tmp_path / f"node{n}") for n in (0, 1)])
    said = [_output(tmp_path / f"node{n}")[1] for n in (0, 1)]
    assert codes == [2, 2], said
    assert said[refusing].startswith(f"mpatch train: error: {reason}") and said[refusing].count("\n") == 1, said
    other = 1 - refusing
    assert said[other].startswith(f"mpatch train: error: rank {refusing} ({os.uname().nodename}) refused its node's "
                                  f"launcher line: {reason}") and said[other].count("\n") == 1, said[other]


@pytest.mark.slow
def test_a_node_refused_for_another_output_folder_leaves_nothing_beside_it(corpus, tmp_path):
    """Node 1 given another OUTPUT_BASEPATH (its own disk): both nodes refuse in one line, and node 1's rank, which
    marked itself beside that folder as a rank writing it, takes its mark away as it ends: no launcher of node 1
    sweeps marks (node 0's does, for the shared folder), so a hidden .other.mpatch-lock.ranks stayed there."""
    out, other = tmp_path / "out", tmp_path / "other"
    lines = [_pretrain_args(corpus, out, ENV="dlc"), _pretrain_args(corpus, other, ENV="dlc")]
    base = _two_node_base()
    codes = _ended([_start(lines[n], {**base, "RANK": str(n)}, tmp_path / f"node{n}") for n in (0, 1)])
    said = [_output(tmp_path / f"node{n}")[1] for n in (0, 1)]
    assert codes == [2, 2] and all("OUTPUT_BASEPATH" in s and s.count("\n") == 1 for s in said), said
    assert [p.name for p in tmp_path.iterdir() if "mpatch-lock" in p.name] == []


@pytest.mark.slow
def test_ctrl_c_ends_a_refusing_node_waiting_for_the_others(corpus, tmp_path):
    """A node whose launcher refused its line waits for the other nodes to tell them; Ctrl-C reached torchrun's
    rendezvous only at its timeout (the s63 audit)."""
    import signal

    node = _start(_pretrain_args(corpus, tmp_path / "out", ENV="dlc", LR="abc"), {**_two_node_base(), "RANK": "0"},
                  tmp_path / "node0", session=True)
    try:
        deadline = time.time() + 60
        while "joins the job" not in _output(tmp_path / "node0")[0]:
            assert time.time() < deadline and node.poll() is None, _output(tmp_path / "node0")
            time.sleep(0.1)
        time.sleep(1)
        os.killpg(node.pid, signal.SIGINT)
        code = node.wait(timeout=20)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    assert code == 130, _output(tmp_path / "node0")
    assert _output(tmp_path / "node0")[1].endswith("mpatch train: interrupted\n"), _output(tmp_path / "node0")


@pytest.mark.slow
def test_a_refusal_is_not_restarted(corpus, tmp_path):
    """MP_MAX_RESTARTS=1 on node 1 only: both nodes refused the differing option, and node 1's agent restarted its
    rank, which waited out the rendezvous for node 0, gone, and blamed the network (the mn audit). A rank's refusal
    of its input ends the restarts: it would refuse again."""
    args, base = _pretrain_args(corpus, tmp_path / "out", ENV="dlc"), _two_node_base()
    codes = _ended([_start(args, {**base, "RANK": str(n), **({"MP_MAX_RESTARTS": "1"} if n else {})},
                           tmp_path / f"node{n}") for n in (0, 1)])
    for n, code in enumerate(codes):
        stdout, stderr = _output(tmp_path / f"node{n}")
        assert code == 2 and "MP_MAX_RESTARTS is 0 on rank 0" in stderr, (n, stdout[-2000:], stderr[-2000:])
        assert "restart 1 of 1" not in stdout


@pytest.mark.slow
def test_two_nodes_train_one_model_with_tp_across_them(tp2_run, corpus, tmp_path):
    """TP=2 with one tensor-parallel rank per node (sequence parallel, distributed optimizer): the losses
    and grad norms of the one-node TP=2 run."""
    out = tmp_path / "out"
    args = _pretrain_args(corpus, out, ENV="dlc", TP="2", SP="true", DO="true")
    results = _run_nodes(args, {"MP_TP_COMM_OVERLAP": "false", "MP_EXIT_INTERVAL": "4"}, tmp_path)
    for code, stdout, stderr in results:
        assert code == 0, stdout[-3000:] + stderr[-3000:]
    got = _last_records(out)
    assert sorted(got) == [1, 2, 3, 4]
    worst = _assert_same_losses(got, _last_records(tp2_run["out"]), range(1, 5))
    print(f"two nodes TP=2 vs one node TP=2: largest loss difference {worst:.3g} over 4 iterations")


def _rank_process(launcher: subprocess.Popen, rank: int, log: Path):
    """The process that runs ``rank``: a descendant of the launcher (its child, or the child of the launcher's fork
    server) that names itself ``mpatch-rank<R>``; the rank's own forked helpers carry its name too, under it."""
    import time

    import psutil

    name = f"mpatch-rank{rank}"
    while launcher.poll() is None:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if child.name() == name and child.parent().name() != name:
                    return child
            except psutil.Error:
                continue
        time.sleep(0.05)
    pytest.fail("the launcher exited before its ranks started:\n" + "\n".join(_output(log))[-3000:])


def _wait_for_checkpoint(launcher: subprocess.Popen, out: Path, log: Path) -> None:
    """Until the first checkpoint is published (the tracker exists): the marker the kill and stop tests act on."""
    import time

    tracker = out / "checkpoint" / "latest_checkpointed_iteration.txt"
    while not tracker.exists():
        if launcher.poll() is not None:
            pytest.fail("the run ended before its first checkpoint:\n" + "\n".join(_output(log))[-3000:])
        time.sleep(0.01)


@pytest.mark.slow
def test_killed_rank_is_restarted_and_the_run_resumes(dp2_run, corpus, tmp_path):
    """MP_MAX_RESTARTS=1: SIGKILL rank 1 right after the first checkpoint; torchrun restarts both ranks, which
    resume from the latest complete checkpoint by themselves; the job ends with status 0 and every
    iteration's loss is the uninterrupted run's."""
    import signal

    import psutil

    out, log = tmp_path / "out", tmp_path / "launcher"
    launcher = _start(_dp2_args(corpus, out), {"MP_NPROC": "2", "MP_MAX_RESTARTS": "1"}, log)
    try:
        victim = _rank_process(launcher, 1, log)
        _wait_for_checkpoint(launcher, out, log)
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pytest.fail("rank 1 had already exited when the first checkpoint appeared")
        launcher.wait(timeout=600)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    stdout, stderr = _output(log)
    assert launcher.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "--max-restarts=1" in stdout
    assert "restart 1 of 1 (MP_MAX_RESTARTS): resuming from the latest complete checkpoint" in stdout
    resumed = re.search(r"resumed from \S+/iter_(\d{7})", stdout)
    assert resumed and int(resumed.group(1)) % DP_SAVE == 0, stdout[-3000:]
    got = _last_records(out)
    assert sorted(got) == list(range(1, DP_ITERS + 1))
    _assert_same_losses(got, _last_records(dp2_run["out"]), range(1, DP_ITERS + 1))


@pytest.mark.slow
def test_an_injected_kill_is_not_injected_again_in_the_restarted_group(dp2_run, corpus, tmp_path):
    """MP_INJECT_FAULT=kill@N with MP_MAX_RESTARTS=1: the restarted group resumed before N and was killed at N
    again, until the restarts ran out. It fires in the first attempt only: the job ends with status 0 and the
    uninterrupted run's losses."""
    out = tmp_path / "out"
    proc = launch(_dp2_args(corpus, out), {"MP_NPROC": "2", "MP_MAX_RESTARTS": "1",
                                           "MP_INJECT_FAULT": f"kill@{DP_SAVE + 2}"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restart 1 of 1 (MP_MAX_RESTARTS)" in proc.stdout
    assert f"resumed from {out}/checkpoint/iter_{DP_SAVE:07d}" in proc.stdout, proc.stdout[-3000:]
    got = _last_records(out)
    assert sorted(got) == list(range(1, DP_ITERS + 1))
    _assert_same_losses(got, _last_records(dp2_run["out"]), range(1, DP_ITERS + 1))


@pytest.mark.slow
def test_stopped_rank_fails_the_job_naming_it(corpus, tmp_path):
    """SIGSTOP rank 1 after the first checkpoint: rank 0's next collective gives up after MP_DIST_TIMEOUT_MIN,
    and the job ends (no restart asked for) with one line naming rank 1, its pid, the collective and the
    iteration, instead of waiting forever."""
    import signal
    import time

    import psutil

    out, log = tmp_path / "out", tmp_path / "launcher"
    launcher = _start(_dp2_args(corpus, out), {"MP_NPROC": "2", "MP_DIST_TIMEOUT_MIN": "0.2"}, log)
    victim = None
    try:
        victim = _rank_process(launcher, 1, log)
        _wait_for_checkpoint(launcher, out, log)
        victim.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        launcher.wait(timeout=600)
        print(f"job ended {time.monotonic() - stopped:.0f} s after rank 1 was stopped (MP_DIST_TIMEOUT_MIN=0.2)")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if victim is not None and victim.is_running():
            victim.send_signal(signal.SIGCONT)
            victim.kill()
    stdout, stderr = _output(log)
    assert launcher.returncode == 1, stdout[-3000:] + stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("mpatch train: error: rank 0 waited 0.2 min (MP_DIST_TIMEOUT_MIN) in "), last
    # Where rank 1 was stopped depends on the machine's speed: in an iteration, or in the next save.
    assert "(called from" in last and re.search(r"during (iteration \d+|saving iter_\d+)", last), last
    assert "rank 1 stopped answering (rank 1: last heartbeat" in last and f"pid {victim.pid})" in last, last
    assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE  # the job left no rank behind


def _copy_checkpoints(src: Path, out: Path) -> Path:
    import shutil

    shutil.copytree(src / "checkpoint", out / "checkpoint")
    return out / "checkpoint"


@pytest.mark.slow
def test_a_resume_the_checkpoint_cannot_follow_is_refused_and_a_new_schedule_is_followed(dp2_run, corpus, tmp_path):
    """Resumed with another precision, optimizer sharding, global batch or model, the launcher refuses in one line
    before any rank starts (a rank failed on each with a traceback, or read other samples than the run's next ones);
    resumed with another learning rate and more iterations, the run says so and follows this launch's schedule
    (megatron-core kept the checkpoint's, whatever the dry run said)."""
    out = tmp_path / "out"
    ckpt = _copy_checkpoints(dp2_run["out"], out)
    refusals = [(dict(PR="bf16"), {}, "was trained with PR=fp32, and this launch asks PR=bf16"),
                (dict(DO="true"), {}, "was trained with DO=false, and this launch asks DO=true"),
                (dict(GLOBAL_BATCH_SIZE=str(2 * GBS)), {}, f"GLOBAL_BATCH_SIZE={GBS}, and this launch asks "
                                                         f"GLOBAL_BATCH_SIZE={2 * GBS}"),
                ({}, {"MP_NUM_LAYERS": "1"}, "holds another model than this launch builds (num_hidden_layers 4 -> 1)")]
    for over, env, message in refusals:
        proc = launch(_dp2_args(corpus, out, **over), {"MP_NPROC": "2", **env})
        assert proc.returncode == 2 and message in proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.stderr.count("\n") == 1 and "+ " not in proc.stdout, proc.stdout[-2000:]  # no rank started
    longer = _pretrain_args(corpus, out, LR="1e-2", TRAIN_TOKENS_OR_ITERS=str((DP_ITERS + 4) * GBS * SEQ),
                            SAVE_INTERVAL=str(DP_SAVE))
    proc = launch(longer, {"MP_NPROC": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("note: the learning-rate schedule follows this launch, not the checkpoint's: LR 0.003 -> 0.01, "
            f"decay iterations {DP_ITERS} -> {DP_ITERS + 4}") in proc.stdout, proc.stdout[:2000]
    # both lengths within the corpus's one epoch: the order continues, and no note says otherwise (the tdoc audit)
    assert f"note: iterations {DP_ITERS} -> {DP_ITERS + 4}" not in proc.stdout, proc.stdout[:2000]
    saved = json.loads((ckpt / f"iter_{DP_ITERS + 4:07d}" / "train_state.json").read_text())["config"]
    warmup, decay, top, low = saved["warmup_iters"], saved["lr_decay_iters"], saved["lr"], saved["min_lr"]
    for i, record in _last_records(out).items():
        if i > DP_ITERS:  # megatron-core's cosine after warm-up, after the i - 1 steps before iteration i's update
            want = low + 0.5 * (math.cos(math.pi * (i - 1 - warmup) / (decay - warmup)) + 1) * (top - low)
            assert record["lr"] == pytest.approx(want, rel=1e-9), (i, record["lr"], want)


@pytest.mark.slow
def test_damaged_checkpoints_are_skipped_for_the_previous_complete_one(dp2_run, corpus, tmp_path):
    """The latest checkpoint with a truncated .distcp and the one before without metadata.json: the run warns
    about each, resumes from the newest complete one (12), and repeats the uninterrupted run's losses."""
    from megatron_patch.training.run_state import iteration_problem

    out = tmp_path / "out"
    ckpt = _copy_checkpoints(dp2_run["out"], out)
    distcp = sorted((ckpt / "iter_0000024").glob("*.distcp"))[-1]
    distcp.write_bytes(distcp.read_bytes()[: distcp.stat().st_size // 2])
    truncated = distcp.stat().st_size
    (ckpt / "iter_0000018" / "metadata.json").unlink()
    proc = launch(_dp2_args(corpus, out), {"MP_NPROC": "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(rf"warning: \S+/iter_0000024 is incomplete or damaged: {re.escape(distcp.name)} is truncated "
                     rf"\({truncated} bytes; its records end at byte \d+\)", proc.stdout), proc.stdout[-3000:]
    assert re.search(r"warning: \S+/iter_0000018 is incomplete or damaged: metadata\.json is missing", proc.stdout)
    # said once, by the launcher before its first line, which names the iteration the ranks resume (they said it too)
    assert proc.stdout.count("is incomplete or damaged") == 2, proc.stdout[-3000:]
    assert proc.stdout.index("iter_0000018 is incomplete") < proc.stdout.index("resuming from iteration 12 of")
    assert re.search(r"resumed from \S+/iter_0000012\n", proc.stdout)
    got = _last_records(out)
    assert sorted(got) == list(range(13, DP_ITERS + 1))
    _assert_same_losses(got, _last_records(dp2_run["out"]), range(13, DP_ITERS + 1))
    # The damaged folders were replaced by complete ones when those iterations were saved again.
    assert iteration_problem(ckpt / "iter_0000024") is None and iteration_problem(ckpt / "iter_0000018") is None


@pytest.mark.slow
def test_no_complete_checkpoint_is_refused_in_one_line(dp2_run, corpus, tmp_path):
    out = tmp_path / "out"
    ckpt = _copy_checkpoints(dp2_run["out"], out)
    for folder in ckpt.glob("iter_*"):
        (folder / ".metadata").unlink()
    (ckpt / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe")
    proc = launch(_dp2_args(corpus, out), {"MP_NPROC": "2"})
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mpatch train: error: no complete checkpoint in {ckpt} ("), err
    assert "latest_checkpointed_iteration.txt is unreadable" in err[0]
    assert "iter_0000006 is incomplete or damaged: .metadata is missing" in err[0]
    assert "torch.distributed.run" not in proc.stdout  # refused before any rank started


FAIL_WRITES = '''
import builtins, errno, os
_open = builtins.open
def _full_disk_open(file, mode="r", *args, **kwargs):
    marker = os.environ.get("MP_TEST_FULL_DISK")
    if marker and isinstance(file, (str, os.PathLike)) and marker in str(file) and "w" in mode:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
    return _open(file, mode, *args, **kwargs)
builtins.open = _full_disk_open
'''


def _small_disk(folder: Path, size: int) -> bool:
    """A tmpfs of ``size`` bytes mounted on ``folder``; False where this machine cannot mount one."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    return proc.returncode == 0



@pytest.mark.slow
def test_a_full_disk_in_the_final_export_and_a_file_size_limit_in_a_save_are_one_line_each(corpus, tmp_path):
    """The final export met a full disk as an internal error (exit 1, its partial folder left on the full disk), and
    a save under `ulimit -f` said to free space (the resource audit). The export's failure is one line keeping the
    last checkpoint, and a rerun exports; a save's file-size limit names the limit."""
    import resource

    out = tmp_path / "out"
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(FAIL_WRITES)
    env = {"PYTHONPATH": f"{tmp_path / 'inject'}:{os.environ.get('PYTHONPATH', '')}",
           "MP_TEST_FULL_DISK": ".final.mpatch-partial"}
    args = _pretrain_args(corpus, out, TRAIN_TOKENS_OR_ITERS=str(3 * GBS * SEQ), SAVE_INTERVAL="3")
    proc = launch(args, env)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    ckpt = out / "checkpoint"
    assert re.fullmatch(rf"mpatch train: error: exporting {out}/final failed on rank 0: \[Errno 28\] No space left on "
                        rf"device \(\S+\); the export stopped, {ckpt}/iter_0000003 is intact and a rerun resumes from "
                        rf"it: free space in {out} \(or choose another OUTPUT_BASEPATH\) and rerun",
                        proc.stderr.strip().splitlines()[-1]), proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir() if "final" in p.name) == []
    summary = json.loads((out / "log" / "throughput.json").read_text())
    assert summary["iterations"] == [2, 3], summary
    again = launch(args, {"PYTHONPATH": env["PYTHONPATH"]})
    assert again.returncode == 0 and (out / "final" / "release").is_dir(), again.stderr[-3000:]
    # the rerun trains nothing: it says so (not "iterations 4..3"), and keeps the run's throughput summary (it wrote
    # null over it, saying "only warm-up iterations ran")
    assert "nothing left to train: iteration 3 of 3 is the run's last, whose model is exported now" in again.stdout
    assert "iterations 4..3" not in again.stdout and "throughput" not in again.stdout, again.stdout[-2000:]
    assert json.loads((out / "log" / "throughput.json").read_text()) == summary

    limited = subprocess.run(["bash", "-c", 'ulimit -f 1000 && exec bash "$@"', "-",
                              str(Path(__file__).parents[1] / "examples" / "llama3_1" / "run_mcore_llama3_1.sh"),
                              *_pretrain_args(corpus, tmp_path / "limited", TRAIN_TOKENS_OR_ITERS=str(3 * GBS * SEQ),
                                              SAVE_INTERVAL="2", WARMUP_TOKENS_OR_ITERS="1")],
                             env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=480)
    assert limited.returncode == 2, limited.stdout[-3000:] + limited.stderr[-3000:]
    last = limited.stderr.strip().splitlines()[-1]
    assert last.startswith("mpatch train: error: saving iter_0000002 failed on rank 0: "), last
    assert last.endswith("a file reached the largest size allowed (`ulimit -f`: 1024000 bytes here, or the "
                         "filesystem's limit): raise the limit (or choose another OUTPUT_BASEPATH on a filesystem "
                         "without it) and rerun"), last
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY  # this process: no limit

    # between saves: the limit met by the run's logs (metrics.jsonl's flush, TensorBoard's event file), whose writes
    # name no file: an internal error, with TensorBoard's thread's traceback above it, restarted under MP_MAX_RESTARTS
    between = subprocess.run(["bash", "-c", 'ulimit -f 40 && exec bash "$@"', "-",
                              str(Path(__file__).parents[1] / "examples" / "llama3_1" / "run_mcore_llama3_1.sh"),
                              *_pretrain_args(corpus, tmp_path / "between", TRAIN_TOKENS_OR_ITERS=str(400 * GBS * SEQ),
                                              SAVE_INTERVAL="1000", WARMUP_TOKENS_OR_ITERS="1")],
                             env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=480)
    last = between.stderr.strip().splitlines()[-1]
    assert between.returncode == 2 and "Traceback" not in between.stderr, between.stderr[-3000:]
    assert re.match(rf"mpatch train: error: rank \d stopped: writing failed: \[Errno 27\] File too large \(in "
                    rf"OUTPUT_BASEPATH {tmp_path / 'between'}\), a file reached the largest size allowed", last), last

@pytest.mark.slow
def test_full_disk_stops_the_run_and_keeps_the_previous_checkpoint(dp2_run, corpus, tmp_path):
    """The checkpoint folder on a disk with room for one and a half checkpoints: the save at 12 fails, the run
    stops with one line naming the error and the checkpoint kept, no partial folder is left, iteration 6 is
    complete; with room again, a rerun resumes from 6 and gives the uninterrupted run's losses.

    Without permission to mount a tmpfs, the same full disk is simulated: a sitecustomize (on PYTHONPATH of
    the ranks) makes every file opened for writing in the save of iteration 12 fail with ENOSPC."""
    from megatron_patch.training.run_state import iteration_problem

    out = tmp_path / "out"
    ckpt = out / "checkpoint"
    one = sum(p.stat().st_size for p in (dp2_run["out"] / "checkpoint" / "iter_0000006").rglob("*") if p.is_file())
    mounted = _small_disk(ckpt, one * 3 // 2)
    env = {"MP_NPROC": "2"}
    if not mounted:
        (tmp_path / "inject").mkdir()
        (tmp_path / "inject" / "sitecustomize.py").write_text(FAIL_WRITES)
        env.update(PYTHONPATH=f"{tmp_path / 'inject'}:{os.environ.get('PYTHONPATH', '')}",
                   MP_TEST_FULL_DISK=".iter_0000012.mpatch-partial")
    try:
        proc = launch(_dp2_args(corpus, out), env)
        assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
        last = proc.stderr.strip().splitlines()[-1]
        said = re.fullmatch(rf"mpatch train: error: saving iter_0000012 failed on rank \d: (.+); training stopped, "
                            rf"{ckpt}/iter_0000006 is intact and a rerun resumes from it: free space in {ckpt} \(or "
                            rf"choose another OUTPUT_BASEPATH\) and rerun", last)
        assert said, last
        # torch.save's writer reports a short write without its errno (megatron-core 0.19 writes through it
        # and only logs what it said); then the free space tells.
        assert (re.search(r"\[Errno 28\] No space left on device|a file could not be written \(.*inline_container",
                          said.group(1)) if not mounted else
                re.search(r"\(the disk is full: [\d.]+ MiB free, a checkpoint takes [\d.]+ MiB\)$", said.group(1))), last
        assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000006", "latest_checkpointed_iteration.txt"]
        assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "6"
        assert iteration_problem(ckpt / "iter_0000006") is None
        first = _last_records(out)
        assert sorted(first) == list(range(1, 13))  # trained up to the failed save

        if mounted:
            subprocess.run(["mount", "-o", "remount,size=64m", str(ckpt)], check=True)
        env.pop("MP_TEST_FULL_DISK", None)
        again = launch(_dp2_args(corpus, out), env)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert re.search(r"resumed from \S+/iter_0000006\n", again.stdout)
        _assert_same_losses(_last_records(out), _last_records(dp2_run["out"]), range(1, DP_ITERS + 1))
    finally:
        if mounted:
            subprocess.run(["umount", str(ckpt)], check=False)

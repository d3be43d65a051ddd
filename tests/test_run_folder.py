"""A run folder (OUTPUT_BASEPATH) is untrusted input too: what training reads back from it and from its data.

- megatron-core's dataset cache (``data_cache/``) never runs code: a pickle planted in place of an index
  (even one that does its work and then returns the real array) is removed before megatron-core's
  ``numpy.load(allow_pickle=True)`` sees it, and the index is built again; a sound cache is kept;
- the training data is checked before the first step: the manifest, ``.bin`` against ``.idx``, every
  token id;
- nothing is written through a symlink that leads outside the folder;
- resume falls back past an iteration that fails any integrity check;
- a launch of another job (SFT after pretraining, other data, another sample length) into a run's folder is
  refused before any rank starts, where it resumed that run;
- every reader of ``.metadata`` refuses the same impossible shapes;
- the tracker, train state, sidecars and manifests are read bounded and strictly.

Each payload is first shown to run through an unguarded reader, so the tests can fail.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy
import pytest
import torch

from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME, read_manifest
from megatron_patch.errors import UserError
from megatron_patch.training import data_cache
from megatron_patch.training.data import build_pretraining_datasets
from megatron_patch.training.validation import resolve
from tests.training_helpers import launcher_args


class Payload:
    """Pickles as a call that touches ``marker`` and then, with ``returns``, gives back the array stored at
    that path: the variant whose training finishes and exits 0."""

    def __init__(self, marker: Path, returns: Path | None = None):
        self.marker, self.returns = marker, returns

    def __reduce__(self):
        code = f"__import__('os').system('touch {self.marker}')"
        if self.returns is not None:
            code += f" or __import__('numpy').load('{self.returns}')"
        return eval, (code,)


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "the payload ran"


def _cfg(corpus, out: Path):
    return resolve("llama3_1", launcher_args("llama3_1", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out)),
                   env={})


def _build(cfg):
    """The training run's datasets, as each rank builds them (one process here: no process group)."""
    return build_pretraining_datasets(cfg, cfg.train_iters * cfg.global_batch_size, 0)[0]


def _indices(ds) -> dict[str, numpy.ndarray]:
    return {name: numpy.array(getattr(ds, name)) for name in ("document_index", "sample_index", "shuffle_index")}


def _same(a: dict, b: dict) -> bool:
    return all(numpy.array_equal(a[k], b[k]) for k in a)


@pytest.fixture
def built(corpus, tmp_path):
    """A run folder whose dataset cache megatron-core has built, and the indices it built."""
    cfg = _cfg(corpus, tmp_path / "out")
    ds = _build(cfg)
    return cfg, _indices(ds), data_cache.run_cache_folder(cfg.output_basepath)


def _cache_file(folder: Path, affix: str) -> Path:
    return next(folder.glob(f"*-GPTDataset-train-{affix}"))


def test_a_pickle_named_npy_runs_through_numpy_load_with_allow_pickle(tmp_path):
    """What megatron-core does with a cache file (0.16 and 0.19 alike: ``numpy.load(..., allow_pickle=True,
    mmap_mode="r")``): a pickle in place of a .npy array runs."""
    ran, kept = tmp_path / "ran", tmp_path / "real.npy"
    numpy.save(kept, numpy.arange(5, dtype=numpy.uint32))
    path = tmp_path / "x-shuffle_index.npy"
    path.write_bytes(pickle.dumps(Payload(ran, returns=kept)))
    got = numpy.load(path, allow_pickle=True, mmap_mode="r")
    assert ran.exists() and numpy.array_equal(got, numpy.arange(5))
    assert data_cache.npy_problem(path).startswith("not a numpy array file")


@pytest.mark.parametrize("affix", ["document_index.npy", "sample_index.npy", "shuffle_index.npy"])
@pytest.mark.parametrize("returns", [False, True], ids=["payload", "payload-then-real-array"])
def test_a_pickle_planted_in_the_data_cache_never_runs(built, marker, capsys, affix, returns):
    cfg, want, folder = built
    path = _cache_file(folder, affix)
    real = marker.parent / "real.npy"
    shutil.copy(path, real)
    path.write_bytes(pickle.dumps(Payload(marker, returns=real if returns else None)))
    capsys.readouterr()
    got = _indices(_build(cfg))
    assert _same(got, want)  # built again, the same order
    out = capsys.readouterr().out
    assert f"warning: {path} is not a numpy array file" in out and "megatron-core builds it again" in out, out
    assert data_cache.npy_problem(path) is None


def test_a_corpus_rewritten_at_its_path_gets_indices_of_its_own(tmp_path):
    """megatron-core keys its cache by the data's path: a corpus written again there with shorter documents (a run
    without a checkpoint yet, relaunched) read the old indices and trained padded samples without a word; longer
    ones stopped in an IndexError."""
    from tests.sft_helpers import write_mmap_pair

    prefix = str(tmp_path / "corpus_text_document")
    documents = [numpy.random.default_rng(i).integers(0, 200, 40).tolist() for i in range(400)]
    write_mmap_pair(prefix, documents)
    cfg = _cfg({"prefix": prefix}, tmp_path / "out")
    first = _build(cfg)
    assert all(bool(first[i]["loss_mask"].all()) for i in range(len(first)))
    # the documents no sample starts in lose half their tokens: the old indices' offsets all still lie within
    # their documents (the fit check passes), and samples run short
    starts = {int(d) for d in numpy.asarray(first.document_index)[numpy.asarray(first.sample_index)[:, 0]]}
    write_mmap_pair(prefix, [d if i in starts else d[:20] for i, d in enumerate(documents)])
    again = _build(cfg)
    assert again.unique_description_hash != first.unique_description_hash
    assert all(bool(again[i]["loss_mask"].all()) for i in range(len(again)))  # no padded sample


def test_a_sound_cache_from_a_colleague_is_kept(built, corpus, tmp_path, capsys):
    """Untrusted is not refused: a copied run folder whose cache is sound reads it as it is."""
    _, want, folder = built
    theirs = tmp_path / "theirs"
    shutil.copytree(folder, theirs / "data_cache")
    stamps = {p.name: p.stat().st_mtime_ns for p in (theirs / "data_cache").iterdir()}
    capsys.readouterr()
    assert _same(_indices(_build(_cfg(corpus, theirs))), want)
    assert "warning" not in capsys.readouterr().out
    assert all(p.stat().st_mtime_ns == stamps[p.name] for p in (theirs / "data_cache").glob("*.npy"))


def _truncate(path: Path) -> str:
    path.write_bytes(path.read_bytes()[:-4])
    return "bytes long, where its header says"


def _objects(path: Path) -> str:
    numpy.save(path, numpy.array([1, "two"], dtype=object), allow_pickle=True)
    return "an array of object, not of integers"


def _floats(path: Path) -> str:
    numpy.save(path, numpy.zeros(4))
    return "an array of float64, not of integers"


def _link_outside(path: Path) -> str:
    outside = path.parent.parent.parent / "outside.npy"
    shutil.copy(path, outside)
    path.unlink()
    path.symlink_to(outside)
    return "not a regular file"


def _flipped(path: Path) -> str:
    """Still a valid .npy of the right shape: only the cache's manifest can tell."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    return f"not what {MANIFEST_NAME} records"


@pytest.mark.parametrize("damage", [_truncate, _objects, _floats, _link_outside, _flipped])
def test_a_damaged_cache_file_is_built_again(built, capsys, damage):
    cfg, want, folder = built
    path = _cache_file(folder, "shuffle_index.npy")
    why = damage(path)
    capsys.readouterr()
    assert _same(_indices(_build(cfg)), want)
    out = capsys.readouterr().out
    assert f"warning: {path} is " in out and why in out, out
    assert not path.is_symlink() and data_cache.npy_problem(path) is None
    outside = folder.parent.parent / "outside.npy"
    if outside.exists():  # the rebuilt index went into the run's folder, not through the link
        assert not outside.samefile(path)


def test_a_cache_rebuilt_in_a_hard_linked_copy_writes_nothing_outside_it(built, tmp_path):
    """A run folder copied with `cp -al` shares its cache files' inodes with the original: megatron-core writes its
    files in place, so a rebuild in the copy rewrote the original's description and indices (the sdoc audit). Each
    cache file gets an inode of its own first; what was sound is kept."""
    cfg, want, folder = built
    original = tmp_path / "original"
    original.mkdir()
    for path in folder.iterdir():  # the copy's files are hard links to the original's
        os.link(path, original / path.name)
    described = _cache_file(folder, "description.txt")
    (original / described.name).write_text("the original run's own")  # through the link: the copy's as well
    kept = {p.name: p.read_bytes() for p in original.iterdir()}
    _cache_file(folder, "shuffle_index.npy").unlink()  # built again: megatron-core rewrites its description too
    assert _same(_indices(_build(cfg)), want)
    assert {p.name: p.read_bytes() for p in original.iterdir()} == kept
    assert all(os.stat(p).st_nlink == 1 for p in folder.iterdir()), [p.name for p in folder.iterdir()]
    assert not list(folder.glob(f"*{data_cache.OWN_COPY}"))


@pytest.mark.parametrize("affix, values, why", [
    ("shuffle_index.npy", lambda a: a + len(a) + 5, "its shuffle index names samples beyond"),
    ("document_index.npy", lambda a: a + 10**6, "its document index names documents beyond"),
    ("sample_index.npy", lambda a: a[::-1].copy(), "its sample index does not run in order"),
    # every entry within range, and one sample over and over (the sdoc audit: it trained on sample 0)
    ("shuffle_index.npy", numpy.zeros_like, "its shuffle index is no order of its"),
    ("shuffle_index.npy", lambda a: a[: len(a) // 2].copy(), "its shuffle index is no order of its"),
    # one document in place of another: the spans still fit where both are as long
    ("document_index.npy", lambda a: numpy.where(a == a[1], a[0], a), "its document index does not hold each of"),
])
def test_a_well_formed_index_that_does_not_fit_the_data_is_built_again(built, capsys, affix, values, why):
    """Real .npy arrays of the right type, with the cache's manifest rewritten to match them: only their
    values give them away (training would read past the corpus, or silently in another order)."""
    cfg, want, folder = built
    path = _cache_file(folder, affix)
    bad = values(numpy.load(path))
    numpy.save(path, bad.astype(numpy.load(path).dtype))
    (folder / MANIFEST_NAME).unlink()
    capsys.readouterr()
    assert _same(_indices(_build(cfg)), want)
    out = capsys.readouterr().out
    assert f"an index that does not fit the data ({why}" in out, out


def test_a_corpus_rewritten_with_other_document_lengths_and_the_same_sizes_is_indexed_again(tmp_path, capsys):
    """The cache is keyed by the data's path and file sizes: 12 tokens moved from document 0 to document 1 keep both
    sizes, and the relaunch read the old sample boundaries against the new documents (other samples than a fresh
    build, silently; an IndexError later). Each sample must span the sequence length of the documents as they are."""
    from tests.sft_helpers import write_mmap_pair

    prefix = str(tmp_path / "corpus")
    lengths = [int(n) for n in numpy.random.default_rng(0).integers(60, 140, size=40)]

    def write(lengths):  # document i holds token 10 + i
        write_mmap_pair(prefix, [[10 + i] * n for i, n in enumerate(lengths)], dtype=numpy.uint16)

    def cfg_of(out):  # 48 samples, within one epoch: each old boundary stays inside its document
        return resolve("llama3_1", launcher_args("llama3_1", DATASET_PATH=prefix, OUTPUT_BASEPATH=str(out),
                                                 TRAIN_TOKENS_OR_ITERS=str(6 * 8 * 64)), env={})

    write(lengths)
    cfg = cfg_of(tmp_path / "out")
    before = _indices(_build(cfg))
    sizes = [os.path.getsize(prefix + suffix) for suffix in (".bin", ".idx")]
    write([lengths[0] - 12, lengths[1] + 12, *lengths[2:]])
    assert [os.path.getsize(prefix + suffix) for suffix in (".bin", ".idx")] == sizes
    capsys.readouterr()
    again = _indices(_build(cfg))
    out = capsys.readouterr().out
    assert "an index that does not fit the data (its samples do not span 64 tokens of the documents as they are now" \
        in out, out
    fresh = _indices(_build(cfg_of(tmp_path / "fresh")))
    assert _same(again, fresh) and not _same(before, fresh)


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1 << 24])
def test_the_span_check_reads_the_document_index_in_pieces_alike(built, monkeypatch, piece):
    """Megatron-core's own index passes in pieces of any size; one boundary moved by a token fails in all."""
    cfg, want, _ = built
    ds = _build(cfg)
    lengths, seq = ds.dataset.sequence_lengths, cfg.seq_len
    monkeypatch.setattr(data_cache, "SPAN_PIECE", piece)
    assert data_cache._span_problem(lengths, want["document_index"], want["sample_index"], seq) is None
    for at in (1, len(want["sample_index"]) // 2, len(want["sample_index"]) - 1):
        moved = want["sample_index"].copy()
        moved[at, 1] += 1 if moved[at, 1] == 0 else -1
        assert "do not span" in data_cache._span_problem(lengths, want["document_index"], moved, seq), at


def test_a_folder_in_place_of_a_cache_file_is_refused_in_one_line(built):
    cfg, _, folder = built
    path = _cache_file(folder, "sample_index.npy")
    path.unlink()
    path.mkdir()
    with pytest.raises(UserError, match="is a folder where megatron-core keeps a file of its dataset cache"):
        _build(cfg)


@pytest.mark.parametrize("failure", [OSError("8192 requested and 1008 written"),  # numpy's write on a full disk
                                     OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))])
def test_a_full_disk_while_the_data_cache_is_written_is_bad_input_in_one_line(corpus, tmp_path, monkeypatch, failure):
    """megatron-core wraps the failed write of its dataset indices in a bare Exception advising path_to_cache: that was
    an internal error with megatron's traceback at start-up (the resource audit); it is one line naming the cache."""
    cfg = _cfg(corpus, tmp_path / "out")

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(numpy, "save", full)
    with pytest.raises(UserError) as raised:
        _build(cfg)
    cache = data_cache.run_cache_folder(cfg.output_basepath)
    # under a process group (every training run), megatron-core wraps the error; an earlier test of this worker
    # may have left a world of one behind, which serves as well
    ours = not torch.distributed.is_initialized()
    if ours:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                                             world_size=1)
    try:
        with pytest.raises(UserError) as wrapped:
            _build(cfg)
    finally:
        if ours:
            torch.distributed.destroy_process_group()
    # the same line, but for the free space measured twice (other writers on this disk move it between the calls)
    free = re.compile(r"[0-9.]+ MiB free")
    assert free.sub("N MiB free", str(wrapped.value)) == free.sub("N MiB free", str(raised.value))
    assert str(raised.value).startswith(f"writing the data cache in {cache} failed ({failure}), ")
    assert str(raised.value).endswith("MiB free there: free space (or choose another OUTPUT_BASEPATH) and rerun")


def test_a_full_disk_while_the_cache_manifest_is_written_leaves_no_half_manifest(tmp_path, monkeypatch):
    """The data cache's manifest is written to a temporary name, then renamed: a full disk there left the empty
    .mpatch_manifest.json.tmp.PID beside the cache (the fail audit, on a 24 KiB tmpfs)."""
    from megatron_patch.checkpoint_files import manifest

    real = manifest.write_manifest

    def full(folder, *args, name, **kwargs):
        (Path(folder) / name).write_text("")  # opened, then the disk was full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    (tmp_path / "x-description.txt").write_text("a cache")
    monkeypatch.setattr(data_cache, "write_manifest", full)
    with pytest.raises(OSError):
        data_cache.record(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x-description.txt"]
    monkeypatch.setattr(data_cache, "write_manifest", real)
    data_cache.record(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [manifest.MANIFEST_NAME, "x-description.txt"]


def test_a_blend_whose_index_names_a_missing_dataset_is_unfit():
    from types import SimpleNamespace

    class Blended(SimpleNamespace):
        pass

    split = SimpleNamespace(name="train")
    blend = Blended(datasets=[[0] * 5, [0] * 3], dataset_index=numpy.array([0, 1, 2], dtype=numpy.int16),
                    dataset_sample_index=numpy.array([0, 0, 0]), unique_description_hash="h", split=split)
    assert data_cache.unfit_indices([blend]) == [("h-Blended-train", "its dataset index names datasets beyond the "
                                                                     "blend's 2")]
    blend.dataset_index = numpy.array([0, 1, 1], dtype=numpy.int16)
    blend.dataset_sample_index = numpy.array([4, 2, 3])
    assert data_cache.unfit_indices([blend])[0][1] == "its sample index names samples beyond a dataset of the blend"
    # in range, but not what megatron-core counts (each dataset's samples from 0, in blend order): one sample
    # of each dataset over and over trained silently (the sdoc audit, for the shuffle index)
    blend.dataset_sample_index = numpy.array([4, 2, 1])
    assert data_cache.unfit_indices([blend])[0][1] == "its sample index does not count each dataset's samples in order"
    blend.dataset_index, blend.dataset_sample_index = numpy.array([0, 1, 1, 0], dtype=numpy.int16), numpy.zeros(4)
    assert data_cache.unfit_indices([blend])[0][1] == "its sample index does not count each dataset's samples in order"
    blend.dataset_sample_index = numpy.array([0, 0, 1, 1])
    assert data_cache.unfit_indices([blend]) == []


def test_a_garbage_cache_manifest_is_removed_and_written_again(built, capsys):
    cfg, want, folder = built
    (folder / MANIFEST_NAME).write_text("{")
    capsys.readouterr()
    assert _same(_indices(_build(cfg)), want)
    assert f"warning: {folder / MANIFEST_NAME} is not a readable manifest" in capsys.readouterr().out
    # every file megatron-core keeps there (its indices and their descriptions): mpatch verify finds none unlisted
    assert set(read_manifest(folder / MANIFEST_NAME)["files"]) == {p.name for p in folder.glob("*.npy")} | {
        p.name for p in folder.glob("*.txt")} and list(folder.glob("*.txt"))


# --- the training data, checked before the first step ------------------------------------------------------

def _write_pair(prefix: Path, documents: list[list[int]], dtype=numpy.int32) -> str:
    """A .bin/.idx pair as megatron-core writes it (no manifest)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in documents:
        builder.add_document(numpy.asarray(doc, dtype=dtype), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


@pytest.fixture(scope="module")
def other_corpus(tmp_path_factory):
    from tests.training_helpers import make_corpus

    return make_corpus(tmp_path_factory.mktemp("other"), 40, seed=3)


def _pair(corpus, tmp: Path, manifest: bool = True) -> str:
    """A copy of the session corpus's pair (and its manifest)."""
    src = Path(corpus["prefix"])
    tmp.mkdir(parents=True, exist_ok=True)
    for p in src.parent.glob(src.name + ".*"):
        if manifest or not p.name.endswith(MANIFEST_NAME):
            shutil.copy(p, tmp / p.name)
    return str(tmp / src.name)


def _mixed(corpus, other, tmp):
    """mpatch preprocess killed between its two renames: the new corpus's .bin beside the old .idx, and no manifest
    (the old one goes first)."""
    prefix = _pair(corpus, tmp, manifest=False)
    shutil.copy(other["prefix"] + ".bin", prefix + ".bin")
    return prefix, "or the two files are not one pair"


def _other_idx(corpus, other, tmp):
    prefix = _pair(corpus, tmp, manifest=False)
    shutil.copy(other["prefix"] + ".idx", prefix + ".idx")
    return prefix, "or the two files are not one pair"


def _other_idx_beside_its_manifest(corpus, other, tmp):
    prefix = _pair(corpus, tmp)
    shutil.copy(other["prefix"] + ".idx", prefix + ".idx")
    return prefix, "but corpus_text_document.mpatch_manifest.json records"


def _truncated_bin(corpus, other, tmp):
    prefix = _pair(corpus, tmp, manifest=False)
    Path(prefix + ".bin").write_bytes(Path(prefix + ".bin").read_bytes()[:-6])
    return prefix, "tokens of uint16"


def _foreign_bin(corpus, other, tmp):
    """Another file of the same size: only the token ids give it away."""
    prefix = _pair(corpus, tmp, manifest=False)
    size = Path(prefix + ".bin").stat().st_size
    Path(prefix + ".bin").write_bytes(numpy.random.default_rng(0).integers(0, 256, size, dtype=numpy.uint8).tobytes())
    return prefix, "outside the model's vocabulary [0, 200)"


def _garbage_idx(corpus, other, tmp):
    prefix = _pair(corpus, tmp, manifest=False)
    Path(prefix + ".idx").write_bytes(b"garbage" * 10)
    return prefix, "is not an index written by megatron-core or 'mpatch preprocess' (no MMIDIDX header)"


def _empty_bin(corpus, other, tmp):
    prefix = _pair(corpus, tmp, manifest=False)
    Path(prefix + ".bin").write_bytes(b"")
    return prefix, ".bin is 0 bytes"


def _no_tokens(corpus, other, tmp):
    return _write_pair(tmp / "empty", []), "holds no tokens"


def _negative_id(corpus, other, tmp):
    return _write_pair(tmp / "labels", [[5, 6, 7], [8, -100, 9]]), "holds token id -100 (token 4, document 1)"


def _id_beyond_the_vocabulary(corpus, other, tmp):
    return _write_pair(tmp / "big", [[5, 6, 7], [8, 9], [300]]), "holds token id 300 (token 5, document 2)"


BAD_DATA = [_mixed, _other_idx, _other_idx_beside_its_manifest, _truncated_bin, _foreign_bin, _garbage_idx, _empty_bin,
            _no_tokens, _negative_id, _id_beyond_the_vocabulary]


def test_sound_data_passes_and_every_token_is_counted(corpus, tmp_path):
    from megatron_patch.training.data_files import check_mmap_data

    assert check_mmap_data(_pair(corpus, tmp_path / "a"), 256) == Path(corpus["prefix"] + ".bin").stat().st_size // 2
    assert check_mmap_data(_write_pair(tmp_path / "ids", [[0, 1], [255]]), 256) == 3


@pytest.mark.parametrize("damage", BAD_DATA, ids=[f.__name__.strip("_") for f in BAD_DATA])
def test_training_refuses_data_that_does_not_match_its_index_in_one_line(corpus, other_corpus, tmp_path, capsys,
                                                                        damage):
    """Before any rank starts (the launcher's own process): one line, exit 2. Unchecked, these trained and exported
    with exit 0 (a mixed pair) or ended in rank tracebacks and 'internal error' (exit 1)."""
    from megatron_patch.cli import main

    prefix, why = damage(corpus, other_corpus, tmp_path / "data")
    out = tmp_path / "out"
    args = launcher_args("llama3_1", DATASET_PATH=prefix, OUTPUT_BASEPATH=str(out), TRAIN_TOKENS_OR_ITERS=str(2 * 8 * 64),
                         WARMUP_TOKENS_OR_ITERS=str(8 * 64))
    code = main(["train", "llama3_1", *args])
    captured = capsys.readouterr()
    assert code == 2 and why in captured.err, captured.err + captured.out[-2000:]
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert "torch.distributed.run" not in captured.out  # refused before any rank started


# --- nothing is written through a link that leads outside the run folder ------------------------------------

def _train_in_process(corpus, out: Path, capsys) -> tuple[int, str]:
    from megatron_patch.cli import main

    args = launcher_args("llama3_1", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out),
                         TRAIN_TOKENS_OR_ITERS=str(2 * 8 * 64), WARMUP_TOKENS_OR_ITERS=str(8 * 64))
    code = main(["train", "llama3_1", *args])
    captured = capsys.readouterr()
    return code, captured.err + captured.out


@pytest.mark.parametrize("name, kind", [("log/metrics.jsonl", "file"), ("log", "folder"), ("data_cache", "folder"),
                                        ("tensorboard", "folder"), ("checkpoint", "folder"),
                                        ("log/throughput.json", "file"), ("eval", "folder"),
                                        ("eval/results.jsonl", "file")])
def test_a_link_leading_outside_the_run_folder_is_refused_where_training_writes(corpus, tmp_path, capsys, name, kind):
    out, outside = tmp_path / "out", tmp_path / "outside"
    (out / "log").mkdir(parents=True)
    if kind == "file":
        outside.write_text("precious\n")
    else:
        outside.mkdir()
    link = out / name
    link.parent.mkdir(exist_ok=True)
    if link.is_dir():
        link.rmdir()
    link.symlink_to(outside)
    code, said = _train_in_process(corpus, out, capsys)
    assert code == 2 and said.splitlines()[0] == (
        f"mpatch train: error: {link} leads outside OUTPUT_BASEPATH (to {outside}), and training writes there: remove "
        "the link (training makes its own), or point OUTPUT_BASEPATH at the folder you want"), said[-2000:]
    assert "torch.distributed.run" not in said
    assert (outside.read_text() == "precious\n") if kind == "file" else not any(outside.iterdir())


def test_links_inside_the_run_folder_are_followed_and_wrong_kinds_refused(tmp_path):
    from megatron_patch.training.run_folder import check_run_folder

    out = tmp_path / "out"
    (out / "cache2").mkdir(parents=True)
    (out / "data_cache").symlink_to("cache2")
    check_run_folder(out)
    (out / "log").mkdir()
    os.mkfifo(out / "log" / "metrics.jsonl")  # appending to it would hang the run
    with pytest.raises(UserError, match=r"metrics\.jsonl is not a regular file, and training writes there"):
        check_run_folder(out)
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="is not a folder"):
        check_run_folder(tmp_path / "file")


def test_metrics_shared_by_a_hard_link_get_a_file_of_their_own(tmp_path):
    """``cp -al`` copies a run folder as hard links: appending to the copy's metrics must leave the original's."""
    from megatron_patch.training.run_folder import METRICS, open_metrics

    original, copy = tmp_path / "run", tmp_path / "copy"
    (original / "log").mkdir(parents=True)
    (original / METRICS).write_text('{"iteration": 1}\n')
    (copy / "log").mkdir(parents=True)
    os.link(original / METRICS, copy / METRICS)
    f, note = open_metrics(copy, resumed=1)
    with f:
        f.write('{"iteration": 2}\n')
    assert note is None
    assert (original / METRICS).read_text() == '{"iteration": 1}\n'
    assert (copy / METRICS).read_text() == '{"iteration": 1}\n{"iteration": 2}\n'


def test_a_resumed_run_drops_the_records_it_trains_again_and_a_cut_line(tmp_path):
    """A run that logged iterations 5 and 6 past its checkpoint at 4 and was cut mid-write: resumed from 4, it
    logged 5 and 6 again (each iteration twice in metrics.jsonl), and its first record ran on from the cut line
    (no longer JSON). What it trains again is dropped, as TensorBoard's purge_step drops it; records without an
    iteration stay."""
    import json

    from megatron_patch.training.run_folder import METRICS, open_metrics

    records = [{"iteration": i, "loss": 1.0 / i} for i in range(1, 7)]
    path = tmp_path / METRICS
    path.parent.mkdir(parents=True)
    text = "".join(json.dumps(r) + "\n" for r in records[:4]) + '{"note": "kept"}\n'
    path.write_text(text + "".join(json.dumps(r) + "\n" for r in records[4:]) + '{"iteration": 7, "lo')
    f, note = open_metrics(tmp_path, resumed=4)
    with f:
        f.write(json.dumps(records[4]) + "\n")
    assert note == f"{METRICS}: dropped 2 record(s) of iterations after 4, trained again now and a line cut short"
    assert path.read_text() == text + json.dumps(records[4]) + "\n"
    f, note = open_metrics(tmp_path, resumed=5)  # a sound log: appended to as it is
    f.close()
    assert note is None and path.read_text() == text + json.dumps(records[4]) + "\n"


# --- resume falls back past an iteration that fails any integrity check -------------------------------------

def _training_iteration(root: Path, iteration: int) -> Path:
    """A small training checkpoint folder as the trainer leaves it: torch DCP files (tensors of 64 KiB and 256 B),
    megatron's metadata.json and common.pt, train_state.json, the RNG file."""
    import json
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_patch.checkpoint_files.layout import iteration_dir, write_tracker
    from megatron_patch.checkpoint_files.torch_dist import MEGATRON_CONFIG

    folder = iteration_dir(root, iteration)
    g = torch.Generator().manual_seed(iteration)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}, checkpoint_id=str(folder),
                 no_dist=True)
    (folder / "metadata.json").write_text(json.dumps(MEGATRON_CONFIG))
    torch.save({"iteration": iteration}, folder / "common.pt")
    (folder / "train_state.json").write_text(json.dumps({"iteration": iteration, "world_size": 1}))
    (folder / "rng").mkdir()
    torch.save({"torch": torch.get_rng_state()}, folder / "rng" / "rank_00000.pt")
    write_tracker(root, iteration)
    return folder


def _flip_tensor_byte(folder: Path) -> Path:
    """One byte of a tensor's data inside a .distcp archive: the archive's CRC-32 no longer matches."""
    from megatron_patch.checkpoint_files.torch_dist import read_metadata
    from megatron_patch.checkpoint_files.zipfmt import ZipIndex

    name, start, length, _ = read_metadata(folder / ".metadata").storage[("w", (0, 0))]
    index = ZipIndex(folder / name, base=start, length=length)
    record = next(n for n in index.names() if n.startswith("data/"))
    offset, size = index.locate(record)
    data = bytearray((folder / name).read_bytes())
    data[offset + size // 2] ^= 0x10
    (folder / name).write_bytes(bytes(data))
    return folder / name


# --- another job into a run's folder: refused, where it resumed the run it found there --------------------------

def _saved_run(out: Path, args: list[str], iteration: int = 4, data: bool = True, env: dict | None = None,
               family: str = "llama3_1") -> Path:
    """A checkpoint of ``args``'s run in ``out``, its train_state.json as the trainer writes it; ``data=False``: as
    checkpoints saved before they recorded their data (``run_state.training_data``)."""
    import json

    from megatron_patch.training.run_state import training_data

    cfg = resolve(family, args, env=env or {})
    folder = _training_iteration(out / "checkpoint", iteration)
    state = {"iteration": iteration, "world_size": 1, "family": cfg.family, "hf_config": cfg.hf_config,
             "config": cfg.to_dict()}
    if data:
        state["data"] = training_data(cfg)
    (folder / "train_state.json").write_text(json.dumps(state, default=str))
    return folder


def test_another_job_into_a_run_folder_is_refused_naming_what_changed(tmp_path, monkeypatch):
    """SFT on or off, other training data (its real path, or the same files' sizes where it moved), another blend
    or sample length: each made a rerun go on from the old run's iteration, optimizer state and place in its data.
    Another schedule, and the same data by another name, resume; an older folder (no data recorded) resumes on
    other data as before."""
    from megatron_patch.training.run_state import check_same_job

    for name, sizes in (("a", (40, 8)), ("b", (60, 8))):
        for suffix, size in zip((".bin", ".idx"), sizes):
            (tmp_path / f"{name}_text_document{suffix}").write_bytes(b"x" * size)
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    out = tmp_path / "out"

    def args(**over):
        return launcher_args("llama3_1", **{"DATASET_PATH": a, "OUTPUT_BASEPATH": str(out), **over})

    def check(folder, env=None, **over):
        env = {"MP_TOKENIZER": str(tmp_path / "tok"), **(env or {})}
        return check_same_job(resolve("llama3_1", args(**over), env=env), folder)

    folder = _saved_run(out, args())
    sft = dict(SFT="true", DATASET_PATH=str(tmp_path / "sft.jsonl"))
    with pytest.raises(UserError) as refused:
        check(folder, **sft)
    assert str(refused.value) == (
        f"OUTPUT_BASEPATH {out} holds another job's run (SFT false -> true; DATASET_PATH {a} -> {sft['DATASET_PATH']})"
        ", and a launch into it resumes that run "
        "(from iter_0000004, with its optimizer state and its place in its data): give this job a new "
        f"OUTPUT_BASEPATH, with PRETRAIN_CHECKPOINT_PATH={out / 'checkpoint'} to start from that run's weights; or "
        "relaunch that run as it was to resume it")
    for over, changed in ((dict(DATASET_PATH=b), f"(DATASET_PATH {a} -> {b})"),
                          (dict(SEQ_LEN="128"), "(SEQ_LEN 64 -> 128)"),
                          (dict(DATASET_PATH=f"1 {a} 1 {b}"), f"(DATASET_PATH {a} -> {a} {b}; DATASET_PATH's blend "
                                                              "weights None -> [1.0, 1.0])")):
        with pytest.raises(UserError, match=re.escape(changed)):
            check(folder, **over)
    # validation held out of the data (other documents train), or the documents of a sample kept apart
    for env, changed in (({"MP_SPLIT": "99,1,0"}, "(MP_SPLIT unset -> 99,1,0)"),
                         ({"MP_SFT_PACKING": "true"}, "(MP_SFT_PACKING false -> true)")):
        with pytest.raises(UserError, match=re.escape(changed)):
            check(folder, env)
    # what resumes: another schedule, the same files by another name (relative, through a link), a moved copy
    assert check(folder, LR="1e-2", TRAIN_TOKENS_OR_ITERS=str(40 * 8 * 64), TP="2") == []
    monkeypatch.chdir(tmp_path)
    assert check(folder, DATASET_PATH="a_text_document") == []
    (tmp_path / "link").symlink_to(tmp_path)
    assert check(folder, DATASET_PATH=str(tmp_path / "link" / "a_text_document")) == []
    (tmp_path / "moved").mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(a + suffix, tmp_path / "moved" / f"a_text_document{suffix}")
    moved = str(tmp_path / "moved" / "a_text_document")
    assert check(folder, DATASET_PATH=moved) == [
        f"DATASET_PATH {moved} is taken as the data the run trained on at {a} (its files have the same sizes)"]
    # the same path, its files grown since (a corpus appended to): resumes, said (docs/training.md)
    with open(a + ".bin", "ab") as grown:
        grown.write(b"y")
    assert check(folder) == ["DATASET_PATH's files changed size since iter_0000004 was saved: the run goes on over "
                             "them as they are now"]
    # data preprocessed again with the same sizes (the same documents in another order): its manifest's digests
    # differ, said alike (the data audit: it resumed without a word)
    from megatron_patch.checkpoint_files.manifest import DIGEST, digest_file, write_manifest
    from megatron_patch.training.data_files import manifest_path

    def preprocessed(content: bytes) -> str:
        c = str(tmp_path / "c_text_document")
        for suffix in (".bin", ".idx"):
            Path(c + suffix).write_bytes(content)
        write_manifest(tmp_path, "mpatch preprocess", name=manifest_path(c).name, files={
            Path(c + s).name: dict(zip(("size", DIGEST), digest_file(c + s))) for s in (".bin", ".idx")})
        return c

    c = preprocessed(b"x" * 40)
    c_folder = _saved_run(tmp_path / "c_out", args(DATASET_PATH=c, OUTPUT_BASEPATH=str(tmp_path / "c_out")))
    assert check(c_folder, DATASET_PATH=c) == []
    preprocessed(b"z" * 40)
    assert check(c_folder, DATASET_PATH=c) == [
        "DATASET_PATH's files changed since iter_0000004 was saved (rebuilt: the same sizes, other digests in their "
        "manifests): the run goes on over them as they are now, in a sample order built for them"]
    # an older run folder, whose checkpoints do not record their data: other data resumes as it did; SFT does not
    old = _saved_run(tmp_path / "old", args(OUTPUT_BASEPATH=str(tmp_path / "old")), data=False)
    assert check(old, DATASET_PATH=b) == []
    with pytest.raises(UserError, match=re.escape("(SFT false -> true)")):  # nor, here, the data
        check(old, **sft)
    # an SFT run on JSON records: its sample is PAD_LEN long (SEQ_LEN bounds it), and the run's own data resumes
    sft_folder = _saved_run(tmp_path / "sft_out", args(**sft, OUTPUT_BASEPATH=str(tmp_path / "sft_out")),
                            env={"MP_TOKENIZER": str(tmp_path / "tok")})
    assert check(sft_folder, **sft, SEQ_LEN="128") == []
    with pytest.raises(UserError, match=re.escape("(PAD_LEN 64 -> 32)")):
        check(sft_folder, **sft, PAD_LEN="32")
    with pytest.raises(UserError, match=re.escape("(SFT true -> false; DATASET_PATH ")):
        check(sft_folder)
    # the records tokenize by MP_TOKENIZER: another vocabulary refused, the same files in another folder resume
    (tmp_path / "tok2").mkdir()
    (tmp_path / "tok2" / "tokenizer.json").write_text('{"model": "other"}')
    with pytest.raises(UserError, match=re.escape(f"(MP_TOKENIZER: {tmp_path / 'tok2'} is another tokenizer than")):
        check_same_job(resolve("llama3_1", args(**sft), env={"MP_TOKENIZER": str(tmp_path / "tok2")}), sft_folder)
    shutil.copytree(tmp_path / "tok", tmp_path / "tok_copy")
    assert check_same_job(resolve("llama3_1", args(**sft), env={"MP_TOKENIZER": str(tmp_path / "tok_copy")}),
                          sft_folder) == []


def test_a_resume_given_another_starting_checkpoint_is_refused(tmp_path):
    """A run resumes its own checkpoint, never PRETRAIN_CHECKPOINT_PATH: a rerun into the folder that named another
    starting model (the same architecture) resumed the old run without a word (the paisft audit). The same
    checkpoint by another name resumes; one gone from where the run began (moved) is said, as moved data is."""
    import dataclasses
    import json

    from megatron_patch.training.run_state import check_same_job

    for suffix in (".bin", ".idx"):
        (tmp_path / f"a_text_document{suffix}").write_bytes(b"x" * 8)
    out = tmp_path / "out"
    args = launcher_args("llama3_1", DATASET_PATH=str(tmp_path / "a_text_document"), OUTPUT_BASEPATH=str(out))
    folder = _saved_run(out, args)
    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir(), other.mkdir()
    (tmp_path / "link").symlink_to(first)
    state = json.loads((folder / "train_state.json").read_text())
    state["config"]["pretrain_checkpoint"] = str(first)  # the run began from `first`
    (folder / "train_state.json").write_text(json.dumps(state))

    def check(start):
        return check_same_job(dataclasses.replace(resolve("llama3_1", args, env={}), pretrain_checkpoint=start), folder)

    assert check(str(first)) == check(str(tmp_path / "link")) == check(None) == []
    with pytest.raises(UserError, match=re.escape(f"holds another job's run (PRETRAIN_CHECKPOINT_PATH {first} -> "
                                                  f"{other}), and a launch into it resumes that run")):
        check(str(other))
    first.rename(tmp_path / "moved")
    assert check(str(other)) == [f"PRETRAIN_CHECKPOINT_PATH {other} is not read: the run resumes its own checkpoint "
                                 f"(it started from {first}, no longer there)"]
    # a run that began from no checkpoint, rerun from one
    state["config"]["pretrain_checkpoint"] = None
    (folder / "train_state.json").write_text(json.dumps(state))
    with pytest.raises(UserError, match=re.escape(f"(PRETRAIN_CHECKPOINT_PATH none -> {other})")):
        check(str(other))


def test_a_resume_with_another_seed_or_lora_is_refused_and_another_dropout_resumes(tmp_path):
    """MP_SEED orders the data (megatron-core's shuffle) and MP_LORA_* shape the saved adapters: a resume with
    another seed trained the rest on other samples than the run's, another LoRA rank or full fine-tuning failed
    in a rank (an internal error), other targets or alpha trained on silently (adapters dropped, or scaled 4x)."""
    from megatron_patch.training.run_state import resume_notes

    (tmp_path / "a_text_document.bin").write_bytes(b"x" * 40)
    (tmp_path / "a_text_document.idx").write_bytes(b"x" * 8)
    out = tmp_path / "out"
    args = launcher_args("llama3_1", DATASET_PATH=str(tmp_path / "a_text_document"), OUTPUT_BASEPATH=str(out))
    folder = _saved_run(out, args, env={"MP_LORA_RANK": "4"})

    def notes(**env):
        return resume_notes(resolve("llama3_1", args, env={"MP_LORA_RANK": "4", **env}), folder)

    assert notes() == [] and notes(MP_LORA_DROPOUT="0.1") == []
    lora = "MP_LORA_RANK=4 MP_LORA_ALPHA=4.0 MP_LORA_TARGETS=qkv,proj,fc1,fc2"
    for env, asked in ((dict(MP_LORA_TARGETS="qkv,proj"), "MP_LORA_RANK=4 MP_LORA_ALPHA=4.0 MP_LORA_TARGETS=qkv,proj"),
                       (dict(MP_LORA_ALPHA="16"), "MP_LORA_RANK=4 MP_LORA_ALPHA=16.0 MP_LORA_TARGETS=qkv,proj,fc1,fc2"),
                       (dict(MP_LORA_RANK="8"), "MP_LORA_RANK=8 MP_LORA_ALPHA=8.0 MP_LORA_TARGETS=qkv,proj,fc1,fc2"),
                       (dict(MP_LORA_RANK="0"), "off (MP_LORA_RANK=0: every weight trains)")):
        with pytest.raises(UserError) as refused:
            notes(**env)
        assert str(refused.value) == (
            f"{folder} was trained with LoRA {lora}, and this launch asks {asked}: the weights and optimizer state "
            "saved there are that run's. Resume with its MP_LORA_* settings, or start afresh in another "
            "OUTPUT_BASEPATH"), env
    with pytest.raises(UserError, match=re.escape("was trained with MP_SEED=1234, and this launch asks MP_SEED=7: the "
                                                  "data's order follows it")):
        notes(MP_SEED="7")
    assert resume_notes(resolve("llama3_1", [*args[:2], "4", *args[3:]], env={"MP_LORA_RANK": "4"}), folder) == [
        "BATCH_SIZE 2 -> 4: the same samples in other micro-batches, which adds them in another order, so the losses "
        "differ from an uninterrupted run's in their last digits"]


def test_a_resume_that_would_train_other_sparse_attention_parameters_is_refused(tmp_path):
    """The dsa audit: a DeepSeek-V3.2 run resumed with its indexer loss off resumed silently (the indexer frozen
    from then on, its optimizer state dropped), with it on a rank refused blaming the checkpoint, and the indexer-only
    mode switched the same way. Refused before any rank starts; another scale of the same loss resumes."""
    from megatron_patch.training.run_state import resume_notes

    (tmp_path / "a_text_document.bin").write_bytes(b"x" * 40)
    (tmp_path / "a_text_document.idx").write_bytes(b"x" * 8)
    out = tmp_path / "out"
    args = launcher_args("deepseek_v32", DATASET_PATH=str(tmp_path / "a_text_document"), OUTPUT_BASEPATH=str(out))
    folder = _saved_run(out, args, env={"MP_DSA_INDEXER_LOSS_SCALE": "1"}, family="deepseek_v32")

    def notes(**env):
        return resume_notes(resolve("deepseek_v32", args, env=env), folder)

    assert notes(MP_DSA_INDEXER_LOSS_SCALE="0.5") == []
    saved = "MP_DSA_INDEXER_ONLY=false MP_DSA_INDEXER_LOSS_SCALE=1.0"
    for env, asked in (({}, "MP_DSA_INDEXER_ONLY=false MP_DSA_INDEXER_LOSS_SCALE=0.0"),
                       ({"MP_DSA_INDEXER_ONLY": "true"}, "MP_DSA_INDEXER_ONLY=true MP_DSA_INDEXER_LOSS_SCALE=1.0")):
        with pytest.raises(UserError) as refused:
            notes(**env)
        assert str(refused.value) == (
            f"{folder} was trained with {saved}, and this launch asks {asked}: which parameters train, and the "
            "optimizer state saved for them, follow those. Resume with its MP_DSA_* settings, or start afresh in "
            "another OUTPUT_BASEPATH"), env


@pytest.mark.parametrize("loss", ["record", "token"])
def test_an_sft_resume_at_another_batch_size_says_what_regrouping_does(tmp_path, loss):
    """MP_SFT_LOSS=token means each micro-batch's token mean, so regrouping SFT's uneven micro-batches reweights the
    tokens; MP_SFT_LOSS=record (the default) weighs each record alike however they are grouped, and the note said it
    reweighted them (the tdoc audit: the resumed losses equalled the uninterrupted run's to 6e-7)."""
    from megatron_patch.training.run_state import resume_notes

    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    env = {"MP_TOKENIZER": str(tmp_path / "tok"), "MP_SFT_LOSS": loss}
    out = tmp_path / "out"

    def args(batch):
        return launcher_args("llama3_1", SFT="true", DATASET_PATH=str(tmp_path / "sft.jsonl"), OUTPUT_BASEPATH=str(out),
                             BATCH_SIZE=batch, TRAIN_TOKENS_OR_ITERS="8", WARMUP_TOKENS_OR_ITERS="1")

    folder = _saved_run(out, args("2"), env=env)
    how = ("reweights the trained tokens (each micro-batch's mean counts alike), so the steps differ from an "
           "uninterrupted run's" if loss == "token" else
           "adds them in another order, so the losses differ from an uninterrupted run's in their last digits")
    assert resume_notes(resolve("llama3_1", args("4"), env=env), folder) == [
        f"BATCH_SIZE 2 -> 4: the same samples in other micro-batches, which {how}"]


def test_an_extended_run_is_told_its_sample_order_changes_only_where_it_does(corpus, tmp_path):
    """Every run extended to more iterations was told its order might not continue, "where the data now runs to
    another number of epochs" (the tdoc audit: within one epoch it does continue). Said now only where a prefix's
    epochs change (``data_files.sample_order``, checked against megatron-core's orders in tests/test_training.py),
    naming it; SFT's samples continue in order at any length."""
    from megatron_patch.training.data_files import one_epoch
    from megatron_patch.training.run_state import resume_notes

    out, prefix = tmp_path / "out", corpus["prefix"]
    per_epoch = one_epoch(prefix, 64)[1]

    def args(iterations):
        return launcher_args("llama3_1", DATASET_PATH=prefix, OUTPUT_BASEPATH=str(out), WARMUP_TOKENS_OR_ITERS="0",
                             TRAIN_TOKENS_OR_ITERS=str(iterations * 8 * 64))

    def order_notes(iterations):  # the schedule's note (its decay iterations change) apart
        return [n for n in resume_notes(resolve("llama3_1", args(iterations), env={}), folder)
                if not n.startswith("the learning-rate schedule")]

    first = per_epoch // 8 // 2
    folder = _saved_run(out, args(first))
    assert order_notes(per_epoch // 8) == []  # one epoch still
    past = per_epoch // 8 + 1
    assert order_notes(past) == [
        f"iterations {first} -> {past}: {prefix} now runs to 2 epochs (it ran to 1), and megatron-core builds the "
        "data's sample order for the run's whole length: the coming iterations are not the continuation of the first "
        "launch's order (some samples seen again, some not at all)"]
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    sft_out, env = tmp_path / "sft", {"MP_TOKENIZER": str(tmp_path / "tok")}

    def sft(iterations):
        return launcher_args("llama3_1", SFT="true", DATASET_PATH=str(tmp_path / "sft.jsonl"),
                             OUTPUT_BASEPATH=str(sft_out), TRAIN_TOKENS_OR_ITERS=str(iterations),
                             WARMUP_TOKENS_OR_ITERS="1")

    notes = resume_notes(resolve("llama3_1", sft(80), env=env), _saved_run(sft_out, sft(8), env=env))
    assert [n for n in notes if not n.startswith("the learning-rate schedule")] == [], notes


def test_a_resume_across_the_experts_own_optimizer_is_refused_before_any_rank(tmp_path, monkeypatch):
    """An MoE run at EP=2 keeps its experts' optimizer state in an optimizer of their own (megatron-core's chained
    one), at EP=1 not: a relaunch at the other said 'resuming from iteration 4', then every rank failed on "has no
    tensor 'optimizer.state...': it was not written for this model". Another EP above 1 resumes."""
    from megatron_patch.training import run_state
    from megatron_patch.training.run_state import resume_notes

    (tmp_path / "a_text_document.bin").write_bytes(b"x" * 40)
    (tmp_path / "a_text_document.idx").write_bytes(b"x" * 8)
    out = tmp_path / "out"

    def args(ep, **over):
        return launcher_args("qwen2_moe", **{"DATASET_PATH": str(tmp_path / "a_text_document"),
                                             "OUTPUT_BASEPATH": str(out), "EP": str(ep), "GLOBAL_BATCH_SIZE": "8",
                                             **over})

    two = {"MP_NPROC": "2"}
    at_ep2 = _saved_run(out, args(2), env=two, family="qwen2_moe")
    with pytest.raises(UserError) as refused:
        resume_notes(resolve("qwen2_moe", args(1), env=two), at_ep2)
    monkeypatch.setattr(run_state, "experts_grouped_whenever_etp_differs", lambda: False)  # megatron-core 0.16
    with pytest.raises(UserError) as refused:
        resume_notes(resolve("qwen2_moe", args(1), env=two), at_ep2)
    assert str(refused.value).startswith(
        f"{at_ep2} was trained at TP=1 EP=2 ETP=1, this launch asks TP=1 EP=1 ETP=1: megatron-core keeps the experts' "
        "optimizer state apart from the rest's at EP > 1 (there and not here: its chained optimizer)"), refused.value
    assert f"Resume with EP > 1, or start from its weights: a new OUTPUT_BASEPATH with PRETRAIN_CHECKPOINT_PATH={out}" \
        in str(refused.value)
    assert resume_notes(resolve("qwen2_moe", args(4), env={"MP_NPROC": "4"}), at_ep2) == []
    at_ep1 = _saved_run(tmp_path / "out1", args(1), env=two, family="qwen2_moe")
    with pytest.raises(UserError, match="was trained at TP=1 EP=1 ETP=1, this launch asks TP=1 EP=2 ETP=1"):
        resume_notes(resolve("qwen2_moe", args(2), env=two), at_ep1)
    # megatron-core 0.19 keeps them apart where ETP differs from TP too: a TP change alone crosses it, and the
    # refusal said "trained at EP=1, this launch asks EP=1 ... Resume with EP>1", naming neither
    from megatron_patch.training import validation

    for module in (run_state, validation):
        monkeypatch.setattr(module, "experts_grouped_whenever_etp_differs", lambda: True)
    at_tp2 = _saved_run(tmp_path / "out2", args(1, TP="2", ETP="1", SP="true"), env=two, family="qwen2_moe")
    with pytest.raises(UserError) as refused:
        resume_notes(resolve("qwen2_moe", args(1), env=two), at_tp2)
    assert str(refused.value).startswith(
        f"{at_tp2} was trained at TP=2 EP=1 ETP=1, this launch asks TP=1 EP=1 ETP=1: megatron-core keeps the experts' "
        "optimizer state apart from the rest's at EP > 1 or ETP other than TP (there and not here"), refused.value
    assert "Resume with EP > 1 or ETP other than TP, or start from its weights" in str(refused.value)


def test_a_launch_of_another_job_into_a_run_folder_stops_before_any_rank(corpus, tmp_path, monkeypatch, capsys):
    """The launcher refuses in one line (exit 2) before any rank starts; the run's own relaunch resumes, the
    resume its first line."""
    import megatron_patch.cli.train as train_cli
    from megatron_patch.cli import main

    launched = []
    monkeypatch.setattr(train_cli, "_launch", lambda *a: launched.append(a) or 0)
    out = tmp_path / "out"
    pretraining = launcher_args("llama3_1", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out))
    _saved_run(out, pretraining)
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    monkeypatch.setenv("MP_TOKENIZER", str(corpus["tok"]))
    code = main(["train", "llama3_1", *launcher_args("llama3_1", SFT="true", DATASET_PATH=str(tmp_path / "sft.jsonl"),
                                                    OUTPUT_BASEPATH=str(out))])
    captured = capsys.readouterr()
    assert code == 2 and captured.err.count("\n") == 1, captured.err + captured.out
    assert f"OUTPUT_BASEPATH {out} holds another job's run (SFT false -> true; DATASET_PATH " in captured.err
    assert not launched and "resuming" not in captured.out
    monkeypatch.delenv("MP_TOKENIZER")
    assert main(["train", "llama3_1", *pretraining]) == 0 and len(launched) == 1
    assert capsys.readouterr().out.startswith(f"resuming from iteration 4 of 20: {out / 'checkpoint' / 'iter_0000004'}")
    # a GLOBAL_BATCH_SIZE the checkpoint cannot follow, which also counts fewer iterations than it holds, is that
    # refusal, not "complete (iteration 4 of 2)"
    monkeypatch.setenv("MP_SAVE", "false")
    bigger = launcher_args("llama3_1", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out), GLOBAL_BATCH_SIZE="64")
    assert main(["train", "llama3_1", *bigger]) == 2 and len(launched) == 1
    captured = capsys.readouterr()
    assert "trained with GLOBAL_BATCH_SIZE=8, and this launch asks GLOBAL_BATCH_SIZE=64" in captured.err, captured
    assert "complete" not in captured.out
    # fewer iterations than the run has trained: it said "resuming from iteration 4 of 3", trained nothing,
    # exported nothing and exited 0, at every rerun
    fewer = launcher_args("llama3_1", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out),
                          TRAIN_TOKENS_OR_ITERS=str(3 * 8 * 64))
    assert main(["train", "llama3_1", *fewer]) == 2 and len(launched) == 1
    captured = capsys.readouterr()
    assert captured.err == (f"mpatch train: error: the run in {out} has trained 4 iterations, more than the 3 this "
                            "launch asks for (TRAIN_TOKENS_OR_ITERS): relaunch with at least 4 to resume it, or choose "
                            "another OUTPUT_BASEPATH to start afresh\n"), captured


@pytest.mark.parametrize("manifest", ["none", "rewritten"])
def test_a_newest_iteration_failing_its_crc_is_skipped_for_the_previous_one(tmp_path, manifest):
    """The docs promise the fallback; a CRC failure used to surface only inside the load, which stopped the resume
    (a manifest catches a flipped byte by its digest, unless there is none or it was rewritten after the damage)."""
    import torch

    from megatron_patch.checkpoint_files.manifest import write_manifest
    from megatron_patch.checkpoint_files.safe_torch import SafeFileSystemReader, load_refusing
    from megatron_patch.training.run_state import latest_iteration, resume_look

    root = tmp_path / "checkpoint"
    _training_iteration(root, 2)
    newest = _training_iteration(root, 4)
    damaged = _flip_tensor_byte(newest)
    if manifest == "rewritten":
        write_manifest(newest, "attacker", sync=False)
    with pytest.raises(UserError, match="is corrupt"):  # what the load does with it
        load_refusing({"w": torch.empty(256, 64)}, SafeFileSystemReader(newest))
    latest, notes = latest_iteration(root)
    assert latest == 2, notes
    assert len(notes) == 2 and notes[0].startswith(f"{newest} is incomplete or damaged: {damaged.name} is damaged "
                                                   "(the archive at byte "), notes
    assert "fails its CRC-32 check" in notes[0] or "CRC" in notes[0], notes
    assert latest_iteration(root, verify=False) == (4, [])  # the launcher's early look leaves the bytes to the ranks
    # MP_NO_VERIFY=true: the ranks read past the manifest, not past what the load refuses (they said "resuming from
    # iteration 4" and the load then stopped the run, exit 2, where without the switch 2 was taken)
    latest, notes = latest_iteration(root, verify=resume_look(no_verify=True))
    assert latest == 2 and "fails its CRC-32 check" in notes[0], notes


def test_the_launcher_skips_a_newest_iteration_whose_small_files_were_edited(tmp_path):
    """The launcher's first line named iteration 4, whose edited train_state.json its ranks then skipped for 2 (two
    lines that disagree, and the resume checks made against the skipped one). Its look checks every size and the
    digests of the small files; the big files' bytes stay the ranks' to check."""
    import json

    from megatron_patch.checkpoint_files.manifest import write_manifest
    from megatron_patch.training.run_state import latest_iteration, resume_look

    root = tmp_path / "checkpoint"
    _training_iteration(root, 2)
    newest = _training_iteration(root, 4)
    (newest / "train_state.json").write_text(json.dumps({"iteration": 4, "world_size": 1, "consumed_samples": 64}))
    write_manifest(newest, "mpatch train", sync=False)
    assert latest_iteration(root, verify="small") == (4, [])
    edited = (newest / "train_state.json").read_text().replace('"consumed_samples": 64', '"consumed_samples": 40')
    (newest / "train_state.json").write_text(edited)  # the same size: only its digest tells
    latest, notes = latest_iteration(root, verify="small")
    assert latest == 2 and notes[1:] == ["iteration 2 (iter_0000002) is read instead"], notes
    assert notes[0].startswith(f"{newest} is incomplete or damaged: {newest / 'train_state.json'} does not match its "
                               "digest"), notes
    assert latest_iteration(root, verify=False) == (4, [])
    assert latest_iteration(root, verify=resume_look(no_verify=True)) == (4, [])  # MP_NO_VERIFY: edited on purpose


# --- every reader of .metadata refuses the same impossible shapes -------------------------------------------

@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    from megatron_patch.cli import main
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("shapes")
    hf = make_tiny_hf_checkpoint("llama3_1", root / "hf", seed=1)
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(root / "mcore"), "--format",
                 "torch_dist", "--quiet"]) == 0
    return {"hf": hf, "mcore": root / "mcore"}


def _claim(folder: Path, how: str) -> tuple[Path, str]:
    """Rewrite .metadata (and, as an attacker would, the manifest) so that one tensor claims an impossible shape."""
    import torch

    from megatron_patch.checkpoint_files.manifest import write_manifest

    path = next(folder.rglob(".metadata"))
    md = pickle.loads(path.read_bytes())  # our own file: trusted here
    key = "embedding.word_embeddings.weight"
    entry = md.state_dict_metadata[key]
    rows, cols = entry.size
    if how == "negative":
        entry.size = torch.Size([-4, cols])
        why = f"tensor {key} claims the shape [-4, {cols}], which no tensor has"
    elif how == "chunk outside":
        entry.chunks[0].sizes = torch.Size([2 * rows, cols])
        why = f"a chunk of {key} at [0, 0] of [{2 * rows}, {cols}] lies outside its shape [{rows}, {cols}]"
    elif how == "huge":
        entry.size = torch.Size([10**12, 10**12])
        why = f"tensor {key} claims the shape [{10**12}, {10**12}], but its chunks hold {rows * cols} of its"
    else:
        entry.size, entry.chunks[0].sizes = torch.Size([2 * rows, cols]), torch.Size([2 * rows, cols])
        why = f"a chunk of {key} at [0, 0] of [{2 * rows}, {cols}] takes {2 * rows * cols * 4} bytes of float32, but its record holds"
    path.write_bytes(pickle.dumps(md))
    write_manifest(folder, "attacker", sync=False)
    return path, f"{path}: {why}"


SHAPES = ["negative", "chunk outside", "huge", "more elements than its bytes"]


@pytest.mark.parametrize("how", SHAPES)
def test_every_reader_of_metadata_refuses_an_impossible_shape_alike(converted, tmp_path, capsys, how):
    """mcore2hf refused these; inspect, align, PRETRAIN_CHECKPOINT_PATH and resume (torch's reader) took them."""
    from megatron_patch.checkpoint_files.layout import torch_dist_problem
    from megatron_patch.checkpoint_files.safe_torch import SafeFileSystemReader
    from megatron_patch.cli import main

    folder = tmp_path / "ckpt"
    shutil.copytree(converted["mcore"], folder)
    path, why = _claim(folder, how)
    for argv in (["inspect", str(folder)],
                 ["convert", "mcore2hf", "--load-dir", str(folder), "--save-dir", str(tmp_path / "hf")],
                 ["align", "--hf-dir", str(converted["hf"]), "--mcore-dir", str(folder), "--report-dir",
                  str(tmp_path / "report")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err, (argv[0], err)
    with pytest.raises(UserError) as refused:  # every torch load: resume, PRETRAIN_CHECKPOINT_PATH, align's ranks
        SafeFileSystemReader(path.parent)
    assert why in str(refused.value)
    assert why in torch_dist_problem(path.parent)  # the resume's choice of checkpoint: skipped for an older one
    with pytest.raises(UserError) as refused:  # the launcher, before any rank starts
        resolve("llama3_1", launcher_args("llama3_1", MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(folder),
                                          DATASET_PATH="none", SFT="false"), env={}, check_paths=False)
    assert why in str(refused.value)


# --- the small files a resume reads back: bounded, strict, one line --------------------------------------------

def _huge(path: Path) -> str:
    """A sparse file beyond the bound of any such file (64 MiB here; a plain read_text of a terabyte-sized one
    asks for a terabyte of memory)."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(2**26)
    return f"holds {2**26:,} bytes, more than the"


def _fifo(path: Path) -> str:
    """A reader that opens it blocks until someone writes: forever."""
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return "is a FIFO, not a regular file"


def _endless(path: Path) -> str:
    """A link to a device that never ends: a link out of the folder, which is not followed."""
    path.unlink(missing_ok=True)
    path.symlink_to("/dev/zero")
    return "which leads outside the folder (to /dev/zero)"


@pytest.mark.parametrize("damage", [_huge, _fifo, _endless])
@pytest.mark.parametrize("name", ["train_state.json", "metadata.json"])
def test_a_huge_or_endless_small_file_skips_its_iteration_in_one_line(tmp_path, damage, name):
    from megatron_patch.training.run_state import latest_iteration

    root = tmp_path / "checkpoint"
    _training_iteration(root, 2)
    newest = _training_iteration(root, 4)
    why = damage(newest / name)
    latest, notes = latest_iteration(root)
    assert latest == 2 and notes[1:] == ["iteration 2 (iter_0000002) is read instead"], notes
    assert notes[0].startswith(f"{newest} is incomplete or damaged: {name} ") and why in notes[0], notes


@pytest.mark.parametrize("config, why", [
    ({"sharded_backend": "zarr"}, "names the sharded backend 'zarr' version 1: only torch_dist version 1 is read"),
    ({"sharded_backend": "torch_dist", "sharded_backend_version": 99}, "names the sharded backend 'torch_dist' "
                                                                        "version 99"),
    ({"sharded_backend": "torch_dist", "singleton_local_shards": True}, "holds 'singleton_local_shards', which "
                                                                         "megatron-core's checkpoint config has not")])
def test_a_metadata_json_megatron_core_cannot_load_skips_its_iteration(tmp_path, config, why):
    """megatron-core's load stopped on another backend (CheckpointingException) or an extra key (0.16: TypeError):
    an internal error in eval and at resume, where mcore2hf and inspect read past the file (the sdoc audit)."""
    import json

    from megatron_patch.training.run_state import latest_iteration

    root = tmp_path / "checkpoint"
    _training_iteration(root, 2)
    newest = _training_iteration(root, 4)
    (newest / "metadata.json").write_text(json.dumps(config))
    latest, notes = latest_iteration(root)
    assert latest == 2 and notes[0].startswith(f"{newest} is incomplete or damaged: metadata.json ") and \
        why in notes[0], notes


def _loop(path: Path) -> str:
    """A link to itself: an internal error (Python's RuntimeError) in verify, inspect and the resume (the hostile
    audit)."""
    path.unlink(missing_ok=True)
    path.symlink_to(path.name)
    return "which cannot be followed (a symlink loop)"


@pytest.mark.parametrize("damage", [_huge, _fifo, _endless, _loop])
def test_a_huge_or_endless_tracker_is_skipped_for_the_newest_complete_iteration(tmp_path, damage):
    from megatron_patch.checkpoint_files.layout import TRACKER_NAME
    from megatron_patch.training.run_state import latest_iteration

    root = tmp_path / "checkpoint"
    _training_iteration(root, 2)
    why = damage(root / TRACKER_NAME)
    latest, notes = latest_iteration(root)
    assert latest == 2 and len(notes) == 1 and why in notes[0], notes
    assert notes[0].startswith(f"{root / TRACKER_NAME} is unreadable"), notes


def test_files_a_checkpoint_reads_are_not_followed_out_of_it(tmp_path):
    """Every file a reader takes from a checkpoint stays inside it (docs/security.md; the sec audit): a rank-local
    __0.metadata, a carried_tensors.safetensors and an RNG file linked to files elsewhere were read as the
    checkpoint's own (the metadata merged and used, the carried file's bytes copied into the export, a valid RNG
    state resumed from). Each is refused as a link out, and the resume takes the iteration before."""
    import shutil

    import torch

    from megatron_patch.checkpoint.hf_reader import read_safetensors_header
    from megatron_patch.checkpoint_files.layout import LEADS_OUTSIDE, torch_dist_problem
    from megatron_patch.checkpoint_files.safe_torch import load_torch_file
    from megatron_patch.training.run_state import iteration_problem, latest_iteration

    root, outside = tmp_path / "run" / "checkpoint", tmp_path / "private"
    outside.mkdir()
    _training_iteration(root, 2)
    newest = _training_iteration(root, 4)

    shutil.move(newest / "rng" / "rank_00000.pt", outside / "rng.pt")  # a sound RNG file, elsewhere
    (newest / "rng" / "rank_00000.pt").symlink_to(outside / "rng.pt")
    assert LEADS_OUTSIDE in iteration_problem(newest)
    assert latest_iteration(root)[0] == 2
    with pytest.raises(UserError, match=LEADS_OUTSIDE):
        load_torch_file(newest / "rng" / "rank_00000.pt", inside=newest)

    shutil.move(newest / ".metadata", outside / "elsewhere.metadata")  # only a rank-local metadata file, elsewhere
    (newest / "__0.metadata").symlink_to(outside / "elsewhere.metadata")
    assert LEADS_OUTSIDE in torch_dist_problem(newest)

    from safetensors.torch import save_file

    save_file({"secret": torch.zeros(2)}, str(outside / "private.safetensors"))
    (newest / "carried_tensors.safetensors").symlink_to(outside / "private.safetensors")
    with pytest.raises(UserError, match=LEADS_OUTSIDE):
        read_safetensors_header(newest / "carried_tensors.safetensors")


def test_a_random_state_no_run_can_take_is_one_line(tmp_path):
    """An RNG file holding a state of the wrong size (a sound archive): an internal error deep in torch at resume."""
    import torch

    from megatron_patch.training.checkpointing import _set_rng_state

    with pytest.raises(UserError, match=r"rank_00000.pt holds no random state a run can resume with \(KeyError"):
        _set_rng_state({"torch": torch.zeros(7, dtype=torch.uint8)}, tmp_path / "rank_00000.pt")
    state = {"random": __import__("random").getstate(), "numpy": __import__("numpy").random.get_state(),
             "torch": torch.zeros(7, dtype=torch.uint8), "tracker": {}}
    with pytest.raises(UserError, match=r"holds no random state a run can resume with \(RuntimeError: Expected a"):
        _set_rng_state(state, tmp_path / "rank_00000.pt")


def test_only_a_release_tracker_is_told_to_be_a_pretrain_checkpoint(tmp_path):
    """A run folder whose checkpoint/ tracker says 'release' holds converted weights: the refusal says to give it as
    PRETRAIN_CHECKPOINT_PATH. A garbage tracker with no complete iteration was told the same (its own message names
    'release', which the check looked for)."""
    from megatron_patch.checkpoint_files.layout import TRACKER_NAME
    from megatron_patch.training.run_state import latest_iteration

    advice = "give it as PRETRAIN_CHECKPOINT_PATH"
    for text, advised in (("release", True), ("garbage", False)):
        root = tmp_path / text / "checkpoint"
        root.mkdir(parents=True)
        (root / TRACKER_NAME).write_text(text)
        (root / "iter_0000002").mkdir()  # no complete iteration
        with pytest.raises(UserError) as refused:
            latest_iteration(root)
        assert (advice in str(refused.value)) == advised, refused.value


def test_a_tracker_linked_out_of_the_run_folder_is_not_read(tmp_path):
    """A run folder's tracker linked to a file outside it (a colleague's folder, a planted link): its content was read,
    quoted in the launcher's warning (a private file's first 40 bytes) and, holding a number, chose the iteration to
    resume. The link is not followed: the newest complete iteration is read instead, and nothing of the file shown."""
    from megatron_patch.checkpoint_files.layout import TRACKER_NAME
    from megatron_patch.training.run_state import latest_iteration

    root = tmp_path / "run" / "checkpoint"
    _training_iteration(root, 2)
    _training_iteration(root, 4)
    for text in ("api_key=SECRET", "2"):
        outside = tmp_path / "private.txt"
        outside.write_text(text)
        (root / TRACKER_NAME).unlink(missing_ok=True)
        (root / TRACKER_NAME).symlink_to(outside)
        latest, notes = latest_iteration(root)
        assert latest == 4 and "leads outside the folder" in notes[0] and "SECRET" not in " ".join(notes), notes


@pytest.mark.parametrize("state, why", [
    ({"iteration": 4.5, "world_size": 1}, "'iteration' is 4.5"),
    ({"iteration": "4", "world_size": 1}, "'iteration' is \"4\""),
    ({"iteration": 4, "world_size": -1}, "'world_size' is -1"),
    ({"iteration": 4, "world_size": True}, "'world_size' is true"),
    ({"iteration": 4, "world_size": 10**12}, f"'world_size' is {10**12}"),
    ({"iteration": 4, "world_size": 1, "consumed_samples": -8}, "'consumed_samples' is -8"),
    ([4, 1], "holds a JSON list, not an object"),
    # the run's config, where a resume computes with it: internal errors (TypeError) at resume (the hostile audit)
    ({"iteration": 4, "world_size": 1, "config": {"train_iters": "ten"}}, "its run's config 'train_iters' is \"ten\""),
    ({"iteration": 4, "world_size": 1, "config": {"ep": None}}, "its run's config 'ep' is null"),
    ({"iteration": 4, "world_size": 1, "config": {"lora": {"rank": 4, "targets": ["linear_qkv", 1]}}},
     "its run's config 'lora' has 'targets' [\"linear_qkv\", 1]"),
    ({"iteration": 4, "world_size": 1, "config": [1]}, "its run's config is not a JSON object"),
])
def test_train_state_is_parsed_strictly(tmp_path, state, why):
    """int() took 4.5, '4' and True; a world size of -1 skipped every RNG file's check; a config of other types
    reached the resume's arithmetic."""
    import json

    from megatron_patch.training.run_state import latest_iteration

    root = tmp_path / "checkpoint"
    _training_iteration(root, 2)
    newest = _training_iteration(root, 4)
    (newest / "train_state.json").write_text(json.dumps(state))
    latest, notes = latest_iteration(root)
    assert latest == 2 and len(notes) == 2 and why in notes[0], notes


@pytest.mark.parametrize("damage", [_huge, _fifo, _endless])
def test_a_huge_or_endless_sidecar_is_refused_in_one_line(converted, tmp_path, damage):
    from megatron_patch.checkpoint.sidecar import SIDECAR_NAME, read_sidecar

    folder = tmp_path / "ckpt"
    shutil.copytree(converted["mcore"], folder)
    why = damage(folder / SIDECAR_NAME)
    with pytest.raises(UserError, match="the checkpoint's sidecar is damaged") as refused:
        read_sidecar(folder)
    assert why.replace("holds", "it holds") in str(refused.value) or why in str(refused.value)


@pytest.mark.parametrize("listed", ["config.json", "model.safetensors", "model.safetensors.index.json", "../secret",
                                    "sub/tokenizer.json"])
def test_a_sidecar_carrying_what_an_export_writes_itself_is_refused(converted, tmp_path, capsys, listed):
    """mcore2hf copies the sidecar's carried files into the export after its own: a listed config.json or
    model.safetensors planted beside the checkpoint replaced the converted ones, exit 0, the export's manifest
    vouching for them (the sdoc audit). Only side files (tokenizer, chat template, generation config) are carried."""
    import json

    from megatron_patch.checkpoint.sidecar import SIDECAR_NAME
    from megatron_patch.cli import main

    folder = tmp_path / "ckpt"
    shutil.copytree(converted["mcore"], folder)
    (folder / MANIFEST_NAME).unlink()  # another tool's checkpoint has none; a digest is no signature anyway
    (folder / "config.json").write_text("{}")
    sidecar = json.loads((folder / SIDECAR_NAME).read_text())
    (folder / SIDECAR_NAME).write_text(json.dumps({**sidecar, "carried_files": [*sidecar["carried_files"], listed]}))
    rc = main(["convert", "mcore2hf", "--load-dir", str(folder), "--save-dir", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and f"lists {listed!r} among its carried files, which is not a side file" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("linked", ["release/__0_0.distcp", "release/.metadata", "release/common.pt", "release",
                                    "legacy"])
def test_a_checkpoint_file_or_folder_linked_outside_it_is_refused(converted, tmp_path, capsys, linked):
    """A .distcp (or .metadata, common.pt, a legacy rank file, the release folder) that is a symlink to a file
    elsewhere was read as the checkpoint's own, exit 0 (the sdoc audit; an HF folder's linked weights were refused,
    and so was a .metadata entry naming ../x.distcp). Refused in one line, as they are; a resume skips it."""
    import os

    from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME
    from megatron_patch.checkpoint_files.layout import latest_complete_iteration
    from megatron_patch.cli import main

    folder, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    if linked == "legacy":
        assert main(["convert", "hf2mcore", "--hf-dir", str(converted["hf"]), "--save-dir", str(folder), "--format",
                     "legacy", "--quiet"]) == 0
        linked = "release/mp_rank_00/model_optim_rng.pt"
    else:
        shutil.copytree(converted["mcore"], folder)
    (folder / MANIFEST_NAME).unlink()  # another tool's checkpoint: no manifest to tell the bytes apart
    shutil.move(folder / linked, elsewhere)
    os.symlink(elsewhere, folder / linked)
    rc = main(["convert", "mcore2hf", "--load-dir", str(folder), "--save-dir", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and "leads outside" in err and str(elsewhere) in err and err.count("\n") == 1, err
    if "mp_rank" not in linked:  # as a training run's iteration: skipped (for none older here, so refused naming it)
        (folder / "release").rename(folder / "iter_0000002")
        (folder / "latest_checkpointed_iteration.txt").write_text("2")
        with pytest.raises(UserError, match="leads outside the folder"):
            latest_complete_iteration(folder)


# --- end to end: the launcher resumes a run folder that travelled ---------------------------------------------

RESUME_ITERS, RESUME_SAVE, STOP_AT = 6, 2, 4


def _resume_args(corpus, out: Path) -> list[str]:
    return launcher_args("llama3_1", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out),
                         SAVE_INTERVAL=str(RESUME_SAVE), TRAIN_TOKENS_OR_ITERS=str(RESUME_ITERS * 8 * 64),
                         WARMUP_TOKENS_OR_ITERS=str(8 * 64))


@pytest.fixture(scope="module")
def stopped_run(corpus, tmp_path_factory) -> Path:
    """A run stopped after its checkpoint at iteration 4 of 6 (checkpoints at 2 and 4): what a colleague hands on."""
    from tests.training_helpers import launch

    out = tmp_path_factory.mktemp("stopped") / "out"
    proc = launch(_resume_args(corpus, out), {"MP_EXIT_INTERVAL": str(STOP_AT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_a_rerun_stopped_by_mp_exit_interval_again_says_why_it_trains_nothing(stopped_run, corpus, tmp_path):
    """Relaunched with the MP_EXIT_INTERVAL it stopped at, a run trains nothing: its line says so and why, not that
    the run ended at its last iteration (nor "iterations 5..4"), and it exports nothing."""
    from tests.training_helpers import launch

    out = tmp_path / "out"
    shutil.copytree(stopped_run, out)
    proc = launch(_resume_args(corpus, out), {"MP_EXIT_INTERVAL": str(STOP_AT)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (f"nothing left to train: iteration {STOP_AT} of {RESUME_ITERS} is at or past "
            f"MP_EXIT_INTERVAL={STOP_AT}") in proc.stdout, proc.stdout[-3000:]
    assert "run's last" not in proc.stdout and not (out / "final").exists()


def _resume(corpus, out: Path):
    from tests.training_helpers import launch

    return launch(_resume_args(corpus, out))


@pytest.mark.slow
def test_the_training_manifest_covers_what_resume_reads(stopped_run):
    """Every file of an iteration folder, .metadata included (the resume unpickles it), and the dataset cache: its
    index files and megatron-core's descriptions beside them (so that `mpatch verify` finds none left out)."""
    for folder in (stopped_run / "checkpoint").glob("iter_*"):
        listed = set(read_manifest(folder / MANIFEST_NAME)["files"])
        on_disk = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MANIFEST_NAME}
        assert ".metadata" in listed and listed == on_disk, on_disk - listed
    cache = stopped_run / "data_cache"
    cached = {p.name for p in cache.iterdir() if p.is_file()} - {MANIFEST_NAME}
    assert {n for n in cached if n.endswith(".npy")} and set(read_manifest(cache / MANIFEST_NAME)["files"]) == cached


@pytest.mark.slow
def test_resuming_a_folder_with_a_planted_cache_pickle_never_runs_it(stopped_run, corpus, tmp_path, marker):
    """The variant that runs its payload and then returns the real array: training used to finish, export and exit
    0 with the payload run."""
    out = tmp_path / "out"
    shutil.copytree(stopped_run, out)
    path = next((out / "data_cache").glob("*-GPTDataset-train-shuffle_index.npy"))
    real = tmp_path / "real.npy"
    shutil.copy(path, real)
    path.write_bytes(pickle.dumps(Payload(marker, returns=real)))
    proc = _resume(corpus, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"warning: {path} is not a numpy array file" in proc.stdout, proc.stdout[-3000:]
    assert "resumed from" in proc.stdout and (out / "final").is_dir()
    assert data_cache.npy_problem(path) is None


@pytest.mark.slow
def test_resume_falls_back_past_a_newest_iteration_failing_its_crc(stopped_run, corpus, tmp_path):
    from megatron_patch.checkpoint_files.manifest import write_manifest
    from megatron_patch.checkpoint_files.torch_dist import read_metadata
    from megatron_patch.checkpoint_files.zipfmt import ZipIndex

    out = tmp_path / "out"
    shutil.copytree(stopped_run, out)
    newest = out / "checkpoint" / f"iter_{STOP_AT:07d}"
    md = read_metadata(newest / ".metadata")
    key = next(k for k, (name, start, length, _) in md.storage.items() if k[1] is not None and length > 4096)
    name, start, length, _ = md.storage[key]
    index = ZipIndex(newest / name, base=start, length=length)
    offset, size = index.locate(next(n for n in index.names() if n.startswith("data/")))
    data = bytearray((newest / name).read_bytes())
    data[offset + size // 2] ^= 0x10
    (newest / name).write_bytes(bytes(data))
    write_manifest(newest, "attacker", sync=False)  # a digest is no signature: only the CRC-32 can tell
    proc = _resume(corpus, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"warning: {newest} is incomplete or damaged: {name} is damaged (the archive at byte {start}:" in \
        proc.stdout, proc.stdout[-3000:]
    assert f"resumed from {out / 'checkpoint' / f'iter_{RESUME_SAVE:07d}'}\n" in proc.stdout


@pytest.mark.slow
def test_a_real_run_records_its_data_and_refuses_another_job(stopped_run, corpus, other_corpus, tmp_path):
    """The trainer's train_state.json records the data (``run_state.training_data``), and the launch of another
    job into a copy of the run's folder is refused from it in one line, before any rank starts."""
    import json

    from tests.training_helpers import launch

    out = tmp_path / "out"
    shutil.copytree(stopped_run, out)
    state = json.loads((out / "checkpoint" / f"iter_{STOP_AT:07d}" / "train_state.json").read_text())
    assert state["data"]["files"][0]["path"] == os.path.realpath(corpus["prefix"]), state.get("data")
    args = launcher_args("llama3_1", DATASET_PATH=other_corpus["prefix"], OUTPUT_BASEPATH=str(out),
                         SAVE_INTERVAL=str(RESUME_SAVE), TRAIN_TOKENS_OR_ITERS=str(RESUME_ITERS * 8 * 64),
                         WARMUP_TOKENS_OR_ITERS=str(8 * 64))
    proc = launch(args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"holds another job's run (DATASET_PATH {os.path.realpath(corpus['prefix'])} -> " \
           f"{os.path.realpath(other_corpus['prefix'])})" in proc.stderr, proc.stderr
    assert "torch.distributed.run" not in proc.stdout and "resuming" not in proc.stdout


@pytest.mark.slow
def test_a_hard_linked_copy_resumes_without_touching_the_original(stopped_run, corpus, tmp_path):
    """``cp -al`` hands on a run folder as hard links: the copy resumes (untrusted is not refused) and the
    original's files stay as they were."""
    import subprocess

    original, copy = tmp_path / "original", tmp_path / "copy"
    shutil.copytree(stopped_run, original)
    subprocess.run(["cp", "-al", str(original), str(copy)], check=True)
    before = {p: p.read_bytes() for p in original.rglob("*") if p.is_file()}
    proc = _resume(corpus, copy)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "warning" not in proc.stdout, proc.stdout[-3000:]
    assert {p: p.read_bytes() for p in original.rglob("*") if p.is_file()} == before
    assert len((copy / "log" / "metrics.jsonl").read_text().splitlines()) > \
        len((original / "log" / "metrics.jsonl").read_text().splitlines())


def _tamper_optimizer_state(folder: Path, edit) -> None:
    """``edit`` applied to the optimizer state in ``folder``'s common.pt, and the manifest written again (whoever can
    change the files can change the manifest)."""
    from megatron_patch.checkpoint_files.manifest import write_manifest

    if (folder / "common.pt").is_file():
        common = torch.load(folder / "common.pt", weights_only=False)  # this test's own run wrote it
    else:  # megatron-core 0.19 keeps it in the .distcp data, and reads a common.pt beside it first (its older format)
        from megatron.core.dist_checkpointing.serialization import load_common_state_dict

        common = load_common_state_dict(folder)
    edit(common["optimizer"])
    torch.save(common, folder / "common.pt")
    (folder / MANIFEST_NAME).unlink()
    write_manifest(folder, "mpatch train", sync=False)


def _losses_after(out: Path, iteration: int) -> list[tuple]:
    from tests.training_helpers import read_metrics

    return [(m["iteration"], m["loss"], m["grad_norm"]) for m in read_metrics(out) if m["iteration"] > iteration]


def _set_steps(state, value) -> None:
    """Every Adam step of an optimizer state dict (torch's per parameter, or megatron-core's ``common_step``)."""
    if isinstance(state, dict):
        for key in list(state):
            if key in ("step", "common_step"):
                state[key] = value
            else:
                _set_steps(state[key], value)
    elif isinstance(state, (list, tuple)):
        for item in state:
            _set_steps(item, value)


@pytest.mark.slow
def test_a_tampered_optimizer_state_is_refused_or_takes_the_launchs_settings(stopped_run, corpus, tmp_path):
    """An edited common.pt (its manifest written again) resumed silently or as an internal error: Adam's step 1e9
    trained with its bias correction gone, -1 divided by zero, a 2-element step and a param group fewer stopped
    as 'a bug'; the saved betas (0, 0) replaced the launch's (torch takes a saved group's settings). A step outside
    0..iteration and another structure are refused in one line; the launch's betas are used."""
    newest = f"iter_{STOP_AT:07d}"
    untouched = tmp_path / "untouched"
    shutil.copytree(stopped_run, untouched)
    proc = _resume(corpus, untouched)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    refusals = {
        "a step past the iteration": (lambda o: _set_steps(o, torch.tensor(1e9)), "holds an Adam step of 1000000000.0 "
                                      f"for iteration {STOP_AT} (a whole number from 0 to {STOP_AT} is due)"),
        "a param group fewer": (lambda o: o.__setitem__("param_groups", o["param_groups"][:1]),
                                "holds a state of another structure than the one this launch's model and optimizer "
                                "read (Cannot merge two lists with different lengths"),
    }
    for case, (edit, said) in refusals.items():
        out = tmp_path / case.replace(" ", "_")
        shutil.copytree(stopped_run, out)
        _tamper_optimizer_state(out / "checkpoint" / newest, edit)
        proc = _resume(corpus, out)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (case, proc.stdout[-2000:] + proc.stderr)
        assert f"{out / 'checkpoint' / newest} {said}" in proc.stderr and "the checkpoint is damaged" in proc.stderr, \
            (case, proc.stderr)
    betas = tmp_path / "betas"
    shutil.copytree(stopped_run, betas)
    _tamper_optimizer_state(betas / "checkpoint" / newest,
                            lambda o: [group.__setitem__("betas", (0.0, 0.0)) for group in o["param_groups"]])
    proc = _resume(corpus, betas)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _losses_after(betas, STOP_AT) == _losses_after(untouched, STOP_AT) != []


def test_every_adam_step_must_be_a_whole_number_up_to_the_iteration():
    """The check a resume runs on the saved optimizer state (launched above for a step past the iteration): a
    negative step divided by zero, a 2-element one stopped the step as an internal error."""
    from megatron_patch.training.checkpointing import _check_adam_steps

    def state(step):
        return {"optimizer": {"state": {0: {"step": step, "exp_avg": torch.zeros(2)}}, "param_groups": [{"lr": 1.0}]}}

    for step, shown in ((torch.tensor(-1.0), "-1.0"), (torch.tensor([2.0, 2.0]), "a tensor of shape (2,)"),
                        (torch.tensor(2.5), "2.5"), (float("nan"), "nan"), (True, "True"), (5, "5")):
        with pytest.raises(UserError, match=re.escape(f"ck holds an Adam step of {shown} for iteration 4 (a whole "
                                                      "number from 0 to 4 is due): the checkpoint is damaged")):
            _check_adam_steps(state(step), 4, "ck")
    for step in (torch.tensor(4.0), 0, 3.0):
        _check_adam_steps(state(step), 4, "ck")
    _check_adam_steps({"common_step": 2, "param_groups": [{"step": 1}]}, 2, "ck")
    with pytest.raises(UserError, match="Adam step of 3 for iteration 2"):
        _check_adam_steps({"common_step": 3}, 2, "ck")


def test_a_legacy_starting_checkpoint_at_another_layout_is_refused_before_any_rank(corpus, tmp_path, monkeypatch, capsys):
    """A legacy checkpoint loads only at the layout it was written at. The refusal came from each rank, after
    torchrun had started them and they had built the model; the launcher now says it before starting any."""
    import megatron_patch.cli.train as train_cli
    from megatron_patch.cli import main
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.distributed import ParallelLayout

    launched = []
    monkeypatch.setattr(train_cli, "_launch", lambda *a: launched.append(a) or 0)
    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf", seed=4)
    legacy = tmp_path / "legacy_tp2"
    hf_to_mcore(hf, legacy, ParallelLayout(tp=2), fmt="legacy", progress=False)
    capsys.readouterr()

    def launch(tp: str, dry: bool = False) -> int:
        monkeypatch.setenv("MP_DRY_RUN", "1" if dry else "0")
        return main(["train", "llama3_1", *launcher_args("llama3_1", MODEL_SIZE="auto", TP=tp, DATASET_PATH=corpus["prefix"],
                                                         PRETRAIN_CHECKPOINT_PATH=str(legacy),
                                                         OUTPUT_BASEPATH=str(tmp_path / f"out{tp}"))])

    for dry in (False, True):
        assert launch("1", dry) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"PRETRAIN_CHECKPOINT_PATH {legacy}: this legacy checkpoint is for TP=2" in err, err
    assert not launched
    assert launch("2") == 0 and len(launched) == 1


def test_the_export_command_a_finished_run_suggests_pastes_into_a_shell(tmp_path):
    """A finished run names the command that converts its model; OUTPUT_BASEPATH may hold spaces and quotes, and
    the command is meant to be pasted: shlex reads back the very folder."""
    import shlex
    from types import SimpleNamespace

    from megatron_patch.checkpoint_files.layout import TRACKER_NAME
    from megatron_patch.checkpoint_files.manifest import write_manifest
    from megatron_patch.training.run_folder import final_export_tool
    from megatron_patch.training.run_state import finished_run

    out = tmp_path / "my run's out"
    (out / "final").mkdir(parents=True)
    (out / "final" / TRACKER_NAME).write_text("release")
    write_manifest(out / "final", final_export_tool(4))
    cfg = SimpleNamespace(output_basepath=str(out), train_iters=4, save=True, checkpoint_dir=str(out / "checkpoint"))
    assert finished_run(cfg, 5) is None  # final/ holds iteration 4: exported again
    said = finished_run(cfg, 4)
    command = re.search(r"\((mpatch convert mcore2hf .*?HF_OUT)\)", said).group(1)
    argv = shlex.split(command)
    assert argv[argv.index("--load-dir") + 1] == str(out / "final")
    assert finished_run(cfg, 3) is None

    # a relative OUTPUT_BASEPATH that starts with a dash: `--load-dir -run/final` was two options to argparse
    from megatron_patch.cli import build_parser
    from megatron_patch.training.run_folder import export_command

    for dashed in (Path("-run") / "final", Path("--run") / "final"):
        argv = shlex.split(export_command(dashed))
        assert Path(build_parser(only="convert").parse_args(argv[1:]).load_dir) == dashed, argv


def test_tensorboard_is_left_out_where_it_cannot_name_the_run_folder(monkeypatch, tmp_path):
    """Under a Latin-1 locale, "run ü" (bytes c3 bc, as a UTF-8 terminal typed it) reads as "run Ã¼": the other
    writers encode it back to the same bytes, TensorBoard's in UTF-8 to another folder, and the run died in an
    internal error at its first record (the env audit). Such a folder is named, so the run goes on without it."""
    import sys

    from megatron_patch.training import run_folder

    typed = "run ü".encode("utf-8")
    assert run_folder.tensorboard_cannot_name(tmp_path / os.fsdecode(typed) / "tensorboard") is None  # UTF-8 here
    monkeypatch.setattr(os, "fsencode", lambda p: os.fspath(p).encode("latin-1", "surrogateescape"))
    monkeypatch.setattr(sys, "getfilesystemencoding", lambda: "iso8859-1")
    assert run_folder.tensorboard_cannot_name(tmp_path / "run" / "tensorboard") is None
    for name in (typed.decode("latin-1"), "run \udcfc"):  # c3 bc as Latin-1 reads it; a byte no locale decoded
        said = run_folder.tensorboard_cannot_name(tmp_path / name / "tensorboard")
        assert said and "it names files in UTF-8 and this locale names them in iso8859-1" in said, name
        assert said.startswith(f"TensorBoard cannot write {tmp_path / name / 'tensorboard'}: "), said


# --- a data blend ---------------------------------------------------------------------------------------------

def _blend_batches(cfg):
    """In a process of its own (megatron's blend builder needs a process group): the first step's batches, as
    {key: shape}, and which dataset each sample comes from."""
    from megatron_patch.runtime.distributed import init_process_group
    from megatron_patch.training.data import micro_batches

    init_process_group()
    ds = _build(cfg)
    shapes = [{k: tuple(v.shape) for k, v in batch.items()} for batch in micro_batches(ds, 0, cfg, 0, 1)]
    return shapes, [int(ds[i]["dataset_id"]) for i in range(len(ds))]


def test_a_blend_gives_batches_of_both_datasets_in_their_weights(corpus, other_corpus, tmp_path):
    """megatron's BlendedDataset tags each sample with its dataset ("dataset_id", a numpy scalar), which the
    batches stacked with the tensors: every blend stopped at its first step with an internal error."""
    from megatron_patch.runtime.launch import run_local

    blend = f"0.75 {corpus['prefix']} 0.25 {other_corpus['prefix']}"
    cfg = resolve("llama3_1", launcher_args("llama3_1", DATASET_PATH=blend, OUTPUT_BASEPATH=str(tmp_path / "out")),
                  env={})
    [(shapes, sources)] = run_local(_blend_batches, 1, cfg)
    assert len(shapes) == cfg.global_batch_size // cfg.micro_batch_size
    sample = (cfg.micro_batch_size, cfg.seq_len)
    assert all(batch == dict.fromkeys(["tokens", "labels", "loss_mask", "position_ids"], sample) for batch in shapes)
    assert len(sources) == cfg.train_iters * cfg.global_batch_size
    assert abs(sources.count(0) / len(sources) - 0.75) < 0.02 and sources.count(1) > 0


@pytest.mark.slow
def test_a_blend_trains_and_records_its_weights(corpus, other_corpus, tmp_path):
    import json

    from tests.training_helpers import GBS, SEQ, launch, pretrain_args, read_metrics

    out = tmp_path / "out"
    proc = launch(pretrain_args(corpus, out, DATASET_PATH=f"0.7 {corpus['prefix']} 0.3 {other_corpus['prefix']}",
                                TRAIN_TOKENS_OR_ITERS=str(3 * GBS * SEQ), WARMUP_TOKENS_OR_ITERS=str(GBS * SEQ),
                                SAVE_INTERVAL="3"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [m["iteration"] for m in read_metrics(out)] == [1, 2, 3]
    state = json.loads((out / "checkpoint" / "iter_0000003" / "train_state.json").read_text())
    assert state["data"]["weights"] == [0.7, 0.3], state["data"]


def test_a_side_file_no_save_can_copy_is_refused_before_the_first_iteration(tmp_path):
    """A FIFO (or a link out of the folder) among MP_TOKENIZER's tokenizer files trained every iteration up to the
    first save, which then refused it and left its partial folder: the folders the saves copy from are checked
    when the run plans them (rank 0, before its first iteration)."""
    from megatron_patch.demo_data import make_texts, make_tokenizer
    from megatron_patch.training import checkpointing

    tokenizer = make_tokenizer(tmp_path / "tok", make_texts(50, seed=0), vocab_size=120)
    os.mkfifo(tokenizer / "tokenizer_extra.txt")
    cfg = resolve("llama3_1", launcher_args("llama3_1", OUTPUT_BASEPATH=str(tmp_path / "out")),
                  env={"MP_TOKENIZER": str(tokenizer)}, check_paths=False)
    with pytest.raises(UserError, match="tokenizer_extra.txt is a FIFO, not a regular file"):
        checkpointing.side_files_source(cfg, None)
    (tokenizer / "tokenizer_extra.txt").unlink()
    (tokenizer / "special_tokens_map.json").symlink_to("/etc/hostname")
    with pytest.raises(UserError, match="which leads outside the folder"):
        checkpointing.side_files_source(cfg, None)


def test_sft_from_a_runs_checkpoint_folder_reads_the_tokenizer_its_iteration_carries(tmp_path):
    """docs/training.md starts another job from a run's checkpoint/ folder (PRETRAIN_CHECKPOINT_PATH), and the
    refusal of another job into a run folder advises it: SFT then looked for tokenizer.json in checkpoint/ itself
    ("not found"), while the iteration it loads carries it."""
    from megatron_patch.checkpoint_files.layout import write_tracker
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.demo_data import make_texts, make_tokenizer
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.distributed import ParallelLayout

    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path / "hf")
    make_tokenizer(hf, make_texts(200, seed=0), vocab_size=190)
    hf_to_mcore(hf, tmp_path / "ckpt", ParallelLayout(), progress=False)
    checkpoints = tmp_path / "run" / "checkpoint"  # a run's, as its saves leave it: iterations and the tracker
    shutil.copytree(tmp_path / "ckpt" / "release", checkpoints / "iter_0000002")
    for name in ("mpatch_checkpoint.json", "tokenizer.json", "tokenizer_config.json"):  # each iteration carries them
        shutil.copy(tmp_path / "ckpt" / name, checkpoints / "iter_0000002")
    write_tracker(checkpoints, 2)
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    args = launcher_args("llama3_1", SFT="true", DATASET_PATH=str(tmp_path / "sft.jsonl"), MODEL_SIZE="auto",
                         PRETRAIN_CHECKPOINT_PATH=str(checkpoints), OUTPUT_BASEPATH=str(tmp_path / "out"))
    assert resolve("llama3_1", args, env={}).tokenizer == str(checkpoints / "iter_0000002")
    given = launcher_args("llama3_1", SFT="true", DATASET_PATH=str(tmp_path / "sft.jsonl"), MODEL_SIZE="auto",
                          PRETRAIN_CHECKPOINT_PATH=str(tmp_path / "ckpt"), OUTPUT_BASEPATH=str(tmp_path / "out"))
    assert resolve("llama3_1", given, env={}).tokenizer == str(tmp_path / "ckpt")  # where it carries it itself


def test_checkpoints_carry_the_tokenizer_the_run_read_and_read_it_as_the_run_did(tmp_path, capsys):
    """An SFT run given MP_TOKENIZER (a chat template of its own) from a converted checkpoint that carries another
    tokenizer: every checkpoint and the export carried the converted checkpoint's, so the HF export and `mpatch eval`
    rendered chats with a template the model never trained on. And a tokenizer folder of its own (no model config),
    carried into a checkpoint, was read there with the model's config: another pipeline than the run's, and in its
    HF export too."""
    from transformers import AutoTokenizer

    from megatron_patch.checkpoint.sidecar import Sidecar, read_sidecar
    from megatron_patch.cli import main
    from megatron_patch.convert.checkpoint import hf_to_mcore
    from megatron_patch.demo_data import make_texts, make_tokenizer
    from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
    from megatron_patch.runtime.distributed import ParallelLayout
    from megatron_patch.tokenizer import load_tokenizer
    from megatron_patch.training import checkpointing
    from tests.training_helpers import make_tiktoken_file

    hf = make_tiny_hf_checkpoint("qwen3", tmp_path / "hf")
    make_tokenizer(hf, make_texts(200, seed=0), vocab_size=190)  # Qwen2Tokenizer's pipeline differs from the file's
    (hf / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    named = "additional_chat_templates/tool_use.jinja"  # transformers 5's named templates, one folder down
    (hf / "additional_chat_templates").mkdir()
    (hf / named).write_text("TOOLS {{ messages[0]['content'] }}")
    hf_to_mcore(hf, tmp_path / "ckpt", ParallelLayout(), progress=False)
    own = tmp_path / "tok"
    (own / "additional_chat_templates").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / name, own / name)
    (own / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    (own / named).write_text("OWN TOOLS {{ messages[0]['content'] }}")
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    args = launcher_args("qwen3", SFT="true", DATASET_PATH=str(tmp_path / "sft.jsonl"), MODEL_SIZE="auto",
                         PRETRAIN_CHECKPOINT_PATH=str(tmp_path / "ckpt"), OUTPUT_BASEPATH=str(tmp_path / "out"))
    text = "The cat sat on the mat. A dog ran."

    def saved(env: dict) -> Path:
        """The converted weights, with the side files and record a run launched with ``env`` writes (the manifest
        left out: another tool's checkpoint, as far as mcore2hf knows)."""
        cfg = resolve("qwen3", args, env=env)
        folder = tmp_path / f"saved{len(list(tmp_path.glob('saved*')))}"
        shutil.copytree(tmp_path / "ckpt" / "release", folder / "release")
        shutil.copy(tmp_path / "ckpt" / "latest_checkpointed_iteration.txt", folder)
        carried = checkpointing.carry_side_files(checkpointing.side_files_source(cfg, None), folder, cfg)
        Sidecar.create("torch_dist", cfg.arch, cfg.layout, "float32", **carried).write(folder)
        assert read_sidecar(folder).carried_files == carried["carried_files"]
        return folder

    given = saved({"MP_TOKENIZER": str(own)})
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", named):
        assert (given / name).read_bytes() == (own / name).read_bytes(), name
    assert (saved({}) / named).read_bytes() == (hf / named).read_bytes()  # the checkpoint's, without MP_TOKENIZER
    assert (given / "generation_config.json").read_bytes() == (hf / "generation_config.json").read_bytes()
    assert load_tokenizer(given).encode(text) == load_tokenizer(own).encode(text) != load_tokenizer(hf).encode(text)
    # its HF export tokenizes as the run did, in transformers too (config.json alone picks Qwen2Tokenizer there)
    assert main(["convert", "mcore2hf", "--load-dir", str(given), "--save-dir", str(tmp_path / "back")]) == 0
    assert load_tokenizer(tmp_path / "back").encode(text) == load_tokenizer(own).encode(text)
    assert AutoTokenizer.from_pretrained(tmp_path / "back").chat_template["tool_use"] == (own / named).read_text()
    assert AutoTokenizer.from_pretrained(tmp_path / "back").encode(text) == load_tokenizer(own).encode(text)
    assert "names tokenizer_class PreTrainedTokenizerFast, the class the training run read" in capsys.readouterr().err
    cfg = resolve("qwen3", args, env={"MP_TOKENIZER": str(own)})
    assert checkpointing.carried_tokenizer_notes(checkpointing.side_files_source(cfg, None), cfg) == [
        f"checkpoints carry MP_TOKENIZER's tokenizer files ({own}), which the run reads, not PRETRAIN_CHECKPOINT_PATH's: "
        "additional_chat_templates/tool_use.jinja, chat_template.jinja differ"]
    # a folder of tokenizer.json alone: its export gets a tokenizer_config.json naming the class (it had none to name
    # it in, and config.json alone picked Qwen2Tokenizer: other ids)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(own / "tokenizer.json", alone)
    assert main(["convert", "mcore2hf", "--load-dir", str(saved({"MP_TOKENIZER": str(alone)})), "--save-dir",
                 str(tmp_path / "back_alone")]) == 0
    exported = AutoTokenizer.from_pretrained(tmp_path / "back_alone")
    assert exported.encode(text) == load_tokenizer(own).encode(text)
    # and the end-of-document token the run found and trained: it named none, and lm-eval's HF backend failed on an
    # export whose tokenizer had no eos_token
    run_tokenizer = load_tokenizer(alone)
    assert exported.eos_token == run_tokenizer.eod_token and exported.eos_token_id == run_tokenizer.eod
    assert "names eos_token '</s>', the end-of-document token the training run found" in capsys.readouterr().err
    # a carried tokenizer_config.json that is no JSON: one line naming the checkpoint's file (an internal error)
    broken = saved({"MP_TOKENIZER": str(own)})
    (broken / "tokenizer_config.json").write_text("{not json")
    assert main(["convert", "mcore2hf", "--load-dir", str(broken), "--save-dir", str(tmp_path / "back_broken")]) == 2
    assert f"{broken / 'tokenizer_config.json'} is not valid JSON" in capsys.readouterr().err
    # a tiktoken file is read by the run and not carried: said at launch (the checkpoint's files are carried)
    tiktoken_file = make_tiktoken_file(tmp_path / "tok.tiktoken", [b"th", b"he"])
    cfg = resolve("qwen3", args, env={"MP_TOKENIZER": str(tiktoken_file)})
    assert checkpointing.carried_tokenizer_notes(checkpointing.side_files_source(cfg, None), cfg) == [
        f"note: MP_TOKENIZER {tiktoken_file} is a tiktoken file, which the run reads and its checkpoints do not carry: "
        f"they carry PRETRAIN_CHECKPOINT_PATH's tokenizer files ({tmp_path / 'ckpt'}), which the export and "
        "'mpatch eval' read; they must encode as the file does"]
    # without MP_TOKENIZER the converted checkpoint's files, read as its HF folder's were
    default = saved({})
    assert all((default / n).read_bytes() == (hf / n).read_bytes() for n in ("tokenizer.json", "chat_template.jinja"))
    assert load_tokenizer(default).encode(text) == load_tokenizer(hf).encode(text)
    assert read_sidecar(default).tokenizer_model_config is None
    assert main(["convert", "mcore2hf", "--load-dir", str(default), "--save-dir", str(tmp_path / "back2")]) == 0
    assert (tmp_path / "back2" / "tokenizer_config.json").read_bytes() == (hf / "tokenizer_config.json").read_bytes()


def test_a_copied_runs_error_log_is_its_own_before_a_crash_is_appended(tmp_path):
    """A run folder copied with `cp -al` shares log/rank0-error.log with the original by a hard link: the copy's
    crash was appended to the original's log too. It gets an inode of its own first, as the metrics do."""
    from megatron_patch.cli.train import _write_traceback

    original, copy = tmp_path / "original", tmp_path / "copy"
    (original / "log").mkdir(parents=True)
    (original / "log" / "rank0-error.log").write_text("the original's crash\n")
    (copy / "log").mkdir(parents=True)
    os.link(original / "log" / "rank0-error.log", copy / "log" / "rank0-error.log")
    try:
        raise RuntimeError("the copy's crash")
    except RuntimeError as exc:
        assert _write_traceback(exc, copy, 0) == copy / "log" / "rank0-error.log"
    assert (original / "log" / "rank0-error.log").read_text() == "the original's crash\n"
    said = (copy / "log" / "rank0-error.log").read_text()
    assert said.startswith("the original's crash\n") and "RuntimeError: the copy's crash" in said


@pytest.mark.parametrize("launcher, line, told", [
    ("qwen2/run_mcore_qwen2_moe", {}, ["2026-12-07: Pai's Mistral and Qwen2 scripts balance experts"]),
    ("qwen3_moe", {}, []),
    ("llama3_1", dict(SFT="true", DATASET_PATH="/data/sft.jsonl"), ["2026-12-05: an SFT record's 'system' field"]),
    ("llama3_1", dict(DATASET_PATH="/data/a_text_document /data/b_text_document"),
     ["2026-12-06: prefixes listed without weights"]),
    ("llama3_1", dict(DATASET_PATH="0.5 /data/a_text_document 0.5 /data/b_text_document"), []),
    ("llama3_1", dict(DATASET_PATH="/data/a_text_document"), []),
])
def test_a_checkpoint_saved_before_the_rules_were_recorded_is_told_what_changed_that_concerns_it(tmp_path, launcher,
                                                                                                   line, told):
    """The upgrade audit: an SFT run's records and a run's unweighted blend were read otherwise by a newer release at
    the resume, without a word; what the older release did is not recorded, so the resume says what changed since
    that concerns the run (a MoE run's coefficient: tests/test_training.py), and nothing where nothing does."""
    import json

    from megatron_patch.checkpoint_files.layout import TRAIN_STATE
    from megatron_patch.training.run_state import rules_at_resume

    cfg = resolve(launcher, launcher_args(launcher, OUTPUT_BASEPATH=str(tmp_path / "out"), **line),
                  env={"MP_TOKENIZER": "/data/tok"}, check_paths=False)
    folder = tmp_path / "iter_0000002"
    folder.mkdir()
    state = {"iteration": 2, "world_size": 1, "consumed_samples": 16, "config": {"tp": 1}}
    (folder / TRAIN_STATE).write_text(json.dumps(state))
    notes, kept = rules_at_resume(cfg, folder)
    assert kept is None and len(notes) == len(told[:1]), notes
    for words in told:
        assert "was saved by a megatron_patch that recorded no training rules (before 2026-12-08)" in notes[0]
        assert words in notes[0] and notes[0].count("2026-12-0") == 2, notes[0]
    (folder / TRAIN_STATE).write_text(json.dumps({**state, "rules": {"version": 1, "moe_balancing": None}}))
    assert rules_at_resume(cfg, folder) == ([], None)
    (folder / TRAIN_STATE).write_text(json.dumps({**state, "rules": ["edited"]}))
    with pytest.raises(UserError, match="records its rules as"):
        rules_at_resume(cfg, folder)


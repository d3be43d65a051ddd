"""megatron-core's dataset cache in ``OUTPUT_BASEPATH/data_cache``, checked before megatron-core reads it.

megatron-core's GPTDataset and BlendedDataset keep their sample order in ``.npy`` files there
(``HASH-GPTDataset-train-{document,sample,shuffle}_index.npy``, ``HASH-BlendedDataset-...``) and load
them with ``numpy.load(allow_pickle=True)``: a file that is not a ``.npy`` array but a pickle runs
whatever it names. 0.19's ``safe_numpy_load`` narrows the unpickler, but its list keeps
``torch.storage._load_from_bytes``, which is ``torch.load(weights_only=False)``. A run folder travels
(colleagues, buckets, shared filesystems), and rerunning it resumes, so the cache is untrusted input.

Here megatron-core is left as it is, on every release: before it looks, rank 0 checks every file of the
cache, and removes what fails, so that megatron-core builds it again (it builds a missing file,
deterministically, from the data and the seed; a sound cache is kept and read as before):

- a ``.npy`` must be one: numpy's magic and header (parsed without running anything), an integer
  array, no Python objects, exactly as long as its header says, and a regular file (a symlink, a FIFO
  or a device is removed, so the rebuilt file is never written through a link);
- where the cache's manifest (``data_cache/mpatch_manifest.json``, written after each build) lists a
  file, its size and digest must match it (a flipped byte in a shuffle index would otherwise reorder
  the data silently);
- after megatron-core has built or loaded the datasets, their indices must fit the data
  (``unfit_indices``): document ids within the corpus, sample boundaries in order, each sample spanning
  exactly its sequence length of the documents as they are now, each exposed document equally often in the
  document index, the shuffle index an order of every sample once (megatron-core writes nothing else). An index
  that does not fit is removed and built again. The spans catch a corpus rewritten in place with other
  document lengths but the same file sizes (megatron-core keys its cache by the data's path, this project adds
  the sizes): documents reordered or re-cut read the old boundaries, silently.

The manifest is integrity, not a signature (whoever can change the files can change it): the checks
above hold without it.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import numpy
from numpy.lib import format as npy_format

from megatron_patch.checkpoint_files.manifest import DIGEST, MANIFEST_NAME, digests, read_manifest, write_manifest
from megatron_patch.errors import UserError

CACHE_DIR = "data_cache"
# numpy's own limit on a header (numpy.load's max_header_size); megatron-core's arrays have short ones.
MAX_HEADER = 10_000
# The 2-D arrays megatron-core keeps (a sample's start: document position and offset); the rest are 1-D.
TWO_COLUMNS = ("-sample_index.npy",)
# Entries of the document index read at a time by the span check (16 Mi: 128 MiB of token counts).
SPAN_PIECE = 1 << 24


def npy_problem(path: Path) -> str | None:
    """Why ``path`` is not a plain integer ``.npy`` array that ``numpy.load(mmap_mode="r")`` maps without
    unpickling anything, or None."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file (a link, a FIFO or a device)"
    try:
        with open(path, "rb") as f:
            version = npy_format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = npy_format.read_array_header_1_0(f, max_header_size=MAX_HEADER)
            elif version == (2, 0):
                shape, fortran, dtype = npy_format.read_array_header_2_0(f, max_header_size=MAX_HEADER)
            else:
                return f"a .npy file of version {version}, which megatron-core does not write"
            data_start = f.tell()
    except (OSError, ValueError, SyntaxError) as exc:
        return f"not a numpy array file ({' '.join(str(exc).split())[:120]})"
    if dtype.hasobject or dtype.kind not in "iu":
        return f"an array of {dtype}, not of integers"
    if fortran:
        return "a Fortran-ordered array, which megatron-core does not write"
    two = path.name.endswith(TWO_COLUMNS)
    if len(shape) != (2 if two else 1) or (two and shape[1] != 2):
        return f"an array of shape {list(shape)}, where megatron-core keeps {'(n, 2)' if two else 'one dimension'}"
    expected = data_start + int(numpy.prod(shape, dtype=numpy.int64)) * dtype.itemsize
    if info.st_size != expected:
        return f"{info.st_size} bytes long, where its header says {expected}"
    return None


def run_cache_folder(output_basepath: str | Path) -> Path:
    """``OUTPUT_BASEPATH/data_cache``, which must be a folder of the run (``run_folder.check_run_folder``
    refuses one that leads outside it)."""
    return Path(output_basepath) / CACHE_DIR


def _remove(path: Path, why: str, log, then: str = "megatron-core builds it again") -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UserError(f"{path} fails its check ({why}) and cannot be removed ({exc.strerror or exc}): remove "
                        f"{path.parent} by hand") from None
    log(f"warning: {path} is {why}: removed; {then}")


def keep_sound_files(folder: Path, log=print) -> None:
    """Remove from the cache ``folder`` every file megatron-core would read that fails its check (module
    docstring), before megatron-core looks. Run on rank 0 alone, before any rank builds a dataset."""
    if not folder.is_dir():
        return
    manifest = folder / MANIFEST_NAME
    listed = _listed(manifest, log)
    names = sorted(p.name for p in folder.iterdir())
    if listed:
        found = digests(folder, [n for n in names if n in listed and (folder / n).is_file()
                                 and not (folder / n).is_symlink()], sync=False)
    for name in names:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            if name.endswith((".npy", ".txt")):  # megatron-core would fail to write its file there
                raise UserError(f"{path} is a folder where megatron-core keeps a file of its dataset cache: move it "
                                "away")
            continue
        if name == MANIFEST_NAME:
            continue
        if not name.endswith(".npy"):
            if not stat.S_ISREG(os.lstat(path).st_mode):  # megatron-core writes its descriptions through it
                _remove(path, "not a regular file (a link, a FIFO or a device)", log)
            continue
        why = npy_problem(path)
        if why is None and name in listed:
            entry, have = listed[name], found.get(name)
            if have is None or have["size"] != entry["size"] or have[DIGEST] != entry[DIGEST]:
                why = f"not what {MANIFEST_NAME} records (changed or damaged since it was built)"
        if why is not None:
            _remove(path, why, log)
    _own_inodes(folder)


def _own_inodes(folder: Path) -> None:
    """Each file left in the cache on an inode of its own: megatron-core writes its files in place (numpy.save, its
    descriptions' open "wt"), so one hard-linked to a file elsewhere (a run copied with `cp -al`) was rewritten
    there too when it built again (the sdoc audit). A copy renamed over the link keeps the contents."""
    for path in sorted(folder.iterdir()):
        if path.name.endswith(OWN_COPY):  # one a killed run left
            path.unlink()
            continue
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            own = path.with_name(f".{path.name}{OWN_COPY}")
            # "x": a new file, never written through whatever is at that name (a planted link among them)
            with open(path, "rb") as source, open(own, "xb") as copy:
                shutil.copyfileobj(source, copy)
            os.replace(own, path)


OWN_COPY = ".mpatch-own"


def _listed(manifest: Path, log) -> dict:
    """The cache manifest's entries; a manifest that does not read is removed (the files are then checked
    for what they are, and a new manifest is written after the build)."""
    if not os.path.lexists(manifest):
        return {}
    try:
        if not stat.S_ISREG(os.lstat(manifest).st_mode):
            raise UserError("not a regular file")
        return read_manifest(manifest)["files"]
    except UserError as exc:
        _remove(manifest, f"not a readable manifest ({exc})", log, then="the cache's files are checked for what they are")
        return {}


def record(folder: Path) -> None:
    """The cache's manifest, once megatron-core has built what it needed (rank 0): every sound ``.npy`` file and
    megatron-core's descriptions beside them, so that ``mpatch verify`` finds no file the manifest leaves out."""
    if not folder.is_dir():
        return
    names = sorted(p.name for p in folder.iterdir()
                   if (p.name.endswith(".npy") and npy_problem(p) is None)
                   or (p.name.endswith(".txt") and stat.S_ISREG(os.lstat(p).st_mode)))
    tmp = f".{MANIFEST_NAME}.tmp.{os.getpid()}"
    (folder / tmp).unlink(missing_ok=True)  # a link planted at the name is removed, not written through
    try:
        write_manifest(folder, "mpatch train, megatron-core's dataset cache", name=tmp,
                       files=digests(folder, names, sync=True))
        os.replace(folder / tmp, folder / MANIFEST_NAME)
    except BaseException:  # a full disk: no half-written manifest is left beside the cache
        (folder / tmp).unlink(missing_ok=True)
        raise


# --- the indices against the data ----------------------------------------------------------------------------

def _outside(values, low: int, high: int) -> bool:
    """Whether any of ``values`` (an array, read in pieces) lies outside [low, high)."""
    values = numpy.asarray(values).reshape(-1)
    step = 1 << 24
    return any(len(part) and (int(part.min()) < low or int(part.max()) >= high)
               for part in (values[i:i + step] for i in range(0, len(values), step)))


def _each_once(values, size: int) -> bool:
    """Whether ``values`` (within [0, size), read in pieces) holds each of them at most once."""
    seen = numpy.zeros(size, dtype=bool)
    values = numpy.asarray(values).reshape(-1)
    step = 1 << 24
    for i in range(0, len(values), step):
        part = numpy.asarray(values[i:i + step]).astype(numpy.int64)
        if seen[part].any() or len(numpy.unique(part)) != len(part):
            return False
        seen[part] = True
    return True


def _each_alike(document_index, exposed: numpy.ndarray, documents: int) -> bool:
    """Whether ``document_index`` holds each ``exposed`` document equally often and no other (counted in pieces)."""
    counts = numpy.zeros(documents, dtype=numpy.int64)
    values = numpy.asarray(document_index).reshape(-1)
    step = 1 << 24
    for i in range(0, len(values), step):
        counts += numpy.bincount(numpy.asarray(values[i:i + step]).astype(numpy.int64), minlength=documents)
    held = counts[exposed]
    return len(held) == 0 or (bool(numpy.all(held == held[0])) and int(held.sum()) == len(values))


def _gpt_problem(ds) -> str | None:
    documents = len(ds.dataset.sequence_lengths)
    document_index, sample_index, shuffle_index = ds.document_index, ds.sample_index, ds.shuffle_index
    if document_index is None:  # megatron-core's lazy mode (defer_npy_index_mmap), which this project does not set
        return None
    if _outside(document_index, 0, documents):
        return f"its document index names documents beyond the corpus's {documents}"
    if len(sample_index) < 1 or _outside(sample_index[:, 0], 0, len(document_index)) or \
            numpy.any(numpy.diff(sample_index[:, 0].astype(numpy.int64)) < 0):
        return "its sample index does not run in order over the document index"
    lengths = numpy.asarray(ds.dataset.sequence_lengths)[numpy.asarray(document_index)[sample_index[:, 0]]]
    offsets = numpy.asarray(sample_index[:, 1]).astype(numpy.int64)
    if numpy.any(offsets < 0) or numpy.any(offsets > lengths):
        return "its sample index points past the end of a document"
    if _outside(shuffle_index, 0, len(sample_index) - 1):
        return f"its shuffle index names samples beyond its {len(sample_index) - 1}"
    # megatron-core writes only orders of every sample once, and of every exposed document once an epoch: an index
    # of zeros (one sample over and over) fitted every range above and trained (the sdoc audit)
    if len(shuffle_index) != len(sample_index) - 1 or not _each_once(shuffle_index, len(sample_index) - 1):
        return f"its shuffle index is no order of its {len(sample_index) - 1} samples"
    indices = getattr(ds, "indices", None)
    if indices is not None and not _each_alike(document_index, numpy.asarray(indices), documents):
        return "its document index does not hold each of its documents equally often (once an epoch)"
    # megatron-core keeps a partial last sample only in a validation split told to (this project never does)
    partial = getattr(getattr(ds, "index_split", None), "name", "") == "valid" and \
        not getattr(ds.config, "drop_last_partial_validation_sequence", True)
    return _span_problem(ds.dataset.sequence_lengths, document_index, sample_index, ds.config.sequence_length,
                         partial_last=partial)


def _span_problem(lengths, document_index, sample_index, sequence_length: int, partial_last: bool = False
                  ) -> str | None:
    """Whether consecutive sample boundaries (position in the document index, offset in that document) lie
    ``sequence_length`` tokens apart over the documents' ``lengths``, as megatron-core's build_sample_idx sets them
    (with ``partial_last``, the last sample may be shorter). Read in pieces of the document index, so no array as
    long as the epochs' documents is made."""
    starts = numpy.asarray(sample_index[:, 0]).astype(numpy.int64)
    offsets = numpy.asarray(sample_index[:, 1]).astype(numpy.int64)
    step, done, tokens_before, previous = SPAN_PIECE, 0, 0, None
    for low in range(0, len(document_index), step):
        block = numpy.asarray(lengths)[numpy.asarray(document_index[low:low + step])].astype(numpy.int64)
        cumulative = numpy.concatenate(([0], numpy.cumsum(block))) + tokens_before
        end = int(numpy.searchsorted(starts, low + len(block), side="left"))  # the boundaries in this piece
        positions = cumulative[starts[done:end] - low] + offsets[done:end]
        if previous is not None:
            positions = numpy.concatenate(([previous], positions))
        spans = numpy.diff(positions)
        last = partial_last and end == len(starts)
        if numpy.any(spans[:-1 if last else None] != sequence_length) or (last and len(spans) and
                                                                            not 0 < spans[-1] <= sequence_length):
            return (f"its samples do not span {sequence_length} tokens of the documents as they are now (the data "
                    "was rewritten since the cache was built)")
        if len(positions):
            previous = int(positions[-1])
        done, tokens_before = end, int(cumulative[-1])
    return None


def _blended_problem(ds) -> str | None:
    if ds.dataset_index is None:
        return None
    if _outside(ds.dataset_index, 0, len(ds.datasets)):
        return f"its dataset index names datasets beyond the blend's {len(ds.datasets)}"
    sizes = numpy.array([len(d) for d in ds.datasets], dtype=numpy.int64)
    if numpy.any(numpy.asarray(ds.dataset_sample_index) < 0) or \
            numpy.any(numpy.asarray(ds.dataset_sample_index) >= sizes[numpy.asarray(ds.dataset_index)]):
        return "its sample index names samples beyond a dataset of the blend"
    # megatron-core counts each dataset's samples up from 0 in blend order (helpers.build_blending_indices)
    which, samples = numpy.asarray(ds.dataset_index), numpy.asarray(ds.dataset_sample_index)
    if any(not numpy.array_equal(samples[which == d], numpy.arange(int(numpy.sum(which == d))))
           for d in range(len(ds.datasets))):
        return "its sample index does not count each dataset's samples in order"
    return None


def _datasets(dataset):
    """``dataset`` and, for a blend, the datasets in it."""
    if dataset is None:
        return []
    return [dataset, *[d for inner in getattr(dataset, "datasets", []) for d in _datasets(inner)]]


def unfit_indices(datasets) -> list[tuple[str, str]]:
    """(cache file prefix, what is wrong) of each built dataset whose indices do not fit its data."""
    out = []
    for ds in [d for top in datasets for d in _datasets(top)]:
        why = _blended_problem(ds) if hasattr(ds, "dataset_index") else _gpt_problem(ds) \
            if hasattr(ds, "shuffle_index") else None
        if why:
            split = getattr(ds, "index_split", None) or getattr(ds, "split", None)
            out.append((f"{ds.unique_description_hash}-{type(ds).__name__}-{split.name}", why))
    return out


def remove_unfit(folder: Path, unfit: list[tuple[str, str]], log=print) -> None:
    for prefix, why in unfit:
        for path in sorted(folder.glob(f"{prefix}-*")):
            _remove(path, f"an index that does not fit the data ({why})", log)

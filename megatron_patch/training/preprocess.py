"""JSONL -> Megatron mmap indexed data (``P_<key>_document.bin/.idx``), with worker processes.

The input is a JSONL file or a folder of them (Pai-Megatron-Patch's README input: ``00.jsonl.zst`` ...), each
plain, zstd- or gzip-compressed, read in name order and decompressed as a stream. One document per JSON line
(the value of ``json_key``), tokenized in parallel, written in input order through megatron-core's
``IndexedDatasetBuilder``; the end-of-document id is appended after each document. Lines that are not JSON
objects with a string under ``json_key`` are reported with their file and line numbers and skipped (``strict``
stops at the first one). A line that is not UTF-8, or longer than ``max_line_bytes``, stops the run naming its
line: each file is read in bytes, a line at a time and never more than the ceiling of one (a compressed file
is decompressed in pieces: ``compressed_files``), so memory stays bounded whatever the files hold
(the workers' too: each is sent a bounded batch of lines, and only a few batches are in flight). A compressed
file that is damaged or cut short is one line too. A UTF-8 byte-order mark opening a file is not part of its
first line.

The output follows the rule of every output (docs/outputs.md): under its lock (one writer per prefix), it
is new, or an earlier output of mpatch preprocess (its manifest lists both files) replaced with ``force``;
a pair mpatch did not write is never replaced. Both files are built in a partial folder beside them and
renamed onto their names at the end, with ``P_<key>_document.mpatch_manifest.json`` last (``mpatch verify``);
every byte is written before the first rename, so a full disk leaves the earlier output as it was. Several
keys (``preprocess_keys``) are one output set: every prefix is checked and locked before any key is read, and
the pairs are published together at the end, so a key that fails leaves none of them published.

Stopped early (an error, Ctrl-C, SIGTERM through the CLI), the worker processes are ended, not waited for; and
each ends with this process however it ends (``die_with_parent``), since they hold the caller's stdout/stderr.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import numpy
from tqdm import tqdm

from megatron_patch.checkpoint_files.manifest import DIGEST, MANIFEST_NAME, digest_file, read_manifest, write_manifest
from megatron_patch.errors import UserError
from megatron_patch.input_files import kind_of
from megatron_patch.outputs.folders import fsync_dir, fsync_file, partial_dir, recover
from megatron_patch.outputs.full_disk import full_disk_is_bad_input
from megatron_patch.outputs.lock import OutputLock
from megatron_patch.runtime.launch import die_with_parent
from megatron_patch.training.compressed_files import (COMPRESSED_SUFFIXES, DECOMPRESSION_ERRORS, decompressing_command,
                                                       open_decompressed, plain_name, unnamed_compression)
from megatron_patch.tokenizer import ids_end, load_tokenizer, vocabulary_digest

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.

# A longer line is refused (``--max-line-mb``): tokenizing a line takes 170-200 MB of memory per MB of its text
# with a HF tokenizer (scripts/bench_preprocess_memory.py), in whichever worker has it; a 100 MB line took 20 GB.
DEFAULT_MAX_LINE_MB = 8
# ... and at most this: a longer line would need over 200 GB in one worker (and 1e13 overflowed the reader).
MAX_LINE_MB = 1024
# What one worker is sent at once: this many lines, or fewer that reach this many bytes (a longer line goes alone).
BATCH_LINES = 64
BATCH_BYTES = 4 * 2**20
# Batches in flight per worker: enough to keep each busy while the results of the one before are written.
BATCHES_PER_WORKER = 2
# Workers per CPU core this process may use, at most: tokenizing is CPU-bound, so more only add memory.
WORKERS_PER_CORE = 4
# Bad lines named in the report (the rest are counted).
BAD_LINES_KEPT = 20
# The files an input folder may hold: JSON lines, plain or compressed.
TEXT_SUFFIXES = (".jsonl", ".json")
# Where stderr is not a terminal (a batch job's log file), a progress line this often instead of a bar.
PROGRESS_LOG_SECONDS = 30.0
UTF8_BOM = b"\xef\xbb\xbf"

# The manifest's record of the tokenizer the pair's ids come from (``tokenizer_record``); data written before it
# was kept has none, and is read as before.
TOKENIZER_RECORD = "tokenizer"

_TOKENIZER = None
_DTYPE = None


def worker_ceiling() -> int:
    """The most ``--workers`` this machine takes."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return WORKERS_PER_CORE * cores


def _init_worker(tokenizer_path: str, dtype) -> None:
    global _TOKENIZER, _DTYPE

    _TOKENIZER = load_tokenizer(tokenizer_path)
    _DTYPE = dtype


def _init_pool_worker(parent_pid: int, tokenizer_path: str, dtype) -> None:
    # Ctrl-C reaches the whole process group: the parent alone handles it and ends the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid, "mpatch preprocess", log=lambda line: None)  # nobody is left to read it
    _init_worker(tokenizer_path, dtype)


EMPTY_DOCUMENT = "a document of no tokens"


def _encode_line(item: tuple[int, str, int, str, bool]):
    """(line number, ids or None, error or None, characters, bytes read)."""
    lineno, line, size, key, append_eod = item
    if not line.strip():
        return lineno, None, "empty line", 0, size
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return lineno, None, f"not valid JSON ({exc.msg} at column {exc.colno})", 0, size
    except ValueError as exc:  # a number of more than 4300 digits
        return lineno, None, f"not readable JSON ({str(exc).split(':')[0]})", 0, size
    except RecursionError:
        return lineno, None, "not readable JSON (nested too deeply)", 0, size
    if not isinstance(obj, dict):
        return lineno, None, f"a JSON {type(obj).__name__}, not an object", 0, size
    if key not in obj:
        fields = ", ".join(repr(k)[:40] for k in itertools.islice(obj, 5))
        return lineno, None, f"no '{key}' field (fields: {fields})", 0, size
    text = obj[key]
    # a list of strings is a document's sentences (Megatron-LM's and Pai's preprocessing: each tokenized, one document)
    sentences = text if isinstance(text, list) else [text]
    if not all(isinstance(t, str) for t in sentences):
        return lineno, None, f"'{key}' is a {type(text).__name__}, not a string or a list of strings", 0, size
    ids = []
    for sentence in sentences:
        try:
            sentence.encode("utf-8")
        except UnicodeEncodeError as exc:  # JSON's "\ud800" escapes decode to a lone surrogate: no tokenizer takes it
            return lineno, None, f"'{key}' holds an unpaired surrogate ({exc.object[exc.start]!r}), not text", 0, size
        try:
            ids += _TOKENIZER.encode(sentence)
        except UserError as exc:  # the tokenizer refuses it for the whole run: not a bad line to skip
            raise LineRefused(lineno, str(exc)) from None
    if not ids:  # no token: no document and no EOD, as Megatron-LM's and Pai's preprocessing (a lone EOD was written)
        return lineno, None, EMPTY_DOCUMENT, 0, size
    if append_eod:
        ids.append(_TOKENIZER.eod)
    return lineno, numpy.asarray(ids, dtype=_DTYPE), None, sum(map(len, sentences)), size


class LineRefused(UserError):
    """A line that stops the run (a worker's, named with its file by the parent, which knows the files)."""

    def __init__(self, where: tuple[int, int], message: str):
        super().__init__(where, message)  # the arguments, so that it crosses from a worker process whole
        self.where, self.message = where, message


def _encode_batch(batch: list) -> list:
    return [_encode_line(item) for item in batch]


def _batches(items):
    """``items`` grouped for the workers: up to BATCH_LINES lines, or fewer that reach BATCH_BYTES."""
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += item[2]
        if len(batch) == BATCH_LINES or size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded(items, workers: int, tokenizer_path, dtype):
    """``_encode_line`` of each item, in input order, with ``workers`` processes; at most BATCHES_PER_WORKER batches
    per worker are read ahead of what was written."""
    if workers == 1:
        _init_worker(str(tokenizer_path), dtype)
        yield from map(_encode_line, items)
        return
    pool = _start_workers(workers, tokenizer_path, dtype)
    pending = collections.deque()
    finished = False
    try:
        for batch in _batches(items):
            pending.append(pool.submit(_encode_batch, batch))
            if len(pending) >= BATCHES_PER_WORKER * workers:
                yield from pending.popleft().result()
        while pending:
            yield from pending.popleft().result()
        finished = True
    except BrokenProcessPool:
        raise UserError(f"a tokenizer worker died (most likely the system ran out of memory for {workers} of them): "
                        "rerun with fewer --workers or a lower --max-line-mb") from None
    finally:
        if finished:
            pool.shutdown(wait=True)
        else:
            _stop_workers(pool)


def _start_workers(workers: int, tokenizer_path, dtype) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init_pool_worker,
                               initargs=(os.getpid(), str(tokenizer_path), dtype))


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Ends a pool whose results are no longer wanted (an error, Ctrl-C, SIGTERM). A batch in a worker may take
    minutes (one line of --max-line-mb): the workers are ended, not waited for (ProcessPoolExecutor has no public
    call for it before Python 3.14's terminate_workers). One ended while it wrote a result leaves half a message in
    the result pipe, on which the pool's manager thread, and so the shutdown joining it, waited forever (a stopped
    run hung in about one try in six); without this process's own write end, the pipe ends with the workers, and the
    thread reads its end and takes the pool as broken."""
    for process in list((pool._processes or {}).values()):
        process.terminate()
    writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
    if writer is not None:
        writer.close()
    pool.shutdown(wait=True, cancel_futures=True)


class _ProgressLog:
    """Progress where no terminal shows a bar (a batch job's log file): a plain line on stderr every
    PROGRESS_LOG_SECONDS, with the documents and bytes so far and their rates. It costs a clock read a line."""

    def __init__(self, label: str, total_bytes: int | None):
        self.label, self.total_bytes = label, total_bytes
        self.start = self.last = time.monotonic()

    def update(self, bytes_read: int, documents: int) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_LOG_SECONDS:
            return
        self.last, elapsed = now, max(now - self.start, 1e-9)
        share = f" ({100 * bytes_read / self.total_bytes:.0f}%)" if self.total_bytes else ""
        print(f"{self.label}: {documents:,} documents, {bytes_read / 1e6:,.1f} MB read{share}; "
              f"{documents / elapsed:,.0f} documents/s, {bytes_read / 1e6 / elapsed:,.1f} MB/s",
              file=sys.stderr, flush=True)


@dataclass
class PreprocessReport:
    output_prefix: str
    documents: int = 0
    tokens: int = 0
    characters: int = 0
    bad_lines: list[tuple[str, int, str]] = field(default_factory=list)  # (file, line, why): the first BAD_LINES_KEPT
    skipped: int = 0  # bad lines in all
    empty_documents: int = 0  # records whose text has no token: left out, as Megatron-LM and Pai leave them


def _manifest_path(prefix: str) -> Path:
    return Path(f"{prefix}.{MANIFEST_NAME}")


def check_output_prefix(prefix: str, force: bool) -> None:
    """Refuse (under the prefix's lock) a pair that is not new unless it is an earlier output of mpatch
    preprocess (its manifest lists both files) and ``force`` is given: a pair mpatch did not write is never
    replaced, as the converters never replace a folder they did not write."""
    manifest = _manifest_path(prefix)
    ours = [Path(prefix + suffix) for suffix in (".bin", ".idx")]
    present = [p for p in (*ours, manifest) if os.path.lexists(p)]
    if not present:
        return
    for p in present:
        if p.is_symlink() or not p.is_file():
            raise UserError(f"{p} exists and is not a file mpatch wrote: move it away or choose another "
                            "--output-prefix")
    if not manifest.exists():
        raise UserError(f"{present[0]} exists and mpatch did not write it (no {manifest.name} lists it): it is not "
                        "replaced, even with --force; move it away or choose another --output-prefix")
    try:
        listed = set(read_manifest(manifest)["files"])
    except UserError as exc:
        raise UserError(f"{prefix} is not replaced: {exc}") from None
    if listed != {p.name for p in ours}:
        raise UserError(f"{manifest} lists {', '.join(sorted(listed)) or 'nothing'}, not the two files of {prefix}: "
                        "it is not replaced, even with --force; move it away or choose another --output-prefix")
    if not force:
        raise UserError(f"{present[0]} exists (an earlier output of mpatch preprocess): pass --force to replace it, or "
                        "choose another --output-prefix")


def check_output_outside_input(input_path: str | Path, output_prefix: str) -> None:
    """An output never overlaps an input (docs/outputs.md): a folder input is every file in it, so a pair written
    there (or in a folder under it) would be read back by the next run as corpus, and refused as not JSONL."""
    folder = Path(input_path).resolve()
    where = Path(output_prefix).parent.resolve()
    if folder.is_dir() and (where == folder or folder in where.parents):
        raise UserError(f"--output-prefix {output_prefix} is inside the input folder {input_path}, every file of which "
                        f"is read as corpus: choose a prefix outside it, such as {folder.parent / Path(output_prefix).name}")


def tokenizer_record(tokenizer, tokenizer_path: str | Path, append_eod: bool) -> dict:
    """What the data's manifest keeps of the tokenizer its ids come from (``TOKENIZER_RECORD``), for the launch to
    compare with the run's (``data_files.check_data_tokenizer``): the ids' meaning (``vocabulary_digest``) and
    their end (every id is below ``ids``), the end-of-document token each document ends with (None without one),
    and where the tokenizer was."""
    ends = {"id": tokenizer.eod, "token": tokenizer.decode([tokenizer.eod])} if append_eod else None
    return {"path": str(Path(tokenizer_path).resolve()), "vocabulary_sha256": vocabulary_digest(tokenizer),
            "ids": ids_end(tokenizer), "end_of_document": ends}


def _seal(tmp: Path, prefix: str, tokenizer: dict) -> None:
    """The two finished files in ``tmp`` made durable, and their manifest written beside them (with the
    ``tokenizer`` record): every byte of the output, so that only renames are left (``_rename_into_place``)."""
    files = {}
    for name in (Path(prefix + suffix).name for suffix in (".bin", ".idx")):
        size, digest = digest_file(tmp / name)
        fsync_file(tmp / name)
        files[name] = {"size": size, DIGEST: digest}
    write_manifest(tmp, "mpatch preprocess", name=_manifest_path(prefix).name, files=files,
                   records={TOKENIZER_RECORD: tokenizer})


def _rename_into_place(tmp: Path, prefix: str) -> None:
    """The sealed files onto their names. Replacing an earlier pair, the manifest last: the old manifest stays until
    the new one replaces it, so a replace interrupted between the renames leaves a pair its manifest does not match
    (mpatch verify names the file), still known as mpatch's for the --force that repairs it. A first pair, the
    manifest first, for the same reason: with it last, a kill between the renames left a .bin no manifest listed,
    which no rerun would replace, --force or not (the outputs audit)."""
    manifest = _manifest_path(prefix)
    pair = [Path(prefix + ".bin").name, Path(prefix + ".idx").name]
    first = not os.path.lexists(manifest)
    for name in [manifest.name, *pair] if first else [*pair, manifest.name]:
        os.replace(tmp / name, manifest.parent / name)
    fsync_dir(manifest.parent)


def preprocess(input_path: str | Path, output_prefix: str, tokenizer_path: str | Path, *, json_key: str = "text",
               workers: int = 1, append_eod: bool = True, strict: bool = False, progress: bool | None = None,
               max_line_bytes: int = DEFAULT_MAX_LINE_MB * 2**20, force: bool = False) -> PreprocessReport:
    """``OUTPUT_PREFIX_<json_key>_document.bin/.idx``: ``preprocess_keys`` with one key."""
    return preprocess_keys(input_path, output_prefix, tokenizer_path, json_keys=[json_key], workers=workers,
                           append_eod=append_eod, strict=strict, progress=progress, max_line_bytes=max_line_bytes,
                           force=force)[0]


def preprocess_keys(input_path: str | Path, output_prefix: str, tokenizer_path: str | Path, *, json_keys: list[str],
                    workers: int = 1, append_eod: bool = True, strict: bool = False, progress: bool | None = None,
                    max_line_bytes: int = DEFAULT_MAX_LINE_MB * 2**20, force: bool = False) -> list[PreprocessReport]:
    """One ``OUTPUT_PREFIX_<key>_document`` pair per key, one report each, published together or not at all."""
    files = input_files(Path(input_path))
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    if workers > worker_ceiling():
        raise UserError(f"--workers {workers} is more than this machine takes: at most {worker_ceiling()} "
                        f"({WORKERS_PER_CORE} per CPU core this process may use; tokenizing is CPU-bound, so more "
                        "workers only add memory)")
    if not 1 <= max_line_bytes <= MAX_LINE_MB * 2**20:
        raise UserError(f"--max-line-mb must be > 0 and at most {MAX_LINE_MB}, got {max_line_bytes / 2**20:g}")
    if not json_keys:
        raise UserError("--json-keys names no key: give the field(s) holding the document text")
    repeated = sorted({key for key in json_keys if json_keys.count(key) > 1})
    if repeated:
        raise UserError(f"--json-keys names {', '.join(map(repr, repeated))} more than once: each key is written to "
                        "one pair of its own; name it once")
    tokenizer = load_tokenizer(tokenizer_path)  # fail early, in this process, on a bad tokenizer
    prefixes = [f"{output_prefix}_{key}_document" for key in json_keys]
    for prefix in prefixes:
        if not Path(prefix).parent.is_dir():
            raise UserError(f"output folder {Path(prefix).parent} does not exist: create it first")
    check_output_outside_input(input_path, output_prefix)
    with contextlib.ExitStack() as held:  # every key's lock and partial folder, until all are published
        partials = []
        for prefix in prefixes:
            with full_disk_is_bad_input(f"{prefix}.bin/.idx", "--output-prefix"):
                held.enter_context(OutputLock(prefix, "--output-prefix"))
                recover(prefix)  # only the lock holder writes here: a partial folder is an earlier run's
                check_output_prefix(prefix, force)
                tmp = partial_dir(prefix)
                tmp.mkdir()  # a new folder, not one found at the name
                held.callback(shutil.rmtree, tmp, ignore_errors=True)
                partials.append(tmp)
        reports, record = [], tokenizer_record(tokenizer, tokenizer_path, append_eod)
        for key, prefix, tmp in zip(json_keys, prefixes, partials):
            with full_disk_is_bad_input(f"{prefix}.bin/.idx", "--output-prefix"):
                reports.append(_preprocess(files, prefix, tmp, tokenizer, tokenizer_path, key, workers, append_eod,
                                           strict, progress, max_line_bytes))
                _seal(tmp, prefix, record)
        for prefix, tmp in zip(prefixes, partials):  # renames only: every byte is written by now
            _rename_into_place(tmp, prefix)
        return reports


def input_files(input_path: Path) -> list[Path]:
    """The JSONL files of the input: the file itself, or every file of the folder (hidden ones aside) in name
    order, each ``.jsonl``/``.json``, plain or ``.zst``/``.gz``; anything else there is refused, not skipped."""
    hint = "give a JSONL file (one JSON object per line; .zst or .gz compressed too) or a folder of them"
    if input_path.is_file():
        return [input_path]
    if not input_path.is_dir():
        if os.path.exists(input_path):  # a FIFO, a device: it said "not found" (the tools audit)
            raise UserError(f"input {input_path} is {kind_of(input_path.stat().st_mode)}: {hint}")
        raise UserError(f"input {input_path} not found: {hint}")
    files = sorted(p for p in input_path.iterdir() if not p.name.startswith("."))
    for p in files:
        name = p.name[:-len(p.suffix)] if p.suffix in COMPRESSED_SUFFIXES else p.name
        if not p.is_file() or not name.endswith(TEXT_SUFFIXES):
            raise UserError(f"{p} is not a .jsonl or .json file (plain, .zst or .gz), and every file of the input "
                            "folder is read: move it away")
    if not files:
        raise UserError(f"input folder {input_path} holds no files: {hint}")
    return files


def _lines(files: list[Path], max_line_bytes: int, json_key: str, append_eod: bool):
    """((file index, line number), text, bytes, key, append_eod) for each line of the files. A line that is not
    UTF-8, or that is longer than ``max_line_bytes``, stops the run naming its line, before more than the ceiling
    is read; so does a file that opens a JSON array (``[``), whose elements, one a line, would each be skipped for
    the comma after it, all but the last."""
    for index, path in enumerate(files):
        with open_decompressed(path) as f:
            opened = False  # whether a line that is not blank was read
            for lineno in itertools.count(1):
                try:
                    raw = f.readline(max_line_bytes + 1)
                except DECOMPRESSION_ERRORS as exc:
                    raise UserError(f"{path} line {lineno}: cannot be decompressed ({exc}): the file is damaged or cut "
                                    "short; compress it again") from None
                if not raw:
                    break
                if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                    raise UserError(f"{path} line {lineno} is longer than {max_line_bytes / 2**20:g} MiB "
                                    "(--max-line-mb; each worker needs about 200 MB of memory per MB of a line it "
                                    "tokenizes): split the document, or raise --max-line-mb if the memory is there")
                # Editors on Windows open a UTF-8 file with a byte-order mark, which JSON does not take.
                bom = len(UTF8_BOM) if lineno == 1 and raw.startswith(UTF8_BOM) else 0
                try:
                    line = raw[bom:].decode("utf-8")
                except UnicodeDecodeError as exc:
                    compressed = unnamed_compression(path, raw) if lineno == 1 else None
                    if compressed is not None:
                        raise compressed from None
                    raise UserError(f"{path} line {lineno} is not UTF-8 ({exc.reason} at byte {bom + exc.start + 1} "
                                    "of the line): re-encode the file") from None
                if not opened and line.lstrip().startswith("["):
                    # jq reads no compressed file: the hint decompresses one first
                    source = (f"{decompressing_command(path)} | jq -c '.[]'" if path.suffix in COMPRESSED_SUFFIXES
                              else f"jq -c '.[]' {path.name}")
                    raise UserError(f"{path} holds a JSON array, not JSON Lines (one object a line, as Megatron's "
                                    f"and Pai's preprocessing read): write one object a line, e.g. {source} > "
                                    f"{Path(plain_name(path)).stem}.jsonl")
                opened = opened or bool(line.strip())
                yield (index, lineno), line, len(raw), json_key, append_eod


def _preprocess(files: list[Path], prefix: str, tmp: Path, tokenizer, tokenizer_path, json_key: str, workers: int,
                append_eod: bool, strict: bool, progress: bool | None, max_line_bytes: int) -> PreprocessReport:
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    partial = tmp / Path(prefix).name  # the files' own names, in the partial folder
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(f"{partial}.bin", dtype=dtype)
    report = PreprocessReport(output_prefix=prefix)
    # The bytes read, out of the files' sizes where none is compressed (a compressed file's text has no known size).
    compressed = any(p.suffix in COMPRESSED_SUFFIXES for p in files)
    total = None if compressed else sum(p.stat().st_size for p in files)
    terminal = sys.stderr.isatty()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"preprocess {json_key}",
               disable=not (terminal if progress is None else progress))
    log = _ProgressLog(f"preprocess {json_key}", total) if progress is None and not terminal else None
    bytes_read = 0
    lines = _lines(files, max_line_bytes, json_key, append_eod)
    encoded = _encoded(lines, workers, tokenizer_path, dtype)
    try:
        for (index, lineno), ids, error, nchars, nbytes in encoded:
            bar.update(nbytes)
            bytes_read += nbytes
            if log is not None:
                log.update(bytes_read, report.documents)
            if error is not None:
                if error == "empty line":
                    continue
                if error == EMPTY_DOCUMENT:
                    report.empty_documents += 1
                    continue
                if strict:
                    raise UserError(f"{files[index]} line {lineno}: {error}")
                report.skipped += 1
                if len(report.bad_lines) < BAD_LINES_KEPT:  # a file of nothing else stays within memory too
                    report.bad_lines.append((str(files[index]), lineno, error))
                continue
            builder.add_document(ids, [len(ids)])
            report.documents += 1
            report.tokens += len(ids)
            report.characters += nchars
        if report.documents == 0:
            why = (f"every '{json_key}' is empty" if report.empty_documents and not report.skipped else
                   f"every line lacked a string '{json_key}' field or was empty")
            raise UserError(f"{files[0] if len(files) == 1 else files[0].parent} has no usable line ({why})")
        builder.finalize(f"{partial}.idx")
    except LineRefused as exc:
        index, lineno = exc.where
        raise UserError(f"{files[index]} line {lineno}: {exc.message}") from None
    finally:
        encoded.close()  # now, not when collected: the workers end before the partial folder is removed
        bar.close()
        with contextlib.suppress(OSError):  # its last buffer, on a full disk: the partial folder is removed anyway
            builder.data_file.close()
    return report

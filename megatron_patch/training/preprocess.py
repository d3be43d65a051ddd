"""JSONL -> Megatron mmap indexed data (``P_<key>_document.bin/.idx``), with worker processes.

One document per JSON line (the value of ``json_key``), tokenized in parallel, written in input
order through megatron-core's ``IndexedDatasetBuilder``; the end-of-document id is appended after
each document. Lines that are not JSON objects with a string under ``json_key`` are reported with
their line numbers and skipped (``strict`` stops at the first one).

The output follows the rule of every output (docs/outputs.md): under its lock (one writer per prefix), it
is new, or an earlier output of mpatch preprocess (its manifest lists both files) replaced with ``force``;
a pair mpatch did not write is never replaced. Both files are built in a partial folder beside them and
renamed onto their names at the end, with ``P_<key>_document.mpatch_manifest.json`` last (``mpatch verify``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from megatron_patch.checkpoint_files.manifest import DIGEST, MANIFEST_NAME, digest_file, read_manifest, write_manifest
from megatron_patch.errors import UserError
from megatron_patch.outputs.folders import fsync_dir, fsync_file, partial_dir, recover
from megatron_patch.outputs.lock import OutputLock
from megatron_patch.training.tokenizer import load_tokenizer

# torch (1.1 s to import on 2 cores), megatron-core (3.4 s with torch) and transformers (0.6 s) are
# imported inside the functions that use them: `mpatch`, the launcher's checks and its dry run start without them.

_TOKENIZER = None


def _init_worker(tokenizer_path: str) -> None:
    global _TOKENIZER

    _TOKENIZER = load_tokenizer(tokenizer_path)


def _encode_line(item: tuple[int, str, str, bool]):
    """(line number, ids or None, error or None, characters)."""
    lineno, line, key, append_eod = item
    if not line.strip():
        return lineno, None, "empty line", 0
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return lineno, None, f"not valid JSON ({exc.msg} at column {exc.colno})", 0
    if not isinstance(obj, dict):
        return lineno, None, f"a JSON {type(obj).__name__}, not an object", 0
    if key not in obj:
        return lineno, None, f"no '{key}' field (fields: {', '.join(list(obj)[:5])})", 0
    text = obj[key]
    if not isinstance(text, str):
        return lineno, None, f"'{key}' is a {type(text).__name__}, not a string", 0
    ids = _TOKENIZER.encode(text)
    if append_eod:
        ids.append(_TOKENIZER.eod)
    return lineno, ids, None, len(text)


@dataclass
class PreprocessReport:
    output_prefix: str
    documents: int = 0
    tokens: int = 0
    characters: int = 0
    bad_lines: list[tuple[int, str]] = field(default_factory=list)


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


def _publish(tmp: Path, prefix: str) -> None:
    """The two finished files in ``tmp`` onto their names, durable, with the manifest last. The old manifest
    stays until the new one replaces it: a replace interrupted between the renames leaves a pair its
    manifest does not match (mpatch verify names the file), still known as mpatch's for the --force that
    repairs it."""
    manifest = _manifest_path(prefix)
    files = {}
    for name in (Path(prefix + suffix).name for suffix in (".bin", ".idx")):
        size, digest = digest_file(tmp / name)
        fsync_file(tmp / name)
        files[name] = {"size": size, DIGEST: digest}
    write_manifest(tmp, "mpatch preprocess", name=manifest.name, files=files)
    for name in (*files, manifest.name):
        os.replace(tmp / name, manifest.parent / name)
    fsync_dir(manifest.parent)


def preprocess(input_path: str | Path, output_prefix: str, tokenizer_path: str | Path, *, json_key: str = "text",
               workers: int = 1, append_eod: bool = True, strict: bool = False, progress: bool | None = None,
               chunksize: int = 64, force: bool = False) -> PreprocessReport:
    input_path = Path(input_path)
    if not input_path.is_file():
        raise UserError(f"input {input_path} not found: give a JSONL file (one JSON object per line)")
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    tokenizer = load_tokenizer(tokenizer_path)  # fail early, in this process, on a bad tokenizer
    prefix = f"{output_prefix}_{json_key}_document"
    out_dir = Path(prefix).parent
    if not out_dir.is_dir():
        raise UserError(f"output folder {out_dir} does not exist: create it first")
    with OutputLock(prefix, "--output-prefix"):
        recover(prefix)  # only the lock holder writes here: a partial folder is an earlier run's that did not finish
        check_output_prefix(prefix, force)
        tmp = partial_dir(prefix)
        tmp.mkdir()  # a new folder, not one found at the name
        try:
            return _preprocess(input_path, prefix, tmp, tokenizer, tokenizer_path, json_key, workers, append_eod,
                               strict, progress, chunksize)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _preprocess(input_path: Path, prefix: str, tmp: Path, tokenizer, tokenizer_path, json_key: str, workers: int,
                append_eod: bool, strict: bool, progress: bool | None, chunksize: int) -> PreprocessReport:
    import numpy
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    partial = tmp / Path(prefix).name  # the files' own names, in the partial folder
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    builder = IndexedDatasetBuilder(f"{partial}.bin", dtype=dtype)
    report = PreprocessReport(output_prefix=prefix)
    if progress is None:
        progress = sys.stderr.isatty()

    def lines():
        with open(input_path, encoding="utf-8", errors="strict") as f:
            lineno = 0
            while True:
                lineno += 1
                try:
                    line = f.readline()
                except UnicodeDecodeError as exc:
                    raise UserError(f"{input_path} line {lineno} is not UTF-8 ({exc.reason}): re-encode the file")
                if not line:
                    return
                yield lineno, line, json_key, append_eod


    bar = tqdm(total=input_path.stat().st_size, unit="B", unit_scale=True, desc="preprocess", disable=not progress)
    pool = None
    try:
        if workers > 1:
            pool = mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(str(tokenizer_path),))
            results = pool.imap(_encode_line, lines(), chunksize=chunksize)
        else:
            _init_worker(str(tokenizer_path))
            results = map(_encode_line, lines())
        for lineno, ids, error, nchars in results:
            if error is not None:
                if error == "empty line":
                    continue
                if strict:
                    raise UserError(f"{input_path} line {lineno}: {error}")
                report.bad_lines.append((lineno, error))
                continue
            builder.add_document(numpy.asarray(ids, dtype=dtype), [len(ids)])
            report.documents += 1
            report.tokens += len(ids)
            report.characters += nchars
            bar.update(nchars)
        if report.documents == 0:
            raise UserError(f"{input_path} has no usable line (every line lacked a string '{json_key}' field)")
        builder.finalize(f"{partial}.idx")
        _publish(tmp, prefix)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return report

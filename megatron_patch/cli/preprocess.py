"""`mpatch preprocess`: JSONL -> Megatron mmap indexed data (P_<key>_document.bin/.idx).

Pai-Megatron-Patch's flags (toolkits/pretrain_data_preprocessing: preprocess_data_megatron.py and the older
preprocess_data.py) are accepted as they are typed there: ``--load`` is the tokenizer folder, ``--json-keys`` /
``--jsonl-keys`` take several keys (one output pair each), and the flags that change nothing here are named in
one line (``PAI_IGNORED``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

from megatron_patch.cli.common import sigterm_as_interrupt
from megatron_patch.errors import UserError
from megatron_patch.training.preprocess import (DEFAULT_MAX_LINE_MB, MAX_LINE_MB, PROGRESS_LOG_SECONDS,
                                                 WORKERS_PER_CORE, preprocess_keys)

# Pai's flags that have no effect here, and why (said in one line when given).
PAI_IGNORED = {
    "patch_tokenizer_type": ("--patch-tokenizer-type", "the tokenizer is the --load/--tokenizer folder's"),
    "tokenizer_type": ("--tokenizer-type", "the tokenizer is the --load/--tokenizer folder's"),
    "partitions": ("--partitions", "the workers share the input, no partition files are written"),
    "keep_sequential_samples": ("--keep-sequential-samples", "documents always keep the input's order"),
    "log_interval": ("--log-interval", f"progress is a bar, or a line every {PROGRESS_LOG_SECONDS:g} s where "
                                       "stderr is not a terminal"),
    "seq_length": ("--seq-length", "documents are written whole"),
    "extra_vocab_size": ("--extra-vocab-size", "the tokenizer's vocabulary is used"),
    "padded_vocab_size": ("--padded-vocab-size", "the tokenizer's vocabulary is used"),
    "vocab_size": ("--vocab-size", "the tokenizer's vocabulary is used"),
    "vocab_file": ("--vocab-file", "the tokenizer is the --load/--tokenizer folder's"),
    "merge_file": ("--merge-file", "the tokenizer is the --load/--tokenizer folder's"),
    "tokenizer_model": ("--tokenizer-model", "the tokenizer is the --load/--tokenizer folder's"),
    "keep_newlines": ("--keep-newlines", "documents are kept whole, newlines included"),
    "lang": ("--lang", "documents are not split into sentences"),
    "ftfy": ("--ftfy", "text is tokenized as it is"),
    "num_docs": ("--num-docs", "every document is read"),
}


@sigterm_as_interrupt  # the workers end, the partial files and the lock go, exit 130
def run(args) -> int:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    if args.tokenizer is None:
        raise UserError("preprocess needs a tokenizer: --tokenizer (or Pai's --load) naming an HF tokenizer folder "
                        "(tokenizer.json) or a tiktoken BPE file")
    if args.split_sentences:
        raise UserError("--split-sentences is not supported: documents are written whole (one sequence each)")
    if args.dataset_impl != "mmap":
        raise UserError(f"--dataset-impl {args.dataset_impl} is not written here: the output is megatron-core's mmap "
                        "indexed format (--dataset-impl mmap)")
    if args.output_prefix == "":
        # an unset shell variable: the pair was written into the working directory as _text_document.bin/.idx
        raise UserError("--output-prefix is an empty path: give a folder and a prefix of file names in it, e.g. "
                        "data/corpus (writes data/corpus_text_document.bin/.idx)")
    if args.output_prefix.endswith(("/", os.sep)) or os.path.basename(args.output_prefix) in (".", ".."):
        # 'pp/' wrote pp/_text_document.bin, a file named by its key alone ('.', hidden ._text_document.bin)
        raise UserError(f"--output-prefix {args.output_prefix} is a folder: give a prefix of file names in it, "
                        f"e.g. {os.path.join(args.output_prefix, 'corpus')} (writes corpus_text_document.bin/.idx)")
    ignored = [f"{flag} ({why})" for dest, (flag, why) in PAI_IGNORED.items() if getattr(args, dest) not in (None, False)]
    if ignored:
        print(f"note: ignored here: {'; '.join(ignored)}", file=sys.stderr)
    reports = preprocess_keys(args.input, args.output_prefix, args.tokenizer,
                              json_keys=args.json_keys or [args.json_key], workers=args.workers,
                              append_eod=args.append_eod, strict=args.strict, progress=False if args.quiet else None,
                              force=args.force, max_line_bytes=args.max_line_mb)
    for report in reports:
        for where, lineno, error in report.bad_lines:
            print(f"{where}:{lineno}: skipped: {error}", file=sys.stderr)
        if report.skipped > len(report.bad_lines):
            print(f"... and {report.skipped - len(report.bad_lines)} more skipped lines", file=sys.stderr)
        print(f"wrote {report.output_prefix}.bin/.idx: {report.documents} documents, {report.tokens} tokens"
              + (f", {report.skipped} bad lines skipped" if report.skipped else "")
              + (f", {report.empty_documents} empty documents left out (no tokens, no EOD: as Megatron-LM's and Pai's "
                 "preprocessing)" if report.empty_documents else ""))
    return 0


def _mebibytes(text: str) -> int:
    """A size in MiB (a fraction too) -> bytes, at least one and at most MAX_LINE_MB MiB."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value * 2**20 < 1 or value > MAX_LINE_MB:
        raise argparse.ArgumentTypeError(f"must be a number of MiB > 0 and at most {MAX_LINE_MB}, not {text!r}")
    return int(value * 2**20)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "preprocess", help="tokenize JSONL into Megatron mmap indexed data",
        description="Tokenize a JSONL file (one JSON object per line), or a folder of them, plain or .zst/.gz "
                    "compressed, into OUTPUT_PREFIX_<json-key>_document.bin/.idx, the mmap indexed format "
                    "megatron-core's GPTDataset reads. Bad lines are reported with their line numbers and skipped "
                    "(--strict stops instead). Pai-Megatron-Patch's flags are accepted too.")
    p.add_argument("--input", required=True,
                   help="JSONL file, or a folder of .jsonl/.json files (each plain, .zst or .gz), read in name order")
    p.add_argument("--output-prefix", required=True, help="output prefix; files are PREFIX_<json-key>_document.bin/.idx")
    p.add_argument("--tokenizer", "--load", dest="tokenizer",
                   help="HF tokenizer folder (with tokenizer.json) or a tiktoken BPE file (Pai's --load: the HF model "
                        "folder)")
    p.add_argument("--json-key", default="text", help="field holding the document text (default: text)")
    p.add_argument("--json-keys", "--jsonl-keys", dest="json_keys", nargs="+", metavar="KEY",
                   help="Pai's form: one or more fields, each written to its own PREFIX_<key>_document pair")
    p.add_argument("--workers", type=int, default=1,
                   help=f"tokenizer worker processes (default 1; at most {WORKERS_PER_CORE} per CPU core)")
    p.add_argument("--max-line-mb", type=_mebibytes, default=DEFAULT_MAX_LINE_MB * 2**20, metavar="MB",
                   help=f"refuse a line longer than this many MiB (default {DEFAULT_MAX_LINE_MB}): tokenizing a "
                        "line takes about 200 MB of memory per MB of it, in each worker")
    p.add_argument("--append-eod", action="store_true", default=True,
                   help="append the end-of-document token to each document (default)")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false", help="do not append it")
    p.add_argument("--strict", action="store_true", help="stop at the first bad line instead of skipping it")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier output of mpatch preprocess at this prefix (its manifest lists both "
                        "files); files mpatch did not write are never replaced")
    p.add_argument("--quiet", action="store_true",
                   help=f"no progress (a bar on a terminal, otherwise a line every {PROGRESS_LOG_SECONDS:g} s)")
    pai = p.add_argument_group("Pai-Megatron-Patch's flags with no effect here (accepted, and named in one line)")
    for dest, (flag, why) in PAI_IGNORED.items():
        if dest in ("keep_sequential_samples", "keep_newlines", "ftfy"):
            pai.add_argument(flag, dest=dest, action="store_true", help=why)
        else:
            pai.add_argument(flag, dest=dest, help=why)
    pai.add_argument("--split-sentences", action="store_true", help="refused: documents are written whole")
    pai.add_argument("--dataset-impl", default="mmap", help="mmap (the only format written)")
    p.set_defaults(run=run)

"""`mpatch preprocess`: JSONL -> Megatron mmap indexed data (P_<key>_document.bin/.idx)."""

from __future__ import annotations

import argparse
import math
import sys
import warnings

from megatron_patch.training.preprocess import DEFAULT_MAX_LINE_MB, WORKERS_PER_CORE, preprocess


def run(args) -> int:
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

    report = preprocess(args.input, args.output_prefix, args.tokenizer, json_key=args.json_key, workers=args.workers,
                        append_eod=args.append_eod, strict=args.strict, progress=False if args.quiet else None,
                        force=args.force, max_line_bytes=args.max_line_mb)
    for lineno, error in report.bad_lines:
        print(f"{args.input}:{lineno}: skipped: {error}", file=sys.stderr)
    if report.skipped > len(report.bad_lines):
        print(f"... and {report.skipped - len(report.bad_lines)} more skipped lines", file=sys.stderr)
    print(f"wrote {report.output_prefix}.bin/.idx: {report.documents} documents, {report.tokens} tokens"
          + (f", {report.skipped} bad lines skipped" if report.skipped else ""))
    return 0


def _mebibytes(text: str) -> int:
    """A size in MiB (a fraction too) -> bytes, at least one."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value * 2**20 < 1:
        raise argparse.ArgumentTypeError(f"must be a number of MiB > 0, not {text!r}")
    return int(value * 2**20)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "preprocess", help="tokenize JSONL into Megatron mmap indexed data",
        description="Tokenize a JSONL file (one JSON object per line) into OUTPUT_PREFIX_<json-key>_document.bin/.idx, "
                    "the mmap indexed format megatron-core's GPTDataset reads. Bad lines are reported with their "
                    "line numbers and skipped (--strict stops instead).")
    p.add_argument("--input", required=True, help="JSONL file")
    p.add_argument("--output-prefix", required=True, help="output prefix; files are PREFIX_<json-key>_document.bin/.idx")
    p.add_argument("--tokenizer", required=True,
                   help="HF tokenizer folder (with tokenizer.json) or a tiktoken BPE file")
    p.add_argument("--json-key", default="text", help="field holding the document text (default: text)")
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
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)

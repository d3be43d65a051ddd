"""What `mpatch preprocess` holds in memory: the peak a HF tokenizer takes per MB of one line (the reason for
``--max-line-mb``), and the peak of a whole run with workers (docs/performance.md, "Preprocessing memory").

The tokenizer is the demo BPE (``training.demo_data``), the text the demo grammar's. Each measurement runs
in a fresh process and reports its peak resident set (``ru_maxrss``; for one line, above what was
resident before it was tokenized); a run with workers reports the larger
of the parent's and its workers' peaks.

    python scripts/bench_preprocess_memory.py --line-mb 1 8 --lines 100 --workers 2 [--code OTHER_CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ONE_LINE = """
import json, os, resource, sys
from megatron_patch.tokenizer import load_tokenizer
tok = load_tokenizer(sys.argv[1])
text = json.loads(open(sys.argv[2]).read())["text"]
resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
ids = tok.encode(text)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"ids": len(ids), "peak_growth_mb": peak - resident}))
"""


def _text(mb: float) -> str:
    from megatron_patch.demo_data import make_texts

    base = " ".join(make_texts(3000, seed=1))
    size = int(mb * 2**20)
    return (base * (size // len(base) + 1))[:size]


def _env(code: Path = ROOT) -> dict:
    return {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--line-mb", type=float, nargs="+", default=[1, 8], help="sizes of the one-line measurements")
    ap.add_argument("--lines", type=int, default=100, help="1 MB lines in the whole run's file")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--code", type=Path, default=ROOT, help="the checkout whose preprocess the whole run uses "
                                                             "(another one, to compare)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from megatron_patch.demo_data import make_texts, make_tokenizer

    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores, Python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        tok = make_tokenizer(Path(tmp) / "tok", make_texts(2000, seed=0))
        data = Path(tmp) / "many.jsonl"
        doc = json.dumps({"text": _text(1)})
        data.write_text("\n".join([doc] * args.lines) + "\n")
        cmd = [sys.executable, "-m", "megatron_patch", "preprocess", "--input", str(data), "--output-prefix",
               str(Path(tmp) / "p"), "--tokenizer", str(tok), "--quiet", "--workers", str(args.workers)]
        # first: RUSAGE_CHILDREN keeps the largest peak of any child (and its workers) waited for so far
        subprocess.run(cmd, env=_env(args.code), cwd=args.code, check=True, capture_output=True)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        print(f"preprocess of {args.lines} lines of 1 MiB with --workers {args.workers} ({args.code}): largest "
              f"process peak {peak / 1024:.0f} MiB")
        for mb in args.line_mb:
            line = Path(tmp) / "line.json"
            line.write_text(json.dumps({"text": _text(mb)}))
            out = subprocess.run([sys.executable, "-c", ONE_LINE, str(tok), str(line)], env=_env(), check=True,
                                 capture_output=True, text=True).stdout
            got = json.loads(out.splitlines()[-1])
            print(f"one line of {mb:g} MiB: {got['ids']} ids, peak grew {got['peak_growth_mb']:.0f} MiB "
                  f"({got['peak_growth_mb'] / mb:.0f} MiB per MiB of text)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""How fast a file copies out of the page cache, just after it was written vs after it was read from disk.

docs/performance.md explains a slow mcore2hf in one benchmark run by the state of its input's pages:
a checkpoint that hf2mcore had just written (through ``copy_file_range``) copies out more slowly than
the same file once it has been dropped from the cache and read again. This measures that without the
converter. A source file is written once (plain large writes); then, ``--repeat`` times:

    drop the page cache, read SOURCE once, copy_file_range SOURCE -> FRESH (as the converter and
    `cp` write), sync
    just written:  copy_file_range FRESH -> OUT,  and  cp FRESH OUT2
    re-read:       drop the page cache, read FRESH once, then the same two copies

and prints the median of each (needs root to drop the page cache), with the load average.

    python scripts/bench_page_state.py [--gib 1] [--repeat 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PIECE = 64 << 20


def copy_file_range(src: Path, dst: Path) -> float:
    """Seconds to copy ``src`` into a new ``dst`` with copy_file_range, 64 MiB per call."""
    size = src.stat().st_size
    s, d = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        start, done = time.perf_counter(), 0
        while done < size:
            done += os.copy_file_range(s, d, min(PIECE, size - done), done, done)
        return time.perf_counter() - start
    finally:
        os.close(s)
        os.close(d)


def cp(src: Path, dst: Path) -> float:
    start = time.perf_counter()
    subprocess.run(["cp", str(src), str(dst)], check=True)
    return time.perf_counter() - start


def read(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(PIECE):
            pass


def drop_caches() -> bool:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="file size in GiB (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; medians are printed (default 3)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    if not drop_caches():
        print("bench_page_state: error: needs root (it drops the page cache)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="page-state-", dir=args.dir))
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    try:
        source, fresh = work / "source", work / "fresh"
        block = os.urandom(PIECE)
        with open(source, "wb") as f:
            for _ in range(max(1, int(args.gib * 2**30) // PIECE)):
                f.write(block)
        size = source.stat().st_size
        times: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            drop_caches()  # the source read from disk, as the conversion benchmark's warm steps read it
            read(source)
            copy_file_range(source, fresh)
            subprocess.run(["sync"], check=True)
            for state in ("just written", "re-read"):
                if state == "re-read":
                    drop_caches()
                    read(fresh)
                for how, fn in (("copy_file_range", copy_file_range), ("cp", cp)):
                    times.setdefault(f"{state:<13} {how}", []).append(fn(fresh, work / "out"))
                    (work / "out").unlink()
                    subprocess.run(["sync"], check=True)
        print(f"{size / 2**30:.2f} GiB, median of {args.repeat} rounds (all rounds in brackets)")
        for name, values in times.items():
            median = statistics.median(values)
            print(f"  {name:<30} {median:6.2f} s  {size / 1e9 / median:5.2f} GB/s  "
                  f"[{', '.join(f'{v:.2f}' for v in values)}]")
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

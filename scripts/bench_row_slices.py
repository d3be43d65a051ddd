#!/usr/bin/env python
"""How a gather's row slices are best written into new files: from a mapping, or file to file.

A gather (a row-parallel weight split or joined at TP > 1) writes each row of its output as slices of
source rows. The copier used to write a band of them from a read-only mapping of the source with one
``pwritev`` per 1024 slices; it now copies every slice of at least ``GATHER_COPY_MIN`` bytes with its own
``copy_file_range`` (``convert/copier.py``). This measures both, without the converter: a source file
(random bytes, read once so it is in the page cache) is written ``--mib`` MiB at a time into a new
file, slice by slice, for each slice size, ``--repeat`` times in alternating order (no output is
deleted until the end, so neither way gets pages the other just freed), and prints the median CPU
time (user + system) and wall time of each, with the load average.

    python scripts/bench_row_slices.py [--mib 256] [--sizes 1024,2048,4096,8192,16384] [--repeat 6] [--dir /tmp]

--mib is a multiple of 32 (whole bands) and every size divides 32 MiB (whole slices).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BAND = 32 << 20
IOV_MAX = 1024


def from_mapping(src: int, dst: int, total: int, piece: int) -> None:
    """The mapped way: each band of the source mapped (populated up front), its slices written with pwritev."""
    for off in range(0, total, BAND):
        with mmap.mmap(src, BAND, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ,
                       offset=off) as m:
            with memoryview(m) as view:
                slices = [view[i:i + piece] for i in range(0, BAND, piece)]
                for k in range(0, len(slices), IOV_MAX):
                    os.pwritev(dst, slices[k:k + IOV_MAX], off + k * piece)
                del slices


def file_to_file(src: int, dst: int, total: int, piece: int) -> None:
    """The copied way: one copy_file_range per slice."""
    for off in range(0, total, piece):
        done = 0
        while done < piece:
            copied = os.copy_file_range(src, dst, piece - done, off + done, off + done)
            if copied == 0:  # the source ended: it spun here forever (the perf audit)
                raise RuntimeError(f"the source ends at {off + done:,} bytes, before the {total:,} measured")
            done += copied


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="MiB written per measurement (default 256)")
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384", help="slice sizes in bytes")
    ap.add_argument("--repeat", type=int, default=6)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    # whole bands of whole slices, as a gather's rows are: a size that does not divide a band hung the copy or
    # failed the mapping (the perf audit)
    if args.mib < 32 or args.mib % 32:
        ap.error(f"--mib must be a positive multiple of {BAND >> 20} (a band), got {args.mib}")
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes must be byte counts separated by commas, got {args.sizes!r}")
    if any(size < 1 or BAND % size for size in sizes):
        ap.error(f"every --sizes must divide {BAND >> 20} MiB (a band), as a power of two does; got {args.sizes}")
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    total = args.mib << 20
    work = Path(tempfile.mkdtemp(prefix="row-slices-", dir=args.dir))
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs); "
          f"{args.mib} MiB per measurement, median of {args.repeat}", flush=True)
    try:
        source = work / "source"
        with open(source, "wb") as f:
            for start in range(0, total, 64 << 20):
                f.write(os.urandom(min(total - start, 64 << 20)))
        src = os.open(source, os.O_RDONLY)
        while os.read(src, 64 << 20):
            pass
        outputs = []
        for piece in sizes:
            results = {"from a mapping (pwritev)": [], "file to file (copy_file_range)": []}
            ways = list(zip(results, (from_mapping, file_to_file)))
            for rep in range(args.repeat):
                for label, way in ways if rep % 2 == 0 else ways[::-1]:
                    out = work / f"out-{len(outputs)}"
                    outputs.append(out)
                    dst = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    cpu, wall = os.times(), time.perf_counter()
                    way(src, dst, total, piece)
                    wall, after = time.perf_counter() - wall, os.times()
                    os.close(dst)
                    results[label].append((after.user - cpu.user + after.system - cpu.system, wall))
            for label, runs in results.items():
                cpu = statistics.median(c for c, _ in runs)
                print(f"slices of {piece:6d} B, {label:30}: CPU {cpu:.3f} s ({total / 2**30 / cpu:.2f} GiB/CPU-s), "
                      f"wall {statistics.median(w for _, w in runs):.3f} s; CPU per run "
                      f"{' '.join(f'{c:.2f}' for c, _ in runs)}", flush=True)
        os.close(src)
    finally:
        for p in sorted(work.iterdir()):
            p.unlink()
        work.rmdir()
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast the manifest's digest is, against the alternatives (docs/performance.md, "The manifest").

Prints GiB/s of XXH3-128 (the manifest's), BLAKE2b and SHA-256 over a buffer in memory, and of
``manifest.digest_file`` over a file just written (in the page cache), each the median of --repeat runs.

    PYTHONPATH=. python scripts/bench_digest.py --mib 1024 --repeat 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import xxhash

from megatron_patch.checkpoint_files.manifest import digest_file

from cli_types import positive_int  # scripts/, beside this one


def rate(fn, nbytes: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return nbytes / 2**30 / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=positive_int, default=1024)
    ap.add_argument("--repeat", type=positive_int, default=5)
    args = ap.parse_args()
    n = args.mib * 2**20
    data = memoryview(os.urandom(n))
    print(f"load average {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs); {args.mib} MiB, median of {args.repeat}")
    for name, fn in (("xxh3_128", lambda: xxhash.xxh3_128(data).digest()),
                     ("blake2b", lambda: hashlib.blake2b(data).digest()),
                     ("sha256", lambda: hashlib.sha256(data).digest())):
        print(f"  {name:<28} {rate(fn, n, args.repeat):6.2f} GiB/s (in memory)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.bin"
        path.write_bytes(data)
        print(f"  {'digest_file (page cache)':<28} {rate(lambda: digest_file(path), n, args.repeat):6.2f} GiB/s "
              "(xxh3_128 through read-only maps)")


if __name__ == "__main__":
    main()

"""Progress of a conversion: a tqdm bar (tensors, bytes, throughput) on a terminal, two log lines otherwise."""

from __future__ import annotations

import sys
import time

# torch (1.1 s to import on 2 cores) and megatron-core (3.4 s with torch) are imported inside the functions
# that use them: a conversion runs without either (tests/test_convert_bytes.py checks that it imports neither).


class Progress:
    def __init__(self, desc: str, total_bytes: int, total_tensors: int, enabled: bool | None = None, stream=None):
        self.stream = stream or sys.stderr
        self.desc, self.total_bytes, self.total_tensors = desc, total_bytes, total_tensors
        self.tensors = 0
        self.bytes = 0
        self.start = time.perf_counter()
        tty = getattr(self.stream, "isatty", lambda: False)()
        # None: a bar on a terminal, a start and an end line otherwise; True: always a bar; False: silent.
        self.mode = "silent" if enabled is False else "bar" if (enabled or tty) else "log"
        self._bar = None
        if self.mode == "bar":
            # tqdm only for a terminal's bar
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                             file=self.stream, dynamic_ncols=True, postfix=self._postfix())
        elif self.mode == "log":
            print(f"{desc}: {total_tensors} tensors, {total_bytes / 2**30:.2f} GiB", file=self.stream, flush=True)

    def _postfix(self) -> str:
        return f"tensors={self.tensors}/{self.total_tensors}"

    def update(self, nbytes: int, tensors: int = 1) -> None:
        self.tensors += tensors
        self.bytes += nbytes
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(nbytes)

    def close(self, stats=None) -> float:
        """``stats``: the copier's, to say how the bytes moved (file to file, through memory)."""
        seconds = time.perf_counter() - self.start
        how = ""
        if stats is not None:
            how = f"; {stats.zero_copy_bytes / 2**30:.2f} GiB file to file, " \
                  f"{(stats.gathered_bytes + stats.buffered_bytes + stats.called_bytes) / 2**30:.2f} GiB through memory"
            if stats.fallback_reason:
                how += f" (copy_file_range unavailable: {stats.fallback_reason})"
        if self._bar is not None:
            self._bar.close()
        if self.mode != "silent":
            rate = self.bytes / max(seconds, 1e-9) / 2**20
            print(f"{self.desc}: done, {self.tensors} tensors, {self.bytes / 2**30:.2f} GiB in {seconds:.1f}s "
                  f"({rate:.0f} MiB/s){how}", file=self.stream, flush=True)
        return seconds

"""JSON-lines files as datasets ship them: plain, or gzip- or zstd-compressed (``.gz``, ``.zst``: the name's last
suffix), opened as one stream of their decompressed bytes. ``mpatch preprocess`` reads them a bounded line at a
time, the SFT reader whole; a compressed file that is damaged or cut short is one line either way."""

from __future__ import annotations

import contextlib
import gzip
import io
import zlib
from pathlib import Path

from megatron_patch.errors import UserError

# zstandard is imported only where a .zst file is read.

COMPRESSED_SUFFIXES = (".zst", ".gz")
# What reading a damaged or cut-short gzip stream raises (a zstd one raises UserError itself)
DECOMPRESSION_ERRORS = (OSError, EOFError, zlib.error)
# The first bytes of a compressed file whose name does not say so
COMPRESSION_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd"}


def unnamed_compression(path: Path, first_bytes: bytes) -> UserError | None:
    """The error for a file that is not UTF-8 because it is compressed and its name does not say so (re-encoding,
    the advice for other bytes, would send the user the wrong way); None for any other file."""
    kind = next((kind for magic, kind in COMPRESSION_MAGIC.items() if first_bytes.startswith(magic)), None)
    if kind is None:
        return None
    return UserError(f"{path} is {kind}-compressed (by its first bytes), and its name does not end in "
                     f".{'gz' if kind == 'gzip' else 'zst'}: rename it so, or decompress it")


def plain_name(path: Path) -> str:
    """``path``'s name less a compression suffix (data.json.gz -> data.json)."""
    return path.stem if path.suffix in COMPRESSED_SUFFIXES else path.name


def decompressing_command(path: Path) -> str:
    """A shell command writing the decompressed bytes of ``path`` (a .gz or .zst file) to stdout."""
    return {".gz": "zcat", ".zst": "zstdcat"}[path.suffix] + f" {path.name}"


# Compressed bytes decompressed at a time: zstd expands a piece at most about 32000-fold (4-byte blocks of one
# repeated byte, 128 KiB each), so a piece's output stays within 8 MiB whatever the file holds.
ZSTD_PIECE = 256


class _ZstdStream(io.RawIOBase):
    """A zstd file's bytes, decompressed ``ZSTD_PIECE`` input bytes at a time (zstandard's own stream reader ends
    silently where a file was cut short; here a frame left open at the end is refused)."""

    def __init__(self, path: Path, raw):
        try:
            import zstandard
        except ImportError:
            raise UserError(f"{path} is zstd-compressed, and reading it needs the zstandard package: pip install "
                            "zstandard") from None
        self.path, self.raw, self.zstandard = path, raw, zstandard
        self.frame, self.fed = zstandard.ZstdDecompressor().decompressobj(), False
        self.pending, self.taken = b"", 0  # decompressed bytes, and how many of them were read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.taken == len(self.pending):
            piece = self.raw.read(ZSTD_PIECE)
            if not piece:
                if self.fed and not self.frame.eof:
                    raise UserError(f"{self.path} ends inside a zstd frame: the file was cut short; copy or compress "
                                    "it again")
                return 0
            self.pending, self.taken = b"", 0
            try:
                while piece:
                    if self.frame.eof:  # the next of several frames
                        self.frame = self.zstandard.ZstdDecompressor().decompressobj()
                    self.pending += self.frame.decompress(piece)
                    self.fed, piece = True, self.frame.unused_data if self.frame.eof else b""
            except self.zstandard.ZstdError as exc:
                raise UserError(f"{self.path} is not a readable zstd file ({exc}): it is damaged or not zstd; "
                                "compress it again") from None
        n = min(len(buffer), len(self.pending) - self.taken)
        buffer[:n] = memoryview(self.pending)[self.taken:self.taken + n]
        self.taken += n
        return n


@contextlib.contextmanager
def open_decompressed(path: Path):
    """``path`` opened for reading its decompressed bytes (bounded ``readline`` included), by its last suffix."""
    with open(path, "rb") as raw:
        if path.suffix == ".zst":
            yield io.BufferedReader(_ZstdStream(path, raw))
        elif path.suffix == ".gz":
            with gzip.GzipFile(fileobj=raw) as f:
                yield f
        else:
            yield raw

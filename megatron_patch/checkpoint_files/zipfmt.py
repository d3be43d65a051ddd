"""The zip container of ``torch.save`` files, laid out and located without torch.

A torch.save file is an uncompressed zip: ``<prefix>/data.pkl``, a few one-line records, and one
``<prefix>/data/<key>`` record per storage, each record's bytes aligned to 64 bytes (padding in the
local header's extra field, as torch's writer does). Because nothing is compressed, every byte's
place is known from the record sizes alone: ``ZipLayout`` computes the whole file (headers,
directory, and where each storage's bytes go) before a single tensor byte exists, so the bytes can
be copied in later, in any order, by any number of workers. Offsets of 4 GiB and more use zip64.

``ZipIndex`` is the reverse: where each record's bytes are in an existing file (ours, torch's, or
one stored inside a torch_dist ``.distcp`` file at some offset).
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field

ALIGNMENT = 64            # torch.serialization._get_storage_alignment()
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")           # 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")    # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")                # 22 bytes
_EOCD64 = struct.Struct("<IQHHIIQQQQ")            # 56 bytes
_LOCATOR = struct.Struct("<IIQI")                 # 20 bytes


class ZipFormatError(ValueError):
    pass


@dataclass
class ZipLayout:
    """A whole zip file planned up front. ``base`` is where the zip starts in its file."""

    base: int
    size: int = 0
    small: list[tuple[int, bytes]] = field(default_factory=list)     # (absolute offset, bytes) to write as is
    records: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (absolute data offset, length)

    @property
    def end(self) -> int:
        return self.base + self.size


def plan_zip(records: list[tuple[str, bytes | int]], *, base: int = 0, force_zip64: bool = False) -> ZipLayout:
    """Lay out a stored (uncompressed) zip of ``records``: (name, bytes) for small records written
    now, (name, length) for records whose bytes are copied in later (their CRC is left 0, which
    torch.load does not check, as torch.save with compute_crc32 off writes).

    ``force_zip64`` writes every size and offset in zip64 form (a test of files above 4 GiB).
    """
    layout = ZipLayout(base)
    central: list[bytes] = []
    pos = 0  # relative to the zip's start
    for name, content in records:
        raw_name = name.encode()
        size = content if isinstance(content, int) else len(content)
        crc = 0 if isinstance(content, int) else zlib.crc32(content)
        big = force_zip64 or size >= _U32
        zip64 = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        start = pos + _LOCAL.size + len(raw_name) + len(zip64)
        pad = -(start + 4) % ALIGNMENT
        extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        header = _LOCAL.pack(0x04034B50, 45 if big else 20, 0, 0, 0, 0, crc,
                             _U32 if big else size, _U32 if big else size, len(raw_name), len(extra))
        layout.small.append((layout.base + pos, header + raw_name + extra))
        data_at = pos + len(header) + len(raw_name) + len(extra)
        assert data_at % ALIGNMENT == 0
        if isinstance(content, int):
            layout.records[name] = (layout.base + data_at, size)
        elif content:
            layout.small.append((layout.base + data_at, content))
        # central directory entry
        far = force_zip64 or pos >= _U32
        c_extra = b""
        if big or far:
            fields = (struct.pack("<QQ", size, size) if big else b"") + (struct.pack("<Q", pos) if far else b"")
            c_extra = struct.pack("<HH", 1, len(fields)) + fields
        central.append(_CENTRAL.pack(
            0x02014B50, 45, 45 if (big or far) else 20, 0, 0, 0, 0, crc, _U32 if big else size, _U32 if big else size,
            len(raw_name), len(c_extra), 0, 0, 0, 0, _U32 if far else pos) + raw_name + c_extra)
        pos = data_at + size
    directory = b"".join(central)
    cd_offset, cd_size, count = pos, len(directory), len(records)
    eocd64_at = cd_offset + cd_size
    tail = _EOCD64.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
    tail += _LOCATOR.pack(0x07064B50, 0, eocd64_at, 1)
    small_cd = not force_zip64 and cd_offset < _U32 and count < _U16
    tail += _EOCD.pack(0x06054B50, 0, 0, count if small_cd else _U16, count if small_cd else _U16,
                       cd_size if small_cd else _U32, cd_offset if small_cd else _U32, 0)
    layout.small.append((layout.base + cd_offset, directory + tail))
    layout.size = eocd64_at + len(tail)
    return layout


# --- reading ---------------------------------------------------------------------------------------

def _pread(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise ZipFormatError(f"file ends {length - len(data)} bytes early")
    return data


class ZipIndex:
    """Where each record of a stored zip lies, for the zip at ``[base, base + length)`` of ``path``.

    Record names are given without the archive's own first path component ("data/0", "data.pkl").
    """

    def __init__(self, path: str | os.PathLike, base: int = 0, length: int | None = None):
        self.path = os.fspath(path)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            total = os.fstat(fd).st_size
            self.base = base
            self.length = total - base if length is None else length
            if base + self.length > total:
                raise ZipFormatError(f"file ends {base + self.length - total} bytes early")
            self._entries = self._read_directory(fd)
            self._data: dict[str, tuple[int, int]] = {}
            self._fd_path = self.path
        finally:
            os.close(fd)

    def _read_directory(self, fd: int) -> dict[str, tuple[int, int, int]]:
        tail_len = min(self.length, _EOCD.size + 65535 + _LOCATOR.size + _EOCD64.size)
        tail = _pread(fd, tail_len, self.base + self.length - tail_len)
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or at + _EOCD.size > len(tail):
            raise ZipFormatError("no zip end-of-directory record")
        _, _, _, _, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, at)
        loc_at = at - _LOCATOR.size
        if loc_at >= 0 and tail[loc_at:loc_at + 4] == b"PK\x06\x07":
            _, _, eocd64_at, _ = _LOCATOR.unpack_from(tail, loc_at)
            rec = _pread(fd, _EOCD64.size, self.base + eocd64_at)
            if rec[:4] != b"PK\x06\x06":
                raise ZipFormatError("bad zip64 end-of-directory record")
            _, _, _, _, _, _, _, count, cd_size, cd_offset = _EOCD64.unpack(rec)
        if cd_offset + cd_size > self.length:
            raise ZipFormatError("the zip directory lies past the end of the file")
        directory = _pread(fd, cd_size, self.base + cd_offset)
        entries: dict[str, tuple[int, int, int]] = {}
        pos = 0
        for _ in range(count):
            if directory[pos:pos + 4] != b"PK\x01\x02":
                raise ZipFormatError("bad zip directory entry")
            (_, _, _, _, method, _, _, _, csize, usize, nlen, xlen, clen, _, _, _, local) = _CENTRAL.unpack_from(directory, pos)
            name = directory[pos + _CENTRAL.size: pos + _CENTRAL.size + nlen].decode("utf-8", "replace")
            extra = directory[pos + _CENTRAL.size + nlen: pos + _CENTRAL.size + nlen + xlen]
            usize, csize, local = _zip64_values(extra, usize, csize, local)
            if method != 0 or csize != usize:
                raise ZipFormatError(f"record {name} is compressed; torch files are stored uncompressed")
            entries[name.split("/", 1)[1] if "/" in name else name] = (local, usize, len(name.encode()))
            pos += _CENTRAL.size + nlen + xlen + clen
        return entries

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def locate(self, name: str) -> tuple[int, int]:
        """(absolute offset of the record's bytes in the file, length)."""
        if name not in self._data:
            if name not in self._entries:
                raise ZipFormatError(f"no record {name}")
            local, size, _ = self._entries[name]
            fd = os.open(self.path, os.O_RDONLY)
            try:
                header = _pread(fd, _LOCAL.size, self.base + local)
            finally:
                os.close(fd)
            sig, *_, nlen, xlen = _LOCAL.unpack(header)
            if sig != 0x04034B50:
                raise ZipFormatError(f"bad local header for record {name}")
            start = local + _LOCAL.size + nlen + xlen
            if start + size > self.length:
                raise ZipFormatError(f"record {name} runs {start + size - self.length} bytes past the end of the file")
            self._data[name] = (self.base + start, size)
        return self._data[name]

    def read(self, name: str) -> bytes:
        offset, size = self.locate(name)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return _pread(fd, size, offset)
        finally:
            os.close(fd)


def _zip64_values(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4: pos + 4 + length]
        if tag == 1:
            values, k = [], 0
            for current in (usize, csize, local):
                if current == _U32:
                    values.append(struct.unpack_from("<Q", body, k)[0])
                    k += 8
                else:
                    values.append(current)
            return values[0], values[1], values[2]
        pos += 4 + length
    return usize, csize, local

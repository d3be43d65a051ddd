"""The zip container of ``torch.save`` files, laid out and located without torch.

A torch.save file is an uncompressed zip: ``<prefix>/data.pkl``, a few one-line records, and one
``<prefix>/data/<key>`` record per storage, each record's bytes aligned to 64 bytes (padding in the
local header's extra field, as torch's writer does). Because nothing is compressed, every byte's
place is known from the record sizes alone: ``ZipLayout`` computes the whole file (headers,
directory, and where each storage's bytes go) before a single tensor byte exists, so the bytes can
be copied in later, in any order, by any number of workers. Offsets of 4 GiB and more use zip64.

``ZipIndex`` is the reverse: where each record's bytes are in an existing file (ours, torch's, or
one stored inside a torch_dist ``.distcp`` file at some offset).

Integrity: every record carries its CRC-32. Records whose bytes are copied in later are laid out with
CRC 0 and sealed once the bytes are in place (``seal``: the CRC computed from the file and written into
the local header and the directory entry). ``ZipIndex`` checks, on opening, that every local header
agrees with its directory entry (or its data descriptor, as torch.save writes them), that the records
and the directory tile the archive, and the CRC-32 of every small record (the pickle among them);
``record_checks`` lists the large records' CRC-32s for the caller to check while it reads them
(``check_crc``). CRC 0 means "not recorded" (files written by this project before CRCs were sealed).
"""

from __future__ import annotations

import mmap
import os
import struct
import zlib
from dataclasses import dataclass, field

try:  # ISA-L's CRC-32 runs at about 12 GB/s here, zlib's at about 2
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal is a dependency; zlib gives the same values, slower
    from zlib import crc32

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
    # Records copied in later: name -> absolute offsets of its CRC field in the local header and the directory.
    unsealed: dict[str, tuple[int, int]] = field(default_factory=dict)

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
            layout.unsealed[name] = (layout.base + pos + 14, None)
        elif content:
            layout.small.append((layout.base + data_at, content))
        # central directory entry
        far = force_zip64 or pos >= _U32
        c_extra = b""
        if big or far:
            fields = (struct.pack("<QQ", size, size) if big else b"") + (struct.pack("<Q", pos) if far else b"")
            c_extra = struct.pack("<HH", 1, len(fields)) + fields
        if name in layout.unsealed:
            layout.unsealed[name] = (layout.unsealed[name][0], sum(map(len, central)) + 16)
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
    layout.unsealed = {name: (local, layout.base + cd_offset + central_at)
                       for name, (local, central_at) in layout.unsealed.items()}
    return layout


def crc_of_range(fd: int, offset: int, length: int, piece: int = 16 * 2**20) -> int:
    """CRC-32 of ``length`` bytes of ``fd`` from ``offset``, read through read-only mappings of the page
    cache (no copy into this process), ``piece`` bytes at a time."""
    crc, end = 0, offset + length
    if os.fstat(fd).st_size < end:
        raise EOFError(f"the file ends before byte {end}")
    while offset < end:
        n = min(piece, end - offset)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(fd, offset + n - start, prot=mmap.PROT_READ, offset=start,
                       flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as m:
            with memoryview(m) as view:
                crc = crc32(view[offset - start:offset - start + n], crc)
        offset += n
    return crc


def seal(fd: int, layout: ZipLayout, names=None) -> int:
    """Compute the CRC-32 of the records copied in later (``names``, default all) from the file open as
    ``fd`` and write it into their headers; returns the bytes read."""
    done = 0
    for name in layout.unsealed if names is None else names:
        offset, length = layout.records[name]
        value = struct.pack("<I", crc_of_range(fd, offset, length) if length else 0)
        for at in layout.unsealed[name]:
            os.pwrite(fd, value, at)
        done += length
    return done


# --- reading ---------------------------------------------------------------------------------------

def _pread(fd: int, length: int, offset: int) -> bytes:
    data = os.pread(fd, length, offset)
    if len(data) != length:
        raise ZipFormatError(f"file ends {length - len(data)} bytes early")
    return data


# Records up to this size are read and CRC-checked when an archive is opened; larger ones (tensor
# storages) are left to ``record_checks``.
SMALL_RECORD = 1 << 20
# The checked bytes kept for ``read``, per archive; other records are read (and checked) again when asked for,
# so an archive of many small tensors (an MoE's experts) costs no memory in proportion to them.
KEPT_BYTES = 64 << 10
_DESCRIPTOR = 0x08074B50


@dataclass(frozen=True)
class _Entry:
    local: int       # offset of the local header, relative to the zip's start
    size: int
    crc: int
    flags: int
    name: bytes


class ZipIndex:
    """Where each record of a stored zip lies, for the zip at ``[base, base + length)`` of ``path``,
    checked on opening (the module docstring says what).

    Record names are given without the archive's own first path component ("data/0", "data.pkl").
    """

    def __init__(self, path: str | os.PathLike, base: int = 0, length: int | None = None, data: bytes | None = None):
        """``data``: the archive's bytes, already in memory (``path`` then only names it)."""
        self.path = os.fspath(path)
        self._memory = None if data is None else memoryview(data)
        fd = os.open(self.path, os.O_RDONLY) if data is None else -1
        self._fd = fd
        try:
            total = os.fstat(fd).st_size if data is None else len(data)
            self.base = base
            self.length = total - base if length is None else length
            if base + self.length > total:
                raise ZipFormatError(f"file ends {base + self.length - total} bytes early")
            self._entries, directory_at = self._read_directory(fd)
            self._data: dict[str, tuple[int, int]] = {}
            self._small: dict[str, bytes] = {}
            self._check_records(fd, directory_at)
        finally:
            if fd >= 0:
                os.close(fd)
            self._fd = -1

    def _read(self, length: int, offset: int) -> bytes:
        if self._memory is not None:
            if offset + length > len(self._memory):
                raise ZipFormatError(f"file ends {offset + length - len(self._memory)} bytes early")
            return bytes(self._memory[offset:offset + length])
        return _pread(self._fd, length, offset)

    def _read_directory(self, fd: int) -> tuple[dict[str, _Entry], int]:
        tail_len = min(self.length, _EOCD.size + 65535 + _LOCATOR.size + _EOCD64.size)
        tail = self._read(tail_len, self.base + self.length - tail_len)
        at = tail.rfind(b"PK\x05\x06")
        if at < 0 or at + _EOCD.size > len(tail):
            raise ZipFormatError("no zip end-of-directory record")
        _, disk, cd_disk, count_here, count, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
        if (disk, cd_disk, count_here != count) != (0, 0, False) or at + _EOCD.size + comment != len(tail):
            raise ZipFormatError("a damaged zip end-of-directory record")
        cd_end = self.length - len(tail) + at  # where the directory (and any zip64 records) must end
        loc_at = at - _LOCATOR.size
        if loc_at >= 0 and tail[loc_at:loc_at + 4] == b"PK\x06\x07":
            _, loc_disk, eocd64_at, disks = _LOCATOR.unpack_from(tail, loc_at)
            rec = self._read(_EOCD64.size, self.base + eocd64_at)
            if rec[:4] != b"PK\x06\x06" or (loc_disk, disks) != (0, 1):
                raise ZipFormatError("bad zip64 end-of-directory record")
            _, size64, _, _, disk64, cd_disk64, count64, total64, cd_size64, cd_offset64 = _EOCD64.unpack(rec)
            if (size64, disk64, cd_disk64) != (_EOCD64.size - 12, 0, 0):
                raise ZipFormatError("a damaged zip64 end-of-directory record")
            for small, big in ((count, total64), (cd_size, cd_size64), (cd_offset, cd_offset64)):
                if small not in (big, _U16, _U32):
                    raise ZipFormatError("the zip64 and zip end-of-directory records disagree")
            if count64 != total64 or eocd64_at + _EOCD64.size != cd_end - _LOCATOR.size:
                raise ZipFormatError("a damaged zip64 end-of-directory record")
            count, cd_size, cd_offset = total64, cd_size64, cd_offset64
            cd_end = eocd64_at
        if cd_offset + cd_size != cd_end:
            raise ZipFormatError("the zip directory does not end where its end record begins")
        directory = self._read(cd_size, self.base + cd_offset)
        entries: dict[str, _Entry] = {}
        pos = 0
        for _ in range(count):
            if directory[pos:pos + 4] != b"PK\x01\x02":
                raise ZipFormatError("bad zip directory entry")
            (_, _, _, flags, method, _, _, crc, csize, usize, nlen, xlen, clen, disk, _, _, local) = \
                _CENTRAL.unpack_from(directory, pos)
            raw = directory[pos + _CENTRAL.size: pos + _CENTRAL.size + nlen]
            extra = directory[pos + _CENTRAL.size + nlen: pos + _CENTRAL.size + nlen + xlen]
            usize, csize, local = _zip64_values(extra, usize, csize, local)
            name = raw.decode("utf-8", "replace")
            if disk != 0:
                raise ZipFormatError("a damaged zip directory entry (it names another disk)")
            if method != 0 or csize != usize:
                raise ZipFormatError(f"record {name} is compressed; torch files are stored uncompressed")
            key = name.split("/", 1)[1] if "/" in name else name
            if key in entries:
                raise ZipFormatError(f"record {name} appears twice")
            entries[key] = _Entry(local, usize, crc, flags, raw)
            pos += _CENTRAL.size + nlen + xlen + clen
        if pos != cd_size:
            raise ZipFormatError("the zip directory holds more than its entries")
        return entries, cd_offset

    def _check_records(self, fd: int, directory_at: int) -> None:
        """Each local header against its directory entry, the records tiling the archive in order up to
        the directory, and the CRC-32 of every small record."""
        at = kept = 0
        for key, e in sorted(self._entries.items(), key=lambda kv: kv[1].local):
            name = e.name.decode("utf-8", "replace")
            if e.local != at:
                raise ZipFormatError(f"record {name} is not where the previous one ends")
            header = self._read(_LOCAL.size, self.base + e.local)
            sig, _, flags, method, _, _, crc, csize, usize, nlen, xlen = _LOCAL.unpack(header)
            names_extra = self._read(nlen + xlen, self.base + e.local + _LOCAL.size)
            if sig != 0x04034B50 or names_extra[:nlen] != e.name or (flags, method) != (e.flags, 0):
                raise ZipFormatError(f"the local header of record {name} disagrees with the zip directory")
            extra = names_extra[nlen:]
            usize, csize, _ = _zip64_values(extra, usize, csize, 0)
            _check_padding(extra, name)
            start = e.local + _LOCAL.size + nlen + xlen
            end = start + e.size
            if end > directory_at:
                raise ZipFormatError(f"record {name} runs {end - directory_at} bytes past the zip directory")
            if flags & 8:  # sizes and CRC in a data descriptor after the bytes (torch.save writes these)
                if (crc, csize, usize) != (0, 0, 0):
                    raise ZipFormatError(f"the local header of record {name} disagrees with the zip directory")
                end = self._check_descriptor(fd, end, e, name)
            elif (crc, csize, usize) != (e.crc, e.size, e.size):
                raise ZipFormatError(f"the local header of record {name} disagrees with the zip directory")
            self._data[key] = (self.base + start, e.size)
            if e.size <= SMALL_RECORD:
                data = self._read(e.size, self.base + start)
                if e.crc and crc32(data) != e.crc:
                    raise ZipFormatError(f"record {name} fails its CRC-32 check")
                if kept + e.size <= KEPT_BYTES:
                    self._small[key] = data
                    kept += e.size
            at = end
        if at != directory_at:
            raise ZipFormatError("bytes the zip directory does not account for lie before it")

    def _check_descriptor(self, fd: int, end: int, e: _Entry, name: str) -> int:
        """The data descriptor after a record's bytes (optional signature, CRC, sizes of 4 or, in zip64, 8
        bytes each) must repeat the directory's values; returns where the next record begins."""
        raw = self._read(min(24, max(0, self.length - end)), self.base + end)
        pos = 4 if raw[:4] == struct.pack("<I", _DESCRIPTOR) else 0
        for fmt in ("<III", "<IQQ"):
            n = struct.calcsize(fmt)
            if len(raw) >= pos + n and struct.unpack_from(fmt, raw, pos) == (e.crc, e.size, e.size):
                return end + pos + n
        raise ZipFormatError(f"the data descriptor of record {name} disagrees with the zip directory")

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def locate(self, name: str) -> tuple[int, int]:
        """(absolute offset of the record's bytes in the file, length)."""
        if name not in self._data:
            raise ZipFormatError(f"no record {name}")
        return self._data[name]

    def crc(self, name: str) -> int:
        """The record's CRC-32 as the directory gives it (0: not recorded)."""
        return self._entries[name].crc

    def read(self, name: str) -> bytes:
        if name in self._small:
            return self._small[name]
        offset, size = self.locate(name)
        if self._memory is not None:
            data = bytes(self._memory[offset:offset + size])
        else:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                data = _pread(fd, size, offset)
            finally:
                os.close(fd)
        if self._entries[name].crc and crc32(data) != self._entries[name].crc:
            raise ZipFormatError(f"record {name} fails its CRC-32 check")
        return data

    def verify(self) -> None:
        """Check the CRC-32 of every record now (the large ones too)."""
        for name, e in self._entries.items():
            if e.crc and e.size > SMALL_RECORD:
                self.read(name)

    def record_check(self, name: str) -> tuple[str, int, int, int] | None:
        """(path, offset, length, CRC-32) of a record opening did not check (a large one with a CRC), else None."""
        e = self._entries[name]
        return (self.path, *self._data[name], e.crc) if e.crc and e.size > SMALL_RECORD else None

    def record_checks(self) -> list[tuple[str, int, int, int]]:
        """(path, offset, length, CRC-32) of each large record that carries a CRC: what opening the
        archive did not read."""
        return [(self.path, *self._data[k], e.crc) for k, e in self._entries.items()
                if e.size > SMALL_RECORD and e.crc]


def _check_padding(extra: bytes, name: str) -> None:
    """torch's alignment padding (extra field "FB") is all "Z": a flipped byte there is found too."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 0x4246 and extra[pos + 4:pos + 4 + size].strip(b"Z"):
            raise ZipFormatError(f"the alignment padding of record {name} is damaged")
        pos += 4 + size
    if pos != len(extra):
        raise ZipFormatError(f"the extra field of record {name} is damaged")


def check_crc(path: str, offset: int, length: int, crc: int, what: str) -> int:
    """Raise ``ZipFormatError`` naming ``what`` unless the bytes have CRC-32 ``crc``; returns the bytes read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        got = crc_of_range(fd, offset, length)
    except EOFError as exc:
        raise ZipFormatError(f"{what}: {exc}") from None
    finally:
        os.close(fd)
    if got != crc:
        raise ZipFormatError(f"{what} fails its CRC-32 check")
    return length


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

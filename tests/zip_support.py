"""Zip archives crafted from real ones for the hostile-input and fuzzing tests: a
torch.save archive's bytes, the same archive rewritten (members stored or deflated), and one
whose central directory lists a member many times; a small archive that inflates to a
gigabyte."""

from __future__ import annotations

import io
import struct
import zipfile

import torch


def torch_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def rezipped(data: bytes, compress_type: int = zipfile.ZIP_STORED) -> bytes:
    """The same archive written by Python's zipfile (no zip64 records), every member
    stored or, with ``compress_type``, compressed."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=compress_type)
    return out.getvalue()


def deflated(data: bytes) -> bytes:
    """The same archive with every member deflated (torch.save stores them)."""
    return rezipped(data, zipfile.ZIP_DEFLATED)


def _central_entries(cd: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(cd):
        assert cd[at : at + 4] == b"PK\x01\x02"
        n, m, k = struct.unpack_from("<HHH", cd, at + 28)
        out.append(cd[at : at + 46 + n + m + k])
        at += 46 + n + m + k
    return out


def listed_again(data: bytes, member_suffix: str, times: int) -> bytes:
    """``data`` (a torch.save archive) with the central directory entry of the member
    ending in ``member_suffix`` repeated ``times`` more times: one stored member, many
    listings."""
    eocd = data.rindex(b"PK\x05\x06")
    z64 = data.rindex(b"PK\x06\x06")
    count, cd_size, cd_off = struct.unpack_from("<QQQ", data, z64 + 32)
    entries = _central_entries(data[cd_off : cd_off + cd_size])
    assert len(entries) == count
    extra = next(
        e
        for e in entries
        if e[46 : 46 + struct.unpack_from("<H", e, 28)[0]].decode().endswith(member_suffix)
    )
    cd = b"".join(entries) + extra * times
    head = data[:cd_off]
    z64rec = bytearray(data[z64:eocd])
    struct.pack_into("<QQQQ", z64rec, 24, count + times, count + times, len(cd), cd_off)
    # the zip64 locator (just before the end record) points at the zip64 end record
    loc_at = len(z64rec) - 20
    struct.pack_into("<Q", z64rec, loc_at + 8, cd_off + len(cd))
    end = bytearray(data[eocd:])
    struct.pack_into("<HHII", end, 8, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
    return head + cd + bytes(z64rec) + bytes(end)


def inflating_bomb() -> bytes:
    """A 5 MB torch.save file of a 1 GiB tensor of zeros: its storage member deflated
    (torch.save stores members; torch inflates whatever it is given)."""
    n, small = 256 << 20, 123457
    src = io.BytesIO(torch_bytes(torch.zeros(small)))
    out = io.BytesIO()
    with (
        zipfile.ZipFile(src) as z,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as dst,
    ):
        for info in z.infolist():
            data = z.read(info)
            if info.filename.endswith("/data/0"):
                piece = bytes(1 << 20)
                with dst.open(info.filename, "w", force_zip64=True) as w:
                    for _ in range(n * 4 >> 20):
                        w.write(piece)
                continue
            if info.filename.endswith("/data.pkl"):  # the storage's and the tensor's sizes
                data = data.replace(b"J" + struct.pack("<i", small), b"J" + struct.pack("<i", n))
            dst.writestr(info.filename, data)
    return out.getvalue()

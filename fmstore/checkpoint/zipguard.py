"""Checking a ``torch.save`` zip archive before torch reads it.

``torch.load`` trusts the archive's central directory: a member listed many times is read
once per listing, a deflated member is inflated whole before any size is checked (a
262 KB file becomes a 256 MiB tensor), and members may overlap so the same bytes count
many times.  :func:`check_torch_zip` reads only the central directory and one local header
per member (no member data) and refuses, with one :class:`~fmstore.errors.CorruptData`
naming the file and the member:

* anything that is not a zip archive (torch has written zip archives since 1.6; the older
  tar/pickle layout allocates whatever its pickle declares and is not read);
* members that are compressed or encrypted (``torch.save`` stores every member as is), or
  whose declared sizes disagree;
* a member name listed twice, and members whose bytes overlap each other or the central
  directory, or run past the end of the file;
* an archive that is not one ``torch.save`` archive (one top directory holding
  ``data.pkl``);
* an archive with bytes after its end record, or whose central directory does not end
  where the end record (or its zip64 record) begins: Python's ``zipfile`` finds the
  directory at the end record's position less the directory's size, torch's reader at the
  offset the end record declares, so a file with two directories would pass the check
  with one and be read by torch with the other.

A file is opened once (:func:`torch_file`, not following a symbolic link), so nothing can
swap it between the check and the load; a file someone other than a trusted uid could
rewrite in place is first copied into a private file (:mod:`.private`).  The check reads
that descriptor and torch is handed the same open file (``/proc/self/fd/N``, so
``mmap=True`` still works): torch reads the bytes that were checked.

After the check the archive's members are disjoint stored byte ranges of the file, so what
torch reads from it is bounded by the file's size.  It is the same for any ``torch.save``
output: a ``.pt`` file or an item of a native DCP ``.distcp`` file.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import struct
import zipfile
from collections.abc import Callable, Iterator
from typing import IO

from ..errors import CorruptData, NotFound
from .private import stable_fd

__all__ = ["MAX_MEMBERS", "check_torch_zip", "load_refusal", "open_regular", "torch_file"]

#: More members than this is no ``torch.save`` archive (one per storage, plus five).
MAX_MEMBERS = 1 << 20

_LOCAL = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_LOCAL_SIG = b"PK\x03\x04"
_END = struct.Struct("<4s4H2LH")  # signature, disks, counts, dir size, dir offset, comment
_END_SIG = b"PK\x05\x06"
_Z64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk, zip64 end record offset, disks
_Z64_END = struct.Struct("<4sQ2H2L4Q")  # signature, record size, ..., dir size, dir offset


def open_regular(
    path: str | os.PathLike[str], *, name: str | None = None, follow: bool = True
) -> IO[bytes]:
    """``path`` opened for reading, refused (:class:`CorruptData`) unless a regular file:
    ``O_NONBLOCK`` so that a FIFO cannot make the open wait for a writer; with
    ``follow=False`` a symbolic link (as the last component) is refused too."""
    where = name or os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise NotFound(f"{where} does not exist") from None
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise CorruptData(f"{where} is a symbolic link, which is not followed") from None
        raise CorruptData(f"{where} cannot be opened ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CorruptData(f"{where} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


#: Test-only seam: called with the path given to :func:`torch_file` after the check and
#: before the caller's load (a test rewrites the file there).  None outside tests.
after_check: Callable[[str], None] | None = None


@contextlib.contextmanager
def torch_file(path: str | os.PathLike[str], *, name: str | None = None) -> Iterator[str]:
    """A path torch can load (``mmap=True`` included) naming the file ``path`` was when it
    was opened, once, without following a symbolic link, or a private copy of it when
    someone other than a trusted uid could rewrite it (:func:`.private.stable_fd`); checked
    through that descriptor (:func:`check_torch_zip`).  The path is ``/proc/self/fd/N``,
    valid inside the ``with`` block only."""
    where = name or os.fspath(path)
    with open_regular(path, name=where, follow=False) as f, stable_fd(f.fileno(), where) as fd:
        with os.fdopen(fd, "rb", closefd=False) as checked:
            check_torch_zip(checked, name=where)
        if after_check is not None:
            after_check(os.fspath(path))
        yield f"/proc/self/fd/{fd}"


def check_torch_zip(
    src: str | os.PathLike[str] | bytes | bytearray | memoryview | IO[bytes],
    *,
    name: str,
    key: str | None = None,
    tier: str | None = None,
) -> None:
    """Refuse (:class:`CorruptData` naming ``name``) a ``torch.save`` archive whose members
    are not disjoint, stored, uniquely named byte ranges inside it (see the module's
    docstring).  ``src``: a path (opened as a regular file), the archive's bytes, or a
    seekable binary file (its position is restored).  Reads no member data: cost grows
    with the number of members, not their sizes."""
    if isinstance(src, (str, os.PathLike)):
        with open_regular(src, name=name) as f:
            _check(f, name, key, tier)
    elif isinstance(src, (bytes, bytearray, memoryview)):
        _check(io.BytesIO(src), name, key, tier)
    else:
        pos = src.tell()
        try:
            _check(src, name, key, tier)
        finally:
            src.seek(pos)


def _check(f: IO[bytes], name: str, key: str | None, tier: str | None) -> None:
    def bad(why: str) -> CorruptData:
        return CorruptData(
            f"{name} is not a torch.save archive fmstore reads: {why}"[:600], key=key, tier=tier
        )

    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as z:
            infos = z.infolist()
            end = getattr(z, "start_dir", size)
    except Exception as e:  # zipfile raises many kinds on a damaged directory
        raise bad(
            f"not a zip archive ({str(e)[:200] or type(e).__name__}); torch.save's "
            "pre-1.6 layout is not read"
        ) from None
    declared = _declared_directory(f, size, bad)
    if declared != end:
        raise bad(
            f"its end record places the central directory at byte {declared}, but the "
            f"directory before the end record starts at byte {end} (two different directories)"
        )
    if not infos:
        raise bad("an empty zip archive")
    if len(infos) > MAX_MEMBERS:
        raise bad(f"{len(infos)} members, more than the {MAX_MEMBERS} allowed")
    top = infos[0].filename.split("/", 1)[0]
    seen: set[str] = set()
    spans: list[tuple[int, int, str]] = []
    for i in infos:
        member = i.filename
        shown = repr(member[:100])
        if member in seen:
            raise bad(f"member {shown} is listed more than once")
        seen.add(member)
        if member.split("/", 1)[0] != top or "/" not in member:
            raise bad(f"member {shown} is outside the archive's directory {top[:100]!r}")
        if i.compress_type != zipfile.ZIP_STORED:
            raise bad(f"member {shown} is compressed (torch.save stores members as they are)")
        if i.flag_bits & 0x1:
            raise bad(f"member {shown} is encrypted")
        if i.compress_size != i.file_size:
            raise bad(f"member {shown} declares {i.file_size} bytes but stores {i.compress_size}")
        if i.header_offset < 0 or i.header_offset + _LOCAL.size > end:
            raise bad(
                f"member {shown} starts at {i.header_offset}, outside the members' {end} bytes"
            )
        f.seek(i.header_offset)
        head = f.read(_LOCAL.size)
        sig, nlen, xlen = _LOCAL.unpack(head) if len(head) == _LOCAL.size else (b"", 0, 0)
        if sig != _LOCAL_SIG:
            raise bad(f"member {shown} has no local header at {i.header_offset}")
        stop = i.header_offset + _LOCAL.size + nlen + xlen + i.compress_size
        if stop > end:
            raise bad(f"member {shown} runs to byte {stop}, past the members' {end} bytes")
        spans.append((i.header_offset, stop, member))
    if f"{top}/data.pkl" not in seen:
        raise bad(f"no {top[:100]}/data.pkl member")
    spans.sort()
    for (_, stop, a), (start, _, b) in zip(spans, spans[1:]):
        if start < stop:
            raise bad(f"members {a[:100]!r} and {b[:100]!r} overlap")


def _declared_directory(f: IO[bytes], size: int, bad: Callable[[str], CorruptData]) -> int:
    """The central directory's offset as the end record (or its zip64 record) declares it,
    checked to end exactly where that record begins, with nothing after the end record."""
    span = min(size, _END.size + 0xFFFF)
    f.seek(size - span)
    tail = f.read(span)
    at = tail.rfind(_END_SIG)
    if at < 0 or at + _END.size > len(tail):
        raise bad("no end of central directory record")
    _, _, _, _, _, dir_size, dir_at, comment = _END.unpack_from(tail, at)
    record = size - span + at
    after = size - (record + _END.size + comment)
    if after:
        raise bad(
            f"{after} bytes after its end record"
            if after > 0
            else "its end record's comment runs past the end of the file"
        )
    dir_end = record
    if record >= _Z64_LOCATOR.size:
        f.seek(record - _Z64_LOCATOR.size)
        sig, _, z64_at, _ = _Z64_LOCATOR.unpack(f.read(_Z64_LOCATOR.size))
        if sig == b"PK\x06\x07":
            f.seek(z64_at)
            head = f.read(_Z64_END.size)
            if len(head) != _Z64_END.size or head[:4] != b"PK\x06\x06":
                raise bad(f"no zip64 end record at byte {z64_at}")
            fields = _Z64_END.unpack(head)
            if z64_at + 12 + fields[1] != record - _Z64_LOCATOR.size:
                raise bad(f"its zip64 end record at byte {z64_at} does not end at its locator")
            dir_size, dir_at, dir_end = fields[8], fields[9], z64_at
    if dir_at + dir_size != dir_end:
        raise bad(
            f"its end record declares a central directory of {dir_size} bytes at byte "
            f"{dir_at}, which does not end at byte {dir_end} where the end record begins "
            "(torch and zipfile would read two different directories)"
        )
    return int(dir_at)


def load_refusal(e: BaseException, limit: int = 200) -> str:
    """Why ``torch.load(weights_only=True)`` refused, in one line: its message is a page of
    advice whose line about the data (the unpickler's, else the first) is the reason."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    why = next((ln for ln in lines if "Unpickler error" in ln), lines[0] if lines else "")
    return why[:limit] or type(e).__name__

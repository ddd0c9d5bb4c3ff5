"""The resume journal of a copy: which files and which parts of big files are done.

An append-only JSON-lines file in the state directory, one record per line, each line
written with a single ``write`` on an ``O_APPEND`` descriptor, so a process killed at any
moment leaves at most one torn last line, which loading ignores.  Part records are
written before the copy moves on, so a resumed copy never writes a journaled part again;
file records are batched, because a finished file is also recognisable at the
destination by its recorded checksum.

Destinations that cache writes (POSIX) are written without a sync per file; the copy
syncs the destination now and then and brackets each sync with markers: ``{"b": N}``
before it starts, ``{"y": N}`` once it returned.  On load, every record before the
``b`` of the last completed sync describes bytes known to be on stable storage
(:attr:`FileRecord.synced`, :attr:`PendingParts.unsynced`); the rest survived a process
crash but maybe not a power loss, so the copy re-checks them.  A process killed by
``kill -9`` loses nothing: its writes are in the page cache.

Records::

    {"f": DST_KEY, "s": SIZE, "v": SRC_VERSION, "c": CRC_HEX, "d": DST_ETAG}   a file is done
    {"u": DST_KEY, "t": TOKEN, "v": SRC_VERSION, "z": PART_SIZE}                a part write started
    {"p": DST_KEY, "t": TOKEN, "i": INDEX, "c": CRC_HEX, "n": LENGTH}           a part is written
    {"b": N} / {"y": N}                                                        sync N began / ended
    {"to": DST_URL}                                                            where the copy writes

A process holds a shared ``flock`` on the journal while it has it open, so the orphan
sweep (:mod:`fmstore.tiering.policy.sweep`) can tell a copy in progress (whose uploads and temp
files it leaves alone) from one whose process died (:func:`inspect`).

Journals are kept after a run (a re-run then skips finished files without asking the
destination), one per source and destination, so the directory would grow with every new
destination: opening a journal removes the others that no run has used for
:data:`KEEP_DAYS` days (at most once a day).  Losing one costs nothing but that shortcut:
a later run recognises finished files by their recorded checksums at the destination.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from ... import runtime
from ...errors import CorruptData

#: A journal no run has opened for this long is removed (see the module docstring).
KEEP_DAYS = 30
_PRUNED = ".pruned"  # its mtime: when the directory was last pruned


@dataclass
class FileRecord:
    size: int
    version: str | None
    crc: str | None
    dst_etag: str | None
    synced: bool = True  # False: recorded after the last completed sync of the destination


@dataclass
class PendingParts:
    token: str
    version: str | None
    part_size: int
    parts: dict[int, tuple[int, int]] = field(default_factory=dict)  # index -> (crc, length)
    unsynced: set[int] = field(default_factory=set)  # parts recorded after the last sync


class Journal:
    """Open with :meth:`open` (loads what a previous run recorded); :meth:`close` at the end."""

    def __init__(self, path: str | None, *, fsync: bool = False, dest: str | None = None) -> None:
        self.path = path
        self.fsync = fsync
        #: The destination's URL, as recorded (``{"to": ...}``).
        self.dest: str | None = None
        self._dest = dest
        self.files: dict[str, FileRecord] = {}
        self.pending: dict[str, PendingParts] = {}
        self._fd: int | None = None
        self._buffer: list[bytes] = []
        self._lines = 0
        self._syncs = 0

    @staticmethod
    def path_for(state_dir: str, src_url: str, dst_url: str) -> str:
        digest = hashlib.sha256(f"{src_url}\0{dst_url}".encode()).hexdigest()[:24]
        return os.path.join(state_dir, "transfers", f"{digest}.jsonl")

    @classmethod
    async def open(
        cls, path: str | None, *, fsync: bool = False, dest: str | None = None
    ) -> Journal:
        """Load what previous runs recorded and hold the journal (see the module doc);
        ``dest``: the destination's URL, recorded for the orphan sweep."""
        j = cls(path, fsync=fsync, dest=dest)
        if path is not None:
            await runtime.to_io(j._load)
        return j

    def _load(self) -> None:
        assert self.path is not None
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        prune(os.path.dirname(self.path), keep=self.path)
        try:
            with open(self.path, "rb") as f:
                lines = f.read().split(b"\n")
            # In use: not to be pruned, even after a run that appends nothing.
            with contextlib.suppress(OSError):
                os.utime(self.path)
        except FileNotFoundError:
            lines = []
        file_line: dict[str, int] = {}
        part_line: dict[tuple[str, int], int] = {}
        began: dict[int, int] = {}
        cutoff = 0  # records before this line are on stable storage
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a torn last line from a killed run
            why = check_record(rec)
            if why:
                raise CorruptData(
                    f"resume journal {self.path}, line {n + 1} ({line[:100]!r}): {why}; "
                    "remove the file to start the copy afresh"
                )
            if "b" in rec:
                began[rec["b"]] = n
            elif "y" in rec:
                cutoff = max(cutoff, began.get(rec["y"], 0))
                self._syncs = max(self._syncs, int(rec["y"]) + 1)
            elif "f" in rec:
                file_line[rec["f"]] = n
            elif "p" in rec:
                part_line[(rec["p"], int(rec["i"]))] = n
            self._apply(rec)
            self._lines += 1
        for key, rec in self.files.items():
            rec.synced = file_line.get(key, 0) < cutoff
        for key, p in self.pending.items():
            p.unsynced = {i for i in p.parts if part_line.get((key, i), 0) >= cutoff}
        live = len(self.files) + sum(1 + len(p.parts) for p in self.pending.values())
        if self._lines > 2 * live + 1000:
            self._compact()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_SH)  # "in use" for the sweep, until close or death
        if self._dest is not None and self._dest != self.dest:
            self.dest = self._dest
            self._buffer.append(_line({"to": self._dest}))

    def _apply(self, rec: dict) -> None:
        if "f" in rec:
            self.files[rec["f"]] = FileRecord(
                rec.get("s", -1), rec.get("v"), rec.get("c"), rec.get("d")
            )
            self.pending.pop(rec["f"], None)
        elif "u" in rec:
            self.pending[rec["u"]] = PendingParts(rec["t"], rec.get("v"), int(rec["z"]))
            self.files.pop(rec["u"], None)
        elif "p" in rec:
            p = self.pending.get(rec["p"])
            if p is not None and p.token == rec["t"]:
                p.parts[int(rec["i"])] = (int(rec["c"], 16), int(rec["n"]))
        elif "to" in rec:
            self.dest = rec["to"]
        elif "x" in rec:  # forget a key (deleted, or its pending write abandoned)
            self.files.pop(rec["x"], None)
            self.pending.pop(rec["x"], None)

    def _compact(self) -> None:
        assert self.path is not None
        tmp = self.path + ".compact"
        with open(tmp, "wb") as f:
            for line in self._snapshot():
                f.write(line)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._lines = len(self.files)

    def _snapshot(self) -> list[bytes]:
        """The live records: those known durable first, then one completed sync, then the
        rest, so a compacted journal keeps what is known about durability."""
        synced: list[bytes] = []
        rest: list[bytes] = []
        for k, r in self.files.items():
            (synced if r.synced else rest).append(
                _line({"f": k, "s": r.size, "v": r.version, "c": r.crc, "d": r.dst_etag})
            )
        for k, p in self.pending.items():
            synced.append(_line({"u": k, "t": p.token, "v": p.version, "z": p.part_size}))
            for i, (crc, n) in p.parts.items():
                rec = _line({"p": k, "t": p.token, "i": i, "c": f"{crc:08x}", "n": n})
                (rest if i in p.unsynced else synced).append(rec)
        head = [_line({"to": self.dest})] if self.dest is not None else []
        return [*head, *synced, _line({"b": 0}), _line({"y": 0}), *rest]

    # ---- recording ------------------------------------------------------------------

    def file_done(
        self, key: str, size: int, version: str | None, crc: int | None, dst_etag: str | None
    ) -> None:
        """Record a finished file (buffered; :meth:`flush` writes it)."""
        rec = FileRecord(size, version, f"{crc:08x}" if crc is not None else None, dst_etag)
        self.files[key] = rec
        self.pending.pop(key, None)
        self._buffer.append(_line({"f": key, "s": size, "v": version, "c": rec.crc, "d": dst_etag}))

    def forget(self, key: str) -> None:
        if self.files.pop(key, None) is not None or self.pending.pop(key, None) is not None:
            self._buffer.append(_line({"x": key}))

    async def parts_started(
        self, key: str, token: str, version: str | None, part_size: int
    ) -> PendingParts:
        p = PendingParts(token, version, part_size)
        self.pending[key] = p
        self.files.pop(key, None)
        self._buffer.append(_line({"u": key, "t": token, "v": version, "z": part_size}))
        await self.flush()
        return p

    async def part_done(self, key: str, token: str, index: int, crc: int, length: int) -> None:
        p = self.pending.get(key)
        if p is not None and p.token == token:
            p.parts[index] = (crc, length)
        self._buffer.append(
            _line({"p": key, "t": token, "i": index, "c": f"{crc:08x}", "n": length})
        )
        await self.flush()

    async def flush(self) -> None:
        if not self._buffer:
            return
        data, self._buffer = b"".join(self._buffer), []
        if self._fd is not None:
            await runtime.to_io(self._write, data)

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if self.fsync:
            os.fdatasync(self._fd)

    async def synced(self, sync: Callable[[], Awaitable[None]]) -> None:
        """Run ``sync`` (the destination's :meth:`~fmstore.stores.base.Store.sync`) between
        markers, so the next load knows every record written before it is durable."""
        n = self._syncs
        self._syncs += 1
        self._buffer.append(_line({"b": n}))
        await self.flush()
        await sync()
        self._buffer.append(_line({"y": n}))
        await self.flush()

    def flush_sync(self) -> None:
        """Write what is buffered from any thread (used on interruption)."""
        if self._buffer and self._fd is not None:
            data, self._buffer = b"".join(self._buffer), []
            self._write(data)

    async def close(self) -> None:
        await self.flush()
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)


def prune(directory: str, *, keep: str | None = None, now: float | None = None) -> int:
    """Remove the journals in ``directory`` that no run has used for :data:`KEEP_DAYS`
    days (except ``keep``); at most once a day.  Returns how many were removed.

    Housekeeping never fails a run: a journal that cannot be removed (another user's, in
    a shared state directory) is left."""
    now = time.time() if now is None else now
    marker = os.path.join(directory, _PRUNED)
    try:
        if now - os.stat(marker).st_mtime < 86400:
            return 0
    except OSError:
        pass
    cutoff = now - KEEP_DAYS * 86400
    removed = 0
    with contextlib.suppress(OSError), os.scandir(directory) as entries:
        for e in entries:
            if not e.name.endswith((".jsonl", ".compact")) or e.path == keep:
                continue
            with contextlib.suppress(OSError):
                if e.stat().st_mtime < cutoff:
                    os.unlink(e.path)
                    removed += 1
    with contextlib.suppress(OSError):
        with open(marker, "a"):
            pass
        os.utime(marker, (now, now))
    return removed


@dataclass(frozen=True)
class JournalInfo:
    """What the sweep needs of a journal: whether a live process holds it, where its copy
    writes, its upload tokens still pending, and when it was last written."""

    path: str
    live: bool
    dest: str | None
    tokens: frozenset[str]
    mtime: float


def inspect(path: str) -> JournalInfo:
    """Read a journal without holding it (OSError when it cannot be read)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            live = False
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            live = True
        mtime = os.fstat(fd).st_mtime
        with os.fdopen(os.dup(fd), "rb") as f:
            lines = f.read().split(b"\n")
    finally:
        os.close(fd)
    j = Journal(path)
    for line in lines:
        with contextlib.suppress(ValueError, RecursionError):
            rec = json.loads(line) if line.strip() else None
            if rec is not None and not check_record(rec):
                j._apply(rec)
    return JournalInfo(path, live, j.dest, frozenset(p.token for p in j.pending.values()), mtime)


_KINDS = ("b", "y", "f", "u", "p", "to", "x")
_HEX8 = re.compile(r"[0-9a-f]{8}")


def _count(v: object, least: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _str_or_none(v: object) -> bool:
    return v is None or isinstance(v, str)


def check_record(rec: object) -> str:
    """Why ``rec`` (one parsed line) is no journal record, or "" when it is one (records
    of kinds this version does not know are accepted and ignored)."""
    if not isinstance(rec, dict):
        return f"a JSON {type(rec).__name__}, not an object"
    kind = next((k for k in _KINDS if k in rec), None)
    if kind is None:
        return ""
    if kind in ("b", "y"):
        return "" if _count(rec[kind]) else f"{kind!r} is not a sync number"
    if not isinstance(rec[kind], str):
        return f"{kind!r} is not a key"
    if kind == "f":
        ok = (
            _count(rec.get("s", -1), -1)
            and all(_str_or_none(rec.get(k)) for k in ("v", "d", "c"))
            and (rec.get("c") is None or _HEX8.fullmatch(rec["c"]))
        )
        return "" if ok else "a file record with a bad size, version, checksum or etag"
    if kind == "u":
        ok = isinstance(rec.get("t"), str) and rec["t"] and _str_or_none(rec.get("v"))
        ok = ok and _count(rec.get("z"), 1)
        return "" if ok else "a part-write record with a bad token, version or part size"
    if kind == "p":
        ok = isinstance(rec.get("t"), str) and _count(rec.get("i")) and _count(rec.get("n"))
        ok = ok and isinstance(rec.get("c"), str) and _HEX8.fullmatch(rec["c"]) is not None
        return "" if ok else "a part record with a bad token, index, checksum or length"
    return ""


def _line(rec: dict) -> bytes:
    return json.dumps(rec, separators=(",", ":")).encode() + b"\n"


def live_destinations(state_dir: str) -> list[str]:
    """Destinations (URLs) of the copies in progress on this node: the journals in
    ``state_dir`` that a live process holds.  ``fmstore ckpt gc`` keeps what lies under
    them, as the sweep does."""
    journals = read_all(os.path.join(state_dir, "transfers"))
    return [j.dest.rstrip("/") for j in journals if j.live and j.dest]


def read_all(directory: str) -> list[JournalInfo]:
    """Every journal in ``directory`` (a node's ``transfers``), inspected."""
    out = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        if not name.endswith(".jsonl"):
            continue
        try:
            out.append(inspect(os.path.join(directory, name)))
        except OSError:
            continue  # removed meanwhile, or another user's
    return out

"""The tier catalog: which checkpoint (and staged file) is on which tier, in which state.

One SQLite database in WAL mode in the config's ``state_dir``, shared by the training
process and the daemon.  Guarantees:

* every write is one short transaction (``BEGIN IMMEDIATE``; a ``busy_timeout`` makes a
  second process wait for it instead of failing), so several processes can use the catalog
  at once and a crash leaves either the old or the new row, never half of one;
* every write is an idempotent upsert keyed by ``(root, step, tier)``: running a step twice
  gives the same catalog, which is what makes every daemon step safe to repeat after a crash;
* the catalog is a cache of what the tiers hold, never the only truth: a copy is a
  checkpoint because its ``manifest.json`` on the tier was read and validated
  (:meth:`fmstore.tiering.tiers.Tiers.committed_facts`); a rescan reconciles stale rows
  with that (:mod:`fmstore.tiering.inventory.discovery`), and :mod:`fmstore.tiering.exports.mover` re-checks
  the tier before trusting a row for anything destructive.

States of a copy (one row per checkpoint per tier):

``writing``    a save or a copy onto this tier has started and not committed;
``present``    the manifest is on the tier (committed); ``verified`` says when its checksums
               were last checked end to end;
``exporting``  (on the destination tier) a copy is under way; a crash leaves it resumable;
``released``   the copy was dropped because a verified durable copy exists elsewhere;
``deleting``   retention decided to delete it; the manifest goes first, then the blobs;
``deleted``    gone from the tier (kept as history, and so save counts stay stable); a save
               that raised before its commit is ``deleted`` with ``error`` starting
               :data:`SAVE_FAILED` (its blobs removed by the writer): never committed;
``corrupt``    a verify found a bad checksum or a missing blob; never read, re-copied by export;
``missing``    the catalog thought it present but the tier has no manifest;
``superseded`` (on the destination) an export that was pending when a newer checkpoint was
               committed, skipped because the destination's retention would not keep it.

A copy whose export keeps failing stays ``exporting`` with ``failures`` (in a row), ``error``,
``error_at`` and ``failing_since`` (:meth:`Catalog.record_failure`; any other state clears
them), columns of schema 2, to which a schema-1 catalog is migrated when opened.

A catalog that SQLite cannot read is moved aside by :meth:`Catalog.open_or_move_aside`
(``catalog.sqlite3.corrupt-<time>``) so that a new one can be rebuilt from the tiers.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ...errors import ConfigError, CorruptData, StoreUnavailable
from .catalog_schema import SCHEMA, SCHEMA_VERSION, migrate

WRITING = "writing"
PRESENT = "present"
EXPORTING = "exporting"
RELEASED = "released"
DELETING = "deleting"
DELETED = "deleted"
CORRUPT = "corrupt"
MISSING = "missing"
SUPERSEDED = "superseded"
STATES = (
    WRITING,
    PRESENT,
    EXPORTING,
    RELEASED,
    DELETING,
    DELETED,
    CORRUPT,
    MISSING,
    SUPERSEDED,
)
#: The ``error`` of a copy whose save raised before its commit (then ``deleted``).
SAVE_FAILED = "save failed"
#: States in which the tier holds (or may hold) bytes of the copy.
HOLDS_BYTES = (WRITING, PRESENT, EXPORTING, DELETING, CORRUPT)

DB_NAME = "catalog.sqlite3"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as the catalog knows it (independent of tiers).

    ``seq`` is its save ordinal within ``root`` (1, 2, 3…): "export every N saves" counts
    these.  ``manifest_crc32c`` is the CRC32C of its ``manifest.json`` bytes, the same on
    every tier, so a copy whose manifest differs is not the same checkpoint.
    """

    root: str
    step: int
    seq: int
    created: float
    bytes: int
    manifest_crc32c: int | None


@dataclass(frozen=True)
class Copy:
    """One checkpoint's copy on one tier."""

    root: str
    step: int
    tier: str
    state: str
    bytes: int
    created: float
    updated: float
    last_access: float | None
    verified: float | None
    attempts: int = 0
    error: str | None = None
    #: Failed attempts since the copy last succeeded (0: not failing), the time of the
    #: last one and of the first one of this run of failures.
    failures: int = 0
    error_at: float | None = None
    failing_since: float | None = None

    @property
    def never_committed(self) -> bool:
        """A save that raised before its commit: nothing of it is left, and it never was a
        checkpoint (``deleted`` would say someone removed one)."""
        return self.state == DELETED and (self.error or "").startswith(SAVE_FAILED)


@dataclass(frozen=True)
class Pin:
    """A checkpoint that must not be deleted or released until ``expires`` (a restore)."""

    id: int
    root: str
    step: int
    reason: str
    owner: str
    expires: float


@dataclass(frozen=True)
class FileCopy:
    """A staged dataset file on one tier."""

    dataset: str
    key: str
    tier: str
    state: str
    bytes: int
    checksum: str | None
    created: float
    updated: float
    last_access: float | None
    verified: float | None


class Catalog:
    """The catalog database at ``path`` (created on first use).

    Thread-safe: one connection per thread.  Process-safe: SQLite locking in WAL mode with a
    ``busy_timeout``.  ``clock`` is injectable so policies can be tested without waiting.
    """

    def __init__(
        self,
        path: str,
        *,
        busy_timeout: float = 30.0,
        clock: object = None,
    ) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self.busy_timeout = busy_timeout
        self._clock = clock if callable(clock) else time.time
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        d = os.path.dirname(self.path)
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the state directory {d!r}: {e.strerror}") from None
        self._init_schema()

    @classmethod
    def for_state_dir(cls, state_dir: str, **kwargs: object) -> Catalog:
        return cls(os.path.join(state_dir, DB_NAME), **kwargs)  # type: ignore[arg-type]

    @classmethod
    def open_or_move_aside(cls, state_dir: str, **kwargs: object) -> tuple[Catalog, str | None]:
        """The catalog of ``state_dir``; one that is not a readable catalog (a damaged file,
        a foreign file) is renamed to ``catalog.sqlite3.corrupt-<unix time>`` (with its WAL
        and shared-memory files) and a new, empty one is created.  Returns the catalog and
        where the damaged one went (None when it was readable).  Only for a process that
        owns the state directory (the daemon holding the runner lock), and the caller then
        rebuilds the catalog from the tiers."""
        path = os.path.join(state_dir, DB_NAME)
        try:
            return cls(path, **kwargs), None  # type: ignore[arg-type]
        except CorruptData:
            pass
        aside = f"{path}.corrupt-{int(time.time())}"
        n = 0
        while os.path.exists(aside):
            n += 1
            aside = f"{path}.corrupt-{int(time.time())}-{n}"
        os.replace(path, aside)
        for suffix in ("-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.replace(path + suffix, aside + suffix)
        return cls(path, **kwargs), aside  # type: ignore[arg-type]

    def now(self) -> float:
        return float(self._clock())  # type: ignore[operator]

    # ---- connection and transactions -------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        c: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if c is None:
            try:
                c = sqlite3.connect(
                    self.path,
                    timeout=self.busy_timeout,
                    isolation_level=None,
                    check_same_thread=False,
                )
            except sqlite3.Error as e:
                raise StoreUnavailable(f"cannot open the catalog: {e}", key=self.path) from None
            c.row_factory = sqlite3.Row
            try:
                c.execute(f"PRAGMA busy_timeout = {int(self.busy_timeout * 1000)}")
                c.execute("PRAGMA journal_mode = WAL")
                # NORMAL is durable across process crashes in WAL mode; a power loss may drop
                # the last transactions, which the idempotent daemon steps repair from the tiers.
                c.execute("PRAGMA synchronous = NORMAL")
                c.execute("PRAGMA foreign_keys = ON")
            except sqlite3.DatabaseError as e:
                c.close()
                raise self._corrupt(e) from None
            self._local.conn = c
            with self._lock:
                self._conns.append(c)
        return c

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One short write transaction; taken with BEGIN IMMEDIATE so it never upgrades a
        read lock (the classic SQLite deadlock between two writers)."""
        c = self._conn()
        try:
            c.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            raise StoreUnavailable(f"catalog is busy: {e}", key=self.path) from None
        try:
            yield c
        except BaseException:
            c.execute("ROLLBACK")
            raise
        else:
            c.execute("COMMIT")

    def _corrupt(self, e: sqlite3.DatabaseError) -> CorruptData:
        return CorruptData(
            f"catalog {self.path} is not a readable fmstore catalog ({e}); move it aside to "
            "start a new one",
            key=self.path,
        )

    def _init_schema(self) -> None:
        try:
            self._init_tables()
        except sqlite3.DatabaseError as e:
            self.close()
            if isinstance(e, sqlite3.OperationalError) and "locked" in str(e):
                raise StoreUnavailable(f"catalog is busy: {e}", key=self.path) from None
            raise self._corrupt(e) from None
        except BaseException:
            self.close()
            raise

    def _init_tables(self) -> None:
        with self._tx() as c:
            for stmt in SCHEMA.split(";"):
                if stmt.strip():
                    c.execute(stmt)
            row = c.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            version = row[0] if row is not None else None
            if version is not None and not str(version).isdigit():
                raise CorruptData(
                    f"catalog {self.path} has a malformed 'schema' field in its meta table: "
                    f"{version!r}",
                    key=self.path,
                )
            if row is None:
                c.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif int(row[0]) > SCHEMA_VERSION:
                raise ConfigError(
                    f"catalog {self.path!r} has schema {row[0]}, newer than this fmstore's "
                    f"{SCHEMA_VERSION}; upgrade fmstore"
                )
            elif int(row[0]) < SCHEMA_VERSION:
                migrate(c)

    def close(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(sqlite3.Error):
                c.close()
        self._local = threading.local()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- checkpoints -----------------------------------------------------------------

    def record_checkpoint(
        self,
        root: str,
        step: int,
        *,
        bytes: int = 0,
        manifest_crc32c: int | None = None,
        created: float | None = None,
    ) -> Checkpoint:
        """Record that checkpoint ``(root, step)`` exists (idempotent: a second call with the
        same step keeps its ``seq`` and creation time, and fills in bytes / checksum)."""
        now = self.now() if created is None else created
        with self._tx() as c:
            row = c.execute(
                "SELECT * FROM checkpoints WHERE root = ? AND step = ?", (root, step)
            ).fetchone()
            if row is None:
                seq = c.execute(
                    "SELECT COALESCE(MAX(seq), 0) + 1 FROM checkpoints WHERE root = ?", (root,)
                ).fetchone()[0]
                c.execute(
                    "INSERT INTO checkpoints VALUES (?, ?, ?, ?, ?, ?)",
                    (root, step, seq, now, bytes, manifest_crc32c),
                )
            else:
                c.execute(
                    "UPDATE checkpoints SET bytes = CASE WHEN ? > 0 THEN ? ELSE bytes END, "
                    "manifest_crc32c = COALESCE(?, manifest_crc32c) WHERE root = ? AND step = ?",
                    (bytes, bytes, manifest_crc32c, root, step),
                )
            row = c.execute(
                "SELECT * FROM checkpoints WHERE root = ? AND step = ?", (root, step)
            ).fetchone()
        return _ckpt(row)

    def checkpoint(self, root: str, step: int) -> Checkpoint | None:
        row = (
            self._conn()
            .execute("SELECT * FROM checkpoints WHERE root = ? AND step = ?", (root, step))
            .fetchone()
        )
        return _ckpt(row) if row else None

    def checkpoints(self, root: str | None = None) -> list[Checkpoint]:
        """Checkpoints in (root, step) order."""
        if root is None:
            rows = self._conn().execute("SELECT * FROM checkpoints ORDER BY root, step")
        else:
            rows = self._conn().execute(
                "SELECT * FROM checkpoints WHERE root = ? ORDER BY step", (root,)
            )
        return [_ckpt(r) for r in rows.fetchall()]

    def roots(self) -> list[str]:
        rows = self._conn().execute("SELECT DISTINCT root FROM checkpoints ORDER BY root")
        return [r[0] for r in rows.fetchall()]

    def forget_checkpoint(self, root: str, step: int) -> None:
        """Drop a checkpoint and all its copy rows (after every copy is deleted)."""
        with self._tx() as c:
            c.execute("DELETE FROM copies WHERE root = ? AND step = ?", (root, step))
            c.execute("DELETE FROM checkpoints WHERE root = ? AND step = ?", (root, step))

    def forget_copy(self, root: str, step: int, tier: str) -> None:
        """Drop one copy row (a step moved aside there); the checkpoint's row goes with
        its last copy."""
        with self._tx() as c:
            c.execute(
                "DELETE FROM copies WHERE root = ? AND step = ? AND tier = ?", (root, step, tier)
            )
            left = c.execute(
                "SELECT 1 FROM copies WHERE root = ? AND step = ? LIMIT 1", (root, step)
            ).fetchone()
            if left is None:
                c.execute("DELETE FROM checkpoints WHERE root = ? AND step = ?", (root, step))

    # ---- copies ----------------------------------------------------------------------

    def set_copy(
        self,
        root: str,
        step: int,
        tier: str,
        state: str,
        *,
        bytes: int | None = None,
        verified: float | None = None,
        error: str | None = None,
        expect: Iterable[str | None] | None = None,
        count_attempt: bool = False,
    ) -> bool:
        """Upsert the state of ``(root, step)`` on ``tier``.

        ``expect``: only change a row currently in one of these states (a missing row counts
        as state ``None``); returns whether the row was written.  That is how two processes
        racing for the same work agree on one winner.
        """
        if state not in STATES:
            raise ValueError(f"unknown copy state {state!r}")
        now = self.now()
        with self._tx() as c:
            row = c.execute(
                "SELECT state FROM copies WHERE root = ? AND step = ? AND tier = ?",
                (root, step, tier),
            ).fetchone()
            if expect is not None:
                allowed = set(expect)
                current = row[0] if row else None
                if current not in allowed:
                    return False
            if row is None:
                c.execute(
                    "INSERT INTO copies (root, step, tier, state, bytes, created, updated, "
                    "last_access, verified, attempts, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        root,
                        step,
                        tier,
                        state,
                        bytes or 0,
                        now,
                        now,
                        now,
                        verified,
                        1 if count_attempt else 0,
                        error,
                    ),
                )
            else:
                keep = state == EXPORTING and row[0] == EXPORTING
                c.execute(
                    "UPDATE copies SET state = ?, updated = ?, "
                    "bytes = COALESCE(?, bytes), verified = COALESCE(?, verified), "
                    "attempts = attempts + ?, "
                    # a new attempt of a failing export keeps its record until it ends
                    "error = CASE WHEN ? THEN COALESCE(?, error) ELSE ? END, "
                    "failures = CASE WHEN ? THEN failures ELSE 0 END, "
                    "error_at = CASE WHEN ? THEN error_at END, "
                    "failing_since = CASE WHEN ? THEN failing_since END "
                    "WHERE root = ? AND step = ? AND tier = ?",
                    (
                        state,
                        now,
                        bytes,
                        verified,
                        1 if count_attempt else 0,
                        keep,
                        error,
                        error,
                        keep,
                        keep,
                        keep,
                        root,
                        step,
                        tier,
                    ),
                )
        return True

    def record_failure(self, root: str, step: int, tier: str, error: str) -> Copy:
        """Record a failed attempt of the copy onto ``tier`` (it stays ``exporting``,
        resumable): one more failure, the error and its time.  Returns the row."""
        now = self.now()
        with self._tx() as c:
            c.execute(
                "INSERT INTO copies (root, step, tier, state, created, updated, last_access, "
                "error, failures, error_at, failing_since) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1, ?, ?) "
                "ON CONFLICT (root, step, tier) DO UPDATE SET state = excluded.state, "
                "updated = excluded.updated, error = excluded.error, "
                "failures = copies.failures + 1, error_at = excluded.error_at, "
                "failing_since = COALESCE(copies.failing_since, excluded.failing_since)",
                (root, step, tier, EXPORTING, now, now, now, error, now, now),
            )
            row = c.execute(
                "SELECT * FROM copies WHERE root = ? AND step = ? AND tier = ?", (root, step, tier)
            ).fetchone()
        return _copy(row)

    def failing(self, root: str | None = None) -> list[Copy]:
        """Copies whose export is failing (oldest failure first)."""
        sql, args = "SELECT * FROM copies WHERE state = ? AND failures > 0", [EXPORTING]
        if root is not None:
            sql += " AND root = ?"
            args.append(root)
        rows = self._conn().execute(sql + " ORDER BY failing_since, root, step, tier", args)
        return [_copy(r) for r in rows.fetchall()]

    def touch(self, root: str, step: int, tier: str) -> None:
        """Record a read of the copy (release-by-age counts from the last access)."""
        with self._tx() as c:
            c.execute(
                "UPDATE copies SET last_access = ? WHERE root = ? AND step = ? AND tier = ?",
                (self.now(), root, step, tier),
            )

    def copy(self, root: str, step: int, tier: str) -> Copy | None:
        row = (
            self._conn()
            .execute(
                "SELECT * FROM copies WHERE root = ? AND step = ? AND tier = ?", (root, step, tier)
            )
            .fetchone()
        )
        return _copy(row) if row else None

    def copies(
        self,
        root: str | None = None,
        *,
        step: int | None = None,
        tier: str | None = None,
        states: Iterable[str] | None = None,
    ) -> list[Copy]:
        """Copies matching the filters, in (root, step, tier) order."""
        where, args = [], []
        for col, val in (("root", root), ("step", step), ("tier", tier)):
            if val is not None:
                where.append(f"{col} = ?")
                args.append(val)
        if states is not None:
            st = list(states)
            where.append(f"state IN ({','.join('?' * len(st))})")
            args.extend(st)
        sql = "SELECT * FROM copies"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY root, step, tier"
        return [_copy(r) for r in self._conn().execute(sql, args).fetchall()]

    def tier_bytes(self) -> dict[str, int]:
        """Bytes held per tier, over copies that hold bytes."""
        q = (
            "SELECT tier, COALESCE(SUM(bytes), 0) FROM copies WHERE state IN "
            f"({','.join('?' * len(HOLDS_BYTES))}) GROUP BY tier"
        )
        return {r[0]: int(r[1]) for r in self._conn().execute(q, HOLDS_BYTES).fetchall()}

    # ---- pins ------------------------------------------------------------------------

    def pin(self, root: str, step: int, *, reason: str, owner: str, ttl: float) -> int:
        """Protect a checkpoint from deletion and release for ``ttl`` seconds (a restore in
        progress); the expiry means a crashed reader never pins it forever."""
        with self._tx() as c:
            cur = c.execute(
                "INSERT INTO pins (root, step, reason, owner, expires) VALUES (?, ?, ?, ?, ?)",
                (root, step, reason, owner, self.now() + ttl),
            )
            return int(cur.lastrowid or 0)

    def unpin(self, pin_id: int) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM pins WHERE id = ?", (pin_id,))

    def pins(self) -> list[Pin]:
        """Live pins (expired ones are dropped on the way)."""
        now = self.now()
        with self._tx() as c:
            c.execute("DELETE FROM pins WHERE expires < ?", (now,))
            rows = c.execute("SELECT * FROM pins ORDER BY id").fetchall()
        return [
            Pin(r["id"], r["root"], r["step"], r["reason"], r["owner"], r["expires"]) for r in rows
        ]

    # ---- staged dataset files --------------------------------------------------------

    def set_file(
        self,
        dataset: str,
        key: str,
        tier: str,
        state: str,
        *,
        bytes: int | None = None,
        checksum: str | None = None,
        verified: float | None = None,
    ) -> None:
        """Upsert one staged file's state on one tier (idempotent)."""
        if state not in STATES:
            raise ValueError(f"unknown file state {state!r}")
        now = self.now()
        with self._tx() as c:
            c.execute(
                "INSERT INTO files (dataset, key, tier, state, bytes, checksum, created, updated, "
                "last_access, verified) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (dataset, key, tier) DO UPDATE SET state = excluded.state, "
                "updated = excluded.updated, bytes = COALESCE(?, files.bytes), "
                "checksum = COALESCE(excluded.checksum, files.checksum), "
                "verified = COALESCE(excluded.verified, files.verified)",
                (dataset, key, tier, state, bytes or 0, checksum, now, now, now, verified, bytes),
            )

    def files(self, dataset: str, *, tier: str | None = None) -> list[FileCopy]:
        sql, args = "SELECT * FROM files WHERE dataset = ?", [dataset]
        if tier is not None:
            sql += " AND tier = ?"
            args.append(tier)
        rows = self._conn().execute(sql + " ORDER BY key, tier", args).fetchall()
        return [
            FileCopy(
                r["dataset"],
                r["key"],
                r["tier"],
                r["state"],
                r["bytes"],
                r["checksum"],
                r["created"],
                r["updated"],
                r["last_access"],
                r["verified"],
            )
            for r in rows
        ]


def _ckpt(r: sqlite3.Row) -> Checkpoint:
    return Checkpoint(
        r["root"], r["step"], r["seq"], r["created"], r["bytes"], r["manifest_crc32c"]
    )


def _copy(r: sqlite3.Row) -> Copy:
    return Copy(
        r["root"],
        r["step"],
        r["tier"],
        r["state"],
        r["bytes"],
        r["created"],
        r["updated"],
        r["last_access"],
        r["verified"],
        r["attempts"],
        r["error"],
        r["failures"],
        r["error_at"],
        r["failing_since"],
    )

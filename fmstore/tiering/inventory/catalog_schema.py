"""The catalog's SQLite schema (:mod:`.catalog`), and its migration from older versions."""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 2

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    root TEXT NOT NULL,
    step INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    created REAL NOT NULL,
    bytes INTEGER NOT NULL DEFAULT 0,
    manifest_crc32c INTEGER,
    PRIMARY KEY (root, step)
);
CREATE TABLE IF NOT EXISTS copies (
    root TEXT NOT NULL,
    step INTEGER NOT NULL,
    tier TEXT NOT NULL,
    state TEXT NOT NULL,
    bytes INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    last_access REAL,
    verified REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    failures INTEGER NOT NULL DEFAULT 0,
    error_at REAL,
    failing_since REAL,
    PRIMARY KEY (root, step, tier)
);
CREATE INDEX IF NOT EXISTS copies_by_tier ON copies (tier, state);
CREATE TABLE IF NOT EXISTS pins (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    root TEXT NOT NULL,
    step INTEGER NOT NULL,
    reason TEXT NOT NULL,
    owner TEXT NOT NULL,
    expires REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS files (
    dataset TEXT NOT NULL,
    key TEXT NOT NULL,
    tier TEXT NOT NULL,
    state TEXT NOT NULL,
    bytes INTEGER NOT NULL DEFAULT 0,
    checksum TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    last_access REAL,
    verified REAL,
    PRIMARY KEY (dataset, key, tier)
);
"""


#: Columns added after schema 1, with their declarations (added by :func:`migrate`).
_ADDED_COLUMNS = {
    "failures": "INTEGER NOT NULL DEFAULT 0",
    "error_at": "REAL",
    "failing_since": "REAL",
}


def migrate(c: sqlite3.Connection) -> None:
    """Schema 1 -> 2 in the caller's transaction: the failure columns of ``copies``."""
    have = {r[1] for r in c.execute("PRAGMA table_info(copies)").fetchall()}
    for name, decl in _ADDED_COLUMNS.items():
        if name not in have:
            c.execute(f"ALTER TABLE copies ADD COLUMN {name} {decl}")
    c.execute("UPDATE meta SET value = ? WHERE key = 'schema'", (str(SCHEMA_VERSION),))

"""One error hierarchy, named by meaning.

Backends translate SDK and OS errors at their edge into these classes, so callers never see
a botocore ``ClientError`` or a bare ``OSError``.  Each error carries the tier and key it is
about.  Where a built-in exception means the same thing the class subclasses it too
(``NotFound`` is a ``FileNotFoundError``), so ``except FileNotFoundError`` keeps working.
"""

from __future__ import annotations


class FmstoreError(Exception):
    """Base class of every error fmstore raises on purpose."""

    def __init__(self, message: str, *, tier: str | None = None, key: str | None = None) -> None:
        self.message = message
        self.tier = tier
        self.key = key
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.tier:
            where.append(f"tier {self.tier}")
        if self.key is not None:
            where.append(f"key {self.key!r}")
        return f"{self.message} ({', '.join(where)})" if where else self.message

    def __str__(self) -> str:
        return self._render()

    def __reduce__(self):  # keep tier/key across pickling (DataLoader workers, process pools)
        return (_rebuild, (type(self), self.message, self.tier, self.key))


def _rebuild(cls: type[FmstoreError], message: str, tier: str | None, key: str | None):
    return cls(message, tier=tier, key=key)


class NotFound(FmstoreError, FileNotFoundError):
    """The object, checkpoint, bucket or dataset does not exist."""


class AlreadyExists(FmstoreError, FileExistsError):
    """A create-only write found the key already present."""


class PreconditionFailed(FmstoreError):
    """A conditional write (``if_match``) lost to a concurrent writer."""


class InvalidKey(FmstoreError, ValueError):
    """A key that could escape its tier's root or that no backend can store."""


class InvalidRange(FmstoreError, ValueError):
    """A byte range outside the object."""


class CorruptData(FmstoreError):
    """Bytes that fail their checksum, or a file that does not parse."""


class VersionError(CorruptData):
    """Data written by a newer format version than this fmstore understands."""


class ConfigError(FmstoreError, ValueError):
    """Invalid configuration: the message names the key and the reason."""


class StoreUnavailable(FmstoreError, ConnectionError):
    """The store could not be reached or kept failing after retries."""


class TierFull(FmstoreError, OSError):
    """No space left on the tier (ENOSPC, EDQUOT, a file-size limit)."""


class PermissionDenied(FmstoreError, PermissionError):
    """The caller may not read or write here (EACCES, S3 AccessDenied, bad credentials)."""


class NotSupported(FmstoreError):
    """The backend cannot do this (for example a conditional put on a store without one)."""

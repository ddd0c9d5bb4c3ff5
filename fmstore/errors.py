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


#: Longest part of an error's own text that :func:`describe_error` keeps.
_EXCERPT = 200


def describe_error(e: BaseException) -> str:
    """A short description of an exception raised while decoding data read from outside:
    its type and where in the input it arose, at most a bounded excerpt of its text.

    Never ``repr(e)`` nor ``str(e)`` of the whole: a ``UnicodeDecodeError`` holds all the
    bytes it was decoding (its repr costs about four characters a byte: a 4 GiB sparse
    "manifest" took root's ``gc`` past the machine's memory), and ``float(s)`` raises a
    ``ValueError`` quoting all of ``s``."""
    import json

    if isinstance(e, UnicodeDecodeError):
        return f"not {e.encoding} text: {str(e.reason)[:80]} at byte {e.start}"
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg[:80]} at line {e.lineno} column {e.colno} (char {e.pos})"
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, FmstoreError):
        return _excerpt(e.message)
    args = ", ".join(_excerpt(a) for a in e.args[:3])
    return f"{type(e).__name__}: {args}" if args else type(e).__name__


def _excerpt(a: object) -> str:
    """``a`` (an exception argument) cut short before it is formatted whole."""
    if isinstance(a, str):
        return a[:_EXCERPT] + ("..." if len(a) > _EXCERPT else "")
    return short_repr(a, 40)


def short_repr(v: object, limit: int = 80) -> str:
    """A repr of a value read from outside, for a message: strings and bytes cut to
    ``limit`` before they are formatted (``f"{v!r:.80}"`` formats all of ``v`` first),
    containers by their length, big ints by their size."""
    if isinstance(v, (str, bytes, bytearray, memoryview)):
        return repr(v[:limit] if isinstance(v, str) else bytes(v[:limit])) + (
            "..." if len(v) > limit else ""
        )
    if isinstance(v, bool) or v is None or isinstance(v, float):
        return repr(v)
    if isinstance(v, int):
        return repr(v) if v.bit_length() <= 128 else f"<an int of {v.bit_length()} bits>"
    if isinstance(v, (list, tuple, dict, set, frozenset)):
        return f"<a {type(v).__name__} of {len(v)}>"
    return f"<{type(v).__name__[:60]}>"

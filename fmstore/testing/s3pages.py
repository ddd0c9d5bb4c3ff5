"""Hostile S3 listing pages, answered by :class:`~.faultproxy.FaultProxy` (``answer`` rules).

:class:`HostilePages` answers whichever listing it is asked for (ListObjectsV2,
ListMultipartUploads, ListParts, GetObjectAttributes' ``ObjectParts``) with a page that
says ``IsTruncated=true``, in one of these :data:`MODES`:

* ``same``: the same continuation token (or marker) on every page;
* ``cycle``: two markers, taken in turn;
* ``replay``: a fresh marker on every page, with the same entries again;
* ``empty``: a fresh marker on every page and no entries;
* ``no_marker``: truncated, without any marker for the next page;
* ``endless``: fresh markers and fresh entries, further on each page, for ever (a listing
  that is long, not broken: only a bound ends it).

The proxy's request log (``seen``) counts the pages a client asked for.
"""

from __future__ import annotations

import itertools
import threading
import urllib.parse
from xml.sax.saxutils import escape

MODES = ("same", "cycle", "replay", "empty", "no_marker", "endless")

_NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
_WHEN = "2026-01-01T00:00:00.000Z"


class HostilePages:
    """An ``answer`` callable for a fault-proxy rule: ``Rule("answer", answer=pages)``.

    ``etag``: the ETag GetObjectAttributes answers with (a reader drops the listing when
    it does not match the object's HEAD)."""

    def __init__(self, mode: str, *, etag: str = "etag") -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.mode = mode
        self.etag = etag
        self._count = itertools.count(1)
        self._lock = threading.Lock()

    def _n(self) -> int:
        with self._lock:
            return next(self._count)

    def marker(self, n: int) -> str | None:
        """The marker of the page after page ``n`` (None: none given)."""
        if self.mode == "same":
            return "1"
        if self.mode == "cycle":
            return str(1 + n % 2)
        if self.mode == "no_marker":
            return None
        return str(n)

    def entries(self, n: int) -> int:
        """The entry number page ``n`` holds (None-like 0: no entries)."""
        if self.mode == "empty":
            return 0
        return n if self.mode == "endless" else 1

    def __call__(self, method: str, path: str) -> bytes:
        url = urllib.parse.urlsplit(path)
        q = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        n = self._n()
        if "list-type" in q:
            return self._objects(q.get("prefix", [""])[0], n)
        if "uploads" in q:
            return self._uploads(q.get("prefix", [""])[0], n)
        if "attributes" in q:
            return self._attributes(n)
        return self._parts(n)

    def _objects(self, prefix: str, n: int) -> bytes:
        e, m = self.entries(n), self.marker(n)
        body = (
            f"<Contents><Key>{escape(prefix)}k{e:012d}</Key><LastModified>{_WHEN}</LastModified>"
            f'<ETag>"e"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>'
            if e
            else ""
        )
        token = f"<NextContinuationToken>t{m}</NextContinuationToken>" if m else ""
        return _doc(
            "ListBucketResult",
            f"<Name>b</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{int(bool(e))}</KeyCount>"
            f"<MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>{body}{token}",
        )

    def _uploads(self, prefix: str, n: int) -> bytes:
        e, m = self.entries(n), self.marker(n)
        # Keys outside the listed prefix: a client lists their parts only for its own.
        body = (
            f"<Upload><Key>elsewhere/k{e:012d}</Key><UploadId>u{e}</UploadId>"
            f"<Initiated>{_WHEN}</Initiated></Upload>"
            if e
            else ""
        )
        markers = (
            f"<NextKeyMarker>k{m}</NextKeyMarker><NextUploadIdMarker>u{m}</NextUploadIdMarker>"
            if m
            else ""
        )
        return _doc(
            "ListMultipartUploadsResult",
            f"<Bucket>b</Bucket><Prefix>{escape(prefix)}</Prefix>{markers}"
            f"<MaxUploads>1000</MaxUploads><IsTruncated>true</IsTruncated>{body}",
        )

    def _part_list(self, n: int, tag: str) -> str:
        e, m = self.entries(n), self.marker(n)
        part = (
            f"<{tag}><PartNumber>{e}</PartNumber><LastModified>{_WHEN}</LastModified>"
            f'<ETag>"e"</ETag><ChecksumCRC32C>AAAAAA==</ChecksumCRC32C><Size>1</Size></{tag}>'
            if e
            else ""
        )
        marker = f"<NextPartNumberMarker>{m}</NextPartNumberMarker>" if m else ""
        return f"<MaxParts>1000</MaxParts><IsTruncated>true</IsTruncated>{marker}{part}"

    def _parts(self, n: int) -> bytes:
        return _doc(
            "ListPartsResult",
            "<Bucket>b</Bucket><Key>k</Key><UploadId>u</UploadId>" + self._part_list(n, "Part"),
        )

    def _attributes(self, n: int) -> bytes:
        return _doc(
            "GetObjectAttributesResponse",
            f"<ETag>{escape(self.etag)}</ETag><ObjectParts><PartsCount>10000</PartsCount>"
            + self._part_list(n, "Part")
            + "</ObjectParts>",
        )


def _doc(root: str, inner: str) -> bytes:
    return f'<?xml version="1.0" encoding="UTF-8"?>\n<{root} {_NS}>{inner}</{root}>'.encode()

"""Guards for S3's paginated answers: a server that pages forever must not hold us forever.

Every loop that follows ``IsTruncated`` (objects, multipart uploads, an upload's parts, an
object's parts) asks a :class:`Pages` guard before it requests the next page.  The guard
refuses a page marker (continuation token, key/upload-id marker, part-number marker) it has
seen before, a truncated page without a marker, and more pages than the listing can hold;
a listing of keys also refuses a page whose entries are those of a recent page again (fresh
markers over the same page).  Keys are not required to move forward page by page: AWS lists
in UTF-8 order, but SeaweedFS (and other servers walking a directory tree) list ``a/b``
before ``a.x``.
Each refusal is a :class:`~fmstore.errors.CorruptData` naming the tier, the listing and the
page, and ends the loop before any more memory or time goes into it.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Hashable

from ...errors import CorruptData

#: S3 numbers parts 1..10,000: no part listing can have more pages than that.
MAX_PART_PAGES = 10_000
#: Pages of a multipart-upload listing (1,000 uploads each): far past any real bucket.
MAX_UPLOAD_PAGES = 100_000
#: Truncated pages in a row that bring nothing: a real server may send an empty page now
#: and then (over keys it skipped), not a thousand in a row.
MAX_EMPTY_PAGES = 1_000
#: Pages of a bucket listing: 10 billion keys at 1,000 a page.  A server that invents
#: fresh keys for ever looks like a big bucket until then; the caller's own limits (what it
#: keeps of the listing) apply first.
MAX_LIST_PAGES = 10_000_000
#: Markers (and pages of keys, by digest) remembered when a listing may be longer than
#: :data:`MAX_UPLOAD_PAGES`: a longer cycle runs into :data:`MAX_LIST_PAGES`.
RECENT_MARKERS = 1_024


class Pages:
    """One paginated listing's guard.

    ``max_pages``: the most pages the listing can have.  Past :data:`MAX_UPLOAD_PAGES`
    (a bucket's objects) only the last :data:`RECENT_MARKERS` markers are remembered.
    :meth:`entries` takes each page's keys where a listing's keys are unique."""

    def __init__(self, what: str, *, tier: str | None, key: str | None, max_pages: int) -> None:
        self.what = what
        self.tier = tier
        self.key = key
        self.max_pages = max_pages
        self.pages = 1
        self.empty = 0
        self._seen: set[Hashable] = set()
        self._recent: deque[Hashable] = deque()
        self._pages: set[bytes] = set()
        self._page_order: deque[bytes] = deque()
        self._part = 0

    def _fail(self, why: str, *, paging: bool = True) -> CorruptData:
        broken = "its pagination is broken, " if paging else ""
        return CorruptData(
            f"the server's {self.what} listing {why} (page {self.pages}); "
            f"{broken}the listing was stopped",
            tier=self.tier,
            key=self.key,
        )

    def next(self, marker: Hashable, *, entries: int | None = None) -> None:
        """Before asking for the page after ``marker``; ``entries``: how many the page
        just read held (pages in a row with none are bounded)."""
        if marker is None or marker == "":
            raise self._fail("said it goes on but gave no marker for the next page")
        if marker in self._seen:
            raise self._fail(f"repeated its page marker {str(marker)[:80]!r}")
        if self.pages >= self.max_pages:
            raise self._fail(f"ran past {self.max_pages} pages")
        if entries is not None:
            self.empty = 0 if entries else self.empty + 1
            if self.empty >= MAX_EMPTY_PAGES:
                raise self._fail(f"gave {self.empty} empty pages in a row")
        self._seen.add(marker)
        if self.max_pages > MAX_UPLOAD_PAGES:
            self._recent.append(marker)
            if len(self._recent) > RECENT_MARKERS:
                self._seen.discard(self._recent.popleft())
        self.pages += 1

    def next_part(self, value: object) -> int:
        """:meth:`next` for a part listing: ``NextPartNumberMarker`` as a part number, past
        the previous page's and within S3's 10,000."""
        try:
            n = int(str(value)) if value is not None else None
        except ValueError:
            n = -1
        if n is not None and not self._part < n <= self.max_pages:
            raise self._fail(f"gave part number marker {str(value)[:80]!r} after {self._part}")
        self.next(n)
        assert n is not None
        self._part = n
        return n

    def under(self, keys: list[str], prefix: str) -> None:
        """Every key of a page lies under the listed prefix, as S3 promises: one that does
        not would be taken for another key of ours (and, say, deleted)."""
        for k in keys:
            if not isinstance(k, str) or not k.startswith(prefix):
                why = f"gave key {str(k)[:80]!r} outside the prefix {prefix[:80]!r}"
                raise self._fail(why, paging=False)

    def entries(self, keys: list[str]) -> None:
        """A page of a listing whose keys are unique: the same entries as one of the last
        :data:`RECENT_MARKERS` pages means the server is answering that page again."""
        if not keys:
            return
        digest = hashlib.blake2b(
            "\0".join(sorted(keys)).encode("utf-8", "surrogatepass"), digest_size=16
        ).digest()
        if digest in self._pages:
            raise self._fail(f"answered the entries of an earlier page again ({keys[0][:80]!r}...)")
        self._pages.add(digest)
        self._page_order.append(digest)
        if len(self._page_order) > RECENT_MARKERS:
            self._pages.discard(self._page_order.popleft())

"""Fuzzing S3 listing pages: repeated tokens, pages answered again, empty pages, truncated
pages without a token, and pages that never end.

Each example scripts a listing (a few pages of keys, each truncated or not, with a token
drawn from a small set so that repeats are common) and how it goes on after the script:
it stops, repeats its last page, or runs on for ever with fresh tokens (with fresh keys, or
empty).  The fault proxy answers the object listing (lean transport) or the multipart-upload
listing (botocore) from the script, with no server behind it.  Whatever the pages say, the
listing ends with the right keys or an fmstore error, within a bounded number of pages,
bounded time and bounded memory; a well-formed script (distinct tokens, each key once, an
end) is listed whole.  ``FMSTORE_FUZZ_EXAMPLES`` raises the number of examples.
"""

from __future__ import annotations

import os
import threading
import tracemalloc
import urllib.parse
from dataclasses import dataclass
from xml.sax.saxutils import escape

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fmstore import runtime
from fmstore.errors import FmstoreError
from fmstore.stores import open_store
from fmstore.stores.s3 import pages
from fmstore.testing.faultproxy import FaultProxy, Rule
from fmstore.testing.seaweed import free_ports

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(600)]

EXAMPLES = int(os.environ.get("FMSTORE_FUZZ_EXAMPLES", "15"))
#: The guards' bounds during the fuzz (the real ones are reached the same way, later).
MAX_PAGES = 32
MAX_EMPTY = 16
#: Most memory one listing may take (its pages are a few hundred bytes each).
MEMORY_BOUND = 8 << 20
#: A key the server lists outside the prefix it was asked for.
OUTSIDE = "!outside"
KEYS = ["a", "b", "b/c", "c", "d~", "é", "z", OUTSIDE]
TOKENS = ["t1", "t2", "t3", "", " ", "t1 ", "%2F", "<", "\u00e9"]
_NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


@dataclass(frozen=True)
class Page:
    keys: tuple[str, ...]
    truncated: bool
    token: str | None


@st.composite
def scripts(draw: st.DrawFn) -> tuple[list[Page], str]:
    n = draw(st.integers(1, 6))
    out = []
    for _ in range(n):
        keys = draw(st.lists(st.sampled_from(KEYS), max_size=3))
        if draw(st.booleans()):
            keys = sorted(set(keys), key=lambda k: k.encode())
        token = draw(st.none() | st.sampled_from(TOKENS))
        out.append(Page(tuple(keys), draw(st.booleans()), token))
    return out, draw(st.sampled_from(["stop", "repeat", "fresh_keys", "fresh_empty"]))


def well_formed(script: list[Page], tail: str, uploads: bool) -> list[str] | None:
    """The keys a correct client lists (pages in turn, objects of a page in UTF-8 order,
    uploads as listed), or None where the script is broken (a key twice, a token twice or
    missing, no end, an object outside the prefix; an upload outside it is passed over)."""
    keys: list[str] = []
    seen: set[str] = set()
    for page in script:
        if set(page.keys) & set(keys) or len(set(page.keys)) != len(page.keys):
            return None
        if OUTSIDE in page.keys and not uploads:
            return None
        listed = [k for k in page.keys if k != OUTSIDE]
        keys += listed if uploads else sorted(listed, key=lambda k: k.encode())
        if not page.truncated:
            return keys
        if not page.token or page.token in seen:
            return None
        seen.add(page.token)
    return None if tail != "stop" else keys


class Script:
    """The answers of one example, page by page, for the proxy's ``answer`` rule."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.set([], "stop")

    def set(self, script: list[Page], tail: str) -> None:
        with self.lock:
            self.script, self.tail, self.asked = script, tail, 0

    def page(self, n: int) -> Page:
        if n < len(self.script):
            return self.script[n]
        if self.tail == "stop":
            return Page((), False, None)
        if self.tail == "repeat" and self.script:
            last = self.script[-1]
            return Page(last.keys, True, last.token)
        fresh = (f"~{n:08d}",) if self.tail == "fresh_keys" else ()
        return Page(fresh, True, f"f{n}")

    def __call__(self, method: str, path: str) -> bytes:
        q = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query, keep_blank_values=True)
        prefix = q.get("prefix", [""])[0]
        if "uploadId" in q:  # the parts of a listed upload: none
            return _doc("ListPartsResult", "<IsTruncated>false</IsTruncated>")
        with self.lock:
            n, self.asked = self.asked, self.asked + 1
            p = self.page(n)
        more = f"<IsTruncated>{'true' if p.truncated else 'false'}</IsTruncated>"
        if "uploads" in q:
            rows = "".join(
                f"<Upload><Key>{escape(_full(prefix, k))}</Key><UploadId>u{i}</UploadId>"
                f"<Initiated>2026-01-01T00:00:00.000Z</Initiated></Upload>"
                for i, k in enumerate(p.keys)
            )
            marker = (
                f"<NextKeyMarker>{escape(p.token)}</NextKeyMarker>"
                f"<NextUploadIdMarker>u</NextUploadIdMarker>"
                if p.token is not None
                else ""
            )
            return _doc("ListMultipartUploadsResult", f"<Bucket>bkt</Bucket>{marker}{more}{rows}")
        rows = "".join(
            f'<Contents><Key>{escape(_full(prefix, k))}</Key><Size>1</Size><ETag>"e"</ETag>'
            "<LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>"
            for k in p.keys
        )
        token = (
            f"<NextContinuationToken>{escape(p.token)}</NextContinuationToken>"
            if p.token is not None
            else ""
        )
        return _doc("ListBucketResult", f"<Name>bkt</Name>{more}{rows}{token}")


def _full(prefix: str, key: str) -> str:
    return "root/other/x" if key == OUTSIDE else prefix + key


def _doc(root: str, inner: str) -> bytes:
    return f'<?xml version="1.0" encoding="UTF-8"?>\n<{root} {_NS}>{inner}</{root}>'.encode()


@pytest.fixture(scope="module")
def rig():
    (dead,) = free_ports(1)
    script = Script()
    with pytest.MonkeyPatch.context() as mp, FaultProxy(f"http://127.0.0.1:{dead}") as proxy:
        mp.setattr(pages, "MAX_LIST_PAGES", MAX_PAGES)
        mp.setattr(pages, "MAX_UPLOAD_PAGES", MAX_PAGES)
        mp.setattr(pages, "MAX_EMPTY_PAGES", MAX_EMPTY)
        proxy.set_plan([Rule("answer", answer=script)])
        store = open_store(
            "s3://bkt/root",
            tier="fuzz",
            metered=False,
            endpoint_url=proxy.endpoint_url,
            access_key="k",
            secret_key="s",
            region="us-east-1",
            addressing_style="path",
            max_attempts=1,
        )
        # Both clients built before any example measures memory (botocore's takes ~30 MB).
        runtime.run(_objects(store), timeout=60)
        runtime.run(_uploads(store), timeout=60)
        yield store, script
        runtime.run(store.close(), timeout=30)


async def _objects(store) -> list[str]:
    return [m.key async for m in store.list("d")]


async def _uploads(store) -> list[str]:
    return [u.key for u in await store.leftovers("d")]


@settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=scripts(), uploads=st.booleans())
def test_any_listing_ends_with_its_keys_or_an_fmstore_error_in_bounded_pages(rig, case, uploads):
    store, script = rig
    pages_, tail = case
    script.set(pages_, tail)
    tracemalloc.start()
    try:
        try:
            got: list[str] | FmstoreError = runtime.run(
                _uploads(store) if uploads else _objects(store), timeout=60
            )
        except FmstoreError as e:
            got = e
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND, peak
    # Never more pages than the bounds allow (+1 for the page that trips a guard).
    assert script.asked <= max(MAX_PAGES, MAX_EMPTY) + 1, script.asked
    want = well_formed(pages_, tail, uploads)
    if isinstance(got, FmstoreError):
        assert got.tier == "fuzz"
        assert want is None, f"a well-formed listing was refused: {got!r}"
        return
    assert all(k.startswith("d/") for k in got)  # nothing outside the listed prefix
    if want is not None:
        assert got == [f"d/{k}" for k in want]

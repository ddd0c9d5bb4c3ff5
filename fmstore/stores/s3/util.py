"""Small helpers every part of the S3 backend uses: CRC32C on or off the event loop,
joining a read's pieces, ETag quoting, and gathering that cancels the rest on failure."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Iterable
from typing import TypeVar

import crc32c as _crc32c

from ... import runtime
from ..base import Buffer, Pieces, nbytes
from ..crc import crc32c_of
from .options import INLINE_BYTES

T = TypeVar("T")


def crc32c(data: Buffer, value: int = 0) -> int:
    return int(_crc32c.crc32c(data, value))


async def crc_off_loop(data: Buffer | Pieces) -> int:
    """CRC32C of ``data`` (a buffer or pieces): inline when small (the hand-off to the CPU
    pool and back costs more than the CRC of a few hundred KiB), else in the CPU pool, off
    the event loop."""
    if nbytes(data) <= INLINE_BYTES:
        return crc32c_of(data)
    return await runtime.to_cpu(crc32c_of, data)


async def join(pieces: list[Buffer]) -> bytes:
    """The pieces of a read as one ``bytes``: a single piece as it is, small reads joined
    inline, big ones in the CPU pool."""
    if len(pieces) == 1 and isinstance(pieces[0], bytes):
        return pieces[0]
    if nbytes(pieces) <= INLINE_BYTES:
        return b"".join(pieces)
    return await runtime.to_cpu(b"".join, pieces)


def b64(n: int) -> str:
    return base64.b64encode(n.to_bytes(4, "big")).decode()


def quote(etag: str) -> str:
    return etag if etag.startswith('"') else f'"{etag}"'


def unquote(etag: str | None) -> str | None:
    return etag.strip('"') if etag else etag


async def all_or_cancel(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Like ``gather`` but the first failure cancels (and awaits) the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return []
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        if pending:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

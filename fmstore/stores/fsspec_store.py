"""Any other fsspec URL (``memory://``, ``gs://``, ``az://``, ``hf://``…) as a Store.

fsspec's sync API is called in the runtime's I/O pool.  Object-store protocols publish a
whole object per write already; for the others a write goes to a hidden temp key first and
is moved into place, so readers never see a partial object.
"""

from __future__ import annotations

import contextlib
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import fsspec

from .. import runtime
from ..errors import (
    AlreadyExists,
    FmstoreError,
    NotFound,
    NotSupported,
    PermissionDenied,
    StoreUnavailable,
)
from .base import Buffer, ObjectMeta, Pieces, PutOptions, Store, Writer, as_pieces
from .types import TMP_MARK

_OBJECT_PROTOCOLS = {"memory", "gs", "gcs", "az", "abfs", "abfss", "s3", "s3a", "oss"}


class FsspecStore(Store):
    def __init__(self, url: str, *, tier: str | None = None, **storage_options: Any) -> None:
        try:
            fs, root = fsspec.core.url_to_fs(url, **storage_options)
        except (ImportError, ValueError) as e:
            raise NotSupported(f"cannot open {url!r} with fsspec: {e}") from None
        self.fs = fs
        self.root = root.rstrip("/")
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.tier = tier or protocol
        self.url = url
        self._atomic_put = protocol in _OBJECT_PROTOCOLS

    def _path(self, key: str) -> str:
        return f"{self.root}/{self._key(key)}"

    def _rel(self, path: str) -> str:
        path = path.lstrip("/")
        root = self.root.lstrip("/")
        return path[len(root) + 1 :] if root else path

    @contextlib.contextmanager
    def _translate(self, key: str | None) -> Iterator[None]:
        try:
            yield
        except FmstoreError:
            raise
        except FileNotFoundError:
            raise NotFound("no such object", tier=self.tier, key=key) from None
        except FileExistsError:
            raise AlreadyExists("object already exists", tier=self.tier, key=key) from None
        except PermissionError as e:
            raise PermissionDenied(f"permission denied: {e}", tier=self.tier, key=key) from None
        except OSError as e:
            raise StoreUnavailable(f"I/O error: {e}", tier=self.tier, key=key) from None

    def _put_sync(self, key: str, data: bytes, options: PutOptions) -> ObjectMeta:
        path = self._path(key)
        with self._translate(key):
            if options.mode == "create" and self.fs.exists(path):
                raise AlreadyExists("object already exists", tier=self.tier, key=key)
            if options.mode == "if_match":
                raise NotSupported(
                    "conditional writes are not supported by fsspec stores", tier=self.tier, key=key
                )
            if self._atomic_put:
                self.fs.pipe_file(path, data)
            else:
                d, name = path.rsplit("/", 1)
                # File systems with directories (local://, sftp…) need the parents; object
                # stores have none to make.
                self.fs.makedirs(d, exist_ok=True)
                tmp = f"{d}/{TMP_MARK}{uuid.uuid4().hex}.{name}"
                self.fs.pipe_file(tmp, data)
                self.fs.mv(tmp, path)
            return self._stat_sync(key)

    async def put(self, key: str, data: Buffer, options: PutOptions = PutOptions()) -> ObjectMeta:
        self._key(key)
        return await runtime.to_io(self._put_sync, key, bytes(data), options)

    async def open_writer(self, key: str, options: PutOptions = PutOptions()) -> Writer:
        self._key(key)
        return _SpoolWriter(self, key, options)

    async def get_range(self, key: str, start: int, end: int | None = None) -> bytes:
        path = self._path(key)

        def do() -> bytes:
            with self._translate(key):
                size = self._stat_sync(key).size
                stop = self._check_range(key, size, start, end)
                if stop == start:
                    return b""
                return bytes(self.fs.cat_file(path, start=start, end=stop))

        return await runtime.to_io(do)

    def _stat_sync(self, key: str) -> ObjectMeta:
        with self._translate(key):
            info = self.fs.info(self._path(key))
            if info.get("type") == "directory":
                raise NotFound("is a directory, not an object", tier=self.tier, key=key)
            return self._meta(key, info)

    def _meta(self, key: str, info: dict[str, Any]) -> ObjectMeta:
        raw = info.get("mtime") or info.get("created") or info.get("LastModified")
        mtime: float | None = None
        stamp = getattr(raw, "timestamp", None)
        if callable(stamp):
            mtime = float(stamp())
        elif isinstance(raw, (int, float)):
            mtime = float(raw)
        etag = info.get("ETag") or info.get("etag") or info.get("md5")
        return ObjectMeta(key=key, size=int(info.get("size") or 0), mtime=mtime, etag=etag)

    async def stat(self, key: str) -> ObjectMeta:
        self._key(key)
        return await runtime.to_io(self._stat_sync, key)

    async def list(
        self,
        prefix: str = "",
        *,
        recursive: bool = True,
        start_after: str | None = None,
        page_size: int = 1000,
    ) -> AsyncIterator[ObjectMeta]:
        prefix = self._prefix(prefix)
        base = f"{self.root}/{prefix}".rstrip("/")

        def do() -> list[ObjectMeta]:
            with self._translate(prefix):
                try:
                    if recursive:
                        infos = list(self.fs.find(base, detail=True, withdirs=False).values())
                    else:
                        infos = self.fs.ls(base, detail=True)
                except FileNotFoundError:
                    return []
            out = []
            for info in infos:
                rel = self._rel(info["name"])
                if not rel or rel.rsplit("/", 1)[-1].startswith(TMP_MARK):
                    continue
                if info.get("type") == "directory":
                    if not recursive:
                        out.append(ObjectMeta(key=rel + "/", size=0, is_dir=True))
                else:
                    out.append(self._meta(rel, info))
            out.sort(key=lambda m: m.key.encode())
            return out

        for meta in await runtime.to_io(do):
            if start_after is None or meta.key > start_after:
                yield meta

    async def delete(self, key: str) -> None:
        path = self._path(key)

        def do() -> None:
            with self._translate(key), contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(path)

        await runtime.to_io(do)

    async def copy(self, src: str, dst: str, options: PutOptions = PutOptions()) -> ObjectMeta:
        spath, dpath = self._path(src), self._path(dst)

        def do() -> ObjectMeta:
            with self._translate(src):
                if not self.fs.isfile(spath):
                    raise NotFound("no such object", tier=self.tier, key=src)
            if options.mode == "create" and self.fs.exists(dpath):
                raise AlreadyExists("object already exists", tier=self.tier, key=dst)
            with self._translate(dst):
                if not self._atomic_put:
                    self.fs.makedirs(dpath.rsplit("/", 1)[0], exist_ok=True)
                self.fs.copy(spath, dpath)
            return self._stat_sync(dst)

        return await runtime.to_io(do)


class _SpoolWriter(Writer):
    """Buffers in a spooled temp file (memory, then disk) and publishes with one put."""

    def __init__(self, store: FsspecStore, key: str, options: PutOptions) -> None:
        self.store, self.key, self.options = store, key, options
        self.buf: Any = tempfile.SpooledTemporaryFile(max_size=64 << 20)
        self._done = False

    async def write(self, data: Buffer | Pieces) -> None:
        if self._done:
            raise ValueError("writer is closed")
        await runtime.to_io(self.buf.writelines, as_pieces(data))

    async def commit(self) -> ObjectMeta:
        if self._done:
            raise ValueError("writer is closed")
        self._done = True
        try:
            self.buf.seek(0)
            data = await runtime.to_io(self.buf.read)
            return await self.store.put(self.key, data, self.options)
        finally:
            self.buf.close()

    async def abort(self) -> None:
        if not self._done:
            self._done = True
            self.buf.close()

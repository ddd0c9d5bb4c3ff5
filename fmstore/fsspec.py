"""``fmstore://TIER/key`` URLs for fsspec: pandas, pyarrow, dask and friends read and write
fmstore tiers through their Stores.

``fsspec.open("fmstore://nvme/datasets/x.parquet")``: the host part is a tier named in
``fmstore.toml`` (the usual lookup, or ``storage_options={"config": PATH}``), the rest is
the key below it, validated like every key (``..``, absolute paths, NUL... are refused with
:class:`~fmstore.errors.InvalidKey`).

* Reads are ranged: a file's ``_fetch_range`` is one :meth:`Store.get_range`, so a parquet
  reader asking for one row group fetches that row group, not the object.
* Writes go through the Store's atomic writer (:meth:`Store.open_writer`: streamed,
  multipart on S3): nothing is visible before ``close()``, and a file closed while an
  exception raised during its write is propagating (``with fsspec.open(url, "wb")`` left
  by an exception) or dropped without ``close()`` is aborted, leaving nothing.
* On a lazily staged POSIX tier (``fmstore stage --lazy``, see ``docs/staging.md``) a
  listed file that is not fetched yet is fetched on first read, as ``fmstore.open`` does;
  ``info`` answers from the listing without fetching, and ``ls`` lists such files too.

This is the reverse of :class:`fmstore.stores.fsspec_store.FsspecStore` (an fsspec file
system as a Store).  It sits above ``tiering`` because lazy read-through needs it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from . import runtime
from .config import Config, get_config, load_config
from .errors import AlreadyExists, InvalidKey, NotFound, NotSupported, PermissionDenied
from .keys import validate_key
from .stores import open_store
from .stores.base import ObjectMeta, PutOptions, Store, Writer

T = TypeVar("T")

PROTOCOL = "fmstore"
log = logging.getLogger(__name__)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return runtime.run(coro)


class FmstoreFileSystem(AbstractFileSystem):
    """fsspec file system over fmstore's tiers; paths are ``TIER/key``.

    ``config``: a path to an ``fmstore.toml`` or a :class:`~fmstore.config.Config`;
    default: the process-wide config (``$FMSTORE_CONFIG``, ``./fmstore.toml``, ...).
    ``block_size``: the default read/write block of opened files (fsspec's 5 MiB)."""

    protocol = PROTOCOL
    root_marker = ""

    def __init__(
        self,
        config: str | os.PathLike[str] | Config | None = None,
        block_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._config_arg = config
        self._loaded: Config | None = (
            config
            if isinstance(config, Config)
            else (load_config(config) if config is not None else None)
        )
        self.blocksize = block_size or AbstractBufferedFile.DEFAULT_BLOCK_SIZE
        self._stores: dict[str, tuple[Config, Store]] = {}

    # ---- paths and stores ---------------------------------------------------------

    @property
    def config(self) -> Config:
        return self._loaded if self._loaded is not None else get_config()

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
        for mark in (f"{PROTOCOL}://", f"{PROTOCOL}::"):
            if path.startswith(mark):
                path = path[len(mark) :]
                break
        if path.startswith("/"):
            return path  # kept, so that split() refuses it
        return path.rstrip("/")  # a trailing "/" names a directory

    @staticmethod
    def _get_kwargs_from_urls(urlpath: str) -> dict[str, Any]:
        return {}

    def split(self, path: str) -> tuple[str, str]:
        """``"nvme/a/b.bin"`` -> ``("nvme", "a/b.bin")``; the key is ``""`` for the tier
        itself.  An absolute path, ``..`` or an unknown tier is refused."""
        path = self._strip_protocol(path)
        if path.startswith("/"):
            raise InvalidKey("an fmstore:// path is TIER/key: absolute paths are refused", key=path)
        tier, _, key = path.partition("/")
        if not tier:
            raise InvalidKey("an fmstore:// path names a tier first (fmstore://TIER/key)")
        if tier in (".", ".."):
            raise InvalidKey(f"a {tier!r} segment: paths may not leave a tier", key=path)
        self.config.tier(tier)  # ConfigError naming the configured tiers
        if key:
            validate_key(key, tier=tier)
        return tier, key

    def store(self, tier: str) -> Store:
        """The Store of ``tier``, opened once per file system (and config)."""
        cfg = self.config
        hit = self._stores.get(tier)
        if hit is None or hit[0] is not cfg:
            hit = (cfg, open_store(f"{tier}:", config=cfg))
            self._stores[tier] = hit
        return hit[1]

    # ---- lazy staging ---------------------------------------------------------------

    def _find_index(self, tier: str, key: str) -> tuple[Any, str, str] | None:
        """(index, key below it, the tier's real root) of the lazy index governing ``key``
        on a POSIX ``tier``, looked for no higher than the tier's root.  An index that is
        not trusted (:mod:`fmstore.tiering.staging.lazy_index`) is not used: logged, not raised,
        so a file someone else planted cannot make reads of absent files fail."""
        root = self.store(tier).local_root
        if root is None:
            return None
        from .tiering.staging.lazy import find_index

        try:
            found = find_index(os.path.join(root, key) if key else root, stop=root)
        except PermissionDenied as e:
            log.warning("%s", e)
            return None
        return None if found is None else (found[0], found[1], os.path.realpath(root))

    def _lazy(self, tier: str, key: str) -> tuple[Any, Any] | None:
        """(index, entry) when ``key`` on ``tier`` is listed by a lazy index and absent."""
        found = self._find_index(tier, key) if key else None
        if found is None:
            return None
        idx, rel, _root = found
        entry = idx.entries.get(rel)
        return None if entry is None else (idx, entry)

    def _lazy_under(self, tier: str, key: str) -> list[tuple[str, int]]:
        """(key below the tier, size) of every lazily listed file directly or deeper under
        the prefix ``key``, as keys of the tier."""
        found = self._find_index(tier, key)
        if found is None:
            return []
        idx, rel, root = found
        base = os.path.relpath(idx.root, root).replace(os.sep, "/")
        base = "" if base == "." else base
        if base.startswith(".."):
            return []
        out = []
        for e in idx.under(rel):
            out.append(("/".join(p for p in (base, e.key) if p), e.size))
        return out

    def _fetch_lazy(self, tier: str, key: str) -> bool:
        """Fetch ``key`` when it is listed lazily and absent; whether it was."""
        hit = self._lazy(tier, key)
        if hit is None:
            return False
        from .tiering.staging.lazy import fetch_async

        idx, entry = hit
        report = _run(fetch_async(idx, [entry]))
        if report.failures:
            raise NotFound(
                f"lazy fetch from {idx.source} failed: {report.failures[0].error}",
                tier=tier,
                key=key,
            )
        return True

    # ---- reading ----------------------------------------------------------------------

    def _meta_info(self, tier: str, m: ObjectMeta) -> dict[str, Any]:
        name = f"{tier}/{m.key.rstrip('/')}"
        if m.is_dir:
            return {"name": name, "size": 0, "type": "directory"}
        return {
            "name": name,
            "size": m.size,
            "type": "file",
            "mtime": m.mtime,
            "etag": m.etag,
        }

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path)
        if path == "":
            out: list[dict[str, Any]] = [
                {"name": t, "size": 0, "type": "directory"} for t in sorted(self.config.tiers)
            ]
        else:
            tier, key = self.split(path)
            store = self.store(tier)

            async def listing() -> list[ObjectMeta]:
                return [m async for m in store.list(key, recursive=False)]

            entries = {
                m.key.rstrip("/"): self._meta_info(tier, m)
                for m in _run(listing())
                if m.key.rstrip("/") != key  # a directory's own folder marker (S3)
            }
            plen = len(key) + 1 if key else 0
            for k, size in self._lazy_under(tier, key):
                rest = k[plen:]
                if not rest or (key and not k.startswith(key + "/")):
                    continue
                head, sep, _ = rest.partition("/")
                sub = k[:plen] + head
                if sub in entries:
                    continue
                entries[sub] = (
                    {"name": f"{tier}/{sub}", "size": 0, "type": "directory"}
                    if sep
                    else {"name": f"{tier}/{sub}", "size": size, "type": "file", "lazy": True}
                )
            out = [entries[k] for k in sorted(entries)]
            if not out:
                info = self.info(path)  # a file lists itself; nothing at all: NotFound
                out = [info] if info["type"] == "file" else []
        return out if detail else [o["name"] for o in out]

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        if path == "":
            return {"name": "", "size": 0, "type": "directory"}
        tier, key = self.split(path)
        if not key:
            return {"name": tier, "size": 0, "type": "directory"}
        store = self.store(tier)
        try:
            return self._meta_info(tier, _run(store.stat(key)))
        except NotFound:
            pass
        except IsADirectoryError:
            return {"name": path, "size": 0, "type": "directory"}
        hit = self._lazy(tier, key)
        if hit is not None:
            return {"name": path, "size": hit[1].size, "type": "file", "lazy": True}

        async def any_below() -> bool:
            async for _ in store.list(key, recursive=True, page_size=1):
                return True
            return False

        if _run(any_below()) or self._lazy_under(tier, key):
            return {"name": path, "size": 0, "type": "directory"}
        raise NotFound("no such file or directory", tier=tier, key=key)

    def exists(self, path: str, **kwargs: Any) -> bool:
        self.split(path)  # a hostile path is an error, not "absent"
        try:
            self.info(path)
        except FileNotFoundError:
            return False
        return True

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        tier, key = self.split(path)
        store = self.store(tier)
        if start is None and end is None:
            try:
                return _run(store.get(key))
            except NotFound:
                if self._fetch_lazy(tier, key):
                    return _run(store.get(key))
                if self.isdir(path):
                    raise IsADirectoryError(f"{path!r} is a directory") from None
                raise
        size = self.size(path)
        assert size is not None
        s = 0 if start is None else (start if start >= 0 else max(0, size + start))
        e = size if end is None else (end if end >= 0 else max(0, size + end))
        e = min(e, size)
        if s >= e:
            return b""
        return self._read_range(tier, key, s, e)

    def _read_range(self, tier: str, key: str, start: int, end: int) -> bytes:
        store = self.store(tier)
        try:
            return _run(store.get_range(key, start, end))
        except NotFound:
            if not self._fetch_lazy(tier, key):
                raise
            return _run(store.get_range(key, start, end))

    # ---- writing and the rest ---------------------------------------------------------

    def _open(
        self,
        path: str,
        mode: str = "rb",
        block_size: int | None = None,
        autocommit: bool = True,
        cache_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> FmstoreFile:
        return FmstoreFile(
            self,
            self._strip_protocol(path),
            mode,
            block_size=block_size or self.blocksize,
            autocommit=autocommit,
            cache_options=cache_options,
            **kwargs,
        )

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        tier, key = self.split(path)
        if not key:
            raise InvalidKey("a tier is not a file", tier=tier)
        put = PutOptions(mode="create" if mode == "create" else "overwrite")
        _run(self.store(tier).put(key, value, put))

    def _rm(self, path: str) -> None:
        tier, key = self.split(path)
        if not key:
            return
        if self.isdir(path):
            return  # directories are implicit: they go with their last file
        _run(self.store(tier).delete(key))

    def rm_file(self, path: str) -> None:
        self._rm(path)

    def rm(
        self, path: Any, recursive: bool = False, maxdepth: int | None = None, **kw: Any
    ) -> None:
        paths = self.expand_path(path, recursive=recursive, maxdepth=maxdepth)
        for p in reversed(paths):
            self._rm(p)
        if recursive and maxdepth is None:
            # S3 folder markers of the directories emptied go too, as s3fs removes them
            for p in [path] if isinstance(path, str) else list(path):
                tier, key = self.split(p)
                store = self.store(tier)

                async def markers(store: Store = store, key: str = key) -> list[str]:
                    try:
                        return [m.key async for m in store.list(key, recursive=True) if m.is_dir]
                    except NotFound:
                        return []

                if key and (found := _run(markers())):
                    _run(store.delete_many(found))

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        self.split(path)  # directories are implicit (prefixes); only check the path

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.split(path)

    def rmdir(self, path: str) -> None:
        self.split(path)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        t1, k1 = self.split(path1)
        t2, k2 = self.split(path2)
        if t1 == t2:
            _run(self.store(t1).copy(k1, k2))
        else:
            _run(self.store(t2).put(k2, self.cat_file(path1)))

    def created(self, path: str) -> Any:
        raise NotSupported("fmstore objects have no creation time", key=path)

    def modified(self, path: str) -> Any:
        import datetime

        mtime = self.info(path).get("mtime")
        if mtime is None:
            raise NotSupported("no modification time known", key=path)
        return datetime.datetime.fromtimestamp(mtime, tz=datetime.timezone.utc)


class FmstoreFile(AbstractBufferedFile):
    """A file of :class:`FmstoreFileSystem`: ranged reads; writes through one Store writer,
    committed on close (or by a transaction's commit), aborted on error."""

    fs: FmstoreFileSystem

    def __init__(self, fs: FmstoreFileSystem, path: str, mode: str = "rb", **kwargs: Any) -> None:
        self.tier, self.key = fs.split(path)
        if not self.key:
            raise IsADirectoryError(f"{path!r} is a tier, not a file")
        if mode not in ("rb", "wb", "xb"):
            raise NotSupported(f"fmstore:// files open as rb, wb or xb, not {mode!r}", key=path)
        if mode == "xb" and _run(fs.store(self.tier).exists(self.key)):
            # refused at open, as open(path, "x") does; the commit stays create-only too,
            # for a key written between this check and the close
            raise AlreadyExists(f"{path!r} exists", tier=self.tier, key=self.key)
        self._writer: Writer | None = None
        self._exc_at_open = sys.exc_info()[1]
        super().__init__(fs, path, mode, **kwargs)

    def _fetch_range(self, start: int, end: int) -> bytes:
        end = min(end, self.size)
        if start >= end:
            return b""
        return self.fs._read_range(self.tier, self.key, start, end)

    def _initiate_upload(self) -> None:
        put = PutOptions(mode="create") if self.mode == "xb" else PutOptions()
        store = self.fs.store(self.tier)
        self._writer = _run(store.open_writer(self.key, put))

    def _upload_chunk(self, final: bool = False) -> bool:
        assert self._writer is not None
        data = self.buffer.getvalue()
        try:
            if data:
                _run(self._writer.write(data))
            if final and self.autocommit:
                self.commit()
        except BaseException:
            self.discard()
            raise
        return True

    def commit(self) -> None:
        if self._writer is not None:
            w, self._writer = self._writer, None
            _run(w.commit())

    def discard(self) -> None:
        if self._writer is not None:
            w, self._writer = self._writer, None
            _run(w.abort())

    def close(self) -> None:
        if self._closed_now() or self.mode == "rb":
            super().close()
            return
        exc = sys.exc_info()[1]
        if exc is not None and exc is not self._exc_at_open:
            self.discard()  # closed by an exception leaving the write: leave nothing
            self.closed = True
            return
        super().close()

    def _closed_now(self) -> bool:
        return bool(getattr(self, "_closed", True))

    def __del__(self) -> None:
        if not self._closed_now() and self.mode != "rb":
            try:  # dropped without close(): never publish a partial write
                self.discard()
            finally:
                self.closed = True

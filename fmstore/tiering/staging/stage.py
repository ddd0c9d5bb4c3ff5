"""Dataset staging: plan what to copy between two locations, then run the copy engine.

Planning is separate from I/O: :func:`plan_stage` lists both sides (in parallel, one
listing per top-level directory), applies ``include``/``exclude`` globs and the shard, and
returns a :class:`StagePlan`: the items to copy (identical files are skipped later by the
engine, cheaply), the totals, and — for sync semantics — the destination keys to delete.
:func:`stage` / :func:`stage_async` open both locations, plan, show the plan to the
caller's ``confirm`` and run it through :mod:`fmstore.tiering.copy.transfer` with a resume
journal in the state directory; ``fmstore stage`` is a call of :func:`stage_async`.

Glob syntax: ``*`` matches within one path segment, ``**`` across segments, ``?`` one
character, ``[abc]`` / ``[!abc]`` a character class.  A pattern without ``/`` matches a
file's name at any depth (``*.json``); one with ``/`` matches the whole key relative to the
source (``train/**/*.tar``).  With includes, a key must match one; a key matching any
exclude is left out.

Shards: ``shard=(k, n)`` keeps the keys whose stable hash (CRC32C of the UTF-8 key) is
``k`` modulo ``n``, so ``n`` processes given ``0/n`` … ``n-1/n`` stage disjoint parts that
together cover everything exactly once; :func:`shard_from_env` reads Slurm's
``SLURM_PROCID``/``SLURM_NTASKS`` (only inside an ``srun`` step, where ``SLURM_STEP_ID`` is
set: a batch script run once with ``--ntasks=4`` also sees ``SLURM_NTASKS=4`` and must stage
everything) or torchrun's ``RANK``/``WORLD_SIZE``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ... import runtime
from ...config import Config, get_config
from ...errors import ConfigError, FmstoreError, NotFound, PermissionDenied
from ...stores import Location, open_store, split_tier
from ...stores.base import ObjectMeta, Store
from ...stores.crc import crc32c
from ...stores.location import open_existing, scheme_of
from ..copy.journal import Journal
from ..copy.transfer import (
    CopyItem,
    TransferOptions,
    TransferProgress,
    TransferReport,
    copy_items,
    version_of,
)
from .stagelock import DestinationLock, lock_destination

log = logging.getLogger(__name__)

#: Names fmstore keeps for itself at a location (temp files, locks, the lazy index).
RESERVED_PREFIX = ".fmstore"


# ---- globs ------------------------------------------------------------------------------


def compile_glob(pattern: str) -> re.Pattern[str]:
    """Translate a glob (syntax in the module docstring) to a regex; :class:`ConfigError`
    names the pattern and the problem when it is malformed."""
    if not pattern or pattern.strip() != pattern:
        raise ConfigError(f"malformed glob {pattern!r}: empty or surrounded by spaces")
    if pattern.startswith("/"):
        raise ConfigError(f"malformed glob {pattern!r}: patterns are relative to the source")
    anchored = "/" in pattern
    i, out = 0, []
    while i < len(pattern):
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                i += 2
                if pattern.startswith("/", i):  # '**/' also matches no directory at all
                    out.append("(?:.*/)?")
                    i += 1
                else:
                    out.append(".*")
                continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            j = pattern.find("]", i + 2 if pattern.startswith(("[!", "[^"), i) else i + 1)
            if j < 0:
                raise ConfigError(
                    f"malformed glob {pattern!r}: '[' at position {i} is never closed"
                )
            body = pattern[i + 1 : j]
            if body.startswith(("!", "^")):
                body = "^" + body[1:]
            if not body or body == "^":
                raise ConfigError(f"malformed glob {pattern!r}: empty character class")
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = j
        elif c == "]":
            raise ConfigError(f"malformed glob {pattern!r}: ']' at position {i} without '['")
        else:
            out.append(re.escape(c))
        i += 1
    body = "".join(out)
    try:
        return re.compile(body if anchored else f"(?:.*/)?{body}", re.DOTALL)
    except re.error as e:
        raise ConfigError(f"malformed glob {pattern!r}: {e}") from None


@dataclass(frozen=True)
class KeyFilter:
    includes: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    _inc: tuple[re.Pattern[str], ...] = field(default=(), repr=False, compare=False)
    _exc: tuple[re.Pattern[str], ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def of(cls, includes: Sequence[str] = (), excludes: Sequence[str] = ()) -> KeyFilter:
        return cls(
            tuple(includes),
            tuple(excludes),
            tuple(compile_glob(p) for p in includes),
            tuple(compile_glob(p) for p in excludes),
        )

    def __call__(self, key: str) -> bool:
        if any(seg.startswith(RESERVED_PREFIX) for seg in key.split("/")):
            return False
        if self._inc and not any(p.fullmatch(key) for p in self._inc):
            return False
        return not any(p.fullmatch(key) for p in self._exc)


# ---- shards -----------------------------------------------------------------------------


def parse_shard(text: str) -> tuple[int, int]:
    """``"K/N"`` → ``(K, N)`` with ``0 <= K < N``."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m:
        raise ConfigError(f"bad shard {text!r}: use K/N, for example 0/4")
    k, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 0 <= k < n:
        raise ConfigError(f"bad shard {text!r}: need 0 <= K < N")
    return k, n


def shard_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(K, N)`` from ``SLURM_PROCID``/``SLURM_NTASKS`` inside an ``srun`` step
    (``SLURM_STEP_ID`` set), or from ``RANK``/``WORLD_SIZE``; None: one process stages all.

    Outside a step (the batch script itself) the Slurm variables describe the job's
    allocation, not this process: they are ignored."""
    env = os.environ if env is None else env
    for k_var, n_var in (("SLURM_PROCID", "SLURM_NTASKS"), ("RANK", "WORLD_SIZE")):
        if k_var == "SLURM_PROCID" and not in_srun_step(env):
            continue
        if k_var in env and n_var in env:
            shard = parse_shard(f"{env[k_var]}/{env[n_var]}")
            return shard if shard[1] > 1 else None
    return None


def in_srun_step(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a task of an ``srun`` job step (not the batch script)."""
    env = os.environ if env is None else env
    step = env.get("SLURM_STEP_ID", "").strip()
    return bool(step) and step not in ("batch", "extern")


def in_shard(key: str, shard: tuple[int, int] | None) -> bool:
    if shard is None or shard[1] == 1:
        return True
    return crc32c(key.encode("utf-8")) % shard[1] == shard[0]


# ---- locations --------------------------------------------------------------------------


def resolve_url(url: str) -> str:
    """A location as it can be opened later from anywhere: plain paths made absolute."""
    tier, _rest = split_tier(url)
    if tier is not None or scheme_of(url) is not None:
        return url
    return os.path.abspath(os.path.expanduser(url))


def local_dir(url: str) -> str | None:
    """The directory a location names on this machine (a path, ``file://``, or a POSIX
    tier's ``TIER:path``), whether or not it exists; None for remote stores."""
    return Location.parse(url).local_root


def open_source(url: str, *, role: str = "source", concurrency: int | None = None) -> Store:
    """Open a location that must already exist (a missing POSIX directory is an error,
    not something to create); ``concurrency`` as for :func:`~fmstore.stores.open_store`."""
    return open_existing(url, role=role, concurrency=concurrency)


def _root_of(store: Store) -> str:
    root = store.local_root
    if root is not None:
        return "file://" + os.path.realpath(root)
    return store.url.rstrip("/")


def check_locations(src: Store, dst: Store, *, delete: bool) -> None:
    """Refuse copies of a location into itself or below itself (the copy would feed on
    its own output), and ``delete`` when the source lies inside the destination."""
    check_roots(_root_of(src), _root_of(dst), delete=delete)


def check_destination(src: Store, dst_url: str, *, delete: bool) -> None:
    """:func:`check_locations` before the destination is opened: opening a local
    directory creates it, which a refused copy must not do."""
    path = local_dir(dst_url)
    if path is not None:
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"destination {dst_url!r} is a file, not a directory")
        check_roots(_root_of(src), "file://" + os.path.realpath(path), delete=delete)


def check_source_has_files(src_url: str, src: Store, plan: StagePlan) -> None:
    """Refuse a source with no files at all (:class:`NotFound`): a job staged from it would
    start without its data.  On S3 an empty prefix and a missing one are the same thing; a
    local directory that exists but is empty is named as such.  A source with files none of
    which the filters select is not refused here (the caller warns)."""
    if plan.src_listing:
        return
    if src.local_root is not None:
        raise NotFound(f"source {src_url!r} is an empty directory: nothing to stage")
    raise NotFound(
        f"source {src_url!r} has no objects ({src.url}): on S3 an empty prefix and a "
        "missing one are the same"
    )


def check_roots(s: str, d: str, *, delete: bool) -> None:
    if s == d:
        raise ConfigError(f"source and destination are the same location ({s})")
    if d.startswith(s + "/"):
        raise ConfigError(f"destination {d} is inside source {s}")
    if delete and s.startswith(d + "/"):
        raise ConfigError(f"source {s} is inside destination {d}: --delete would remove it")


# ---- listing and planning ---------------------------------------------------------------


async def list_tree(
    store: Store, *, parallel: int = 16, role: str = "location"
) -> dict[str, ObjectMeta]:
    """Every object under ``store``, listing each top-level directory concurrently."""
    try:
        top = [m async for m in store.list("", recursive=False)]
    except NotFound as e:
        raise NotFound(f"{role} {store.url} does not exist ({e.message})", tier=e.tier) from None
    out = {m.key: m for m in top if not m.is_dir}
    sem = asyncio.Semaphore(parallel)

    async def sub(prefix: str) -> list[ObjectMeta]:
        async with sem:
            return [m async for m in store.list(prefix, recursive=True) if not m.is_dir]

    dirs = [m.key for m in top if m.is_dir and not m.key.startswith(RESERVED_PREFIX)]
    try:
        for metas in await asyncio.gather(*(sub(d) for d in dirs)):
            out.update((m.key, m) for m in metas)
    except PermissionDenied as e:  # a part of the tree cannot be listed: say whose
        raise PermissionDenied(f"{role} {store.url}: {e.message}", tier=e.tier, key=e.key) from None
    return out


@dataclass
class StagePlan:
    items: list[CopyItem]
    delete: list[str]
    dst_existing: dict[str, ObjectMeta]
    src_listing: dict[str, ObjectMeta]

    @property
    def files(self) -> int:
        return len(self.items)

    @property
    def bytes(self) -> int:
        return sum(i.size for i in self.items)

    def to_copy(self) -> list[CopyItem]:
        """Items whose destination is missing or differs in size (the dry-run estimate;
        same-size files are checked against recorded checksums during the run)."""
        out = []
        for i in self.items:
            d = self.dst_existing.get(i.dst_key)
            if d is None or d.size != i.size:
                out.append(i)
        return out


async def plan_stage(
    src: Store,
    dst: Store | None,
    *,
    key_filter: KeyFilter = KeyFilter(),
    shard: tuple[int, int] | None = None,
    delete: bool = False,
    list_destination: bool = True,
    dst_label: str | None = None,
) -> StagePlan:
    """List both sides and plan the copy; ``dst`` None (or ``list_destination`` False)
    plans against an empty destination, named ``dst_label`` in the log."""
    src_task = asyncio.ensure_future(list_tree(src, role="source"))
    dst_task = (
        asyncio.ensure_future(list_tree(dst, role="destination"))
        if list_destination and dst is not None
        else None
    )
    try:
        src_all = await src_task
        dst_all = await dst_task if dst_task is not None else {}
    except BaseException:
        for t in (src_task, dst_task):
            if t is not None:
                t.cancel()
        raise
    items = [
        CopyItem(k, k, m.size, version_of(m))
        for k, m in sorted(src_all.items())
        if key_filter(k) and in_shard(k, shard)
    ]
    deletes: list[str] = []
    if delete:
        deletes = sorted(
            k for k in dst_all if k not in src_all and key_filter(k) and in_shard(k, shard)
        )
    log.debug(
        "plan %s -> %s: %d of %d source files selected (shard %s), %d to delete",
        src.url,
        dst.url if dst is not None else (dst_label or "-"),
        len(items),
        len(src_all),
        "all" if shard is None else f"{shard[0]}/{shard[1]}",
        len(deletes),
    )
    return StagePlan(items, deletes, dst_all, src_all)


# ---- settings ---------------------------------------------------------------------------

#: Keys of the config's ``[stage]`` table.
_STAGE_KEYS = ("preserve_owner", "lazy_sources")


def preserve_owner_setting(config: Config | None = None) -> bool:
    """``[stage] preserve_owner`` (default false): whether copies to a POSIX destination
    restore the owner and group recorded in the source's metadata.  Raises
    :class:`ConfigError` on an unknown key or a value that is not a boolean."""
    raw, w = (config or get_config()).table("stage", _STAGE_KEYS)
    value = raw.get("preserve_owner", False)
    if not isinstance(value, bool):
        raise ConfigError(f"{w} preserve_owner must be true or false, not {value!r}")
    return value


# ---- running ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StageOptions:
    """What :func:`stage_async` does.  ``dry_run``: plan only (the result carries the
    plan) and change nothing, not even create a missing local destination.
    ``transfer.concurrency`` is also the request limit the two stores are opened with
    (:meth:`fmstore.stores.Location.open`)."""

    includes: tuple[str, ...] = ()
    excludes: tuple[str, ...] = ()
    delete: bool = False
    shard: tuple[int, int] | None = None
    lazy: bool = False
    transfer: TransferOptions = TransferOptions()
    state_dir: str | None = None  # journals go to <state_dir>/transfers
    dry_run: bool = False


@dataclass
class StageResult:
    """What a run did.  ``plan``: what it planned (all of a dry run's answer);
    ``declined``: the caller's ``confirm`` said no, and nothing was changed."""

    report: TransferReport
    deleted: int = 0
    delete_failures: list[tuple[str, str]] = field(default_factory=list)
    lazy_entries: int = 0
    lazy_dropped: list[str] = field(default_factory=list)  # stale local copies dropped
    lazy_kept: list[str] = field(default_factory=list)  # stale, but changed locally: kept
    plan: StagePlan | None = None
    declined: bool = False

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.delete_failures


def journal_path(src: Store, dst: Store, state_dir: str | None = None) -> str:
    """Where the resume journal of copies from ``src`` to ``dst`` lives."""
    return Journal.path_for(state_dir or get_config().state_dir, src.url, dst.url)


async def run_plan(
    src: Store,
    dst: Store,
    plan: StagePlan,
    options: StageOptions,
    *,
    progress: TransferProgress | None = None,
    src_url: str | None = None,
) -> StageResult:
    progress = progress or TransferProgress()
    if options.lazy:
        from .lazy import drop_stale, write_index

        n = await write_index(dst, resolve_url(src_url) if src_url else src.url, plan.items)
        dropped, kept = await drop_stale(dst, plan.items, plan.dst_existing)
        progress.files_total = progress.files_skipped = n
        progress.bytes_total = progress.bytes_skipped = sum(i.size for i in plan.items)
        return StageResult(
            TransferReport(progress, [], 0.0),
            lazy_entries=n,
            lazy_dropped=dropped,
            lazy_kept=kept,
            plan=plan,
        )
    journal = await Journal.open(journal_path(src, dst, options.state_dir), dest=dst.url)
    try:
        report = await copy_items(
            src,
            dst,
            plan.items,
            options.transfer,
            journal=journal,
            progress=progress,
            dst_existing=plan.dst_existing,
        )
        result = StageResult(report, plan=plan)
        if plan.delete:
            await _delete(dst, plan.delete, result, journal, options.transfer.concurrency)
    finally:
        await asyncio.shield(journal.close())
    return result


async def _delete(
    dst: Store, keys: list[str], result: StageResult, journal: Journal, concurrency: int
) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(key: str) -> None:
        async with sem:
            try:
                await dst.delete(key)
            except FmstoreError as e:
                result.delete_failures.append((key, str(e)))
                return
            journal.forget(key)
            result.deleted += 1

    await asyncio.gather(*(one(k) for k in keys))


#: Shown the plan before anything is changed; False stops the run.
Confirm = Callable[[StagePlan], "bool | Awaitable[bool]"]


async def stage_async(
    src_url: str,
    dst_url: str,
    options: StageOptions = StageOptions(),
    *,
    progress: TransferProgress | None = None,
    confirm: Confirm | None = None,
) -> StageResult:
    """Stage ``src_url`` into ``dst_url`` (any store URLs or ``TIER:path``).

    In order: both locations are checked and opened (a source must exist; a local
    destination is created, except by a dry run), with ``options.transfer.concurrency``
    as the stores' request limit; both are listed and the plan made
    (:func:`plan_stage`); a dry run returns here.  Then ``confirm(plan)``, when given,
    is called once on the event loop, before anything is copied or deleted: it shows the
    plan (``plan.delete`` lists what would be deleted) and returns, or returns an
    awaitable of, whether to go on; on no, the result is ``declined`` and nothing has
    changed.  Then the plan runs (:func:`run_plan`), counting into ``progress`` (live
    counters, readable from any thread while the run goes on).  The stores are closed
    before this returns."""
    key_filter = KeyFilter.of(options.includes, options.excludes)
    if options.lazy:
        from .lazy import check_stage

        check_stage(resolve_url(src_url), dst_url)
    # The stores allow as many requests as the copy keeps in flight (S3 alone allows 16).
    concurrency = options.transfer.concurrency
    src = open_source(src_url, concurrency=concurrency)
    local = local_dir(dst_url)
    dst: Store | None = None

    def open_destination() -> Store:
        # ``fsync="none"``: scratch data.  A local destination then neither syncs nor
        # starts each part's write-back early (the kernel's flusher writes it later,
        # off the copy's CPU); parts received into rings go to disk with O_DIRECT.
        if local is not None and options.transfer.fsync == "none":
            return open_store(dst_url, concurrency=concurrency, fsync=False)
        return open_store(dst_url, concurrency=concurrency)

    lock: DestinationLock | None = None
    try:
        check_destination(src, dst_url, delete=options.delete)
        if not options.dry_run:
            # One stage at a time into a destination (shards of one side by side): a second
            # identical stage waits, then plans against what the first one copied.
            lock = await lock_destination(
                options.state_dir or get_config().state_dir,
                dst_url,
                options.shard,
                on_wait=lambda msg: log.warning("%s", msg),
            )
        # A local destination that is not there yet has nothing to list: it is created
        # (opened) only once the source proved to have files and the run is not a dry one.
        if not (local is not None and not os.path.exists(local)):
            dst = open_destination()
            if local is None:  # a remote destination, checked once open
                check_locations(src, dst, delete=options.delete)
        plan = await plan_stage(
            src,
            dst,
            key_filter=key_filter,
            shard=options.shard,
            delete=options.delete,
            dst_label=f"file://{local} (not there yet)" if dst is None else None,
        )
        check_source_has_files(src_url, src, plan)
        if options.dry_run:
            return StageResult(TransferReport(progress or TransferProgress(), [], 0.0), plan=plan)
        if dst is None:
            dst = open_destination()
        if confirm is not None:
            go_on = confirm(plan)
            if inspect.isawaitable(go_on):
                go_on = await go_on
            if not go_on:
                report = TransferReport(progress or TransferProgress(), [], 0.0)
                return StageResult(report, plan=plan, declined=True)
        return await run_plan(src, dst, plan, options, progress=progress, src_url=src_url)
    finally:
        opened = [s for s in (src, dst) if s is not None]
        await asyncio.shield(asyncio.gather(*(s.close() for s in opened), return_exceptions=True))
        if lock is not None:
            lock.release()


def stage(
    src_url: str,
    dst_url: str,
    options: StageOptions = StageOptions(),
    *,
    progress: TransferProgress | None = None,
    confirm: Confirm | None = None,
) -> StageResult:
    """Sync facade of :func:`stage_async`."""
    return runtime.run(stage_async(src_url, dst_url, options, progress=progress, confirm=confirm))

"""What the copy commands (stage, hydrate, cp, rm) share: running a library call on the
fmstore loop while the main thread shows its progress and asks its questions, the
summary printed after it, and the exit codes.

Exit codes (also in docs/staging.md):

====  ==================================================================
0     everything done (or nothing to do)
1     error before or outside the copy: bad location, unreachable store,
      missing bucket, unreadable source, unknown tier, bad config
2     usage error: bad option value, malformed glob, bad --shard, or a
      deletion refused because --yes is missing on a non-interactive run
3     the run finished but some files failed (listed on stderr)
130   interrupted (Ctrl-C); re-run the same command to resume
====  ==================================================================
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import queue
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from .. import runtime
from ..tiering.copy.transfer import TransferProgress, TransferReport
from ..tiering.staging.stage import preserve_owner_setting
from .util import human_bytes, plural, printable

if TYPE_CHECKING:
    from rich.console import Console

T = TypeVar("T")

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def make_console(*, stderr: bool = False, **options: Any) -> Console:
    """A rich console for the commands' output.  Piped to a file or a program it is not
    wrapped at rich's default of 80 columns (tables and lines keep their width), unless
    ``$COLUMNS`` says otherwise; on a terminal it fits the terminal."""
    from rich.console import Console  # on demand: a copy logging to a file needs none

    c = Console(stderr=stderr, **options)
    if not c.is_terminal and not os.environ.get("COLUMNS"):
        c.width = 1 << 12
    return c


def console(err: bool = False) -> Console:
    return make_console(stderr=err, highlight=False)


def progress_bar(*columns: Any, **options: Any) -> Any:
    """A rich progress bar on stderr, shown only on a terminal: written into a file or a
    pipe (``2>err``, ``| cat``) a bar is a heap of redrawn lines, so there it is off (the
    command's result lines say what was done)."""
    from rich.progress import Progress

    err = make_console(stderr=True)
    return Progress(*columns, console=err, disable=not err.is_terminal, **options)


def print_titled(out: Console, title: str, table: Any) -> None:
    """``table`` under ``title`` (plain text, already :func:`~.util.printable`), the title a
    line of its own: a rich table title is wrapped to the table's width, which cuts a long
    location in two, in a pipe too."""
    out.print(title, markup=False, highlight=False, soft_wrap=True)
    out.print(table)


class Interrupted(Exception):
    pass


class MainThreadConfirm:
    """A run's ``confirm(plan)`` (:func:`fmstore.tiering.staging.stage.stage_async`) answered on
    the CLI's main thread, where a prompt must be asked: the run, on the event loop,
    awaits the answer while :func:`run_with_progress` waits for the question.  ``ask``
    shows the plan and says whether to go on."""

    def __init__(self, ask: Callable[[Any], bool]) -> None:
        self.ask = ask
        self.declined = False
        self._asked: queue.SimpleQueue[tuple[Any, asyncio.AbstractEventLoop, Any] | None] = (
            queue.SimpleQueue()
        )

    def __call__(self, plan: Any) -> Awaitable[bool]:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[bool] = loop.create_future()
        self._asked.put((plan, loop, answer))
        return answer

    def answer(self, run: cf.Future[Any]) -> None:
        """Wait on this thread for the question, or for the run to end without asking,
        and answer it."""
        run.add_done_callback(lambda _: self._asked.put(None))
        asked = self._asked.get()
        if asked is None:
            return
        plan, loop, answer = asked
        go_on = self.ask(plan)
        self.declined = not go_on
        loop.call_soon_threadsafe(_settle, answer, go_on)


def _settle(answer: asyncio.Future[bool], go_on: bool) -> None:
    if not answer.done():  # not cancelled meanwhile
        answer.set_result(go_on)


def run_with_progress(
    coro: Coroutine[Any, Any, T],
    progress: TransferProgress | None,
    label: str,
    show: bool,
    interval: float,
    confirm: MainThreadConfirm | None = None,
) -> T:
    """Run ``coro`` on the fmstore loop while showing ``progress``: a rich bar when
    ``show`` and stderr is a terminal, else a log line every ``interval`` seconds (0:
    none), so that turning the bar off (``--no-progress``) never silences the lines.
    ``confirm``: answered first, before the display starts.  Ctrl-C cancels the run,
    waits for it to leave its journal in order, and raises :class:`Interrupted`."""
    finished = threading.Event()

    async def wrapped() -> T:
        try:
            return await coro
        finally:
            finished.set()

    fut = runtime.submit(wrapped())
    try:
        if confirm is not None:
            confirm.answer(fut)
        if progress is None or (confirm is not None and confirm.declined):
            return runtime.wait(fut)
        if show and sys.stderr.isatty():
            return _rich_loop(fut, progress, label, console(err=True))
        if interval > 0:
            return _log_loop(fut, progress, label, interval)
        return runtime.wait(fut)
    except KeyboardInterrupt:
        fut.cancel()
        finished.wait(30)
        raise Interrupted() from None
    except BaseException:
        fut.cancel()  # a failed prompt (typer.Abort): the run must not go on without it
        finished.wait(30)
        raise


#: Below this rate (bytes/s) no time left is shown: a stalled or throttled copy's estimate
#: ("ETA 5628339 s") says nothing.
ETA_MIN_RATE = 1024
#: Nor beyond this many seconds (a week).
ETA_MAX_S = 7 * 86400


def rate_text(rate: float | None) -> str:
    """A rate in the binary units of the byte counts beside it (``12.5 MiB/s``)."""
    return "?/s" if rate is None else f"{human_bytes(rate)}/s"


def eta_text(left: float, rate: float | None) -> str:
    """Time left as ``h:mm:ss``, or ``?`` while the rate is about 0 or the estimate absurd."""
    if not left:
        return "0:00:00"
    if rate is None or rate < ETA_MIN_RATE or left / rate > ETA_MAX_S:
        return "?"
    s = int(left / rate + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def byte_columns(*, eta: bool = True) -> list[Any]:
    """The columns of every progress bar that counts bytes: done/total, rate and (``eta``)
    time left, all in binary units (MiB, MiB/s), the time left hidden while the rate is
    about 0 (:func:`eta_text`)."""
    from rich.progress import DownloadColumn, ProgressColumn
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Any) -> Text:
            return Text(rate_text(task.speed), style="progress.data.speed")

    class Eta(ProgressColumn):
        def render(self, task: Any) -> Text:
            left = (task.total or 0) - task.completed
            return Text(f"ETA {eta_text(left, task.speed)}", style="progress.remaining")

    return [DownloadColumn(binary_units=True), Rate(), *([Eta()] if eta else [])]


def _rich_loop(fut: Any, p: TransferProgress, label: str, err: Console) -> Any:
    from rich.progress import BarColumn, Progress, TextColumn

    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), *byte_columns(), console=err
    ) as bar:
        task = bar.add_task(label, total=max(p.bytes_total, 1))
        while True:
            done = fut.done()
            failed = f" [red]{p.files_failed} failed[/red]" if p.files_failed else ""
            bar.update(
                task,
                completed=p.bytes_done,
                total=max(p.bytes_total, 1),
                description=f"{label} {p.files_done}/{p.files_total} files{failed}",
            )
            if done:
                return fut.result()
            time.sleep(0.1)


def _log_loop(fut: Any, p: TransferProgress, label: str, interval: float) -> Any:
    last = time.monotonic()
    while True:
        done, _ = cf.wait([fut], timeout=runtime.WAKE_S)
        if done:
            return fut.result()
        now = time.monotonic()
        if now - last >= interval:
            last = now
            el = max(now - p.started, 1e-6)
            rate = p.bytes_copied / el
            left = max(p.bytes_total - p.bytes_done, 0)
            typer.echo(
                f"{label}: {p.files_done}/{p.files_total} files, {human_bytes(p.bytes_done)}/"
                f"{human_bytes(p.bytes_total)}, {rate_text(rate)}, ETA {eta_text(left, rate)}"
                + (f", {p.files_failed} failed" if p.files_failed else ""),
                err=True,
            )


def shard_label(shard: tuple[int, int] | None) -> str:
    """Which part of the data a run covered: ``1/4``, or ``all``."""
    return "all" if shard is None else f"{shard[0]}/{shard[1]}"


def summary(report: TransferReport, *, verb: str = "copied", shard: str | None = None) -> None:
    """The one-line summary on stderr; ``shard`` (:func:`shard_label`): which part ran."""
    p = report.progress
    secs = max(report.seconds, 1e-6)
    rate = human_bytes(p.bytes_copied / secs) + "/s"
    line = (
        f"{verb} {plural(p.files_copied, 'file')} ({human_bytes(p.bytes_copied)}), skipped "
        f"{p.files_skipped} identical ({human_bytes(p.bytes_skipped)})"
    )
    if p.bytes_resumed:
        line += f", resumed {human_bytes(p.bytes_resumed)} of earlier parts"
    line += f", {p.files_failed} failed, in {report.seconds:.1f} s ({rate})"
    if shard is not None:
        line += f"; shard {shard}"
    typer.echo(line, err=True)
    list_failures(report)


def list_failures(report: TransferReport) -> None:
    if report.failures:
        typer.secho(
            f"{plural(len(report.failures), 'file')} failed:", fg=typer.colors.RED, err=True
        )
        for f in report.failures[:200]:
            typer.echo(printable(f"  FAILED {f.key}: {f.error}", markup=False), err=True)
        if len(report.failures) > 200:
            typer.echo(f"  … and {len(report.failures) - 200} more", err=True)


def ask_yes(question: str, yes: bool, declined: str = "Nothing deleted.") -> bool:
    """Ask ``question``; a no (or no terminal to ask on, without ``--yes``) says
    ``declined`` and returns False (the caller exits 2)."""
    if yes:
        return True
    if not sys.stdin.isatty():
        typer.secho(
            f"{question} Refusing without --yes (not a terminal). {declined}",
            fg=typer.colors.RED,
            err=True,
        )
        return False
    if not typer.confirm(question, default=False, err=True):
        typer.echo(declined, err=True)
        return False
    return True


PRESERVE_OWNER_HELP = (
    "Restore owner and group from the source's metadata (FSx's file-owner / file-group) "
    "on a POSIX destination; default: [stage] preserve_owner in fmstore.toml (false). "
    "Only for sources whose writers you trust: metadata is set by whoever writes the object."
)


def preserve_owner(flag: bool | None) -> bool:
    return preserve_owner_setting() if flag is None else flag

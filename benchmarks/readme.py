"""The README's headline figures, generated from ``benchmarks/RESULTS.md``.

    python -m benchmarks.readme [--check]

Rewrites the block between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` in README.md:
one line per :data:`HEADLINES` entry, every figure read from a table of RESULTS.md (a range
where several runs or rows match).  ``run_all`` calls it after writing RESULTS.md;
``--check`` exits 1 when the README does not match (tests/test_readme_bench.py runs it), so
a figure typed by hand fails CI.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

Table = list[dict[str, str]]


@dataclass(frozen=True)
class Fig:
    """One figure: column ``col`` of the rows matching ``where`` (cell == value, or
    startswith when the value ends with ``*``) in the tables of section ``section`` whose
    title starts with ``table``; ``last``: only the last such table (the newest run)."""

    section: str
    table: str
    where: dict[str, str]
    col: str
    fmt: str = "{:.2f}×"
    last: bool = False


@dataclass(frozen=True)
class Headline:
    what: str
    figs: tuple[Fig, ...]
    #: text between the figures (``" / "`` by default), one fewer than figs
    joins: tuple[str, ...] = field(default=())
    #: text after the last figure
    tail: str = ""


def parse_results(text: str) -> dict[str, list[tuple[str, Table]]]:
    """``## section`` -> [(``### title``, rows as dicts by header)], in file order."""
    out: dict[str, list[tuple[str, Table]]] = {}
    section, title, lines = "", "", text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("## "):
            section = line[3:].strip()
            out.setdefault(section, [])
        elif line.startswith("### "):
            title = line[4:].strip()
        elif line.startswith("|") and section:
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            head, body = block[0], [r for r in block[2:] if len(r) == len(block[0])]
            out[section].append((title, [dict(zip(head, r, strict=True)) for r in body]))
            continue
        i += 1
    return out


def _match(row: dict[str, str], where: dict[str, str]) -> bool:
    for k, v in where.items():
        cell = row.get(k)
        if cell is None or not (cell.startswith(v[:-1]) if v.endswith("*") else cell == v):
            return False
    return True


def values(results: dict[str, list[tuple[str, Table]]], fig: Fig) -> list[float]:
    tables = [rows for title, rows in results.get(fig.section, []) if title.startswith(fig.table)]
    if fig.last:
        tables = tables[-1:]
    out = []
    for rows in tables:
        for r in rows:
            if _match(r, fig.where):
                with contextlib.suppress(KeyError, ValueError):  # blank cell
                    out.append(float(r[fig.col]))
    return out


def render_fig(results: dict[str, list[tuple[str, Table]]], fig: Fig) -> str:
    vals = values(results, fig)
    if not vals:
        return "—"
    lo, hi = min(vals), max(vals)
    if fig.fmt.format(lo) == fig.fmt.format(hi):
        return fig.fmt.format(lo)
    # "0.84–1.08×", "1250–1355 MB/s": the unit (what the format puts after the number)
    # once, after the range
    unit = fig.fmt[fig.fmt.rindex("}") + 1 :]
    return f"{fig.fmt.format(lo).removesuffix(unit)}–{fig.fmt.format(hi)}"


def _ckpt(what: str, col: str, **kw: object) -> Fig:
    return Fig("checkpoint", "checkpoint", {"what": what}, col, **kw)  # type: ignore[arg-type]


def _dcp(tier: str, col: str, last: bool = False) -> Fig:
    return Fig("dcp", "DCP, 2 ranks", {"tier": tier, "method": "fmstore"}, col, last=last)


def _s3(op: str, col: str) -> Fig:
    return Fig("stores", "S3Store vs peers", {"op": op}, col)


def _stage(title: str, set_: str, direction: str, tool: str, col: str = "ratio") -> Fig:
    where = {"set": set_, "direction": direction, "tool": tool}
    return Fig("stage", f"stage: {title}", where, col)


def _start(command: str) -> Fig:
    where = {"command": command}
    return Fig("stage", "stage: start to first request", where, "first request s", "{:.2f} s")


def _loader(case: str, col: str, fmt: str = "{:.2f}×") -> Fig:
    table = f"Streaming loaders from SeaweedFS: ({case})"
    return Fig("loader", table, {"library": "fmstore"}, col, fmt=fmt, last=True)


def _ranks(col: str) -> Fig:
    return Fig("loader", "Many ranks on one node", {"library": "fmstore"}, col, last=True)


HEADLINES: tuple[Headline, ...] = (
    Headline(
        "PosixStore large write vs write+fsync floor (1 / 16 objects)",
        (
            Fig(
                "stores",
                "PosixStore vs floor",
                {"what": "PosixStore buffered+fdatasync, 1 object"},
                "vs floor",
            ),
            Fig(
                "stores",
                "PosixStore vs floor",
                {"what": "PosixStore buffered+fdatasync, 16 objects"},
                "vs floor",
            ),
        ),
    ),
    Headline(
        "S3Store upload / download vs boto3 (1 and 16 objects)",
        (_s3("upload", "x boto3"), _s3("download", "x boto3")),
    ),
    Headline(
        "S3Store upload / download vs s3torchconnector",
        (_s3("upload", "x s3torchconnector"), _s3("download", "x s3torchconnector")),
    ),
    Headline(
        "bf16 byte-group+zstd: ratio, MB/s per core",
        (
            _ckpt("bytegroup+zstd on bf16 weights", "ratio", fmt="{:.2f}"),
            _ckpt("bytegroup+zstd on bf16 weights", "enc MB/s", fmt="{:.0f} MB/s"),
        ),
        (" at ",),
    ),
    Headline(
        "checkpoint sync save vs O_DIRECT floor / vs torch.save",
        (
            _ckpt("fmstore.save compression=raw", "vs floor"),
            _ckpt("fmstore.save compression=raw", "vs torch.save"),
        ),
    ),
    Headline(
        "`async_save` first-call stall (fresh process) vs memcpy floor / vs copy into fresh "
        "memory / vs DCP; after `prepare_async_save`",
        (
            _ckpt("fmstore.async_save (first call, fresh process)", "vs floor"),
            _ckpt("fmstore.async_save (first call, fresh process)", "vs fresh floor"),
            _ckpt("fmstore.async_save (first call, fresh process)", "vs DCP"),
            _ckpt("fmstore.async_save after prepare_async_save (first*", "vs floor"),
            _ckpt("fmstore.async_save after prepare_async_save (first*", "vs DCP"),
        ),
        (" / ", " / ", "; ", " / "),
    ),
    Headline(
        "`async_save` steady-state stall vs memcpy floor / vs DCP",
        (
            _ckpt("fmstore.async_save (steady state)", "vs floor"),
            _ckpt("fmstore.async_save (steady state)", "vs DCP"),
        ),
    ),
    Headline(
        "DCP save / load / async stall vs FileSystemWriter / Reader (POSIX)",
        (_dcp("posix", "save x peer"), _dcp("posix", "load x peer"), _dcp("posix", "stall / peer")),
    ),
    Headline(
        "DCP save / load on S3 vs s3torchconnector (newest run)",
        (_dcp("s3", "save x peer", last=True), _dcp("s3", "load x peer", last=True)),
    ),
    Headline(
        "StreamingDataset vs in-memory floor, epoch 1 / 2, first batch: (a) tokens",
        (
            _loader("a", "e1_vs_floor"),
            _loader("a", "e2_vs_floor"),
            _loader("a", "e1_first_batch_s", fmt="{:.2f} s"),
        ),
        (" / ", ", first batch "),
    ),
    Headline(
        "StreamingDataset vs in-memory floor, epoch 1 / 2, first batch: (b) ~100 KB samples",
        (
            _loader("b", "e1_vs_floor"),
            _loader("b", "e2_vs_floor"),
            _loader("b", "e1_first_batch_s", fmt="{:.2f} s"),
        ),
        (" / ", ", first batch "),
    ),
    Headline(
        "StreamingDataset, 4 ranks × 2 workers on one node cache, vs in-memory floor, epoch 1 / "
        "2; epoch 1 vs the floor + download on the same cores",
        (_ranks("e1_vs_floor"), _ranks("e2_vs_floor"), _ranks("e1_vs_bound")),
        (" / ", "; "),
    ),
    Headline(
        "`fmstore stage` vs s5cmd, 10,000 × 4 KiB up / down (synced vs s5cmd + sync; "
        "--fsync none vs s5cmd)",
        (
            _stage("10000", "small", "local→S3", "s5cmd"),
            _stage("10000", "small", "S3→local", "s5cmd + sync"),
            _stage("10000", "small", "S3→local", "s5cmd"),
        ),
        (" / ", "; "),
    ),
    Headline(
        "`fmstore stage` vs s5cmd, 40 × 16 MiB up / down (synced vs s5cmd + sync; "
        "--fsync none vs s5cmd)",
        (
            _stage("10000", "medium", "local→S3", "s5cmd"),
            _stage("10000", "medium", "S3→local", "s5cmd + sync"),
            _stage("10000", "medium", "S3→local", "s5cmd"),
        ),
        (" / ", "; "),
    ),
    Headline(
        "`fmstore stage` vs s5cmd, 3 × 300 MiB up / down (synced vs s5cmd + sync; "
        "--fsync none vs s5cmd)",
        (
            _stage("10000", "big", "local→S3", "s5cmd"),
            _stage("10000", "big", "S3→local", "s5cmd + sync"),
            _stage("10000", "big", "S3→local", "s5cmd"),
        ),
        (" / ", "; "),
    ),
    Headline(
        "start to first S3 request: `fmstore ls` / `fmstore stage` (`s5cmd ls` / `s5cmd cp`)",
        (
            _start("fmstore ls"),
            _start("fmstore stage (download)"),
            _start("s5cmd ls"),
            _start("s5cmd cp (download)"),
        ),
        (" / ", " (", " / "),
        ")",
    ),
    Headline(
        "`fmstore stage` vs aws cli, 10,000 × 4 KiB up / down",
        (
            _stage("10000", "small", "local→S3", "aws"),
            _stage("10000", "small", "S3→local", "aws"),
        ),
    ),
    Headline(
        "verified tiering export nvme→lustre / nvme→S3 vs cp -r + sync / s5cmd cp",
        (
            Fig(
                "tiering",
                "export throughput",
                {"case": "nvme→lustre", "tool": "fmstore mover (verified)"},
                "vs peer",
            ),
            Fig(
                "tiering",
                "export throughput",
                {"case": "nvme→s3", "tool": "fmstore mover (verified)"},
                "vs peer",
            ),
        ),
    ),
)


def render(results_text: str) -> str:
    """The README block (markers included) for RESULTS.md text ``results_text``."""
    results = parse_results(results_text)
    lines = [
        BEGIN,
        "<!-- generated by `python -m benchmarks.readme` from benchmarks/RESULTS.md: "
        "do not edit by hand -->",
        "",
        "| what | fmstore vs peer / floor |",
        "|---|---|",
    ]
    for h in HEADLINES:
        joins = h.joins or (" / ",) * (len(h.figs) - 1)
        text = render_fig(results, h.figs[0])
        for j, fig in zip(joins, h.figs[1:], strict=True):
            text += j + render_fig(results, fig)
        text += h.tail
        lines.append(f"| {h.what} | {text} |")
    lines.append(END)
    return "\n".join(lines)


def rewrite(readme_text: str, block: str) -> str:
    pat = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not pat.search(readme_text):
        raise SystemExit(f"README.md has no {BEGIN} … {END} block")
    return pat.sub(lambda _: block, readme_text, count=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md is stale")
    args = ap.parse_args(argv)
    old = README.read_text()
    new = rewrite(old, render(RESULTS.read_text()))
    if args.check:
        if new != old:
            print(
                "README.md's benchmark block does not match benchmarks/RESULTS.md: "
                "run `python -m benchmarks.readme`",
                file=sys.stderr,
            )
            return 1
        return 0
    if new != old:
        README.write_text(new)
        print(f"updated {README}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

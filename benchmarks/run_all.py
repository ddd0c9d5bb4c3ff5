"""``make bench``: run every benchmark, then write ``benchmarks/RESULTS.md`` and PNG charts.

    python -m benchmarks.run_all [--quick] [--only stores,checkpoint,...] [--skip dcp,...]

Each benchmark runs as its own process (its own SeaweedFS, its own page-cache drops) with the
sizes below; ``--quick`` passes each one's ``--quick`` (small sizes, to check the scripts).
Then README.md's headline block is regenerated from the new RESULTS.md (``benchmarks.readme``).
The tables each benchmark prints (markdown) are collected verbatim; every column of ratios
(names starting ``x `` or containing ``vs``) becomes a bar chart.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import readme
from benchmarks.common import machine

HERE = Path(__file__).parent
#: name → arguments of a full run (the issue's sizes, or the largest this machine fits).
BENCHMARKS: dict[str, list[str]] = {
    "stores": ["--total-mib", "1024"],
    "memory": [],
    "checkpoint": ["--size", "1GiB,4GiB"],
    "dcp": ["--size", "2GiB"],
    "loader": [],
    "stage": [],
    "tiering": [],
    # 4 GiB onto the GPU where CUDA is present; 1 GiB with CPU targets otherwise.
    "gpu": [],
    # this node's figures, the predictions at 1,024 and 16,384 GPUs, the 1-3 node check
    "scale": [],
    # sharded checkpoints of 1-3 nodes on this host: stall, time to durable, exports
    "cluster": ["--size", "256MiB"],
    # per-rank bytes and collectives of a save and a restore, W = 2..16 (counts, not times)
    "ranks": [],
}
#: ``--quick``: sizes that finish in minutes on a 2-core machine, still past cache effects
#: where it matters (others use their own ``--quick``).
QUICK: dict[str, list[str]] = {
    "stores": ["--total-mib", "256"],
    "checkpoint": ["--size", "512MiB"],
    "stage": ["--small-n", "2000", "--big-n", "2", "--big-mib", "128"],
}


def tables(text: str) -> list[tuple[str, list[str]]]:
    """The ``## title`` + markdown table blocks of a benchmark's output."""
    out: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("## "):
            title = lines[i][3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("|"):
                j += 1
            rows = []
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(lines[j])
                j += 1
            if rows:
                out.append((title, rows))
            i = j
        else:
            i += 1
    return out


def chart(name: str, idx: int, title: str, rows: list[str]) -> Path | None:
    cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
    head, body = cells[0], [r for r in cells[2:] if len(r) == len(cells[0])]
    ratio_cols = [
        k for k, h in enumerate(head) if h.startswith("x ") or "vs" in h or "ratio" in h.lower()
    ]
    if not ratio_cols or not body:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [" / ".join(c for c in r[: min(2, len(r))] if c) for r in body]
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(body) * len(ratio_cols) + 1.5))
    height = 0.8 / len(ratio_cols)
    for n, k in enumerate(ratio_cols):
        vals = []
        for r in body:
            try:
                vals.append(float(r[k]))
            except ValueError:
                vals.append(0.0)
        ax.barh([y + n * height for y in range(len(body))], vals, height=height, label=head[k])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(
        [y + height * (len(ratio_cols) - 1) / 2 for y in range(len(body))], labels, fontsize=7
    )
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = HERE / "charts" / f"{name}-{idx}.png"
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _split(text: str) -> tuple[str, dict[str, str]]:
    parts = re.split(r"(?m)^## ", text)
    return parts[0], {p.split("\n", 1)[0].strip(): "## " + p for p in parts[1:]}


def merge_sections(old: str, new: str, names: list[str]) -> str:
    """``old`` with the sections of ``names`` taken from ``new`` (order of BENCHMARKS)."""
    head, old_s = _split(old)
    _, new_s = _split(new)
    merged = {**old_s, **{n: new_s[n] for n in names if n in new_s}}
    return head + "".join(merged[n] for n in BENCHMARKS if n in merged)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--skip", default="")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per benchmark")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    skip = {s for s in args.skip.split(",") if s}
    m = machine()
    sections = [
        "# Benchmark results",
        "",
        f"Machine: {m['cpus']} CPUs ({m['cpu']}), {m['mem_gib']} GiB RAM, Python {m['python']}, "
        f"Linux {m['kernel']}. Run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        + (" (quick sizes)" if args.quick else "")
        + ". S3 is a local SeaweedFS on loopback sharing the same 2 cores, so S3 figures measure "
        "client CPU efficiency as much as the server.",
        "",
    ]
    for name, full in BENCHMARKS.items():
        if (only and name not in only) or name in skip:
            continue
        extra = QUICK.get(name, ["--quick"]) if args.quick else full
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *extra]
        print(f"==> {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        try:
            r = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=args.timeout,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            out, rc = r.stdout, r.returncode
            err = r.stderr
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc, err = -1, f"timed out after {args.timeout} s"
        print(out[-3000:], flush=True)
        sections.append(f"## {name}")
        sections.append("")
        sections.append(
            f"`python -m {' '.join([f'benchmarks.{name}', *extra])}` — {time.time() - t0:.0f} s, exit {rc}"
        )
        sections.append("")
        if rc != 0:
            sections.append("```\n" + "\n".join(err.strip().splitlines()[-15:]) + "\n```\n")
        for i, (title, rows) in enumerate(tables(out)):
            sections.append(f"### {title}")
            sections.append("")
            sections.extend(rows)
            sections.append("")
            png = chart(name, i, title, rows)
            if png:
                sections.append(f"![{title}](charts/{png.name})")
                sections.append("")
        notes = [
            ln for ln in out.splitlines() if ln.lower().startswith(("note", "skipped", "peer"))
        ]
        if notes:
            sections.extend(["Notes printed by the run:", ""] + [f"- {n}" for n in notes] + [""])
    text = "\n".join(sections) + "\n"
    old = HERE / "RESULTS.md"
    if only and old.exists():  # keep the other benchmarks' sections of the last full run
        text = merge_sections(old.read_text(), text, only)
    old.write_text(text)
    print(f"wrote {HERE / 'RESULTS.md'}")
    readme.main([])


if __name__ == "__main__":
    main()

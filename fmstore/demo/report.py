"""The demo's summary table and plot, from the training log, the daemon's metrics and the
catalog."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from ..cli.util import human_bytes
from ..config import load_config
from ..tiering.inventory.catalog import Catalog


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when absent)."""
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name
    ]


def read_log(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def same_final(log: Path, console: Console) -> bool:
    done = [r for r in read_log(log) if r.get("event") == "done"]
    if len(done) < 2:
        console.print("[red]resume check: a run did not finish[/red]")
        return False
    ref, resumed = done[0]["hash"], done[-1]["hash"]
    r = last_restore(log)
    if r:
        console.print(
            f"resumed from step {r['step']} on tier {r['tier'][0] if r['tier'] else '?'} in {r['seconds']:.2f} s"
        )
    if ref == resumed:
        console.print(
            f"[green]bit-identical[/green]: final weights and optimizer state of the killed-and-resumed run equal the uninterrupted run's (sha256 {ref[:16]}…)"
        )
        return True
    console.print(f"[red]MISMATCH[/red]: uninterrupted {ref[:16]}… vs resumed {resumed[:16]}…")
    return False


def last_restore(log: Path) -> dict[str, Any] | None:
    restores = [r for r in read_log(log) if r.get("event") == "restore"]
    return restores[-1] if restores else None


def summarize(work: Path, log: Path, metrics: str, lags: list[float], console: Console) -> None:
    recs = read_log(log)
    steps = [r for r in recs if r.get("event") == "step"]
    first_run = [r for r in steps if r["pid"] == steps[0]["pid"]] if steps else []
    times = [r["step_time"] for r in first_run]
    stalls = [r["ckpt_stall"] for r in first_run if "ckpt_stall" in r]
    t = Table(title="training", show_header=False)
    t.add_row("steps", str(len(first_run)))
    if first_run:
        t.add_row("final loss", f"{first_run[-1]['loss']:.3f} (first {first_run[0]['loss']:.3f})")
    if times:
        t.add_row("step time (median)", f"{statistics.median(times) * 1000:.1f} ms")
    if stalls:
        t.add_row(
            "checkpoint stall (median / max)",
            f"{statistics.median(stalls) * 1000:.1f} / {max(stalls) * 1000:.1f} ms"
            f"  = {statistics.median(stalls) / statistics.median(times):.2f} step times",
        )
    console.print(t)

    cfg = load_config(work / "fmstore.toml")
    with Catalog.for_state_dir(cfg.state_dir) as cat:
        copies = cat.copies()
    per: dict[tuple[str, str], list[int]] = defaultdict(list)
    for c in copies:
        per[(c.tier, c.state)].append(c.bytes)
    t = Table(title="checkpoints per tier and state (catalog)")
    for col in ("tier", "state", "copies", "bytes"):
        t.add_column(col)
    for tier in ("nvme", "lustre", "s3"):
        for (tr, state), sizes in sorted(per.items()):
            if tr == tier:
                t.add_row(tier, state, str(len(sizes)), human_bytes(sum(sizes)))
    console.print(t)

    if metrics:
        t = Table(title="tiering daemon (/metrics)")
        t.add_column("what")
        t.add_column("value", justify="right")
        for labels, value in _samples(metrics, "fmstore_tier_copy_bytes_total"):
            t.add_row(f"bytes copied {labels.get('src')} → {labels.get('dst')}", human_bytes(value))
        if lags:
            t.add_row(
                "export lag while training (mean / max)",
                f"{statistics.mean(lags):.1f} / {max(lags):.1f} s",
            )
        t.add_row(
            "export lag at the end", f"{metric(metrics, 'fmstore_tier_export_lag_seconds'):.1f} s"
        )
        n = metric(metrics, "fmstore_tier_copy_seconds_count")
        if n:
            t.add_row(
                "copies / mean copy time",
                f"{n:.0f} / {metric(metrics, 'fmstore_tier_copy_seconds_sum') / n:.2f} s",
            )
        console.print(t)


#: Label levels above a tier's bar; labels that fit on none are left out (the tick stays).
LABEL_LEVELS = 3


def label_levels(xs: Sequence[float], width: float, levels: int = LABEL_LEVELS) -> list[int | None]:
    """For labels starting at ``xs``, each ``width`` wide: the level each goes on so that no
    two on one level overlap (the lowest free one), None when all are taken."""
    ends = [float("-inf")] * levels
    out: list[int | None] = [None] * len(xs)
    for i in sorted(range(len(xs)), key=lambda i: xs[i]):
        for lv in range(levels):
            if xs[i] >= ends[lv]:
                ends[lv] = xs[i] + width
                out[i] = lv
                break
    return out


def timeline(
    ax: Any, copies: Sequence[Any], t_start: float, end: float, rows: dict[str, int]
) -> None:
    """Each checkpoint copy as a bar on its tier's row, from complete to deleted, with its
    step above the start; labels of steps close in time are stacked, never overlapping."""
    ax.set_xlim(0, max(end, 1e-9) * 1.02)
    fig = ax.figure
    fig.canvas.draw()  # the axes' size in pixels is known once laid out
    px = ax.get_window_extent().width or 1.0
    per_px = ax.get_xlim()[1] / px
    by_row: dict[int, list[tuple[float, str]]] = {}
    for c in copies:
        y = rows.get(c.tier)
        if y is None or c.state in ("writing", "exporting"):
            continue
        born = (c.verified or c.created) - t_start  # when the copy was complete on that tier
        gone = c.updated - t_start if c.state in ("deleted", "released") else end
        color = {"nvme": "tab:green", "lustre": "tab:blue", "s3": "tab:purple"}.get(c.tier, "grey")
        ax.plot([born, gone], [y, y], color=color, lw=6, alpha=0.35, solid_capstyle="butt")
        ax.plot([born], [y], "|", color=color, ms=14)
        by_row.setdefault(y, []).append((born, str(c.step)))
    char_px = 7 * fig.dpi / 72 * 0.7  # a digit at fontsize 7, with room to spare
    for y, labels in by_row.items():
        longest = max(len(t) for _x, t in labels)
        width = (longest + 1) * char_px * per_px
        for (x, text), lv in zip(labels, label_levels([x for x, _t in labels], width)):
            if lv is not None:
                ax.annotate(text, (x, y + 0.18 + 0.24 * lv), fontsize=7)


def plot(work: Path, log: Path, console: Console) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_log(log)
    steps = [r for r in recs if r.get("event") == "step"]
    pid0 = steps[0]["pid"]
    run = [r for r in steps if r["pid"] == pid0]
    t_start = run[0]["t"]
    cfg = load_config(work / "fmstore.toml")
    with Catalog.for_state_dir(cfg.state_dir) as cat:
        copies = cat.copies("runs/demo")
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=[2, 1])
    ax1.plot([r["t"] - t_start for r in run], [r["loss"] for r in run], lw=1)
    ax1.set_ylabel("training loss")
    ax1.set_title("fmstore demo: loss and checkpoint timeline per tier")
    for r in run:
        if "ckpt_stall" in r:
            ax1.axvline(r["t"] - t_start, color="grey", lw=0.5, alpha=0.5)
    rows = {"nvme": 2, "lustre": 1, "s3": 0}
    end = max([run[-1]["t"]] + [c.updated for c in copies]) - t_start
    ax2.set_yticks(list(rows.values()), list(rows.keys()))
    ax2.set_ylim(-0.5, 3.0)
    ax2.set_xlabel(
        "seconds since the first step (each bar: a checkpoint's copy on a tier, from complete to deleted)"
    )
    fig.tight_layout()  # the axes' final size: labels are spaced for it
    timeline(ax2, copies, t_start, end, rows)
    png = work / "demo.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png

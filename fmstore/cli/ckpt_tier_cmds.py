"""``fmstore ckpt list`` and ``fmstore ckpt verify --all-tiers``: checkpoints across tiers.

Both read the catalog of the config's ``state_dir`` and look at the tiers themselves, so
they also work on a node whose catalog is new or lost.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import typer
from rich.table import Table
from rich.text import Text

from .. import runtime
from ..checkpoint.commit import read_bounded_manifest
from ..config import Config, load_config
from ..errors import ConfigError, FmstoreError, NotFound
from ..format.manifest import Manifest
from ..protocol.env import Env
from ..protocol.skew import InFuture, future_groups
from ..stores import split_tier
from ..stores.base import Store
from ..tiering.exports.parts import parts_on
from ..tiering.inventory import catalog as cat
from ..tiering.inventory.catalog import Catalog
from ..tiering.inventory.discovery import Rediscovered, rediscover
from ..tiering.policy.policies import Policies, State, export_lags, from_config
from ..tiering.tiers import Tiers
from .main import ckpt
from .progress import make_console
from .util import human_bytes, plural, printable

_STYLE = {
    cat.PRESENT: "green",
    cat.CORRUPT: "bold red",
    cat.MISSING: "red",
    cat.EXPORTING: "yellow",
    cat.WRITING: "yellow",
    cat.DELETING: "yellow",
    cat.RELEASED: "dim",
    cat.DELETED: "dim",
    cat.SUPERSEDED: "dim",
}


def _discover(config: Config, catalog: Catalog, ladder: tuple[str, ...], roots: list[str] | None):
    """Record committed checkpoints found on the tiers that the catalog does not know
    (every root on every tier when ``roots`` is None)."""
    tiers = Tiers(config)

    async def scan() -> Rediscovered:
        try:
            return await rediscover(catalog, tiers, ladder, roots)
        finally:
            await tiers.close()

    return runtime.run(scan())


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _lag_lines(pol: Policies, catalog: Catalog, roots: list[str]) -> list[str]:
    s = State(
        checkpoints=[c for r in roots for c in catalog.checkpoints(r)],
        copies=[c for r in roots for c in catalog.copies(r)],
        pins=catalog.pins(),
        now=catalog.now(),
    )
    out = []
    for lag in export_lags(pol, s):
        line = f"lag {lag.root} → {lag.dest}: {lag.pending} pending"
        if lag.oldest_pending_step is not None:
            line += f", oldest step {lag.oldest_pending_step} ({_age(lag.oldest_pending_age)} old)"
        newest = "none" if lag.newest_step is None else str(lag.newest_step)
        out.append(f"{line}; newest step {newest}")
    return out


@ckpt.command("list")
def list_checkpoints(
    root: str = typer.Argument(None, help="Run root (like runs/llama); default: every root."),
    config: str = typer.Option(None, "--config", "-c", help="fmstore.toml to use."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """A table of steps × tiers with each copy's state and size; below it the export lag,
    for each copy whose export keeps failing, its failures and the last error, and what the
    tiers hold that is not counted as a checkpoint (a native DCP directory, torchtitan's
    step-4, ...) and why."""
    cfg = load_config(config)
    pol = from_config(cfg)
    if root:
        _check_root(root, cfg)
    with Catalog.for_state_dir(cfg.state_dir) as catalog:
        found = _discover(cfg, catalog, pol.ladder, [root.strip("/")] if root else None)
        roots = [root.strip("/")] if root else catalog.roots()
        rows = [c for r in roots for c in catalog.copies(r)]
        ckpts = {(c.root, c.step): c for r in roots for c in catalog.checkpoints(r)}
        lags = _lag_lines(pol, catalog, roots)
        now = catalog.now()
    uncounted = [printable(found.notes.describe(r), markup=False) for r in found.notes.roots()]
    ahead = [f for f in found.notes.future if f.root in roots or not root]
    skewed = [
        printable(g.describe(Env.from_config(cfg).clock_skew), markup=False)
        for g in future_groups(ahead)
    ]
    if root and not rows and ahead:
        raise NotFound(
            f"no checkpoint of run root {root.strip('/')!r} is counted as committed, but "
            f"{plural(len(ahead), 'checkpoint')} of it exist with manifests created in the "
            "future:" + "".join(f"\n  {line}" for line in skewed)
        )
    if root and not rows:
        raise NotFound(
            f"no checkpoint of run root {root.strip('/')!r} on any tier "
            f"({', '.join(pol.ladder)}) nor in the catalog of {cfg.state_dir}"
            + "".join(f"\n  {line}" for line in uncounted)
        )
    by_step: dict[tuple[str, int], dict[str, cat.Copy]] = {}
    for c in rows:
        by_step.setdefault((c.root, c.step), {})[c.tier] = c
    future: dict[tuple[str, int], dict[str, InFuture]] = {}
    for f in ahead:  # not in the catalog: not counted; shown in their rows all the same
        future.setdefault((f.root, f.step), {})[f.tier] = f
        by_step.setdefault((f.root, f.step), {})
    parts = _parts(cfg, rows)
    if as_json:
        out = [
            {
                "root": r,
                "step": s,
                "bytes": ckpts[(r, s)].bytes if (r, s) in ckpts else None,
                "tiers": {
                    t: {"state": c.state, "bytes": c.bytes, "verified": c.verified}
                    | (
                        {"failures": c.failures, "error": c.error, "error_at": c.error_at}
                        if c.failures
                        else {}
                    )
                    | ({"never_committed": True, "error": c.error} if c.never_committed else {})
                    | (
                        {"parts" if "present" in parts[(r, s, t)] else "part": parts[(r, s, t)]}
                        if (r, s, t) in parts
                        else {}
                    )
                    for t, c in copies.items()
                }
                | {
                    t: {
                        "state": "not_counted",
                        "why": "created_in_future",
                        "offset_seconds": round(f.offset, 1),
                        "node": f.node,
                    }
                    for t, f in future.get((r, s), {}).items()
                },
            }
            for (r, s), copies in sorted(by_step.items())
        ]
        typer.echo(json.dumps(out, indent=2))
        for line in skewed + uncounted:
            typer.echo(f"warning: {line}", err=True)
        return
    table = Table(box=None, show_header=True)
    table.add_column("root")
    table.add_column("step", justify="right")
    for t in pol.ladder:
        table.add_column(t)
    local_parts = False  # a node-local column showing this node's part of a step in parts
    for (r, s), copies in sorted(by_step.items()):
        cells: list[str | Text] = []
        for t in pol.ladder:
            cp = copies.get(t)
            if cp is None:
                f = future.get((r, s), {}).get(t)
                cells.append("" if f is None else Text(f.describe(), style="bold red"))
                continue
            nbytes = cp.bytes
            part = parts.get((r, s, t))
            if part and isinstance(part.get("bytes"), int):
                nbytes = int(part["bytes"])  # type: ignore[call-overload]  # this node's part
            size = f" {human_bytes(nbytes)}" if cp.state in cat.HOLDS_BYTES and nbytes else ""
            mark = "✓" if cp.state == cat.PRESENT and cp.verified else ""
            mark += f" ✗{cp.failures}" if cp.failures else ""
            if part and "present" in part:  # a shared tier: the nodes whose parts are there
                present: list[str] = part["present"]  # type: ignore[assignment]
                where = f" parts {len(present)}/{part['of'] or '?'} ({','.join(present)})"
                if part.get("cannot"):
                    where += (
                        " cannot complete: no node holds the parts of " + ", ".join(part["cannot"])  # type: ignore[arg-type]
                    )
                elif part.get("waiting"):
                    where += f" waiting for {','.join(part['waiting'])}"  # type: ignore[arg-type]
            else:
                where = (
                    f" part {part['index']}/{part['of']} (this node, {part['node']})"
                    if part
                    else ""
                )
                local_parts = local_parts or bool(part)
            state = "not committed" if cp.never_committed else cp.state  # a save that raised
            cells.append(Text(f"{state}{mark}{where}{size}", style=_STYLE.get(cp.state, "")))
        table.add_row(printable(r), str(s), *cells)
    console = make_console()
    console.print(table)
    # A save that never committed is listed (that it failed is news), not counted.
    n = sum(not all(c.never_committed for c in cs.values()) for cs in by_step.values())
    console.print(f"[dim]{plural(n, 'checkpoint')}; ✓ = verified[/dim]")
    for line in lags:
        console.print(printable(line, markup=False), highlight=False, markup=False)
    for line in _failure_lines(rows, now):
        console.print(printable(line, markup=False), style="red", highlight=False, markup=False)
    for c in rows:
        if c.state == cat.EXPORTING and not c.failures and (c.error or "").startswith("waiting"):
            # This node's part is on the shared tier; the commit waits for other nodes'.
            line = f"part of {c.root} step {c.step} on {c.tier}, commit {c.error}"
            console.print(printable(line, markup=False), highlight=False, markup=False)
    if local_parts:
        console.print(
            "part i/N (this node, NODE): a node-local tier's column shows this node's part "
            "only; the step restores from node-local copies only while every node of the save "
            "holds its part, else from a shared tier's committed copy",
            style="dim",
            highlight=False,
            markup=False,
        )
    for line in skewed:
        console.print(line, style="bold red", highlight=False, markup=False)
    for line in _cannot_lines(parts):
        console.print(printable(line, markup=False), style="red", highlight=False, markup=False)
    for line in uncounted:
        console.print(f"not counted: {line}", style="yellow", highlight=False, markup=False)


def _check_root(root: str, cfg: Config) -> None:
    """Refuse a location where a run root is meant: the root is the same on every tier."""
    tier, rest = split_tier(root, cfg)
    if tier is not None:
        raise ConfigError(
            f"{root!r} is a location on tier {tier!r}; ckpt list takes a run root, the same "
            f"on every tier: fmstore ckpt list {rest.strip('/') or 'ROOT'}"
        )
    if "://" in root or root.startswith(("/", "./", "~")):
        raise ConfigError(
            f"{root!r} is a location; ckpt list takes a run root, the key prefix of a "
            "CheckpointManager (like runs/llama), the same on every tier"
        )


def _failure_lines(rows: list[cat.Copy], now: float) -> list[str]:
    """One line per copy whose export keeps failing: the count, the last error, when."""
    out = []
    for c in rows:
        if not c.failures:
            continue
        at = c.error_at or now
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
        out.append(
            f"failing {c.root} step {c.step} → {c.tier}: {plural(c.failures, 'failure')}, "
            f"last at {when} ({_age(max(0.0, now - at))} ago): {c.error}"
        )
    return out


def _parts(cfg: Config, rows: list[cat.Copy]) -> dict[tuple[str, int, str], dict[str, object]]:
    """For copies on node-local tiers of sharded checkpoints in several parts: which part
    this node holds (``index`` of ``of``, ``node``), from each manifest's ``parts``.  For
    copies on shared tiers of checkpoints whose node-local copies are in parts: which nodes'
    parts are there (``present``, ``of``, ``committed``), from the destination's part
    records (every node sees every part there)."""
    local = [c for c in rows if c.state in cat.HOLDS_BYTES and cfg.tier(c.tier).scope == "node"]
    if not local:
        return {}
    shared = [
        c
        for c in rows
        if c.state in (cat.EXPORTING, cat.PRESENT, cat.CORRUPT) and cfg.tier(c.tier).scope != "node"
    ]
    from ..checkpoint.dcp.manifest import DcpManifest  # loads torch: only with node-local copies
    from ..checkpoint.dcp.nodes import node_id

    me = node_id()
    tiers = Tiers(cfg)

    async def read() -> dict[tuple[str, int, str], dict[str, object]]:
        out: dict[tuple[str, int, str], dict[str, object]] = {}
        for c in local:
            try:
                store = tiers.checkpoint(c.tier, c.root, c.step)
                data = await read_bounded_manifest(store)
                m = DcpManifest.loads(data, where=f"{c.tier}:{c.root} step {c.step}")
            except Exception:
                continue  # the copy's state says what is wrong with it
            nodes = [p.node for p in m.parts]
            if nodes:
                idx = nodes.index(me) + 1 if me in nodes else 0
                own = m.part_view(me) if me in nodes else None
                out[(c.root, c.step, c.tier)] = {
                    "index": idx,
                    "of": len(nodes),
                    "nodes": nodes,
                    "node": me,
                    # this node's own bytes (its blobs), not the whole checkpoint's
                    "bytes": sum(b.size for b in own.blobs) if own is not None else 0,
                }
        in_parts = {(r, s): p["of"] for (r, s, _t), p in out.items()}
        node_names = {(r, s): p["nodes"] for (r, s, _t), p in out.items()}
        for c in shared:
            if (c.root, c.step) not in in_parts:
                continue
            with contextlib.suppress(FmstoreError):
                got = await parts_on(tiers.checkpoint(c.tier, c.root, c.step))
                if got is not None:
                    got["of"] = got["of"] or in_parts[(c.root, c.step)]
                    names: list[str] = node_names[(c.root, c.step)]  # type: ignore[assignment]
                    have = set(got["present"])  # type: ignore[call-overload]
                    # the nodes whose parts the step waits for on this tier
                    got["waiting"] = [] if got["committed"] else [n for n in names if n not in have]
                    out[(c.root, c.step, c.tier)] = got
        _never(cfg, out)
        await tiers.close()
        return out

    return runtime.run(read())


def _never(cfg: Config, parts: dict[tuple[str, int, str], dict[str, object]]) -> None:
    """Mark the shared copies whose commit cannot complete (``cannot``: the nodes whose
    parts no node holds), as this node sees it: a waited-for node exported its part of a
    later step of the run root to that tier (its daemon is past this step, so its node no
    longer holds this one's part: a replaced node, a wiped NVMe) and no node-local tier keeps
    replicas of parts (``replicas = 0``) that a peer could export in its place."""
    if any(t.scope == "node" and t.replicas > 0 for t in cfg.tiers.values()):
        return
    seen: dict[tuple[str, str, str], int] = {}  # (root, tier, node) -> its newest step there
    for (r, s, t), p in parts.items():
        for n in p.get("present") or []:  # type: ignore[attr-defined]
            seen[(r, t, n)] = max(seen.get((r, t, n), s), s)
    for (r, s, t), p in parts.items():
        waiting: list[str] = p.get("waiting") or []  # type: ignore[assignment]
        cannot = [n for n in waiting if seen.get((r, t, n), -1) > s]
        if cannot:
            p["cannot"] = cannot


def _cannot_lines(parts: dict[tuple[str, int, str], dict[str, object]]) -> list[str]:
    """Why each shared copy marked by :func:`_never` stays uncommitted, and what to do."""
    out = []
    for (r, s, t), p in sorted(parts.items()):
        cannot: list[str] = p.get("cannot") or []  # type: ignore[assignment]
        if cannot:
            nodes = ", ".join(cannot)
            out.append(
                f"{r} step {s} on {t} cannot complete: no node holds the parts of {nodes} "
                f"({nodes} exported a later step since, and no replicas are kept): it will "
                "never be restorable from there; restore a committed step"
            )
    return out


async def _own_part(store: Store) -> Any:
    """On a node-local tier: this node's part of a sharded checkpoint in node parts (the
    other nodes' blobs are not here), None for any other checkpoint (verified whole)."""
    from ..checkpoint.verify import read_committed

    try:
        _data, m = await read_committed(store)
    except FmstoreError:
        return None  # verify_checkpoint reads it again and reports what is wrong
    if isinstance(m, Manifest) or not m.parts:
        return None
    from ..checkpoint.dcp.nodes import node_id

    return m.part_view(node_id()) or m


def _own(cfg: Config, tier: str) -> bool:
    """Whether only this node removes copies from ``tier``: a node-local tier, or any tier
    of a config without node-local ones (one node).  Where nodes share a tier beside their
    own, another node's daemon may have removed a copy there by the same retention rules
    before this node's catalog heard of it: that is for the daemons, not an error."""
    return cfg.tier(tier).scope == "node" or all(t.scope != "node" for t in cfg.tiers.values())


def _tracked_steps(cfg: Config, rows: list[cat.Copy]) -> set[int]:
    """Steps that should have a good copy: one catalogued present (on a tier this node
    alone removes from) or corrupt, or every copy of which was found gone (``missing``)
    with none retired on purpose (deleted or released)."""
    by_step: dict[int, list[cat.Copy]] = {}
    for c in rows:
        by_step.setdefault(c.step, []).append(c)
    out = set()
    for step, copies in by_step.items():
        states = {c.state for c in copies}
        present = any(c.state == cat.PRESENT and _own(cfg, c.tier) for c in copies)
        if present or cat.CORRUPT in states or states == {cat.MISSING}:
            out.add(step)
    return out


def verify_all_tiers(root: str, config: str | None = None, *, as_json: bool = False) -> int:
    """Verify every committed copy of every checkpoint of ``root`` on every tier; marks bad
    copies ``corrupt`` in the catalog, good ones verified, and copies the catalog has as
    present that are gone from a tier ``missing``.  Returns the exit code: 1 when a copy is
    bad or gone, or a checkpoint has no good copy left.  ``as_json``: one JSON object on
    stdout instead of a line per copy."""
    from ..checkpoint.verify import verify_checkpoint  # loads torch: only when verifying

    cfg = load_config(config)
    pol = from_config(cfg)
    root = root.strip("/")
    tiers = Tiers(cfg)
    reached: set[str] = set()
    unchecked: set[tuple[str, int]] = set()

    async def run() -> list[tuple[str, int, bool, list[str], int]]:
        out = []
        for tier in pol.ladder:
            try:
                steps = await tiers.steps_on(tier, root)
            except Exception as e:
                out.append((tier, -1, False, [f"tier unreachable: {e}"], 0))
                continue
            reached.add(tier)
            for step in steps:
                store = tiers.checkpoint(tier, root, step)
                try:
                    part = await _own_part(store) if cfg.tier(tier).scope == "node" else None
                    res = await verify_checkpoint(store, part)
                except FmstoreError as e:  # a read that failed: unknown, never "corrupt"
                    unchecked.add((tier, step))
                    out.append((tier, -1, False, [f"step {step} not checked: {e}"], 0))
                    continue
                out.append((tier, step, res.ok, res.problems, res.bytes))
        await tiers.close()
        return out

    results = runtime.run(run())
    console = make_console(quiet=as_json)
    bad = 0
    with Catalog.for_state_dir(cfg.state_dir) as catalog:
        seen = {(t, s) for t, s, *_ in results}
        tracked = _tracked_steps(cfg, catalog.copies(root))
        # Catalogued as present on a tier that answered, but not committed there any more
        # (removed outside fmstore): gone, not good.
        for c in catalog.copies(root, states=[cat.PRESENT]):
            gone = (c.tier, c.step) not in seen | unchecked
            if c.tier in reached and gone and _own(cfg, c.tier):
                results.append((c.tier, c.step, False, ["catalogued as present, but gone"], 0))
        for tier, step, ok, problems, nbytes in results:
            if step < 0:
                bad += 1
                console.print(f"[red]{tier}: {printable(problems[0])}[/red]", highlight=False)
                continue
            catalog.record_checkpoint(root, step)
            if ok:
                catalog.set_copy(
                    root, step, tier, cat.PRESENT, bytes=nbytes, verified=catalog.now()
                )
                console.print(f"[green]ok[/green]  {tier:<8} step {step}", highlight=False)
            else:
                bad += 1
                gone = (tier, step) not in seen
                state = cat.MISSING if gone else cat.CORRUPT
                catalog.set_copy(root, step, tier, state, error="; ".join(problems)[:2000])
                console.print(
                    f"[red]BAD[/red] {tier:<8} step {step}: {printable('; '.join(problems))}",
                    highlight=False,
                )
    good_steps = {s for _t, s, ok, _p, _n in results if ok}
    lost = sorted((tracked | {s for _t, s, *_ in results if s >= 0}) - good_steps)
    for step in lost:
        console.print(f"[red]BAD[/red] step {step}: no good copy on any tier", highlight=False)
    summary = f"{len(results) - bad} good, {bad} bad copies of {root!r}"
    console.print(
        summary + (f"; {plural(len(lost), 'checkpoint')} with no good copy" if lost else ""),
        markup=False,
    )
    if as_json:
        copies = [
            {"tier": t, "step": s if s >= 0 else None, "ok": ok, "bytes": n, "problems": p}
            for t, s, ok, p, n in results
        ]
        doc = {"root": root, "ok": not (bad or lost), "good": len(results) - bad, "bad": bad}
        typer.echo(json.dumps({**doc, "lost": lost, "copies": copies}))
    return 1 if bad or lost else 0

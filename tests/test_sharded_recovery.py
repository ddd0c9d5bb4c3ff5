"""``ShardedCheckpointManager`` on two ranks, each its own node (gloo, processes spawned by
the test): no failure lost, starts that must work, read errors that are never "no
checkpoint", the caller's config everywhere, SIGTERM agreed at the next step.

One launch runs the whole sequence (the ranks' start-up is most of its time); each rank
returns what it saw and the test checks it.  Every rank's ``$FMSTORE_CONFIG`` names a decoy
config whose tiers must stay empty: the managers are given ``config=`` of their own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from gloo_ranks import run
from sharded_support import config_text, make_state, same

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

STEP = "run/step_{:012d}"


def _error(fn: Any) -> str:
    """``''`` if ``fn()`` returns, else the exception's classes (what a caller catches)."""
    try:
        fn()
    except BaseException as e:
        return " ".join(c.__name__ for c in type(e).__mro__)
    return ""


def sequence(rank: int, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    from fmstore import ShardedCheckpointManager
    from fmstore.checkpoint.dcp.nodes import RankRecord, rank_record_key
    from fmstore.checkpoint.layout import new_generation
    from fmstore.tiering.inventory.catalog import Catalog

    node = f"n{rank}"
    nvme = Path(tmp, node, "nvme")
    cfg = f"{tmp}/{node}.toml"
    pg = dist.new_group(backend="gloo")
    seen: dict[str, Any] = {}
    mgr = ShardedCheckpointManager("run", process_group=pg, config=cfg)

    def restore(m: Any = mgr, step: int | None = None, want: int | None = None) -> int | None:
        state = make_state(0)
        got = m.restore(state, step=step)
        if got is not None:
            seen[f"exact-{got}"] = same(state, make_state(want or got))
        return got

    # -- starts that must work: nothing yet; a job killed in its first save (a rank record,
    # no manifest) beside an empty step directory
    seen["fresh"] = restore()
    gen = new_generation()
    pending = nvme / STEP.format(5) / rank_record_key(gen, rank)
    pending.parent.mkdir(parents=True)
    (pending.parent / f"{rank:06d}.bin").write_bytes(b"abc")
    rec = RankRecord(gen, "s", rank, node, ((f"{rank:06d}.bin", 3),), nodes=("n0", "n1"))
    pending.write_bytes(rec.dumps())
    (nvme / STEP.format(7)).mkdir(parents=True)
    if rank == 0:
        (Path(tmp, "lustre") / STEP.format(7)).mkdir(parents=True)
    dist.barrier(pg)
    seen["killed_first_save"] = restore()
    seen["pending_removed"] = not pending.exists()

    # -- saves; restore(step=...)
    for s in (10, 20):
        mgr.save(s, make_state(s))
    mgr.wait()
    seen["replica"] = (nvme / ".replicas" / STEP.format(20) / "manifest.json").exists()
    seen["newest"] = restore()
    seen["step_10"] = restore(step=10)

    # -- a read error on the only node holding step 20's manifest, while n1's copy is not
    # written yet (its part pending): unknown, so raised, and nothing removed
    man = nvme / STEP.format(20) / "manifest.json"
    aside = man.with_name("aside.json")
    if rank == 0:
        man.rename(aside)
        man.symlink_to("manifest.json")  # a link loop: the store refuses to read it
    else:
        man.unlink()
    part_before = sorted(p.name for p in (nvme / STEP.format(20)).rglob("*"))
    dist.barrier(pg)
    seen["read_error"] = _error(restore)
    seen["part_kept"] = sorted(p.name for p in (nvme / STEP.format(20)).rglob("*")) == part_before
    if rank == 0:
        man.unlink()
        aside.rename(man)
    dist.barrier(pg)
    # Restored by a manager whose catalog is new: n1's adopted part is recorded there.
    fresh = Path(tmp, f"{node}-fresh.toml")
    fresh.write_text(config_text(tmp, node, state="state-fresh"))
    mgr_fresh = ShardedCheckpointManager("run", process_group=pg, config=str(fresh))
    seen["after_read_error"] = restore(mgr_fresh)
    with Catalog.for_state_dir(f"{tmp}/{node}/state-fresh") as c:
        seen["recorded"] = [(x.step, x.tier, x.state) for x in c.copies("run", step=20)]
    mgr_fresh.close()

    # -- a failed background save: raised by the next save(), fmstore's own error
    Path(nvme, STEP.format(30)).parent.mkdir(parents=True, exist_ok=True)
    if rank == 1:
        Path(nvme, STEP.format(30)).write_bytes(b"not a directory")
    dist.barrier(pg)
    seen["save_30"] = _error(lambda: mgr.save(30, make_state(30)))
    seen["save_40"] = _error(lambda: mgr.save(40, make_state(40)))
    seen["save_40_again"] = _error(lambda: mgr.save(40, make_state(40)))
    seen["wait"] = _error(mgr.wait)
    if rank == 1:
        Path(nvme, STEP.format(41)).write_bytes(b"not a directory")
    dist.barrier(pg)
    seen["save_41"] = _error(lambda: mgr.save(41, make_state(41)))
    seen["wait_41"] = _error(mgr.wait)
    seen["wait_after"] = _error(mgr.wait)  # raised once

    # -- a rank-local failure (n0's catalog cannot be written): save() goes on, wait() and
    # close() raise it on that rank only
    bad = Path(tmp, f"{node}-bad.toml")
    if rank == 0:
        Path(tmp, node, "state-file").write_text("a file, not a directory")
    bad.write_text(config_text(tmp, node, state="state-file" if rank == 0 else "state"))

    def local() -> None:
        with ShardedCheckpointManager("run", process_group=pg, config=str(bad)) as m:
            m.save(50, make_state(50))
            seen["save_after_local"] = _error(lambda: m.save(60, make_state(60)))
            # a collective after it: no rank leaves it because of its own failure
            seen["restore_after_local"] = _error(lambda: m.restore(make_state(0)))

    seen["close_local"] = _error(local)

    # -- a restore that passes over a newer, uncommitted step says why
    (nvme / STEP.format(70)).mkdir()
    dist.barrier(pg)
    seen["passed_over"] = restore()
    seen["reason"] = list(mgr.restored_reason)

    # -- a fallback, then the redone steps: n1 replaced after step 80 (its part and n0's
    # replica of it gone), the job falls back to 60 and saves 80 again on every node
    mgr.save(80, make_state(80))
    mgr.wait()

    def export_80() -> Any:  # this node's part to lustre, as its daemon does
        from fmstore import runtime
        from fmstore.protocol.env import Env
        from fmstore.stores import open_store
        from fmstore.tiering.exports.mover import CHECKPOINT_COPY
        from fmstore.tiering.exports.parts import export_part

        src = open_store(str(nvme / STEP.format(80)))
        dst = open_store(str(Path(tmp, "lustre", STEP.format(80))))
        return runtime.run(
            export_part(src, dst, node, options=CHECKPOINT_COPY, env=Env())
        ).waiting_for

    if rank == 0:  # n0's daemon exported its part before n1 was lost
        seen["export_old_80"] = export_80()
        with Catalog.for_state_dir(f"{tmp}/{node}/state") as c:
            c.set_copy("run", 80, "lustre", "exporting")
    if rank == 1:
        shutil.rmtree(nvme / STEP.format(80))
    else:
        shutil.rmtree(nvme / ".replicas" / STEP.format(80))
    dist.barrier(pg)
    seen["fallback"] = restore()
    seen["moved_aside"] = list(getattr(mgr, "moved_aside", ()))
    seen["aside_left"] = sorted(
        str(p.relative_to(nvme).parent.parent)
        for p in nvme.glob(".aside/*/**/step_000000000080/manifest.json")
    )
    seen["newer_left"] = (nvme / STEP.format(80)).exists() or (
        nvme / ".replicas" / STEP.format(80)
    ).exists()
    with Catalog.for_state_dir(f"{tmp}/{node}/state") as c:
        seen["rows_80"] = [(x.tier, x.state) for x in c.copies("run", step=80)]
    seen["redo_80"] = _error(lambda: (mgr.save(80, make_state(81)), mgr.wait()))
    seen["gen_80"] = json.loads((nvme / STEP.format(80) / "manifest.json").read_bytes())[
        "generation"
    ]
    seen["after_redo"] = restore(want=81)
    # the redone step's export follows, beside the old step's uncommitted part
    seen["export_80"] = export_80()
    dist.barrier(pg)
    if rank == 0:
        # n0 again: n1's part is there now, but the lease of n0's export of the abandoned
        # generation may still be alive (its writes could land yet): the commit waits
        seen["export_80_waits"] = export_80()
        # no attempt renews that lease any more (the restore took its row): it ages out
        from fmstore.protocol.records import ExportLease, lease_key

        for lease in Path(tmp, "lustre", STEP.format(80)).glob("*/export-n0.json"):
            if lease.parent.name != seen["gen_80"]:
                key = lease_key(lease.parent.name, "n0")
                lease.write_bytes(ExportLease("n0", os.getpid(), 1.0).dumps())
                seen["aged"] = key
        seen["export_80"] = export_80()  # it commits
    with Catalog.for_state_dir(f"{tmp}/{node}/state") as c:
        seen["rows_80_redone"] = [(x.tier, x.state) for x in c.copies("run", step=80)]

    if rank == 0:
        Path(tmp, "elsewhere").mkdir()
        Path(tmp, "lustre", "linked").symlink_to(Path(tmp, "elsewhere"))
    dist.barrier(pg)
    linked = ShardedCheckpointManager("linked", process_group=pg, config=cfg)
    seen["unlisted"] = _error(lambda: linked.restore(make_state(0)))
    linked.close()

    # -- SIGTERM on one rank: every rank agrees to save at the next step
    seen["before_sigterm"] = mgr.should_save(1, every=100)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    seen["after_sigterm"] = mgr.should_save(2, every=100)
    seen["preempted"] = mgr.preempted
    mgr.close()
    return seen


def test_sharded_manager_recovers_the_way_clusters_fail(tmp_path):
    tmp = str(tmp_path)
    envs = []
    for node in ("n0", "n1"):
        Path(tmp, f"{node}.toml").write_text(config_text(tmp, node))
        decoy = Path(tmp, f"decoy-{node}.toml")
        decoy.write_text(config_text(f"{tmp}/decoy", node, replicas=0))
        envs.append({"FMSTORE_NODE_ID": node, "FMSTORE_CONFIG": str(decoy)})
    r0, r1 = run(sequence, envs, tmp, init=str(tmp_path / "pg-init"))
    for seen in (r0, r1):
        assert seen["fresh"] is None
        assert seen["killed_first_save"] is None and seen["pending_removed"]
        assert seen["replica"]
        assert seen["newest"] == 20 and seen["step_10"] == 10
        # never skipped for step 10, nothing removed
        assert "StoreUnavailable" in seen["read_error"] and seen["part_kept"]
        assert seen["after_read_error"] == 20
        assert seen["save_30"] == ""
        assert "FmstoreError" in seen["save_40"] and "CheckpointException" not in seen["save_40"]
        assert seen["save_40_again"] == "" and seen["wait"] == ""
        assert seen["save_41"] == "" and "FmstoreError" in seen["wait_41"]
        assert "CheckpointException" not in seen["wait_41"] and seen["wait_after"] == ""
        assert seen["save_after_local"] == "" and seen["restore_after_local"] == ""
        assert "StoreUnavailable" in seen["unlisted"]
        assert seen["passed_over"] == 60
        assert any("step_000000000070" in r for r in seen["reason"])
        assert (seen["before_sigterm"], seen["after_sigterm"], seen["preempted"]) == (
            False,
            True,
            True,
        )
        # the fallback moved step 80 aside on both nodes (n0 its part, n1 its replica of
        # n0's part), its catalog rows with it; the redone step 80 saved and restores
        assert seen["fallback"] == 60
        assert seen["redo_80"] == "" and seen["after_redo"] == 80
        assert seen["moved_aside"] == [80] and not seen["newer_left"] and seen["rows_80"] == []
        assert seen["rows_80_redone"] == [("nvme", "present")]
        assert all(v for k, v in seen.items() if k.startswith("exact-"))
    # n0's old part waited for n1; the redone step's export waited for the abandoned
    # export's lease, then committed on lustre (a new generation; the old one retired)
    assert r0["export_old_80"] == ("n1",) and r0["export_80"] == ()
    assert [w.split(" ")[0] for w in r0["export_80_waits"]] == ["n0"], r0["export_80_waits"]
    assert r0["aged"]
    assert Path(tmp, "lustre", STEP.format(80), "manifest.json").is_file()
    assert r0["aside_left"][0].endswith("run") and r1["aside_left"][0].endswith(".replicas/run")
    assert r0["close_local"] and not r1["close_local"]
    # n1 adopted its pending part of step 20: its catalog holds it
    assert (20, "nvme", "present") in r1["recorded"]
    # the decoy config of $FMSTORE_CONFIG was never used
    assert not [p for p in Path(tmp, "decoy").rglob("*") if p.is_file()]

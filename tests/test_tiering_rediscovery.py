"""The daemon rebuilds a lost or corrupt catalog from what the tiers hold and carries on
exporting and retaining every existing step."""

from __future__ import annotations

import logging
import os

from tiering_helpers import posix_config
from tiering_runs import held, lose_catalog, run_saves

from fmstore.tiering.inventory import catalog as cat
from fmstore.tiering.inventory.catalog import Catalog
from fmstore.tiering.service.daemon import Daemon, DaemonSettings

POLICIES = {
    "export": [{"to": "lustre", "every_saves": 1}, {"to": "s3", "every_saves": 2}],
    "retention": {"nvme": {"keep_latest": 1}},
}


def one_step(cfg) -> None:
    d = Daemon(cfg, settings=DaemonSettings(port=0, interval=0.01))
    try:
        assert d.run(drain=True, timeout=120) == 0
    finally:
        d.close()


def test_the_daemon_rediscovers_every_root_after_the_catalog_is_deleted(tmp_path):
    cfg = posix_config(str(tmp_path), POLICIES)
    run_saves(cfg, "runs/a", [1, 2, 3], settle_each=False)
    run_saves(cfg, "team/b/run", [10], settle_each=False)
    lose_catalog(str(tmp_path))
    one_step(cfg)
    assert held(cfg, "lustre", "runs/a") == [1, 2, 3]
    assert held(cfg, "s3", "runs/a") == [2]
    assert held(cfg, "nvme", "runs/a") == [3]
    assert held(cfg, "lustre", "team/b/run") == [10]
    with Catalog.for_state_dir(cfg.state_dir) as c:
        assert sorted(c.roots()) == ["runs/a", "team/b/run"]
        assert [x.step for x in c.checkpoints("runs/a")] == [1, 2, 3]


def test_a_corrupt_catalog_is_moved_aside_with_one_log_line_and_rebuilt(tmp_path, caplog):
    cfg = posix_config(str(tmp_path), POLICIES)
    run_saves(cfg, "runs/a", [1, 2], settle_each=False)
    db = os.path.join(cfg.state_dir, cat.DB_NAME)
    for suffix in ("-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.unlink(db + suffix)
    with open(db, "wb") as f:
        f.write(b"this is not a database" * 100)
    with caplog.at_level(logging.INFO, logger="fmstore.tiering"):
        one_step(cfg)
    aside = [n for n in os.listdir(cfg.state_dir) if n.startswith(cat.DB_NAME + ".corrupt-")]
    assert len(aside) == 1
    lines = [r for r in caplog.records if getattr(r, "event", "") == "catalog_corrupt"]
    assert len(lines) == 1 and aside[0] in lines[0].fields["moved_to"]
    assert held(cfg, "lustre", "runs/a") == [1, 2]
    assert held(cfg, "s3", "runs/a") == [2]
    assert held(cfg, "nvme", "runs/a") == [2]

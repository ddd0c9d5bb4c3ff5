"""Two replicas of every node's part over failure domains, on real nodes (issue 49,
point 2).

Three ``torchrun`` agents x 1 rank on loopback (:class:`fmstore.testing.cluster.Cluster`),
``[tiers.nvme] replicas = 2``, n0 and n1 in rack ``a`` and n2 in rack ``b``.  One save of
step 10 to NVMe: each node holds the other two nodes' parts, and the placement beside them
puts each copy in another rack first (n0's part: n2, then n1).  Then, while the job waits
on the test's signal, n1's and n2's NVMe are wiped (no shared tier holds the step): the
job restores step 10 from NVMe bit-exact, both lost parts sent by n0, the one holder left.
One launch: the save and the restore share it.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
from pathlib import Path

import pytest

from fmstore.testing.cluster import Cluster

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "replica_k_worker.py")
NODES = ["n0", "n1", "n2"]
KEY = f"run/step_{10:012d}"


def held(c: Cluster, node: str, gen: str) -> set[int]:
    d = c.nvme(node) / ".replicas" / KEY / gen
    return {int(p.stem.split("-")[1]) for p in d.glob("rank-*.json")}


@pytest.mark.slow
def test_two_replicas_over_racks_restore_two_lost_nodes(tmp_path: Path):
    racks = {"n0": "a", "n1": "a", "n2": "b"}
    with Cluster(tmp_path, nproc=1, pg_timeout=20, replicas=2, domains=racks) as c:
        procs = c.start(WORKER, [str(c.out), str(c.port)], NODES, name="k2")
        try:
            c.store.wait(
                [f"replicas-k/saved-{r}" for r in range(3)], datetime.timedelta(seconds=120)
            )
        except Exception:
            pytest.fail(f"the save did not finish: {c.logs('k2', NODES)}")
        m = json.loads((c.nvme("n0") / KEY / "manifest.json").read_text())
        gen = m["generation"]
        assert {n: held(c, n, gen) for n in NODES} == {"n0": {1, 2}, "n1": {0, 2}, "n2": {0, 1}}
        placed = json.loads((c.nvme("n1") / ".replicas" / KEY / "placement.json").read_text())
        # rack b before n0's rack-mate; n2 (rack b) to n1 then n0
        assert dict((r, h) for r, h in placed["holders"]) == {0: [2, 1], 1: [2, 0], 2: [1, 0]}
        for b in m["blobs"]:
            if b["rank"] == 0:
                own = (c.nvme("n0") / KEY / gen / b["name"]).read_bytes()
                for n in ("n1", "n2"):
                    assert (c.nvme(n) / ".replicas" / KEY / gen / b["name"]).read_bytes() == own

        for n in ("n1", "n2"):  # both lost: their NVMe wiped
            shutil.rmtree(c.nvme(n))
        c.store.set("replicas-k/go", "1")
        rcs = [p.wait(timeout=120) for p in procs]
        assert rcs == [0, 0, 0], c.logs("k2", NODES)
        reps = [json.loads((c.out / f"restore-{r}.json").read_text()) for r in range(3)]
        assert [r["node"] for r in reps] == NODES
        assert all(r["used"] == "nvme:" + KEY for r in reps), reps
        for n, rank in (("n1", 1), ("n2", 2)):  # each lost part written back on its node
            assert json.loads((c.nvme(n) / KEY / "manifest.json").read_text())["generation"] == gen
            assert (c.nvme(n) / KEY / gen / f"rank-{rank:06d}.json").is_file()

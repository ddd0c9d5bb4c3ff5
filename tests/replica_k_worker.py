"""Run under three ``torchrun`` agents x 1 rank on loopback by tests/test_dcp_replicas_k.py
(gloo, CPU; ``[tiers.nvme] replicas = 2`` and each node's ``failure_domain`` from its
config).

``python -m torch.distributed.run ... tests/replica_k_worker.py OUT PORT``

1. step 10 of a state sharded by rank (each rank its own tensors, so each node's part holds
   only its rank's) saved through ``fmstore.checkpoint.dcp.save`` to ``nvme:``; each rank
   then sets ``replicas-k/saved-RANK`` in the test's TCP store (on ``PORT``) and waits for
   ``replicas-k/go`` (the test wipes nodes' NVMe meanwhile);
2. the same step loaded from ``nvme:`` alone, checked bit-exact.

Every rank writes ``OUT/restore-RANK.json`` (the node, the URI used).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fmstore.checkpoint.dcp as fdcp  # noqa: E402
from fmstore.checkpoint.dcp.nodes import node_id  # noqa: E402
from fmstore.testing.cluster import pg_timeout  # noqa: E402

warnings.filterwarnings("ignore")
URI = f"nvme:run/step_{10:012d}"


def state(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return {
        f"w{rank}": torch.randn(128, 256, generator=g),
        f"i{rank}": torch.arange(5000 + rank, dtype=torch.int64),
    }


def main() -> None:
    out, port = sys.argv[1:]
    dist.init_process_group("gloo", timeout=pg_timeout())
    try:
        ckpt = dist.new_group(backend="gloo", timeout=pg_timeout())
        rank = dist.get_rank()
        fdcp.save(state(rank), URI, process_group=ckpt)
        test = dist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=pg_timeout())
        test.set(f"replicas-k/saved-{rank}", "1")
        test.wait(["replicas-k/go"])
        sd = {k: torch.zeros_like(v) for k, v in state(rank).items()}
        used = fdcp.load(sd, URI, process_group=ckpt)
        for k, v in state(rank).items():
            assert sd[k].view(torch.uint8).equal(v.view(torch.uint8)), f"{k} differs"
        with open(os.path.join(out, f"restore-{rank}.json"), "w") as f:
            json.dump({"node": node_id(), "used": used}, f)
        dist.barrier(group=ckpt)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

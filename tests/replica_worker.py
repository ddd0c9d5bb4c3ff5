"""Run under three ``torchrun`` agents on loopback by tests/test_dcp_replicas.py (gloo,
CPU; ``[tiers.nvme] replicas = 1`` from the environment).

``python -m torch.distributed.run ... tests/replica_worker.py SCENARIO OUT PORT [URI ...]``

Several launches' worth of work share one launch: between its phases every rank sets
``replicas/NAME-RANK`` in the test's TCP store (on ``PORT``) and waits for the test's
``replicas/go-NAME`` (the test checks and changes the nodes' directories meanwhile).

* ``save``: step 10 through ``fmstore.checkpoint.dcp.save`` to ``nvme:`` (node-local, with
  its replicas), ``lustre:`` and ``s3:`` (the state of tests/node_worker.py: FSDP2 model,
  Adam state, values DCP deduplicates onto rank 0); then, on the test's signal, the faults:
  step 5 to ``nvme:`` in DCP's checkpoint process (``async_save(process=True)``: no
  replica group there, so each part is read back and sent after the commit), then step 20
  to ``nvme:`` with rank 2's first replica chunk corrupted in flight (the save raises; its
  text in the report), then step 30 with node n1 stuck after the first chunk of its replica
  transfer (``PATH-RANK`` written in OUT once it is sent; the test kills n1 there);
* ``restore``: the first of the URIs every rank can read, checked bit-exact against step
  10's state (the first URI is tried alone first, to report why it was passed over);
* ``restores``: that restore three times (``restore1``..``restore3``), each on the test's
  signal (the test replaces nodes' NVMe in between).

Every rank writes ``OUT/NAME-RANK.json`` for each phase (the node, the URI used, ``why``).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from typing import Any

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dcp_worker import same  # noqa: E402
from node_worker import ref, restore, save_step, trained  # noqa: E402

from fmstore.checkpoint.dcp import replica_stream  # noqa: E402
from fmstore.checkpoint.dcp.nodes import node_id  # noqa: E402
from fmstore.errors import FmstoreError, NotFound  # noqa: E402
from fmstore.testing.cluster import pg_timeout  # noqa: E402

warnings.filterwarnings("ignore")


def restore_reported(uris: list[str], ckpt: Any) -> dict[str, Any]:
    """The first URI alone, to report why it was passed over; then the fallbacks."""
    rep: dict[str, Any] = {"node": node_id()}
    try:
        used, got = restore(uris[:1], ckpt)
        rep["why"] = ""
    except NotFound as e:
        rep["why"] = str(e)
        used, got = restore(uris[1:], ckpt)
    same(got, ref(OUT, 10), f"step 10 from {used}")
    rep["used"] = used
    return rep


def report(name: str, rep: dict[str, Any], ckpt: Any, test: Any) -> None:
    """``OUT/NAME-RANK.json``, then (every rank's written) ``replicas/NAME-RANK`` set."""
    with open(os.path.join(OUT, f"{name}-{dist.get_rank()}.json"), "w") as f:
        json.dump(rep, f)
    dist.barrier(group=ckpt)
    test.set(f"replicas/{name}-{dist.get_rank()}", "1")


def faults(model: Any, opt: Any, ckpt: Any) -> None:
    save_step(5, "nvme", model, opt, ckpt, OUT, process=True)
    os.environ[replica_stream.CORRUPT_ENV] = "2"
    rep = {"node": node_id()}
    try:
        save_step(20, "nvme", model, opt, ckpt, OUT)
        rep["error"] = ""
    except FmstoreError as e:
        rep["error"] = str(e)
    del os.environ[replica_stream.CORRUPT_ENV]
    with open(os.path.join(OUT, f"faults-{dist.get_rank()}.json"), "w") as f:
        json.dump(rep, f)
    os.environ[replica_stream.STALL_ENV] = f"n1:{os.path.join(OUT, 'stalled')}"
    save_step(30, "nvme", model, opt, ckpt, OUT)  # never returns: n1 is killed
    raise AssertionError("step 30 was saved while n1 was stuck")


OUT = ""


def main() -> None:
    global OUT
    name, OUT, port, *uris = sys.argv[1:]
    dist.init_process_group("gloo", timeout=pg_timeout())
    # The test's store: its checks between phases take no process group's time.
    test = dist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=timedelta(seconds=300))
    try:
        ckpt = dist.new_group(backend="gloo", timeout=pg_timeout())
        if name == "save":
            model, opt = trained(2)
            for tier in ("nvme", "lustre", "s3"):
                save_step(10, tier, model, opt, ckpt, OUT)
            report("save", {"node": node_id()}, ckpt, test)
            test.wait(["replicas/go-faults"])
            faults(model, opt, ckpt)
        elif name == "restore":
            report("restore", restore_reported(uris, ckpt), ckpt, test)
        else:
            for k in (1, 2, 3):
                test.wait([f"replicas/go-restore{k}"])
                report(f"restore{k}", restore_reported(uris, ckpt), ckpt, test)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

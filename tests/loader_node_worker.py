"""One rank of a multi-node job, as a plain process (tests/test_loader_nodes_procs.py).

``python tests/loader_node_worker.py CFG``, with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` and ``FMSTORE_NODE_ID`` in the environment, as a launcher sets them.
``CFG`` is JSON: ``remote``, ``cache`` (this node's own cache directory), ``out``, ``batch``,
``direct_reads`` and ``runs``: each ``{"tag", "epoch", "options" (store options), "stop_after" (batches, or
null: the whole epoch), "state" (a loader state to resume from, or null)}``, one after the
other.  Each run writes ``OUT/{tag}-r{rank}.json``: the sample ids this rank got and its
loader's state at the end.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fmstore.loaders import StreamingDataLoader, StreamingDataset  # noqa: E402

warnings.filterwarnings("ignore")


def sample_id(sample: dict) -> int:
    return int(sample["i"])


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank = int(os.environ["RANK"])
    for run in cfg["runs"]:
        ds = StreamingDataset(
            cfg["remote"], cfg["cache"], batch_size=cfg["batch"],
            storage_options=run["options"], transform=sample_id, direct_reads=cfg["direct_reads"],
        )  # fmt: skip
        if run["state"] is not None:
            ds.load_state_dict(run["state"])
        else:
            ds.set_epoch(run["epoch"])
        dl = StreamingDataLoader(ds, batch_size=cfg["batch"], num_workers=0)
        got: list[int] = []
        for k, b in enumerate(dl):
            got.extend(int(x) for x in b)
            if run["stop_after"] is not None and k + 1 == run["stop_after"]:
                break
        with open(os.path.join(cfg["out"], f"{run['tag']}-r{rank}.json"), "w") as f:
            json.dump({"ids": got, "state": dl.state_dict()}, f)


if __name__ == "__main__":
    main()

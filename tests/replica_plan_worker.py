"""Two ranks, each its own node (``n0``, ``n1``), on a node-local ``nvme`` tier that keeps
one replica: a save whose replicas stream (rank 0's part holds a non-tensor item, rank 1's
only tensors, so both kinds of plan bound are met by an honest sender); then rank 1 turns
hostile and sends rank 0's replica stream well-framed chunks outside its planned part, and
a chunk that fails its CRC32C after a whole blob.  Each rank writes ``OUT/RANK.json``.

Run as ``python replica_plan_worker.py RANK PORT BASE``."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

RANK, PORT, BASE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = os.path.join(BASE, f"n{RANK}.toml")
with open(cfg, "w") as f:
    f.write(
        f'state_dir = "{BASE}/state{RANK}"\n[tiers.nvme]\nurl = "{BASE}/nvme{RANK}"\n'
        'scope = "node"\nreplicas = 1\n'
    )
os.environ["FMSTORE_CONFIG"] = cfg
os.environ["FMSTORE_NODE_ID"] = f"n{RANK}"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fmstore import runtime  # noqa: E402
from fmstore.checkpoint import dcp  # noqa: E402
from fmstore.checkpoint.dcp.replica_stream import Part, Stream  # noqa: E402
from fmstore.format.checksum import crc32c  # noqa: E402
from fmstore.stores import open_store  # noqa: E402

KEY = "run/step_000000000001"
GEN = "g000000000000-00000000"
CHUNK, BLOB_END, END = 1, 2, 4

dist.init_process_group(
    "gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=RANK, world_size=2,
    timeout=timedelta(seconds=60),
)  # fmt: skip
result: dict[str, object] = {}
state: dict[str, object] = {f"w{RANK}": torch.arange(3000, dtype=torch.float32) * (RANK + 1)}
if RANK == 0:
    state["meta"] = {"step": 1, "note": "x" * 5000}  # a non-tensor item: no byte bound
try:
    dcp.save(state, f"nvme:{KEY}")
    result["save"] = ""
except BaseException as e:  # DCP raises its CheckpointException, a BaseException
    result["save"] = str(e)[-2000:]
held = os.path.join(BASE, f"nvme{RANK}", ".replicas", KEY)
result["replica"] = sorted(
    os.path.relpath(os.path.join(d, n), held) for d, _, ns in os.walk(held) for n in ns
)

PAGE = bytes(range(256)) * 16  # 4096 bytes
# (kind, blob, offset, bytes, crc ok?) rank 1 sends, per case, then END
CASES = {
    "blob": [(CHUNK, 10, 0, 4096, True)],  # blob 10: outside 8..9
    "bytes": [  # 12288 bytes: more than the 8192 planned
        (CHUNK, 8, 0, 4096, True), (BLOB_END, 8, 4096, 0, True),
        (CHUNK, 9, 0, 4096, True), (CHUNK, 9, 4096, 4096, True), (BLOB_END, 9, 8192, 0, True),
    ],
    "crc": [(CHUNK, 8, 0, 4096, True), (BLOB_END, 8, 4096, 0, True), (CHUNK, 9, 0, 4096, False)],
}  # fmt: skip


def send(frames: list[tuple[int, int, int, int, bool]]) -> None:
    for kind, blob, off, n, ok in frames:
        crc = crc32c(PAGE[:n]) ^ (0 if ok else 1)
        dist.send(torch.tensor([kind, blob, off, n, crc], dtype=torch.int64), 0)
        if n:
            dist.send(torch.frombuffer(bytearray(PAGE[:n]), dtype=torch.uint8), 0)
    dist.send(torch.tensor([END, 0, 0, 0, 0], dtype=torch.int64), 0)


def hold(case: str) -> dict[str, object]:
    where = os.path.join(BASE, f"hostile-{case}")

    async def holder() -> Stream:
        return Stream(
            dist.group.WORLD, 0, "n0", (), (1,), open_store(where), GEN, 4096, {1: Part(8, 2, 8192)}
        )

    stream = runtime.run(holder())
    stream.finish_sends(True)
    error = stream.wait_received()[1].error
    left = sorted(n for _, _, ns in os.walk(where) for n in ns)
    return {"error": error, "left": left}


for case, frames in CASES.items():
    if RANK == 1:
        send(frames)
    else:
        result[case] = hold(case)
with open(os.path.join(BASE, f"{RANK}.json"), "w") as f:
    json.dump(result, f)
dist.destroy_process_group()

"""A superseded export of a node's part never removes that part from a copy another node has
committed meanwhile (seen in the three-node kill schedule: a node whose catalog still had
the export pending superseded it after another node committed the copy, and took its blobs
out of a committed checkpoint on Lustre)."""

from __future__ import annotations

import pytest

from fmstore import runtime
from fmstore.protocol.env import Env
from fmstore.protocol.records import PartRecord, part_record_key
from fmstore.stores import open_store
from fmstore.tiering.exports.parts import delete_own_part

GEN = "g000000000001-00000001"


def _export(root, committed: bool):
    gen = root / GEN
    gen.mkdir(parents=True)
    (gen / "000000.bin").write_bytes(b"abc")
    rec = PartRecord("n1", (1,), GEN, "0" * 64, (("000000.bin", 3, None),))
    (root / part_record_key(GEN, "n1")).write_bytes(rec.dumps())
    if committed:
        (root / "manifest.json").write_bytes(b"{}")
    return open_store(str(root))


@pytest.mark.parametrize("committed", [False, True])
def test_superseded_part_is_kept_in_a_copy_another_node_committed(tmp_path, committed):
    root = tmp_path / "step_000000000010"
    store = _export(root, committed)
    removed = runtime.run(delete_own_part(store, "n1", env=Env()))
    assert removed is not committed
    left = sorted(p.name for p in (root / GEN).iterdir()) if (root / GEN).exists() else []
    assert left == (["000000.bin", "part-n1.json"] if committed else [])

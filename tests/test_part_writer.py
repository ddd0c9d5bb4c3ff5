"""Store.open_part_writer: resumable numbered-part writes on POSIX and the default
(temp objects joined on commit, here on memory://)."""

from __future__ import annotations

import os
import uuid

import pytest

from fmstore import runtime
from fmstore.stores import open_store

PART = 1 << 20


@pytest.fixture(params=["posix", "memory"])
def store(request, tmp_path):
    if request.param == "posix":
        return open_store(str(tmp_path / "s"))
    return open_store(f"memory://parts-{uuid.uuid4().hex}")


def test_parts_resume_in_a_new_writer_and_commit_atomically(store):
    data = os.urandom(3 * PART + 123)

    async def go():
        w = await store.open_part_writer("d/obj", len(data), PART)
        assert not w.resumed
        await w.write_part(2, data[2 * PART : 3 * PART])
        await w.write_part(0, data[:PART])
        assert not await store.exists("d/obj")
        assert await store.list_keys("") == []  # pending parts are hidden
        w2 = await store.open_part_writer("d/obj", len(data), PART, token=w.token)
        assert w2.resumed
        await w2.write_part(1, data[PART : 2 * PART])
        await w2.write_part(3, data[3 * PART :])
        meta = await w2.commit({"k": "v"})
        assert meta.size == len(data)
        assert await store.get("d/obj") == data
        assert await store.list_keys("") == ["d/obj"]

    runtime.run(go())


def test_abort_leaves_nothing_and_unknown_token_starts_afresh(store):
    async def go():
        w = await store.open_part_writer("x", 2 * PART, PART)
        await w.write_part(0, os.urandom(PART))
        await w.abort()
        assert await store.list_keys("") == []
        w2 = await store.open_part_writer(
            "x", 2 * PART, PART, token=w.token if store.tier == "file" else "zz"
        )
        assert not w2.resumed
        with pytest.raises(ValueError):
            await w2.write_part(0, b"short")
        await w2.abort()

    runtime.run(go())


def test_a_part_in_more_pieces_than_one_pwritev_takes(store):
    # POSIX writes pieces with pwritev, at most IOV_MAX (1024 on Linux) buffers a call.
    data = os.urandom(PART)
    pieces = [data[i : i + 300] for i in range(0, PART, 300)]
    assert len(pieces) > 3000

    async def go():
        w = await store.open_part_writer("many", PART, PART)
        await w.write_part(0, pieces)
        await w.commit()
        assert await store.get("many") == data

    runtime.run(go())

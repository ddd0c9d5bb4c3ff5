from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fmstore import runtime
from fmstore.errors import NotFound
from fmstore.stores import open_store


def sample(name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_store_operations_are_counted(tmp_path):
    store = open_store(str(tmp_path), tier="metrics-test")
    before = sample("fmstore_store_bytes_total", tier="metrics-test", op="put")
    runtime.run(store.put("k", b"x" * 1000))
    runtime.run(store.get("k"))
    with pytest.raises(NotFound):
        runtime.run(store.get("missing"))
    assert sample("fmstore_store_bytes_total", tier="metrics-test", op="put") == before + 1000
    assert (
        sample("fmstore_store_operations_total", tier="metrics-test", op="get", outcome="ok") >= 1
    )
    assert (
        sample("fmstore_store_errors_total", tier="metrics-test", op="get", error="NotFound") >= 1
    )
    assert sample("fmstore_store_operation_seconds_count", tier="metrics-test", op="put") >= 1
    assert sample("fmstore_store_inflight", tier="metrics-test") == 0


def test_early_stopped_listing_is_not_an_error(tmp_path):
    store = open_store(str(tmp_path), tier="metrics-list")
    for i in range(3):
        runtime.run(store.put(f"k{i}", b""))

    async def first() -> str:
        async for m in store.list():
            return m.key
        return ""

    assert runtime.run(first()) == "k0"
    assert sample("fmstore_store_errors_total", tier="metrics-list", op="list") == 0

"""One grammar of node ids (``FMSTORE_NODE_ID``, part records): host names pass, control
characters, dots, blanks, non-ASCII and over-long names are refused; step directory names
are whole ASCII ``step_NNNNNNNNNNNN`` names only."""

from __future__ import annotations

import json

import pytest

from fmstore.errors import ConfigError, CorruptData


@pytest.mark.parametrize("bad", ["n0\n", "..", ".", "-x", "n 0", "[/]", "ｎ0", "x" * 201, ""])
def test_node_id_has_one_grammar(monkeypatch, bad):
    from fmstore.checkpoint.dcp.nodes import NODE_ENV, node_id
    from fmstore.protocol.records import PartRecord, is_node_id

    assert not is_node_id(bad)
    if bad:
        monkeypatch.setenv(NODE_ENV, bad)
        with pytest.raises(ConfigError, match="node id"):
            node_id()
    rec = PartRecord("n0", (0,), "g000000000001-00000001", "0" * 64, ())
    with pytest.raises(CorruptData, match="not a node id"):
        PartRecord.loads(
            rec.dumps().replace(b'"node":"n0"', b'"node":' + json.dumps(bad).encode()), where="x"
        )


def test_node_id_accepts_host_names(monkeypatch):
    from fmstore.checkpoint.dcp.nodes import NODE_ENV, node_id

    for good in ("n0", "ip-10-0-0-1.ec2.internal", "node_7:gpu@rack+2"):
        monkeypatch.setenv(NODE_ENV, good)
        assert node_id() == good


@pytest.mark.parametrize(
    "name", ["step_000000000001\n", "step_00000000000١", "step_1", "xstep_000000000001"]
)
def test_parse_step_takes_whole_ascii_names_only(name):
    from fmstore.checkpoint.layout import parse_step

    assert parse_step(name) is None
    assert parse_step("step_000000000012/") == 12

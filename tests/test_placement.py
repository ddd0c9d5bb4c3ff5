"""The placement of replicas over nodes and failure domains (pure, exhaustive over small
clusters)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from fmstore.protocol.placement import capped, holders, is_domain, node_holders, spread


def _nodes(n: int, per: int) -> list[tuple[str, list[int]]]:
    return [(f"n{i}", list(range(i * per, (i + 1) * per))) for i in range(n)]


def _domain_maps(n: int):
    """Every way to put ``n`` nodes into domains (labels by first appearance), and none."""
    yield None
    for labels in itertools.product(range(n), repeat=n):
        if all(labels[i] <= max(labels[:i], default=-1) + 1 for i in range(n)):
            yield {f"n{i}": f"rack-{d}" for i, d in enumerate(labels)}


@pytest.mark.parametrize(("n", "per"), [(n, 2) for n in range(2, 7)] + [(4, 3), (5, 4)])
def test_every_rank_has_k_holders_on_other_nodes_and_survives_any_k_lost_nodes(n, per):
    for k in range(1, 4):
        for domains in _domain_maps(n):
            hmap = holders(_nodes(n, per), k, domains)
            assert hmap is not None
            node = {r: f"n{r // per}" for r in range(n * per)}
            kk = capped(k, n)
            for r, hs in hmap.items():
                where = [node[h] for h in hs]
                assert len(set(where)) == len(hs) == kk, (r, hs)
                assert node[r] not in where
                assert all(h % per == r % per for h in hs)  # same position on the node
            # the spread: a node's ranks' first holders span as many nodes as may come first
            for i in range(n):
                first = {hmap[r][0] // per for r in range(i * per, (i + 1) * per)}
                others = [x for x in range(n) if x != i]
                if domains is not None and len(set(domains.values())) > 1:
                    others = [x for x in others if domains[f"n{x}"] != domains[f"n{i}"]]
                assert len(first) == min(per, len(others)), (k, domains, i, first)
            if domains is None:  # every position a rotation: each rank holds k parts
                assert Counter(h for hs in hmap.values() for h in hs) == Counter(
                    {r: kk for r in range(n * per)}
                )
            for lost in itertools.combinations(range(n), kk):
                gone = {f"n{i}" for i in lost}
                for r, hs in hmap.items():
                    assert {node[r], *(node[h] for h in hs)} - gone, (k, domains, lost, r)
            if domains is None:
                continue
            ds = set(domains.values())
            spread = min(kk, len(ds) - 1)
            for r, hs in hmap.items():
                own = domains[node[r]]
                others = {domains[node[h]] for h in hs} - {own}
                # copies in as many other domains as there are (up to k)
                assert len(others) == spread, (k, domains, r, hs)
            # any `spread` domains lost: every part still on some surviving node
            for lost_d in itertools.combinations(sorted(ds), spread):
                for r, hs in hmap.items():
                    alive = [x for x in (r, *hs) if domains[node[x]] not in lost_d]
                    assert alive, (k, domains, lost_d, r)


def test_placement_is_the_ring_without_domains_and_balanced_with_equal_domains():
    ids = ["n0", "n1", "n2", "n3"]
    assert node_holders(ids, 1) == {"n0": ("n1",), "n1": ("n2",), "n2": ("n3",), "n3": ("n0",)}
    assert node_holders(ids, 2)["n3"] == ("n0", "n1")
    # racks of consecutive nodes: every copy leaves the rack, each node holds one part
    racks = {"n0": "a", "n1": "a", "n2": "b", "n3": "b"}
    one = node_holders(ids, 1, racks)
    assert all(racks[h[0]] != racks[n] for n, h in one.items())
    assert Counter(h[0] for h in one.values()) == Counter(ids)
    two = node_holders(ids, 2, racks)
    # other domains before a node's own, again where there are fewer than k others
    assert all({racks[x] for x in h} == {"ab".replace(racks[n], "")} for n, h in two.items())
    assert Counter(x for h in two.values() for x in h) == Counter(ids * 2)
    # a node without a domain: the ring, as if no node had one
    assert node_holders(ids, 1, {"n0": "a"}) == node_holders(ids, 1)


def test_placement_is_deterministic_caps_k_and_places_nothing_it_cannot():
    assert holders(_nodes(3, 2), 2) == holders(_nodes(3, 2), 2)
    # position 0: the next nodes of the ring; position 1 starts one node further
    assert holders(_nodes(3, 2), 2) == {
        0: (2, 4),
        1: (5, 3),
        2: (4, 0),
        3: (1, 5),
        4: (0, 2),
        5: (3, 1),
    }
    # node i's rank at position j -> node i + 1 + (j mod (n - 1)), same position
    eight = holders(_nodes(9, 8), 1)
    assert eight is not None
    assert all(
        eight[8 * i + j] == (8 * ((i + 1 + j % 8) % 9) + j,) for i in range(9) for j in range(8)
    )
    assert (spread(128, 8), spread(3, 8), spread(2, 8), spread(5, 1)) == (8, 2, 1, 1)
    assert holders(_nodes(3, 1), 5) == holders(_nodes(3, 1), 2)  # capped at nodes - 1
    assert capped(5, 3) == 2 and capped(1, 1) == 0
    assert holders(_nodes(1, 2), 1) is None  # one node: nowhere else to go
    assert holders(_nodes(3, 2), 0) is None
    assert holders([("n0", [0, 1]), ("n1", [2])], 1) is None  # uneven nodes
    with pytest.raises(ValueError, match="named twice"):
        holders([("n0", [0]), ("n0", [1])], 1)
    assert is_domain("rack-a") and is_domain("az1/rack:2")
    assert not any(is_domain(x) for x in ("", " a", "../x", "a b", "x" * 200, 3, None))


def test_replicas_placed_by_the_old_ring_restore_without_a_placement_file():
    """Replicas saved before the spread (node i's part wholly on node i + 1, no
    ``placement.json``): what each node holds is all a restore needs, for any lost node."""
    from fmstore.checkpoint.dcp.replicas import plan

    n, per = 4, 2
    ring = {r: ((r + per) % (n * per),) for r in range(n * per)}  # the old k = 1 ring
    assert ring != holders(_nodes(n, per), 1)  # the spread places otherwise now
    for lost in range(n):
        lacking = list(range(lost * per, (lost + 1) * per))
        held = [
            ("d", tuple(s for s, hs in ring.items() if any(h // per == r // per for h in hs)))
            if r not in lacking
            else (None, ())
            for r in range(n * per)
        ]
        got = plan("d", held, lacking)
        assert got is not None and all(ring[r][0] // per == got[r] // per for r in lacking)


def test_a_lost_part_comes_from_the_first_surviving_holder_in_the_saves_order():
    from fmstore.checkpoint.dcp.replicas import plan

    # 4 nodes x 1 rank, k = 2: rank 0's holders were n2 then n3 (placement over racks).
    held = [(None, ()), ("d", (0,)), ("d", (0, 1)), ("d", (0, 2))]
    prefer = [{}, {}, {0: 0}, {0: 1, 2: 0}]
    assert plan("d", held, [0], prefer) == {0: 2}
    assert plan("d", held, [0, 2], prefer) == {0: 3, 2: 3}  # the first holder lost too
    assert plan("d", held, [0, 2, 3], prefer) is None  # rank 3's part has no holder
    assert plan("d", held[:3], [0, 2], prefer) is None
    assert plan("d", held, [0], [{}, {}, {0: 1}, {0: 0}]) == {0: 3}
    assert plan("d", held, [0]) == {0: 1}  # no order known: the lowest rank
    assert plan("d", held, [0, 1, 2, 3]) is None


def test_routes_read_a_part_from_whichever_of_its_holders_is_in_the_job():
    from fmstore.protocol.routing import REPLICA, Holding, Routes, route

    # saved on n0..n2 (one rank each), k = 2; the relaunch runs n0 and two new nodes
    hs = [
        Holding(0, "n9", frozenset(), frozenset()),
        Holding(1, "n0", frozenset({0}), frozenset({1, 2})),
        Holding(2, "n8", frozenset(), frozenset()),
    ]
    got = route(3, hs)
    assert isinstance(got, Routes)
    assert got.source[(0, 1)] == (1, REPLICA) and got.source[(2, 2)] == (1, REPLICA)
    assert route(3, [Holding(0, "n9"), Holding(1, "n0", frozenset({0}))]) == (1, 2)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ('{"holders": [[0, [4, 2]], [1, [5, 3]], [4, [0, 2]]]}', [[0, 1], [1, 1], [4, 1]]),
        ('{"holders": [[0, [2]], ["1", [3]], [2, "x"], [3, [{}]], 7]}', [[0, 0]]),
        ('{"holders": {"0": [2]}}', []),
        ("[]", None),
        ("not json", None),
        ('{"holders": ' + "[" * 5000 + "]" * 5000 + "}", None),  # too deep to parse
    ],
)
def test_a_holders_place_is_read_from_its_placement_file_and_checked(
    tmp_path, monkeypatch, text, want
):
    """What a node reports of its place among a part's holders comes from a file on its
    tier: hostile input, bounded, checked field by field (None: it raises, and the restore
    counts it as no place)."""
    from dataclasses import replace

    import torch

    import fmstore.checkpoint.dcp as fdcp
    from fmstore import runtime
    from fmstore.checkpoint.dcp.manifest import DcpPart
    from fmstore.checkpoint.dcp.replicas import PLACEMENT_KEY, _preference, replica_uri
    from fmstore.config import from_dict
    from fmstore.stores import open_store

    fdcp.save({"w": torch.arange(16.0)}, str(tmp_path / "ck"))
    m = runtime.run(fdcp.read_manifest(open_store(str(tmp_path / "ck"))))
    m = replace(m, parts=[DcpPart(f"n{i}", (2 * i, 2 * i + 1)) for i in range(3)])
    cfg = from_dict({"tiers": {"nvme": {"url": str(tmp_path / "nvme"), "scope": "node"}}})
    uri = "nvme:run/step_000000000010"
    where = tmp_path / "nvme" / replica_uri(uri, cfg).split(":", 1)[1]
    where.mkdir(parents=True)
    (where / PLACEMENT_KEY).write_text(text)
    monkeypatch.setenv("FMSTORE_NODE_ID", "n1")  # ranks 2, 3
    if want is None:
        with pytest.raises(Exception):  # noqa: B017,PT011 - any error: no place reported
            runtime.run(_preference(uri, {"config": cfg}, m))
    else:
        assert runtime.run(_preference(uri, {"config": cfg}, m)) == want


def test_each_nodes_domain_is_what_all_its_ranks_said_or_none():
    from fmstore.protocol.placement import domains_of

    nodes = [("n0", [0, 1]), ("n1", [2, 3])]
    assert domains_of(nodes, ["a", "a", "b", "b"]) == {"n0": "a", "n1": "b"}
    assert domains_of(nodes, [None, None, "b", "b"]) == {"n1": "b"}  # n0 names none
    for bad in (["a", "b", "b", "b"], ["a", None, "b", "b"], ["a", "a", "../x", "../x"]):
        with pytest.raises(ValueError, match="node n"):
            domains_of(nodes, bad)
    with pytest.raises(ValueError, match="node n1"):
        domains_of(nodes, ["a", "a", 3, 3])
    with pytest.raises(ValueError, match="node n1"):
        domains_of(nodes, ["a", "a", "b"])  # a rank that said nothing

"""Where the replicas of each node's part go: a pure decision (no I/O, no torch), made alike
on every rank from what every rank reports.

The nodes of a save are its manifest's parts, in their order (the order of their lowest
rank).  With ``replicas = k``, the part of each rank is copied to ``k`` other nodes, to the
rank at the same position among each holder node's ranks (every node must run as many
ranks).  The holders of the rank at position ``j`` of a node, in preference order:

* **Without failure domains** (some node reports none): ``k`` consecutive nodes of the ring
  of nodes, starting ``1 + (j mod (nodes - 1))`` after its own node, like the replication
  "jump" of NVIDIA's resiliency extension with a jump of one node.  So a node's part is
  *spread*: its ranks' first holders are ``min(ranks per node, nodes - 1)`` different nodes
  (:func:`spread`), and a lost node's part is read back from that many holders at once,
  each reading its own part and a share of the lost one.  Every position is a rotation of
  the ring, so every rank holds exactly ``k`` parts.
* **With failure domains** (every node reports one, ``[tiers.X] failure_domain`` or
  ``$FMSTORE_FAILURE_DOMAIN``): the nodes are first interleaved across domains (the first
  node of each domain, in the order the domains first appear, then the second of each, ...),
  and each node walks that ring from its own place, starting (the spread) at the
  ``j mod m``-th of the ``m`` nodes of other domains on its walk: the first ``k`` nodes of
  domains it has not used yet and other than its own, then, when there are fewer domains
  than ``k + 1``, nodes of domains it already used, and its own domain's other nodes last.
  So the copies of a part are in ``min(k, D - 1)`` domains besides its own (``D`` the
  number of domains), a node's ranks' first holders are ``min(ranks per node, m)`` nodes,
  and each node holds about ``k`` parts when the domains are of equal size.

Replicas placed before the spread (the plain ring, without ``placement.json``) restore all
the same: a restore asks each node which replicas it holds, never where the placement put
them.

A holder is never on the sender's node; ``k`` over ``nodes - 1`` is capped (see
:func:`capped`), so losing any ``k`` nodes (or any ``min(k, D - 1)`` domains) leaves every
part on a node that survives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..config import is_failure_domain as is_domain

__all__ = [
    "MAX_REPLICAS",
    "capped",
    "domains_of",
    "holders",
    "is_domain",
    "node_holders",
    "spread",
]

#: the most replicas of a part (``[tiers.X] replicas`` is 0..8)
MAX_REPLICAS = 8


def capped(k: int, nodes: int) -> int:
    """The number of replicas a save of ``nodes`` nodes can place: ``k``, at most
    ``nodes - 1`` (never two copies of a part on one node); 0 for one node."""
    return max(0, min(k, nodes - 1))


def domains_of(
    nodes: Sequence[tuple[str, Sequence[int]]], said: Sequence[object]
) -> dict[str, str]:
    """Node -> its failure domain, from what each rank said (``said[rank]``: a name, or
    None where its node names none); nodes that name none are left out.  Raises
    :class:`ValueError` naming a node whose ranks say different things or something that
    is not a name (a peer's message is hostile: checked here)."""
    out: dict[str, str] = {}
    for node, ranks in nodes:
        got = {said[r] if 0 <= r < len(said) else "?" for r in ranks}
        if got == {None}:
            continue
        d = got.pop() if len(got) == 1 else None
        if not is_domain(d):
            raise ValueError(f"node {node} reports no valid failure domain")
        out[node] = str(d)
    return out


def _ring(ids: Sequence[str], domains: Mapping[str, str] | None) -> list[str]:
    """The nodes in the order holders are looked for: the manifest's, or interleaved across
    ``domains`` (first of each domain, then second of each, ...)."""
    if domains is None:
        return list(ids)
    by: dict[str, list[str]] = {}
    for i in ids:
        by.setdefault(domains[i], []).append(i)
    out: list[str] = []
    for j in range(max(len(v) for v in by.values())):
        out += [v[j] for v in by.values() if j < len(v)]
    return out


def node_holders(
    ids: Sequence[str], k: int, domains: Mapping[str, str] | None = None, position: int = 0
) -> dict[str, tuple[str, ...]]:
    """Node -> the ``capped(k)`` other nodes holding the part of its rank at ``position``
    (0-based among its ranks), in preference order (see the module docstring).
    ``domains``: node -> its failure domain, used only when every node of ``ids`` has one."""
    k = capped(k, len(ids))
    use = domains if domains is not None and all(i in domains for i in ids) else None
    ring = _ring(ids, use)
    out: dict[str, tuple[str, ...]] = {}
    for pos, node in enumerate(ring):
        n = len(ring)
        if use is None:  # the next nodes of the ring from the one this position starts at
            at = position % (n - 1)
            out[node] = tuple(ring[(pos + 1 + (at + t) % (n - 1)) % n] for t in range(k))
            continue
        walk = [ring[(pos + d) % n] for d in range(1, n)]
        # the spread: each position starts at another of the nodes that may come first
        first = [x for x in walk if use[x] != use[node]] or walk
        at = walk.index(first[position % len(first)])
        walk = walk[at:] + walk[:at]
        chosen: list[str] = []
        seen = {use[node]}
        for x in walk:  # new domains first
            if len(chosen) < k and use[x] not in seen:
                chosen.append(x)
                seen.add(use[x])
        for x in walk:  # then other domains again, own domain last
            if len(chosen) < k and x not in chosen and use[x] != use[node]:
                chosen.append(x)
        for x in walk:
            if len(chosen) < k and x not in chosen:
                chosen.append(x)
        out[node] = tuple(chosen)
    return out


def holders(
    nodes: Sequence[tuple[str, Sequence[int]]], k: int, domains: Mapping[str, str] | None = None
) -> dict[int, tuple[int, ...]] | None:
    """Rank -> the ranks holding its replicas, in preference order: the rank at the same
    position on each of :func:`node_holders`' nodes for that position (so a node's part is
    spread over several holders).  ``nodes``: (node id, its sorted ranks) in the manifest's
    order of parts.  None where no replica can be placed (``k`` of 0, one node, or nodes
    with different numbers of ranks)."""
    ids = [n for n, _r in nodes]
    ranks = {n: list(r) for n, r in nodes}
    if capped(k, len(ids)) == 0 or len({len(r) for r in ranks.values()}) != 1:
        return None
    if len(set(ids)) != len(ids):
        raise ValueError(f"a node is named twice among the parts: {ids}")
    out: dict[int, tuple[int, ...]] = {}
    for j in range(len(ranks[ids[0]])):
        for node, hs in node_holders(ids, k, domains, j).items():
            out[ranks[node][j]] = tuple(ranks[h][j] for h in hs)
    return dict(sorted(out.items()))


def spread(nodes: int, per_node: int, k: int = 1) -> int:
    """The holder nodes one node's part is spread over (its ranks' first holders), without
    failure domains: ``min(per_node, nodes - 1)``, from :func:`holders` itself."""
    got = holders([(f"n{i}", range(i * per_node, (i + 1) * per_node)) for i in range(nodes)], k)
    return len({h[0] // per_node for r, h in (got or {}).items() if r < per_node})

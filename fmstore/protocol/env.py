"""The environment the multi-node protocol runs in: its clock, who it is, and its settings.

Every protocol decision that depends on time or identity (is a lease alive, may a committer
still write its manifest, whose lease is this, which node wrote this record) reads them from
one :class:`Env`, built once from a :class:`~fmstore.config.Config`'s ``[protocol]`` table
(:meth:`Env.from_config`) and held by the objects that run the protocol (``Tiers``, the
daemon, a sweep) or passed down to the functions that do.  Nothing sets one in a module: a
simulation hands its own (a virtual clock, a node of its own, a fixed process id) to the
same code, and two simulations with different clocks run side by side in one process.

Torch-free, and free of any store: a value, read by :mod:`.decisions`' pure functions'
callers.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..config import NODE_ENV, Config, is_node_id
from ..errors import ConfigError
from ..units import parse_duration
from .decisions import commit_holds, lease_alive

__all__ = ["CLOCK_SKEW_VAR", "LEASE_TTL_VAR", "Env"]

#: Environment variables that override ``[protocol] lease_ttl`` / ``clock_skew`` (seconds).
LEASE_TTL_VAR = "FMSTORE_EXPORT_LEASE_TTL"
CLOCK_SKEW_VAR = "FMSTORE_CLOCK_SKEW"
#: The defaults of ``[protocol]`` (docs/configuration.md): a lease lives 2 minutes.
DEFAULT_LEASE_TTL = 120.0


def _renew_of(ttl: float) -> float:
    return max(0.05, ttl / 6)


def _skew_of(ttl: float) -> float:
    return ttl / 12


def _seconds(environ: Mapping[str, str], var: str) -> float | None:
    raw = environ.get(var)
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"${var} is {raw!r}, not a number of seconds") from None


@dataclass(frozen=True)
class Env:
    """The protocol's clock, identity and settings (``docs/configuration.md``, ``[protocol]``).

    ``lease_ttl``: seconds an export lease keeps its generation alive after its last
    renewal; ``lease_renew``: how often an exporter renews it; ``clock_skew``: the most two
    nodes' clocks may be apart.  A lease is taken for alive until its renewal is older than
    ``lease_ttl + clock_skew`` on the reader's clock; a committer refuses to commit once its
    own lease could look expired to a node whose clock is ahead; a manifest ``created``
    later than now plus the skew is not counted as committed.

    ``clock`` returns this node's wall-clock time in seconds (``time.time``).  ``node`` and
    ``pid`` name this node and process as leases and records name them; left ``None`` they
    are read when asked (``$FMSTORE_NODE_ID`` or the host name; ``os.getpid()``), as a
    process that forks or a test that sets ``$FMSTORE_NODE_ID`` expects.
    """

    lease_ttl: float = DEFAULT_LEASE_TTL
    lease_renew: float = field(default=_renew_of(DEFAULT_LEASE_TTL))
    clock_skew: float = field(default=_skew_of(DEFAULT_LEASE_TTL))
    clock: Callable[[], float] = field(default=time.time, compare=False)
    node: str | None = None
    pid: int | None = None

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Config | None, *, environ: Mapping[str, str] | None = None) -> Env:
        """The settings of ``config``'s ``[protocol]`` table, ``$FMSTORE_EXPORT_LEASE_TTL``
        and ``$FMSTORE_CLOCK_SKEW`` (``environ``, default ``os.environ``) overriding it; a
        key neither sets takes its default (derived from the lifetime: renewal a sixth,
        skew a twelfth).  ConfigError when the table sets something and the renewal plus
        the skew leave a committer no time to write the manifest (they must stay under
        half the lifetime).  ``config`` None: the environment alone."""
        environ = os.environ if environ is None else environ
        raw, w = config.table("protocol") if config is not None else ({}, "[protocol]")
        ttl = _seconds(environ, LEASE_TTL_VAR)
        if ttl is None:
            ttl = (
                parse_duration(raw["lease_ttl"], f"{w} lease_ttl")
                if "lease_ttl" in raw
                else DEFAULT_LEASE_TTL
            )
        renew = (
            parse_duration(raw["lease_renew"], f"{w} lease_renew")
            if "lease_renew" in raw
            else _renew_of(ttl)
        )
        skew = _seconds(environ, CLOCK_SKEW_VAR)
        if skew is None:
            skew = (
                parse_duration(raw["clock_skew"], f"{w} clock_skew", allow_zero=True)
                if "clock_skew" in raw
                else _skew_of(ttl)
            )
        if raw and ttl > 0 and renew + skew >= ttl / 2:
            raise ConfigError(
                f"{w} lease_renew ({renew:g} s) plus clock_skew ({skew:g} s) must stay under "
                f"half of lease_ttl ({ttl:g} s): a committer needs that much of its lease left"
            )
        return cls(lease_ttl=ttl, lease_renew=renew, clock_skew=skew)

    # ---- what it reads -----------------------------------------------------------------

    def now(self) -> float:
        """This node's clock (seconds since the epoch)."""
        return self.clock()

    def here(self) -> str:
        """This node's id as leases and records name it (``node``, else
        ``$FMSTORE_NODE_ID``, else the host name), unchecked: a host name that is no node
        id names no lease or record, so comparing with it is harmless."""
        if self.node is not None:
            return self.node
        return os.environ.get(NODE_ENV) or socket.gethostname()

    def node_id(self) -> str:
        """This node's id, checked (:func:`fmstore.config.node_id`'s rule): ConfigError when
        it is no node id (it would name this node's records and parts)."""
        raw = self.here()
        if not is_node_id(raw):
            raise ConfigError(
                f"node id {raw!r} (from ${NODE_ENV} or the host name) must be 1-200 ASCII "
                "letters, digits or ._:@+-, starting with a letter or a digit"
            )
        return raw

    def process(self) -> int:
        """This process's id as its leases name it (``pid``, else ``os.getpid()``)."""
        return os.getpid() if self.pid is None else self.pid

    # ---- the decisions, with these settings --------------------------------------------

    def lease_alive(self, renewed: float, now: float | None = None) -> bool:
        """:func:`~.decisions.lease_alive` with this lifetime and skew, at ``now`` (this
        clock's reading when not given)."""
        return lease_alive(
            renewed,
            now=self.now() if now is None else now,
            ttl=self.lease_ttl,
            skew=self.clock_skew,
        )

    def commit_holds(self, renewed: float, now: float | None = None) -> bool:
        """:func:`~.decisions.commit_holds` with this lifetime and skew."""
        return commit_holds(
            renewed,
            now=self.now() if now is None else now,
            ttl=self.lease_ttl,
            skew=self.clock_skew,
        )

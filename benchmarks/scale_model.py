"""The model of checkpointing at scale behind ``benchmarks/scale.py`` and ``docs/scale.md``.

Pure arithmetic, no I/O: every phase of a save or a restore is a set of *limits*, each a
number of bytes (or requests) pushed through a rate; the phase takes as long as its slowest
limit, and that limit is the one that *binds*.  A limit is either **per node** (the node's
own GPUs' PCIe links, its NVMe, its client's rate to Lustre or S3, its NIC: every node has
its own, so the time does not grow with the node count) or **shared** by every node (the
FSx for Lustre file system's throughput, S3's request rate per partitioned prefix: the time
grows with the job).  The same functions give the 1-3 node runs of this machine, where the
disk, the S3 server and the two cores are shared by every "node" (:func:`local_check`).

Units: bytes, seconds, bytes per second, requests per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

MiB = 1 << 20
TiB = 1 << 40


@dataclass(frozen=True)
class Job:
    """A training job: a Llama-shaped model sharded by FSDP over every GPU.

    ``bytes_per_param``: the saved state per parameter (bf16 weights, fp32 master weights and
    two Adam moments: about 14).  The tensor shapes (``hidden``, ``ffn``, ``kv``, ``vocab``,
    ``layers``) only decide how many items each rank holds and how big they are, which sets
    the number of blobs, S3 objects and requests."""

    name: str
    gpus: int
    gpus_per_node: int
    layers: int
    hidden: int
    ffn: int
    kv: int
    vocab: int
    bytes_per_param: float = 14.0

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpus / self.gpus_per_node)

    def tensors(self) -> list[int]:
        """Element counts of the model's tensors (one entry per tensor)."""
        h = self.hidden
        layer = [h * h, h * self.kv, h * self.kv, h * h, h * self.ffn, h * self.ffn]
        layer += [self.ffn * h, h, h]
        return layer * self.layers + [self.vocab * h, self.vocab * h, h]

    @property
    def params(self) -> int:
        return sum(self.tensors())

    @property
    def total_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def node_bytes(self) -> float:
        return self.total_bytes / self.nodes

    @property
    def rank_bytes(self) -> float:
        return self.total_bytes / self.gpus

    def rank_items(self) -> list[float]:
        """Bytes of each item one rank saves: every tensor's shard of its weights and its
        optimizer state (three items per tensor sharing ``bytes_per_param``)."""
        out: list[float] = []
        for n in self.tensors():
            share = n * self.bytes_per_param / 3 / self.gpus
            out += [share, share, share]
        return out


LLAMA_70B = Job("Llama-70B", 1024, 8, layers=80, hidden=8192, ffn=28672, kv=1024, vocab=128256)
LLAMA_405B = Job("Llama-405B", 16384, 8, layers=126, hidden=16384, ffn=53248, kv=1024, vocab=128256)


@dataclass(frozen=True)
class Inputs:
    """The figures the model runs on, each with where it came from (``sources``).

    Per node, measured on one node (``benchmarks/scale.py`` measures them):
    ``nvme_write`` / ``nvme_read`` (fmstore's DCP Writer and Reader on the node's disk),
    ``lustre_export`` / ``s3_export`` (the mover copying a committed checkpoint from NVMe),
    ``lustre_read`` / ``s3_read`` (a restore reading from that tier), ``replica_pair`` (gloo
    send/recv between two ranks; a node sends ``gpus_per_node`` such streams).
    Per GPU or per node, published: ``d2h_gpu`` (device-to-host copy into pinned memory),
    ``nic`` (the node's network), ``fsx_per_tib`` (FSx for Lustre throughput per TiB),
    ``fsx_copies`` (the file system is sized to hold this many checkpoints), the S3 request
    rates per partitioned prefix.  fmstore's layout: ``part_size`` (S3 multipart part),
    ``chunk_size`` (checksummed chunk, one GET each on restore), ``streams`` and
    ``direct_min`` (the Writer's packing of items into blobs), ``prefixes`` (partitioned S3
    prefixes one save's keys spread over)."""

    nvme_write: float
    nvme_read: float
    lustre_export: float
    s3_export: float
    lustre_read: float
    s3_read: float
    replica_pair: float
    #: fmstore's DCP Writer straight onto S3 (the 1-3 node check saves that way); 0: s3_export
    s3_save: float = 0.0
    #: seconds of a save (to NVMe, to S3) and a restore of almost nothing by one process
    #: (plans, manifest, fsyncs, requests): the fixed part of each phase of the 1-3 node
    #: check, whose sizes are small.  Not in the predictions at scale (see docs/scale.md)
    #: what the machine's shared parts serve to many clients at once (several writers and
    #: readers of the disk, many uploads to the S3 server); 0: one node's rate
    disk_write_all: float = 0.0
    disk_read_all: float = 0.0
    s3_server_all: float = 0.0
    save_fixed_s: float = 0.0
    s3_save_fixed_s: float = 0.0
    load_fixed_s: float = 0.0
    d2h_gpu: float = 25e9
    nic: float = 400e9
    fsx_per_tib: float = 1000e6
    fsx_copies: float = 10.0
    s3_put_per_prefix: float = 3500.0
    s3_get_per_prefix: float = 5500.0
    prefixes: int = 1
    part_size: int = 8 * MiB
    chunk_size: int = 8 * MiB
    read_direct_min: int = 2 * MiB
    read_max_request: int = 64 * MiB
    streams: int = 4
    direct_min: int = 4 * MiB
    #: bytes of one item's entry (with its one chunk) in manifest.json, and items per second
    #: one rank parses (``DcpManifest.loads``); both measured by ``benchmarks/scale.py``
    manifest_entry_bytes: float = 490.0
    manifest_parse: float = 7500.0
    #: how the manifest reaches the ranks at restore (and every node after a commit): one of
    #: :data:`MANIFEST_WAYS`; "every rank" is what fmstore does
    manifest: str = "every rank"
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Inputs:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def but(self, **changes: Any) -> Inputs:
        return replace(self, **changes)


@dataclass(frozen=True)
class Limit:
    """``amount`` (bytes or requests) through ``rate``; ``shared``: by every node."""

    name: str
    amount: float
    rate: float
    shared: bool = False

    @property
    def seconds(self) -> float:
        return self.amount / self.rate if self.rate > 0 else math.inf


@dataclass(frozen=True)
class Phase:
    """One phase: ``before`` seconds that must pass first (the phases it waits for), then
    its own limits, all at once; the slowest binds."""

    name: str
    limits: tuple[Limit, ...]
    before: float = 0.0

    @property
    def binding(self) -> Limit:
        return max(self.limits, key=lambda lim: lim.seconds)

    @property
    def own(self) -> float:
        return self.binding.seconds

    @property
    def seconds(self) -> float:
        return self.before + self.own

    def shared_above(self, node_bytes: float) -> float | None:
        """The per-node rate above which a shared limit, not the node, binds this phase
        (None when the phase has no shared limit)."""
        shared = [lim.seconds for lim in self.limits if lim.shared]
        return node_bytes / max(shared) if shared else None


def s3_objects(job: Job, inp: Inputs) -> list[float]:
    """Sizes of the objects one rank's part becomes on S3 (one per blob): items of at least
    ``direct_min`` bytes are a blob each; the rest is packed into ``streams`` blobs."""
    items = job.rank_items()
    direct = [b for b in items if b >= inp.direct_min]
    packed = sum(b for b in items if b < inp.direct_min)
    n = min(inp.streams, max(1, sum(1 for b in items if b < inp.direct_min)))
    return direct + ([packed / n] * n if packed else [])


def put_requests(size: float, part_size: int) -> int:
    """PUT-class requests for one object: one PUT up to ``part_size``, else create + parts +
    complete (parts grow so that no more than 10,000 are needed, as the S3 store does)."""
    if size <= part_size:
        return 1
    part = max(part_size, math.ceil(size / 10_000 / MiB) * MiB)
    return math.ceil(size / part) + 2


def get_requests(job: Job, inp: Inputs) -> int:
    """GETs of one rank's restore from S3: items of at least ``read_direct_min`` bytes one
    per chunk; smaller ones merged into ranged requests of up to ``read_max_request``."""
    n, small = 0, 0.0
    for b in job.rank_items():
        if b >= inp.read_direct_min:
            n += math.ceil(b / inp.chunk_size)
        else:
            small += b
    return n + math.ceil(small / inp.read_max_request)


def s3_save_requests(job: Job, inp: Inputs) -> int:
    """PUT-class requests of one save of the whole job to S3 (blobs, rank records, manifest)."""
    per_rank = sum(put_requests(s, inp.part_size) for s in s3_objects(job, inp)) + 1
    return per_rank * job.gpus + 1


def fsx_throughput(job: Job, inp: Inputs) -> float:
    """FSx for Lustre's aggregate throughput when sized for ``fsx_copies`` checkpoints
    (PERSISTENT_2 grows in 2.4 TiB steps, from 1.2 TiB)."""
    tib = inp.fsx_copies * job.total_bytes / TiB
    tib = 1.2 if tib <= 1.2 else math.ceil(tib / 2.4) * 2.4
    return tib * inp.fsx_per_tib


def _stall(job: Job, inp: Inputs) -> Phase:
    return Phase("stall", (Limit("device-to-host copy, per GPU", job.rank_bytes, inp.d2h_gpu),))


def replica_link(job: Job, inp: Inputs) -> float:
    """A node's rate to its partner: one gloo stream per rank, capped by the NIC."""
    return min(inp.replica_pair * job.gpus_per_node, inp.nic)


@dataclass(frozen=True)
class Prediction:
    job: Job
    phases: dict[str, Phase]
    save_requests: int
    restore_gets: int
    fsx: float

    def rows(self) -> list[dict[str, Any]]:
        return [
            {
                "job": self.job.name,
                "what": p.name,
                "s": p.seconds,
                "binds": p.binding.name,
                "scope": "shared" if p.binding.shared else "per node",
                "shared binds above": p.shared_above(self.job.node_bytes),
            }
            for p in self.phases.values()
        ]


#: How the manifest reaches the ranks (:func:`manifest_phase`).
MANIFEST_WAYS = ("every rank", "per node", "slices")


def manifest_entries(job: Job, inp: Inputs) -> int:
    """Chunk entries of the whole job's manifest: every rank's items, a chunk each per
    ``chunk_size`` (an item's first chunk shares its entry)."""
    per_rank = sum(max(1, math.ceil(b / inp.chunk_size)) for b in job.rank_items())
    return per_rank * job.gpus


def manifest_bytes(job: Job, inp: Inputs) -> float:
    """Bytes of the job's ``manifest.json``: entries times the bytes of one."""
    return manifest_entries(job, inp) * inp.manifest_entry_bytes


def manifest_phase(job: Job, inp: Inputs, way: str, *, at_restore: bool = True) -> Phase:
    """The manifest's trip to the ranks that need it, ``way`` one of :data:`MANIFEST_WAYS`.

    * ``every rank`` (fmstore today): at restore each rank reads the whole manifest from its
      tier once (the collective's look hashes it), the rank holding it broadcasts its bytes
      to every rank, and every rank parses it once (the collective's check hands the parsed
      manifest to the Reader) (gloo's broadcast, taken as a binomial
      tree: log2(ranks) hops of the whole manifest over one gloo stream each); after a
      commit rank 0 broadcasts it the same way and each node writes it.
    * ``per node``: one rank per node reads it once, the bytes go down a tree of nodes
      (pipelined: one part's time per node), every rank parses it once.
    * ``slices``: each rank reads and parses only its own items' entries and the index of
      the model's items (names, shapes: one rank's count of entries); the whole manifest
      stays the commit and is read only by a restore onto other shards.
    """
    m, e, g = manifest_bytes(job, inp), manifest_entries(job, inp), job.gpus_per_node
    link = replica_link(job, inp)
    name = "the manifest at restore" if at_restore else "the manifest on every node"
    name += f" ({way})"
    if way == "every rank":
        hops = max(1, math.ceil(math.log2(job.gpus)))
        lims = [Limit("broadcast to every rank", m * hops, inp.replica_pair, shared=True)]
        if at_restore:
            lims += [
                Limit("every rank reads it", g * m, inp.nvme_read),
                Limit("every rank parses it once", e, inp.manifest_parse),
            ]
        else:
            lims.append(Limit("each node writes it", m, inp.nvme_write))
    elif way == "per node":
        lims = [Limit("down a tree of nodes", m, link)]
        if at_restore:
            lims += [
                Limit("one rank per node reads it", m, inp.nvme_read),
                Limit("every rank parses it", e, inp.manifest_parse),
            ]
        else:
            lims.append(Limit("each node writes it", m, inp.nvme_write))
    elif way == "slices":
        own = 2 * e / job.gpus  # the rank's entries and the index of the model's items
        if at_restore:
            lims = [
                Limit(
                    "every rank reads its slice", g * own * inp.manifest_entry_bytes, inp.nvme_read
                ),
                Limit("every rank parses its slice", own, inp.manifest_parse),
            ]
        else:  # a node holds its ranks' entries already (their records): the index only
            index = own / 2 * inp.manifest_entry_bytes
            lims = [
                Limit("down a tree of nodes", index, link),
                Limit("each node writes the index", index, inp.nvme_write),
            ]
    else:
        raise ValueError(f"manifest way {way!r} is not one of {MANIFEST_WAYS}")
    return Phase(name, tuple(lims))


def predict(job: Job, inp: Inputs) -> Prediction:
    """Every phase of a save and of a restore after one node is lost, for ``job``."""
    nb, total = job.node_bytes, job.total_bytes
    link = replica_link(job, inp)
    stall = _stall(job, inp)
    # The node's part, written from the staged host copy once the snapshot is taken; the
    # save's time includes its fsyncs (the commit waits for them: docs/scale.md).
    nvme = Phase("on NVMe", (Limit("NVMe write", nb, inp.nvme_write),), stall.seconds)
    # After the commit, the coordinator's manifest to every node (a save returns then).
    copies = manifest_phase(job, inp, inp.manifest, at_restore=False)
    copies = Phase(copies.name, copies.limits, nvme.seconds)
    # Replicas from memory: each rank streams its part from the staged host copy to its
    # holder while its own NVMe write runs; the holder checks each chunk and holds it in
    # memory, then writes it to its NVMe behind.  In memory on the peer: the slower of the
    # two, and the last chunk's trip.
    tail = min(inp.chunk_size, nb) / link
    peer_mem = Phase(
        "on a peer (in memory)",
        (
            Limit("NVMe write", nb, inp.nvme_write),
            Limit("replica link: the part sent while it is written", nb, link),
        ),
        stall.seconds + tail,
    )
    # Durable on the peer: each node's NVMe writes its part and a replica (2x the bytes).
    durable = Phase(
        "durable on the peer's NVMe",
        (
            Limit("NVMe writes its part and a replica", 2 * nb, inp.nvme_write),
            Limit("replica link: the part sent while it is written", nb, link),
        ),
        stall.seconds,
    )
    # Before replicas from memory: after the commit, each part read back from the NVMe,
    # sent, and written by the partner (docs/distributed.md).
    readback = Phase(
        "on a peer, read back after the commit (before)",
        (
            Limit("each node reads its part back", nb, inp.nvme_read),
            Limit("replica link: gloo streams over the NIC", nb, link),
            Limit("partner writes the replica", nb, inp.nvme_write),
        ),
        nvme.seconds,
    )
    fsx = fsx_throughput(job, inp)
    lustre = Phase(
        "on Lustre",
        (
            Limit("Lustre export", nb, inp.lustre_export),
            Limit("FSx throughput", total, fsx, shared=True),
        ),
        nvme.seconds,
    )
    puts = s3_save_requests(job, inp)
    s3 = Phase(
        "on S3",
        (
            Limit("S3 export", nb, inp.s3_export),
            Limit(
                f"S3 PUTs per prefix x {inp.prefixes}",
                puts,
                inp.s3_put_per_prefix * inp.prefixes,
                shared=True,
            ),
        ),
        nvme.seconds,
    )
    h2d = Limit("host-to-device copy, per GPU", job.rank_bytes, inp.d2h_gpu)
    # Every restore first brings the manifest to the ranks.
    man = manifest_phase(job, inp, inp.manifest)
    own = Limit("every node reads its part", nb, inp.nvme_read)
    nothing = Phase("restore, nothing lost", (own, h2d), man.seconds)
    # One node replaced: its part comes from the replica's holders over the network, into
    # the restore (the new node writes it to its NVMe behind, below); a holder reads its own
    # part and its share of the replica from the same NVMe.
    spread = max(1, replica_spread(job))
    from_replica = Phase(
        "restore, one node lost, from the replica",
        (
            own,
            Limit(
                f"a holder reads its part and 1/{spread} of the replica",
                nb * (1 + 1 / spread),
                inp.nvme_read,
            ),
            Limit("replica link to the new node", nb, link),
            h2d,
        ),
        man.seconds,
    )
    from_memory = Phase(
        "restore, one node lost, from the replica in the holder's memory",
        (own, Limit("replica link to the new node", nb, link), h2d),
        man.seconds,
    )
    rewrite = Phase(
        "restore, one node lost: the new node's part durable again",
        (Limit("new node writes its part", nb, inp.nvme_write), Limit("replica link", nb, link)),
        man.seconds,
    )
    # fmstore today: the holder reads the replica, sends it, the new node writes it back
    # where its part belongs; then every rank reads its own part.
    refill = (
        Limit("partner reads the replica", nb, inp.nvme_read),
        Limit("replica link to the new node", nb, link),
        Limit("new node writes its part", nb, inp.nvme_write),
    )
    written_back = Phase(
        "restore, one node lost, from the replica: written back, then read (today)",
        (own, h2d),
        man.seconds + max(lim.seconds for lim in refill),
    )
    from_lustre = Phase(
        "restore, one node lost, no replica: every rank from Lustre",
        (
            Limit("Lustre read", nb, inp.lustre_read),
            Limit("FSx throughput", total, fsx, shared=True),
            h2d,
        ),
        man.seconds,
    )
    gets = get_requests(job, inp) * job.gpus
    from_s3 = Phase(
        "restore, one node lost, no replica: every rank from S3",
        (
            Limit("S3 read", nb, inp.s3_read),
            Limit(
                f"S3 GETs per prefix x {inp.prefixes}",
                gets,
                inp.s3_get_per_prefix * inp.prefixes,
                shared=True,
            ),
            h2d,
        ),
        man.seconds,
    )
    phases = [
        stall,
        nvme,
        copies,
        peer_mem,
        durable,
        readback,
        lustre,
        s3,
        man,
        nothing,
        from_replica,
        from_memory,
        rewrite,
        written_back,
        from_lustre,
        from_s3,
    ]
    return Prediction(job, {p.name: p for p in phases}, puts, gets, fsx)


def replica_spread(job: Job) -> int:
    """The holder nodes one node's replica is spread over: fmstore's placement for this
    job's nodes (without failure domains), computed by the placement itself
    (:func:`fmstore.protocol.placement.spread`), never an input."""
    from fmstore.protocol.placement import spread

    return spread(job.nodes, job.gpus_per_node)


def targets(job: Job, inp: Inputs) -> dict[str, float]:
    """The ratios issue 49 sets goals for, on the phases' own times (the stall, which both
    sides of a save ratio share, included; the manifest's trip, which both sides of a
    restore ratio wait for alike, left out: it is its own row):

    * ``peer in memory / NVMe`` (goal <= 1.2), ``durable on peer / NVMe`` (<= 2.05);
    * ``lost, from the replica / nothing lost`` (<= 1.5), and the same from the holder's
      memory."""
    ph = predict(job, inp).phases
    nvme = ph["on NVMe"].seconds
    nothing = ph["restore, nothing lost"].own
    return {
        "peer in memory / NVMe": ph["on a peer (in memory)"].seconds / nvme,
        "durable on peer / NVMe": ph["durable on the peer's NVMe"].seconds / nvme,
        "lost, from the replica / nothing lost": (
            ph["restore, one node lost, from the replica"].own / nothing
        ),
        "lost, from memory / nothing lost": (
            ph["restore, one node lost, from the replica in the holder's memory"].own / nothing
        ),
    }


def prefixes_needed(job: Job, inp: Inputs) -> dict[str, int]:
    """Partitioned prefixes that keep one save's PUTs and one restore's GETs within S3's
    per-prefix rates while every node moves at its own S3 rate."""
    put_s = job.node_bytes / inp.s3_export
    get_s = job.node_bytes / inp.s3_read
    return {
        "put": math.ceil(s3_save_requests(job, inp) / put_s / inp.s3_put_per_prefix),
        "get": math.ceil(get_requests(job, inp) * job.gpus / get_s / inp.s3_get_per_prefix),
    }


def local_check(inp: Inputs, nodes: int, node_bytes: float) -> dict[str, Phase]:
    """The model for ``nodes`` "nodes" on this one machine, each saving ``node_bytes``:
    a node's limit is one process's rate (``nvme_write``, ...), and the disk (NVMe and Lustre
    are directories on it) and the S3 server are shared: all nodes' bytes at what they serve
    many clients (``disk_write_all``, ...); a phase starts with the fixed cost of a save or
    restore of almost nothing."""
    total = nodes * node_bytes

    def phase(name: str, what: str, rate: float, shared: float, before: float) -> Phase:
        # The disk or server serves all nodes together at least as fast as it served one
        # client alone: a many-client figure below the one-client one says the machine's
        # load moved between the two measurements, not that one node contends with itself.
        return Phase(
            name,
            (
                Limit(f"{what}, one node", node_bytes, rate),
                Limit(f"{what}, one for all nodes", total, max(shared, rate), shared=True),
            ),
            before,
        )

    s3 = inp.s3_save or inp.s3_export
    save = phase("save to NVMe", "disk write", inp.nvme_write, inp.disk_write_all, inp.save_fixed_s)
    restore = phase(
        "restore from NVMe", "disk read", inp.nvme_read, inp.disk_read_all, inp.load_fixed_s
    )
    # Replicas from memory: each node writes its part and a replica (sent while its own
    # write runs), all on the one disk; a replaced node's part comes back alone (read,
    # sent, written back: fmstore's restore today), then every node reads.
    move = min(inp.nvme_read, inp.nvme_write, inp.replica_pair)
    write_all = max(inp.disk_write_all, inp.nvme_write)
    extra = {
        "save to NVMe with replicas": Phase(
            "save to NVMe with replicas",
            (
                Limit("part and replica written, one node", 2 * node_bytes, inp.nvme_write),
                Limit("part sent, one node", node_bytes, inp.replica_pair),
                Limit("parts and replicas, one disk for all", 2 * total, write_all, shared=True),
            ),
            inp.save_fixed_s,
        ),
        "restore from the replica": Phase(
            "restore from the replica",
            restore.limits,
            restore.seconds - restore.own + node_bytes / move,
        ),
    }
    return {
        "save to NVMe": save,
        "save to Lustre": phase(
            "save to Lustre", "disk write", inp.nvme_write, inp.disk_write_all, inp.save_fixed_s
        ),
        "save to S3": phase("save to S3", "S3 server", s3, inp.s3_server_all, inp.s3_save_fixed_s),
        "restore from NVMe": restore,
        **(extra if nodes > 1 else {}),
    }


def shared_fraction(one: float, measured: float, nodes: int) -> float:
    """Where ``nodes`` nodes' time ``measured`` falls between one node's time ``one`` (no
    part of the machine shared: 0) and ``nodes`` times it (one part serving all in turn: 1)."""
    if nodes < 2 or one <= 0:
        return 0.0
    return (measured - one) / ((nodes - 1) * one)

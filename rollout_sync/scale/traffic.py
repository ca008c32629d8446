"""Traffic of a plan and the time model of one sync.

**Traffic.** Every segment moves ``numel(extent) × itemsize(source dtype)`` bytes (the wire carries the
source dtype; the receiver casts) from its source rank to its target rank. Per rank: bytes sent and
received over intra-node links (NVLink) and inter-node links (the NIC), bytes copied within the rank, the
peers it sends to and receives from, and the size of its half (8-byte integers: each segment record plus
its tensor index, as the wire's half encoding writes them; the tensor table is not counted). Plans keep one
record array per layout shared by every tensor of that layout, so each distinct array is read once.

**Topology.** Trainer rank ``r`` (``0 <= r < T``) sits on node ``r // trainer_gpus_per_node``; rollout
rank ``T + j`` on node ``j // rollout_gpus_per_node`` after the trainer's nodes (separate nodes, the
default), or on that very node index when ``shared_nodes`` (trainer and rollout GPUs share nodes: rollout
GPU ``j`` sits next to trainer GPU ``j``; both sides then need the same GPUs per node).

**Time model.** Every GPU has, per direction, one intra-node link (NVLink, default 350 GB/s: NCCL busBW of
NVLink4 on H100/H200) and one inter-node link (a 400 Gb/s NIC per GPU, default 50 GB/s), all usable at once
and at full rate (full duplex, no congestion in the fabric, no latency, no per-message cost)::

    time(gpu)  = max(sent_intra / intra_bw, sent_inter / inter_bw, recv_intra / intra_bw, recv_inter / inter_bw)
    modeled_s  = max over GPUs of time(gpu)

**Lower bound.** A rollout GPU must receive every byte of its target storages that it does not copy from
itself; whatever the plan, those bytes arrive over its ingress links, so::

    lower_bound_s = max over rollout GPUs of needed_bytes / ingress_bw

with ``ingress_bw`` the NIC (``inter_bw``) when no trainer GPU shares its node, ``inter_bw + intra_bw``
otherwise. ``lower_bound_s <= modeled_s`` for every plan (the received bytes of a GPU are its needed bytes,
split over links whose times are each at least their share). It is the bound of direct point-to-point
syncs from trainer GPUs (what plans are); relaying through other rollout GPUs (receive a replicated tensor
once per node, fan it out over NVLink) is not modeled.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from math import prod

from ..errors import DryRunSpecError
from ..layout.dtypes import ITEMSIZE
from ..layout.maps import TensorMap
from ..planning.plan import Plan
from ..planning.records import record_width

__all__ = [
    "DEFAULT_INTER_GBPS",
    "DEFAULT_INTRA_GBPS",
    "Bandwidth",
    "LowerBound",
    "Topology",
    "Traffic",
    "lower_bound",
    "modeled_seconds",
    "needed_bytes",
    "node_link_seconds",
    "plan_traffic",
]

DEFAULT_INTRA_GBPS = 350.0
"""Intra-node bandwidth per GPU and direction, GB/s (NVLink4 H100/H200, practical NCCL busBW)."""

DEFAULT_INTER_GBPS = 50.0
"""Inter-node bandwidth per GPU and direction, GB/s (one 400 Gb/s ConnectX-7 / EFA NIC per GPU)."""


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """Per-GPU, per-direction link bandwidths in bytes per second."""

    intra: float = DEFAULT_INTRA_GBPS * 1e9
    inter: float = DEFAULT_INTER_GBPS * 1e9

    def __post_init__(self) -> None:
        if not (self.intra > 0 and self.inter > 0):
            raise DryRunSpecError(
                "bandwidths must be positive", expected="> 0", found=(self.intra, self.inter)
            )


@dataclass(frozen=True, slots=True)
class Topology:
    """Which node each global rank sits on (see the module docstring)."""

    trainer_world: int
    rollout_world: int
    trainer_gpus_per_node: int = 8
    rollout_gpus_per_node: int = 8
    shared_nodes: bool = False

    def __post_init__(self) -> None:
        if (
            min(
                self.trainer_world, self.rollout_world, self.trainer_gpus_per_node, self.rollout_gpus_per_node
            )
            < 1
        ):
            raise DryRunSpecError(f"topology sizes must be positive: {self}")
        if self.shared_nodes and self.trainer_gpus_per_node != self.rollout_gpus_per_node:
            raise DryRunSpecError(
                "trainer and rollout GPUs share nodes, so they need the same GPUs per node",
                expected=self.trainer_gpus_per_node,
                found=self.rollout_gpus_per_node,
            )

    @property
    def trainer_nodes(self) -> int:
        return -(-self.trainer_world // self.trainer_gpus_per_node)

    def node(self, rank: int) -> int:
        if rank < self.trainer_world:
            return rank // self.trainer_gpus_per_node
        j = rank - self.trainer_world
        if j >= self.rollout_world:
            raise DryRunSpecError(
                "rank outside the sync group",
                rank=rank,
                expected=f"< {self.trainer_world + self.rollout_world}",
                found=rank,
            )
        first = 0 if self.shared_nodes else self.trainer_nodes
        return first + j // self.rollout_gpus_per_node

    def trainer_on_node(self, node: int) -> bool:
        return node < self.trainer_nodes


@dataclass
class Traffic:
    """Per-rank traffic of one plan (bytes in the source dtype). Dicts are keyed by global rank and hold
    only ranks with a non-zero entry."""

    segments: int = 0
    sent_intra: dict[int, int] = field(default_factory=dict)
    sent_inter: dict[int, int] = field(default_factory=dict)
    recv_intra: dict[int, int] = field(default_factory=dict)
    recv_inter: dict[int, int] = field(default_factory=dict)
    local: dict[int, int] = field(default_factory=dict)
    half_bytes: dict[int, int] = field(default_factory=dict)
    half_segments: dict[int, int] = field(default_factory=dict)
    send_peers: dict[int, set[int]] = field(default_factory=dict)
    recv_peers: dict[int, set[int]] = field(default_factory=dict)

    def sent(self, rank: int) -> int:
        return self.sent_intra.get(rank, 0) + self.sent_inter.get(rank, 0)

    def received(self, rank: int) -> int:
        return self.recv_intra.get(rank, 0) + self.recv_inter.get(rank, 0)

    @property
    def total_sent(self) -> int:
        return sum(self.sent_intra.values()) + sum(self.sent_inter.values())

    @property
    def total_local(self) -> int:
        return sum(self.local.values())

    def ranks(self) -> list[int]:
        """Every rank with any traffic or a non-empty half, increasing."""
        return sorted({*self.half_segments, *self.local})


def _add(table: dict[int, int], key: int, value: int) -> None:
    table[key] = table.get(key, 0) + value


def plan_traffic(plan: Plan, topology: Topology) -> Traffic:
    """Per-rank traffic of ``plan`` under ``topology`` (see the module docstring)."""
    # Tensors of one layout share their record array: count each (array, itemsize) once, with multiplicity.
    arrays: dict[int, tuple[array, int]] = {}  # id(records) -> (records, ndim)
    multiplicity: dict[tuple[int, int], int] = {}  # (id(records), itemsize) -> tensors
    for i, t in enumerate(plan.tensors):
        rec = plan.records(i)
        arrays.setdefault(id(rec), (rec, len(t.shape)))
        key = (id(rec), ITEMSIZE[t.source_dtype])
        multiplicity[key] = multiplicity.get(key, 0) + 1
    pair_elems: dict[int, dict[tuple[int, int], tuple[int, int]]] = {}  # id(rec) -> pair -> (numel, count)
    pair_bytes: dict[tuple[int, int], int] = {}
    pair_words: dict[tuple[int, int], int] = {}
    pair_segments: dict[tuple[int, int], int] = {}
    out = Traffic()
    for (rid, size), mult in multiplicity.items():
        rec, ndim = arrays[rid]
        per_pair = pair_elems.get(rid)
        if per_pair is None:
            per_pair = pair_elems[rid] = _pairs(rec, ndim)
        width = record_width(ndim) + 1  # the half's encoding prefixes each record with its tensor index
        for pair, (numel, count) in per_pair.items():
            pair_bytes[pair] = pair_bytes.get(pair, 0) + numel * size * mult
            pair_segments[pair] = pair_segments.get(pair, 0) + count * mult
            pair_words[pair] = pair_words.get(pair, 0) + count * mult * width
            out.segments += count * mult
    nodes: dict[int, int] = {}
    for (src, tgt), nbytes in pair_bytes.items():
        count = pair_segments[(src, tgt)]
        words = pair_words[(src, tgt)]
        _add(out.half_segments, src, count)
        _add(out.half_bytes, src, 8 * words)
        if src == tgt:
            _add(out.local, src, nbytes)
            continue
        _add(out.half_segments, tgt, count)
        _add(out.half_bytes, tgt, 8 * words)
        out.send_peers.setdefault(src, set()).add(tgt)
        out.recv_peers.setdefault(tgt, set()).add(src)
        a = nodes.get(src)
        if a is None:
            a = nodes[src] = topology.node(src)
        b = nodes.get(tgt)
        if b is None:
            b = nodes[tgt] = topology.node(tgt)
        if a == b:
            _add(out.sent_intra, src, nbytes)
            _add(out.recv_intra, tgt, nbytes)
        else:
            _add(out.sent_inter, src, nbytes)
            _add(out.recv_inter, tgt, nbytes)
    return out


def _pairs(rec: array, ndim: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(source rank, target rank) -> (elements, segments) of one record array."""
    width = record_width(ndim)
    ext = 4 + 2 * ndim
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for k in range(0, len(rec), width):
        pair = (rec[k], rec[k + 2])
        numel = prod(rec[k + ext : k + width])
        got = out.get(pair)
        out[pair] = (numel, 1) if got is None else (got[0] + numel, got[1] + 1)
    return out


def modeled_seconds(traffic: Traffic, bandwidth: Bandwidth) -> tuple[float, int | None]:
    """``(seconds, the slowest rank)`` of the time model (module docstring); ``(0.0, None)`` for no
    traffic."""
    best = 0.0
    slowest: int | None = None
    for rank in sorted({*traffic.sent_intra, *traffic.sent_inter, *traffic.recv_intra, *traffic.recv_inter}):
        t = max(
            traffic.sent_intra.get(rank, 0) / bandwidth.intra,
            traffic.sent_inter.get(rank, 0) / bandwidth.inter,
            traffic.recv_intra.get(rank, 0) / bandwidth.intra,
            traffic.recv_inter.get(rank, 0) / bandwidth.inter,
        )
        if t > best:
            best, slowest = t, rank
    return best, slowest


def node_link_seconds(
    traffic: Traffic, topology: Topology, link_bytes_per_s: float
) -> tuple[float, int | None]:
    """``(seconds, the busiest node)`` when every node has one link of ``link_bytes_per_s`` per direction
    that all its ranks share (hosts joined by one NIC each, as the emulated hosts of ``bench hosts``): the
    inter-node bytes into or out of a node, over its link; the slowest node sets the sync."""
    if link_bytes_per_s <= 0:
        raise DryRunSpecError("a link rate must be positive", expected="> 0", found=link_bytes_per_s)
    into: dict[int, int] = {}
    out: dict[int, int] = {}
    for rank, nbytes in traffic.recv_inter.items():
        _add(into, topology.node(rank), nbytes)
    for rank, nbytes in traffic.sent_inter.items():
        _add(out, topology.node(rank), nbytes)
    busiest = max({*into, *out}, key=lambda n: max(into.get(n, 0), out.get(n, 0)), default=None)
    if busiest is None:
        return 0.0, None
    return max(into.get(busiest, 0), out.get(busiest, 0)) / link_bytes_per_s, busiest


@dataclass(frozen=True, slots=True)
class LowerBound:
    seconds: float
    rank: int | None  # the rollout GPU that sets it
    needed_bytes: int  # what that GPU must receive


def needed_bytes(sources: Iterable[TensorMap], targets: Sequence[TensorMap]) -> dict[int, int]:
    """Per target rank, the bytes (source dtype) of all its target storages."""
    wire = {m.name: ITEMSIZE[m.dtype] for m in sources}
    per_layout: dict[int, tuple[object, dict[int, int]]] = {}  # id(storage shapes) -> numel per rank
    out: dict[int, int] = {}
    for t in targets:
        shapes = t.storage_shapes
        got = per_layout.get(id(shapes))
        if got is None:
            got = per_layout[id(shapes)] = (shapes, {r: prod(s) for r, s in shapes.items()})
        size = wire.get(t.name, ITEMSIZE[t.dtype])
        for rank, numel in got[1].items():
            if numel:
                out[rank] = out.get(rank, 0) + numel * size
    return out


def lower_bound(
    needed: dict[int, int], traffic: Traffic, topology: Topology, bandwidth: Bandwidth
) -> LowerBound:
    """The ingress bound (module docstring). ``needed``: ``needed_bytes`` of the plan's maps; bytes a rank
    copies from itself (``traffic.local``) are not needed over a link."""
    best = LowerBound(0.0, None, 0)
    for rank in sorted(needed):
        nbytes = needed[rank] - traffic.local.get(rank, 0)
        ingress = bandwidth.inter
        if topology.trainer_on_node(topology.node(rank)):
            ingress += bandwidth.intra
        seconds = nbytes / ingress
        if seconds > best.seconds:
            best = LowerBound(seconds, rank, nbytes)
    return best

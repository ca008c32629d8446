"""A time model of one sync as the executor runs it, from link figures measured on the machine (pure).

The bytes-over-bandwidth model of ``traffic`` ignores what the executor does besides moving bytes. This
model follows the executor's phases (``rollout_sync.transport.executor``) rank by rank, from the same
schedule the executor builds (``transport.schedule.build_schedule``):

- **agree**: one small allgather over the group (``LinkFigures.agree_s``);
- **pack**: the sender copies its packed messages into staging (``packed_send_bytes``) and the receiver
  copies them out (``packed_recv_bytes``), and each rank copies its local segments, at ``copy_gbps``;
- **messages**: every message costs ``message_s`` on each end (posting, completion, a loopback
  round trip's share), whatever its size;
- **wire**: the bytes of every pair of ranks, all pairs at once, over links that share one medium (one
  host's loopback, or a GPU's NIC): with ``k`` streams active the medium carries ``stream_gbps(k)`` in
  all, split evenly among them; a stream that finishes leaves its share to the others (progressive
  filling). ``stream_gbps`` is measured at a few ``k`` and interpolated linearly between them (held flat
  beyond the largest).

Each rank's time is agree + its copies + its messages + the time the wire needs until its last byte is in,
and a sync takes the slowest rank's time. The phases are added, not overlapped: the executor overlaps
packing round ``k + 1`` with round ``k`` on the wire, which the model ignores (it matters with many rounds;
the benchmark's rows say how much).

``bench model`` measures the figures and compares the model with real syncs; ``rollout-sync plan`` uses
the same function with GPU defaults.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from math import prod
from typing import TYPE_CHECKING

from ..layout.dtypes import ITEMSIZE
from ..planning.half import PlanHalf

if TYPE_CHECKING:  # the transport package imports torch; the model itself is pure
    from ..transport.core.schedule import Schedule

__all__ = [
    "GPU_LINKS",
    "LinkFigures",
    "ModeledSync",
    "RankWork",
    "modeled_sync",
    "overhead_seconds",
    "rank_work",
    "wire_seconds",
]


@dataclass(frozen=True)
class LinkFigures:
    """What the model needs to know about the machine: seconds per message (one end), aggregate GB/s of
    the shared medium with ``k`` streams active (``stream_gbps[k]``), memcpy GB/s of one rank while every
    rank copies, and seconds of one small allgather over the group."""

    message_s: float
    stream_gbps: Mapping[int, float]
    copy_gbps: float
    agree_s: float

    def aggregate(self, k: int) -> float:
        """Bytes per second the medium carries in all with ``k`` streams active."""
        points = sorted(self.stream_gbps.items())
        if not points:
            raise ValueError("stream_gbps needs at least one measured stream count")
        if k <= points[0][0]:
            return points[0][1] * 1e9
        for (k0, g0), (k1, g1) in pairwise(points):
            if k <= k1:
                return (g0 + (g1 - g0) * (k - k0) / (k1 - k0)) * 1e9
        return points[-1][1] * 1e9


GPU_LINKS = LinkFigures(message_s=20e-6, stream_gbps={1: 50.0}, copy_gbps=1000.0, agree_s=1e-3)
"""Assumed, not measured (the GPU path has not run): 20 µs per NCCL point-to-point message and end, 1 TB/s
for a device-to-device pack or unpack copy, 1 ms for the agreement's small allgather. ``rollout-sync
plan`` takes the wire time from its per-link traffic model and these for the rest."""


@dataclass(frozen=True)
class RankWork:
    """One rank's work in one sync, from its schedule: bytes per peer each way, bytes it packs and unpacks,
    bytes it copies locally, messages (sends and receives), packed rounds."""

    rank: int
    sent: Mapping[int, int]
    received: Mapping[int, int]
    packed_send_bytes: int
    packed_recv_bytes: int
    local_bytes: int
    messages: int
    rounds: int

    @property
    def copy_bytes(self) -> int:
        return self.packed_send_bytes + self.packed_recv_bytes + self.local_bytes


def rank_work(half: PlanHalf, schedule: Schedule) -> RankWork:
    """The work of ``half`` under the executor's ``schedule`` of it."""
    sent: dict[int, int] = {}
    received: dict[int, int] = {}
    packed_send = packed_recv = 0
    for m in schedule.sends:
        sent[m.peer] = sent.get(m.peer, 0) + m.nbytes
        packed_send += 0 if m.direct else m.nbytes
    for m in schedule.receives:
        received[m.peer] = received.get(m.peer, 0) + m.nbytes
        packed_recv += 0 if m.direct else m.nbytes
    local = 0
    for s in schedule.local:
        local += prod(s.extent) * ITEMSIZE[half.tensors[s.tensor].target_dtype]
    return RankWork(
        half.rank,
        sent,
        received,
        packed_send,
        packed_recv,
        local,
        len(schedule.sends) + len(schedule.receives),
        schedule.rounds,
    )


def wire_seconds(pairs: Mapping[tuple[int, int], int], links: LinkFigures) -> dict[tuple[int, int], float]:
    """When each stream ``(source, target) -> bytes`` finishes, all starting at once on the shared medium
    (progressive filling: the active streams share ``aggregate(k)`` evenly)."""
    left = {p: float(b) for p, b in pairs.items() if b > 0}
    done: dict[tuple[int, int], float] = {p: 0.0 for p, b in pairs.items() if b <= 0}
    now = 0.0
    while left:
        rate = links.aggregate(len(left)) / len(left)
        first = min(left.values())
        step = first / rate
        now += step
        for p in list(left):
            left[p] -= first
            if left[p] <= 1e-6:
                done[p] = now
                del left[p]
    return done


@dataclass(frozen=True)
class ModeledSync:
    """The modeled seconds of one sync (``seconds``: the slowest rank) and each rank's parts."""

    seconds: float
    slowest: int
    parts: Mapping[int, Mapping[str, float]] = field(default_factory=dict)


def overhead_seconds(work: RankWork, links: LinkFigures) -> dict[str, float]:
    """What a rank spends besides the wire: the agreement, its copies and its messages."""
    return {
        "agree": links.agree_s,
        "copy": work.copy_bytes / (links.copy_gbps * 1e9),
        "messages": work.messages * links.message_s,
    }


def modeled_sync(works: Sequence[RankWork], links: LinkFigures) -> ModeledSync:
    """The model's time of one sync whose ranks do ``works``."""
    pairs = {(w.rank, peer): n for w in works for peer, n in w.sent.items()}
    finished = wire_seconds(pairs, links)
    parts: dict[int, dict[str, float]] = {}
    for w in works:
        mine = [t for (src, dst), t in finished.items() if w.rank in (src, dst)]
        parts[w.rank] = {**overhead_seconds(w, links), "wire": max(mine, default=0.0)}
    totals = {r: sum(p.values()) for r, p in parts.items()}
    slowest = max(totals, key=lambda r: (totals[r], -r)) if totals else -1
    return ModeledSync(totals.get(slowest, 0.0), slowest, parts)

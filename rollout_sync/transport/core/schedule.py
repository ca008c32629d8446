"""The transfer schedule of one rank's half: which bytes travel in which message, in which round, through
which staging slot.

Pure (no torch, no process group). Lifecycle (see ``executor.py``): ``half_check.check_half`` (before
agreement) → ``wanted_message_bytes`` (each rank's offer, exchanged in the agreement: ``message_offer``) →
``build_schedule`` with ``message_bytes[peer] = min(offer of this rank, offer of peer)`` (``message_sizes``)
→ the executor runs it.

``build_schedule`` cuts each pair stream into messages (``messages.pair_messages``: direct messages, and
packed message ``k`` in round ``k``) and lays out the staging slots: packed round ``k`` uses slot parity
``k % depth`` of its (direction, peer), so the executor keeps ``depth`` rounds in flight and the rank's
staging is ``depth`` slots per peer and direction, whatever the number of rounds.

A pair whose two ranks run in the same process (``in_process``: a trainer rank and a vLLM worker of TRL's
colocate mode) has no messages at all: its segments are a **handoff**. The sender offers its source
storages, the receiver copies each segment straight from the sender's storage into its own (one cast-copy per
element, no staging) and tells the sender when it is done.

A pair on one host in two processes (``shared``) packs its messages into staging slots that live in shared
memory (``shared_memory``), laid out per (direction, peer) segment (``shared_slots``, ``shared_bytes``)
instead of in the rank's arena. Where the receiver can read the sender's memory (``pulls_from`` /
``pulled_by``, found by a probe) every ``pullable`` segment is a direct message the receiver pulls straight
from the sender's source storage into its target storage, run by run (``copies.part_runs``,
``cross_memory``): one copy, no staging, no work for the sender; the rest is packed like any segment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ...planning.half import PlanHalf
from ...planning.records import Segment
from .pair_messages import ALIGN, MIN_MESSAGE_BYTES, Message, pair_messages, segment_key

__all__ = [
    "Schedule",
    "build_schedule",
    "message_offer",
    "message_sizes",
    "peers_of",
    "wanted_message_bytes",
]


@dataclass(frozen=True, slots=True)
class Schedule:
    """What one rank does in one sync.

    ``sends`` / ``receives`` are sorted by ``(direct, round, peer)``; ``rounds`` counts packed rounds.
    ``shared_slots`` / ``shared_bytes``: the slots of ``shared`` peers, as byte ranges in one segment per
    ``(direction, peer)``, and each segment's size.
    ``handoff_to``: the in-process peers this rank offers its sources to; ``handoff_from``: per in-process
    peer that sends to this rank, the segments this rank copies from that peer's storages (canonical order).
    ``slots`` gives each staging slot's
    byte range in the rank's staging arena, keyed by ``(direction, peer, parity)`` with direction
    ``"send"`` or ``"recv"``; packed message of round ``k`` uses parity ``k % depth``.
    """

    rank: int
    sends: tuple[Message, ...]
    receives: tuple[Message, ...]
    local: tuple[Segment, ...]
    rounds: int
    depth: int
    slots: Mapping[tuple[str, int, int], tuple[int, int]]
    staging_bytes: int
    handoff_to: tuple[int, ...] = ()
    handoff_from: tuple[tuple[int, tuple[Segment, ...]], ...] = ()
    shared_slots: Mapping[tuple[str, int, int], tuple[int, int]] = field(default_factory=dict)
    shared_bytes: Mapping[tuple[str, int], int] = field(default_factory=dict)

    def slot(self, direction: str, message: Message) -> tuple[int, int]:
        """The byte range of ``message``'s slot: in the arena, or in its pair's shared segment."""
        key = (direction, message.peer, message.round % self.depth)
        found = self.slots.get(key)
        return found if found is not None else self.shared_slots[key]


def _align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _align_down(n: int) -> int:
    return n // ALIGN * ALIGN


def peers_of(
    half: PlanHalf, in_process: frozenset[int] = frozenset()
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ranks this half sends messages to, and those it receives messages from (sorted); peers in
    ``in_process`` are left out (their segments are handoffs, not messages)."""
    return (
        tuple(sorted({s.target_rank for s in half.sends} - in_process)),
        tuple(sorted({s.source_rank for s in half.receives} - in_process)),
    )


def wanted_message_bytes(
    half: PlanHalf, staging_cap_bytes: int, depth: int, in_process: frozenset[int] = frozenset()
) -> int:
    """The largest message this rank can stage per peer: ``cap / (depth · (send peers + receive peers))``,
    rounded down to ``ALIGN``. ``depth`` is 2 when packing the next round overlaps the current transfer."""
    send_peers, recv_peers = peers_of(half, in_process)
    slots = depth * (len(send_peers) + len(recv_peers))
    return _align_down(staging_cap_bytes // max(slots, 1))


def message_offer(
    half: PlanHalf, staging_cap_bytes: int, depth: int, in_process: frozenset[int] = frozenset()
) -> tuple[int, str | None]:
    """The message size this rank offers in the agreement (``wanted_message_bytes``), and why its staging cap
    is too small for its half (a half with peers needs at least ``MIN_MESSAGE_BYTES`` per message), or
    None."""
    wanted = wanted_message_bytes(half, staging_cap_bytes, depth, in_process)
    send_peers, recv_peers = peers_of(half, in_process)
    if (send_peers or recv_peers) and wanted < MIN_MESSAGE_BYTES:
        slots = depth * (len(send_peers) + len(recv_peers))
        return wanted, (
            f"a staging cap of {staging_cap_bytes} bytes leaves {wanted} bytes per message for {slots} "
            f"staging slots; at least {MIN_MESSAGE_BYTES} are needed"
        )
    return wanted, None


def message_sizes(
    half: PlanHalf, offers: list[int], rank: int, in_process: frozenset[int] = frozenset()
) -> dict[int, int]:
    """The agreed message size with each peer this half exchanges messages with: the smaller of the two
    offers (``offers`` indexed by group rank; ``rank``: this rank's)."""
    send_peers, recv_peers = peers_of(half, in_process)
    return {p: min(offers[rank], offers[p]) // ALIGN * ALIGN for p in {*send_peers, *recv_peers}}


def build_schedule(
    half: PlanHalf,
    message_bytes: Mapping[int, int],
    *,
    zero_copy: bool = True,
    depth: int = 2,
    in_process: frozenset[int] = frozenset(),
    shared: frozenset[int] = frozenset(),
    pulls_from: frozenset[int] = frozenset(),
    pulled_by: frozenset[int] = frozenset(),
    uniform: bool = False,
    maps_from: frozenset[int] = frozenset(),
    mapped_by: frozenset[int] = frozenset(),
) -> Schedule:
    """The schedule of ``half`` given the agreed message size with each peer; segments with a peer in
    ``in_process`` become handoffs; peers in ``shared`` get shared slots, and direct messages only where
    this rank pulls from them (``pulls_from``) or they pull from it (``pulled_by``); segments this rank sends
    to a peer that maps its storages (``mapped_by``) or receives from one whose storages it maps
    (``maps_from``) are handoffs too (``mapped``); ``uniform``: one wire element size per packed message
    (``pair_messages``)."""
    if depth not in (1, 2):
        raise ValueError(f"depth must be 1 or 2, not {depth}")
    by_peer_out: dict[int, list[Segment]] = {}
    by_peer_in: dict[int, list[Segment]] = {}
    handoff_in: dict[int, list[Segment]] = {}
    handoff_to: set[int] = set()
    for s in half.sends:
        if s.target_rank in in_process or s.target_rank in mapped_by:
            handoff_to.add(s.target_rank)
        else:
            by_peer_out.setdefault(s.target_rank, []).append(s)
    for s in half.receives:
        if s.source_rank in in_process or s.source_rank in maps_from:
            handoff_in.setdefault(s.source_rank, []).append(s)
        else:
            by_peer_in.setdefault(s.source_rank, []).append(s)
    sends: list[Message] = []
    receives: list[Message] = []
    slot_sizes: dict[tuple[str, int, int], int] = {}
    for direction, by_peer, out in (("send", by_peer_out, sends), ("recv", by_peer_in, receives)):
        for peer in sorted(by_peer):
            pulls = pulled_by if direction == "send" else pulls_from
            direct = zero_copy and peer not in shared
            msgs = pair_messages(
                half,
                by_peer[peer],
                peer,
                message_bytes[peer],
                zero_copy=direct,
                pull=zero_copy and peer in pulls,
                uniform=uniform,
            )
            out.extend(msgs)
            for m in msgs:
                if not m.direct:
                    key = (direction, peer, m.round % depth)
                    slot_sizes[key] = max(slot_sizes.get(key, 0), _align_up(m.nbytes))
    order = lambda m: (m.direct, m.round, m.peer)  # noqa: E731
    sends.sort(key=order)
    receives.sort(key=order)
    slots: dict[tuple[str, int, int], tuple[int, int]] = {}
    shared_slots: dict[tuple[str, int, int], tuple[int, int]] = {}
    shared_bytes: dict[tuple[str, int], int] = {}
    offset = 0
    for key in sorted(slot_sizes):
        direction, peer, _ = key
        if peer in shared:
            at = shared_bytes.get((direction, peer), 0)
            shared_slots[key] = (at, slot_sizes[key])
            shared_bytes[(direction, peer)] = at + slot_sizes[key]
            continue
        slots[key] = (offset, slot_sizes[key])
        offset += slot_sizes[key]
    rounds = max((m.round + 1 for m in (*sends, *receives) if not m.direct), default=0)
    return Schedule(
        rank=half.rank,
        sends=tuple(sends),
        receives=tuple(receives),
        local=tuple(sorted(half.local, key=segment_key)),
        rounds=rounds,
        depth=depth,
        slots=slots,
        staging_bytes=offset,
        handoff_to=tuple(sorted(handoff_to)),
        shared_slots=shared_slots,
        shared_bytes=shared_bytes,
        handoff_from=tuple(
            (peer, tuple(sorted(segments, key=segment_key))) for peer, segments in sorted(handoff_in.items())
        ),
    )

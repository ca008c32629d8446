"""Executor rounds of one rank's half at a staging cap, from the executor's own pure schedule.

The executor (``rollout_sync.transport.executor``) lets every rank offer a message size, ``cap / (depth ·
(send peers + receive peers))`` rounded down to ``ALIGN`` (``schedule.wanted_message_bytes``), uses with each
peer the smaller of the two offers, and runs ``schedule.build_schedule``. Here the offers of all ranks come
from the plan's traffic (peer counts only), so the schedule of one rank is built exactly as the executor
would build it, without the other ranks' halves.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..planning.half import PlanHalf
from ..transport.core.pair_messages import ALIGN, MIN_MESSAGE_BYTES
from ..transport.core.schedule import build_schedule, peers_of
from .sync_model import RankWork, rank_work
from .traffic import Traffic

__all__ = ["RankRounds", "message_offers", "rank_rounds"]


def message_offers(traffic: Traffic, staging_cap_bytes: int, depth: int = 2) -> dict[int, int]:
    """Per rank with peers, the message size it offers (``schedule.wanted_message_bytes``)."""
    ranks = {*traffic.send_peers, *traffic.recv_peers}
    out = {}
    for rank in ranks:
        peers = len(traffic.send_peers.get(rank, ())) + len(traffic.recv_peers.get(rank, ()))
        out[rank] = staging_cap_bytes // max(depth * peers, 1) // ALIGN * ALIGN
    return out


@dataclass(frozen=True, slots=True)
class RankRounds:
    rank: int
    rounds: int
    messages: int
    staging_bytes: int
    message_bytes: int  # the smallest agreed message size with any peer
    refused: str | None  # why the executor would refuse this rank, or None
    work: RankWork | None = None  # what the schedule makes the rank do (``sync_model``)


def rank_rounds(half: PlanHalf, offers: dict[int, int], depth: int = 2) -> RankRounds:
    """The rounds, messages and staging bytes of ``half`` under the agreed message sizes."""
    send_peers, recv_peers = peers_of(half)
    peers = {*send_peers, *recv_peers}
    if not peers:
        return RankRounds(half.rank, 0, 0, 0, 0, None)
    own = offers[half.rank]
    sizes = {p: min(own, offers[p]) // ALIGN * ALIGN for p in peers}
    smallest = min(sizes.values())
    if smallest < MIN_MESSAGE_BYTES:
        peer = min(sizes, key=lambda p: (sizes[p], p))
        reason = (
            f"the staging cap leaves {smallest} bytes per message between ranks {half.rank} and {peer} (too"
            f" many peers for the cap); the executor needs at least {MIN_MESSAGE_BYTES}"
        )
        return RankRounds(half.rank, 0, 0, 0, smallest, reason)
    schedule = build_schedule(half, sizes, zero_copy=True, depth=depth)
    messages = len(schedule.sends) + len(schedule.receives)
    return RankRounds(
        half.rank,
        schedule.rounds,
        messages,
        schedule.staging_bytes,
        smallest,
        None,
        rank_work(half, schedule),
    )

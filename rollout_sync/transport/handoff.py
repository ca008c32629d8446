"""Copies within one process: a rank's local segments, and handoffs between ranks of one process
(``in_process``), where the receiver copies each segment straight from the source storages its in-process
peer hands over. ``Handoffs`` is one transfer's handoffs: this rank's offers to the peers it sends to, its
copies from those that send to it, and, when it fails first, its refusals of the rest (so that no sender
waits for the timeout)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..planning.half import PlanHalf
from ..planning.records import Segment
from .p2p import Pending, Transport
from .schedule import Schedule
from .targets import Targets

__all__ = ["Handoffs", "copy_handoff", "copy_segments"]


def copy_segments(
    segments: Iterable[Segment], half: PlanHalf, sources: Mapping[str, torch.Tensor], targets: Targets
) -> None:
    """Copy each segment from its source storage into its target storage (cast to the target's dtype)."""
    for s in segments:
        name = half.tensors[s.tensor].name
        src, dst = sources[name], targets.get(name)
        torch.as_strided(dst, s.extent, s.target_strides, dst.storage_offset() + s.target_offset).copy_(
            torch.as_strided(src, s.extent, s.source_strides, src.storage_offset() + s.source_offset)
        )
        targets.landed(name)


def copy_handoff(
    transport: Transport, peer: int, segments: tuple[Segment, ...], half: PlanHalf, targets: Targets
) -> None:
    """Copy ``segments`` straight from the source storages ``peer`` (in this process) hands over."""
    sources = transport.take(peer)
    try:
        copy_segments(segments, half, sources, targets)
    except BaseException as e:
        transport.finish(peer, f"rank {transport.rank} failed copying from rank {peer}'s storages: {e!r}")
        raise
    transport.finish(peer)


class Handoffs:
    """One transfer's handoffs with the peers in this process (``schedule.handoff_to`` / ``handoff_from``)."""

    def __init__(self, transport: Transport, schedule: Schedule) -> None:
        self.transport = transport
        self.schedule = schedule
        self.offered: list[Pending] = []
        self.taken: set[int] = set()  # in-process peers whose handoff this rank took

    def offer(self, sources: Mapping[str, torch.Tensor]) -> None:
        """Hand this rank's source storages to every in-process peer it sends to (they copy from them while
        this rank goes on)."""
        self.offered = [self.transport.offer(peer, sources) for peer in self.schedule.handoff_to]

    def take(self, half: PlanHalf, targets: Targets) -> None:
        """Copy every segment the in-process peers that send to this rank hand over."""
        for peer, handed in self.schedule.handoff_from:
            self.taken.add(peer)
            copy_handoff(self.transport, peer, handed, half, targets)

    def wait(self) -> None:
        """Wait until every peer offered to has copied from this rank's sources."""
        self.transport.wait(self.offered)

    def decline(self, error: BaseException) -> None:
        """This rank failed: fail the offers of the peers whose handoff it has not taken, so that their
        senders do not wait for the timeout."""
        for peer, _ in self.schedule.handoff_from:
            if peer not in self.taken:  # its sender must not wait for the timeout
                self.transport.decline(
                    peer, f"rank {self.transport.rank} failed before copying from rank {peer}: {error!r}"
                )

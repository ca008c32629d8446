"""Copies straight from a sender's storages: a rank's local segments, and handoffs between ranks of one
process (``in_process``) or of one host whose receiver maps the sender's storages (``mapped``), where the
receiver copies each segment straight from the source storages its peer hands over. ``Handoffs`` is one
transfer's handoffs: this rank's offers to the peers it sends to, its
copies from those that send to it, and, when it fails first, its refusals of the rest (so that no sender
waits for the timeout)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ...planning.half import PlanHalf
from ...planning.records import Segment
from ..core.p2p import Pending, Transport
from ..core.pair_messages import segment_key
from ..core.program import torch_dtype
from ..core.schedule import Schedule
from ..core.target_streams import Targets

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


def handed_names(half: PlanHalf, segments: Iterable[Segment]) -> list[str]:
    """The source storages a handoff's segments read (sorted: the order of a mapped handoff's table)."""
    return sorted({half.tensors[s.tensor].name for s in segments})


def _take(
    transport: Transport, peer: int, segments: tuple[Segment, ...], half: PlanHalf, provisional: bool
) -> Mapping[str, torch.Tensor]:
    """``transport.take`` of the source storages ``segments`` read, with their dtypes."""
    names = handed_names(half, segments)
    dtype_of = {half.tensors[s.tensor].name: half.tensors[s.tensor].source_dtype for s in segments}
    return transport.take(peer, names, [torch_dtype(dtype_of[n]) for n in names], provisional)


def copy_handoff(
    transport: Transport, peer: int, segments: tuple[Segment, ...], half: PlanHalf, targets: Targets
) -> Pending | None:
    """Copy ``segments`` straight from the source storages ``peer`` hands over (in this process, or mapped
    from its memory); returns the answer on the wire, if any."""
    # a streamed target is rebuilt as soon as it has landed: never from provisional sources
    sources = _take(transport, peer, segments, half, provisional=not targets.streamed)
    try:
        copy_segments(segments, half, sources, targets)
        current = transport.confirm(peer)
        if current is not None:  # the peer hands over other storages than it did last time
            copy_segments(segments, half, current, targets)
    except BaseException as e:
        transport.finish(peer, f"rank {transport.rank} failed copying from rank {peer}'s storages: {e!r}")
        raise
    return transport.finish(peer)


class Handoffs:
    """One transfer's handoffs with the peers in this process (``schedule.handoff_to`` / ``handoff_from``)."""

    def __init__(self, transport: Transport, schedule: Schedule) -> None:
        self.transport = transport
        self.schedule = schedule
        self.offered: list[Pending] = []
        self.answers: list[Pending] = []  # "done" sent to mapped peers
        self.taken: set[int] = set()  # peers whose handoff this rank took

    def offer(self, half: PlanHalf, sources: Mapping[str, torch.Tensor]) -> None:
        """Hand this rank's source storages to every peer it hands off to (they copy from them while this
        rank goes on)."""
        for peer in self.schedule.handoff_to:
            names = handed_names(half, (s for s in half.sends if s.target_rank == peer))
            self.offered.append(self.transport.offer(peer, sources, names))

    def take(self, half: PlanHalf, targets: Targets) -> None:
        """Copy every segment the peers that hand off to this rank hand over."""
        if targets.streamed and len(self.schedule.handoff_from) > 1:
            self._take_streamed(half, targets)
            return
        for peer, handed in self.schedule.handoff_from:
            self.taken.add(peer)
            answer = copy_handoff(self.transport, peer, handed, half, targets)
            if answer is not None:
                self.answers.append(answer)

    def _take_streamed(self, half: PlanHalf, targets: Targets) -> None:
        """Streamed targets (a layer's loaded form exists only while it is written): take every peer's
        storages first, then copy all peers' segments in plan order, so that each target completes (and is
        rebuilt and freed) before the next one opens, as with messages."""
        taken: list[tuple[int, Mapping[str, torch.Tensor]]] = []
        try:
            for peer, handed in self.schedule.handoff_from:
                self.taken.add(peer)
                taken.append((peer, _take(self.transport, peer, handed, half, provisional=False)))
            sources_of = dict(taken)
            merged = sorted(
                ((s, peer) for peer, handed in self.schedule.handoff_from for s in handed),
                key=lambda e: segment_key(e[0]),
            )
            for s, peer in merged:
                copy_segments((s,), half, sources_of[peer], targets)
        except BaseException as e:
            for peer, _ in taken:
                why = f"rank {self.transport.rank} failed copying from rank {peer}'s storages: {e!r}"
                answer = self.transport.finish(peer, why)
                if answer is not None:
                    self.answers.append(answer)
            raise
        for peer, _ in taken:
            answer = self.transport.finish(peer)
            if answer is not None:
                self.answers.append(answer)

    def wait(self) -> None:
        """Wait until every peer offered to has copied from this rank's sources (and this rank's answers
        have left)."""
        self.transport.wait(self.offered)
        self.transport.wait(self.answers)

    def decline(self, error: BaseException) -> None:
        """This rank failed: fail the offers of the peers whose handoff it has not taken, so that their
        senders do not wait for the timeout."""
        for peer, _ in self.schedule.handoff_from:
            if peer not in self.taken:  # its sender must not wait for the timeout
                self.transport.decline(
                    peer, f"rank {self.transport.rank} failed before copying from rank {peer}: {error!r}"
                )

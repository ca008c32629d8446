"""The transfer of a full sync on one rank: every message of its compiled program (``program``), bounded by
its staging.

Order (every rank issues in the same order, which NCCL needs): packed round 0, then every direct message
(dense, same dtype: storage to storage, no staging) at once, then the other packed rounds: post receives,
pack and post sends, wait, unpack (the sender casts to a narrower target dtype while packing, the receiver
otherwise); with ``overlap`` the next round is packed while the current one is on the wire. Copies within
the rank run while the first rounds are in flight, then the handoffs from peers in this process (each
segment copied straight from the peer's source storage: ``handoff``), then the pulls from same-host peers
(``pulls``). Every wait is bounded by the transport's timeout (a progress timeout: no single message may
take longer).

**Streamed targets**: a target given as a meta tensor (its shape and dtype only) exists only while it is
written, through a ``TargetStream``: ``open(name)`` makes it at its first received byte, ``close(name)``
follows its last. Its direct messages are posted in plan order (each pair's messages keep their order); one
that would make the stream hold more than ``staging_cap_bytes`` (less the staging arena and the stream's
reserve: what closing a target may allocate) first waits for earlier ones to land and their targets to
close, unless nothing else is in flight. So targets stream through memory instead of all existing at once
(a layer's loaded form that vLLM rebuilds into a kernel's form, on the rollout side).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

import torch

from ..planning.half import PlanHalf
from .core.p2p import Op, Pending, Transport
from .core.pair_messages import Message
from .core.program import PartProgram, Program, pack, unpack, unpack_by_tensor, view
from .core.stats import PhaseClock
from .core.target_streams import Targets
from .same_host.handoff import Handoffs, copy_segments
from .same_host.pairs import SameHostPairs
from .same_host.pulls import Pulls
from .same_host.shared_memory import SIGNAL_ONLY, SharedSegments

__all__ = ["FullTransfer"]


def _direct_view(storage: torch.Tensor, parts: tuple[PartProgram, ...]) -> torch.Tensor:
    (c,) = parts[0].copies  # a direct part is dense: one flat copy
    return view(storage, c)


class FullTransfer:
    """One full sync's transfer of ``program`` on this rank (see the module docstring). ``arena``: the
    staging slots in this rank's memory; ``segments``: those shared with same-host peers (``pairs``);
    ``coalesced``: the transport posts each batch as one (NCCL). ``run`` once."""

    def __init__(
        self,
        half: PlanHalf,
        program: Program,
        arena: torch.Tensor,
        segments: SharedSegments | None,
        sources: Mapping[str, torch.Tensor],
        targets: Targets,
        transport: Transport,
        handoffs: Handoffs,
        pairs: SameHostPairs,
        staging_cap_bytes: int,
        coalesced: bool,
        clock: PhaseClock,
    ) -> None:
        self.half = half
        self.program = program
        self.schedule = program.schedule
        self.arena = arena
        self.segments = segments
        self.sources = sources
        self.targets = targets
        self.transport = transport
        self.handoffs = handoffs
        self.pairs = pairs
        self.staging_cap_bytes = staging_cap_bytes
        self.coalesced = coalesced
        self.clock = clock
        self.pending_recv: dict[int, list[Pending]] = {}
        self.pending_send: dict[int, list[Pending]] = {}
        self.acks: list[Pending] = []  # "slot free" signals to same-host peers

    def _slot(self, direction: str, m: Message) -> torch.Tensor:
        offset, _ = self.schedule.slot(direction, m)
        if m.peer in self.pairs.shared:
            assert self.segments is not None
            return self.segments.of(direction, m.peer)[offset : offset + m.nbytes]
        return self.arena[offset : offset + m.nbytes]

    def _recv(self, m: Message, parts: tuple[PartProgram, ...]) -> Op:
        return Op(
            "recv",
            _direct_view(self.targets.get(parts[0].name), parts),
            m.peer,
            m.tag,
            f"direct message {m.round}",
        )

    def _post_direct(self) -> tuple[list[Pending], deque[tuple[Pending, str, int]]]:
        """Every direct message, at once: they hold no staging. Receives into streamed targets go in
        plan order with at most ``staging_cap_bytes`` in flight (waited here as the window moves)."""
        program, targets, transport, arena = self.program, self.targets, self.transport, self.arena
        t = time.perf_counter()
        window: deque[tuple[Pending, str, int]] = deque()
        # direct messages of a same-host pair that pulls are not messages: the receiver pulls them
        receives = [e for e in program.direct_receives if e[0].peer not in self.pairs.pulls_from]
        ordered = targets.streamed | targets.watched  # their landings are told, in plan order
        ops = [] if ordered else [self._recv(m, parts) for m, parts in receives]
        ops += [
            Op(
                "send",
                _direct_view(self.sources[parts[0].name], parts),
                m.peer,
                m.tag,
                f"direct message {m.round}",
            )
            for m, parts in program.direct_sends
            if m.peer not in self.pairs.pulled_by
        ]
        posted = transport.post(ops)
        if ordered:
            # the staging arena, the memory the stream holds and what closing a target may allocate
            # share the cap
            budget = self.staging_cap_bytes - arena.numel() * arena.element_size() - targets.reserve_bytes()
            # by tensor, then peer: each pair's messages keep their order (NCCL matches by order)
            for m, parts in sorted(
                receives, key=lambda e: (e[0].parts[0].segment.tensor, e[0].peer, e[0].round)
            ):
                name = parts[0].name
                if name not in ordered:
                    posted += transport.post([self._recv(m, parts)])
                    continue
                while window and targets.held_bytes() + targets.adds_bytes(name) > budget:
                    pending, landed, _ = window.popleft()
                    transport.wait([pending])
                    targets.landed(landed)
                window.append((transport.post([self._recv(m, parts)])[0], name, m.nbytes))
        self.clock.add("post", t)
        return posted, window

    def _post(self, r: int) -> None:
        """Round ``r`` of packed messages: post its receives, pack and post its sends."""
        transport, clock = self.transport, self.clock
        t = time.perf_counter()
        label = f"round {r}"
        # a shared slot is read after the peer's signal (its segment may not exist before)
        recv_ops = [
            Op(
                "recv",
                SIGNAL_ONLY if m.peer in self.pairs.shared else self._slot("recv", m),
                m.peer,
                m.tag,
                label,
            )
            for m, _ in self.program.receives.get(r, ())
        ]
        send_ops = []
        if not self.coalesced:
            self.pending_recv[r] = transport.post(recv_ops)
            t = clock.add("post", t)
        sent: list[Pending] = []
        for m, parts in self.program.sends.get(r, ()):
            buf = self._slot("send", m)
            pack(buf, parts, self.sources)
            t = clock.add("pack", t)
            op = Op("send", buf, m.peer, m.tag, label)
            if self.coalesced:
                send_ops.append(op)
            else:
                sent += transport.post([op])  # on the wire while the next one is packed
                t = clock.add("post", t)
        if self.coalesced:
            posted = transport.post(recv_ops + send_ops)
            self.pending_recv[r] = posted[: len(recv_ops)]
            sent = posted[len(recv_ops) :]
            clock.add("post", t)
        self.pending_send[r] = sent

    def run(self) -> None:
        """Move every byte: returns when every byte this rank sends has left and every byte it receives has
        landed in its target storage."""
        schedule, transport, clock, targets = self.schedule, self.transport, self.clock, self.targets
        depth = schedule.depth
        rounds = schedule.rounds
        # Handoffs first: a peer in this process copies from these sources while this rank goes on.
        self.handoffs.offer(self.half, self.sources)
        pulls = Pulls(
            self.program, self.pairs.pull_plan(self.program), self.pairs.pulled_by, self.sources, transport
        )
        # Round 0 first: its receivers can unpack while the direct messages stream behind it (on one
        # connection per pair, messages leave in the order they are posted). Every rank issues in the
        # same order (round 0, direct, round 1, ...), which NCCL needs.
        if rounds:
            self._post(0)
        direct, window = self._post_direct()
        for r in range(1, min(depth, rounds)):
            self._post(r)
        t = time.perf_counter()
        copy_segments(schedule.local, self.half, self.sources, targets)
        self.handoffs.take(self.half, targets)
        t = clock.add("local", t)
        if self.pairs.slots is not None:  # while the senders pack the first rounds
            pulls.run(targets, self.pairs.slots.same_host.peers)
        clock.add("pull", t)
        for r in range(rounds):
            t = time.perf_counter()
            transport.wait(self.pending_recv.pop(r, []))
            t = clock.add("wait", t)
            received = self.program.receives.get(r, ())
            if targets.streamed:  # each loaded form closes at the round's last part of it
                unpack_by_tensor([(self._slot("recv", m), parts) for m, parts in received], targets)
            else:
                for m, parts in received:
                    unpack(self._slot("recv", m), parts, targets)
            for m, _ in received:
                ack = transport.consumed(m.peer, m.tag, f"round {r}")
                if ack is not None:
                    self.acks.append(ack)
            t = clock.add("unpack", t)
            while window and transport.completed(window[0][0]):  # direct messages landed meanwhile
                targets.landed(window.popleft()[1])
            t = clock.add("unpack", t)
            if r + depth < rounds:
                transport.wait(self.pending_send.pop(r, []))  # its slots are reused by round r + depth
                clock.add("wait", t)
                self._post(r + depth)
        t = time.perf_counter()
        transport.wait(direct)
        while window:
            pending, landed, _ = window.popleft()
            transport.wait([pending])
            targets.landed(landed)
        for r in sorted(self.pending_send):
            transport.wait(self.pending_send.pop(r))
        self.handoffs.wait()
        transport.wait(self.acks)
        transport.wait(pulls.pending)
        clock.add("wait", t)

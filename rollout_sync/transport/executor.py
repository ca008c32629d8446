"""The executor: every rank of the sync group runs its half of a plan.

Lifecycle of one sync (every rank of the group calls ``Executor.execute``, even with an empty half):

1. **check** — locally: the half is well formed (``schedule.check_half``) and this rank holds every storage
   it needs with the plan's shape and dtype (``local_check``). A failure is not raised yet: it becomes the
   rank's refusal.
2. **agree** — one allgather of a fixed-size record per rank (``agreement``): plan digest, refusal and
   reason, half fingerprints, options, message size offer. Every rank decides the same way and, on any
   mismatch, every rank raises the same ``PlanMismatchError``. Nothing has moved yet.
3. **schedule** — pure, cached per (half content, agreed message sizes): per pair of ranks, the same
   messages on both ends (``schedule.build_schedule``).
4. **transfer** — packed round 0, then every direct message (dense, same dtype: storage to storage, no
   staging) at once, then the other packed rounds: post receives, pack and post sends, wait, unpack
   (the sender casts to a narrower target dtype while packing, the receiver otherwise); with ``overlap``
   the next round is packed while the current one is on the wire. Copies within the rank run while the
   first rounds are in flight, then the handoffs from peers in this process (each segment copied straight
   from the peer's source storage: see ``schedule``). Every wait is bounded by ``timeout`` (a progress
   timeout: no single message may take longer).

After a transport failure (``PeerFailedError`` / ``SyncTimeoutError``) the group's connections to the
failed peer may be closed (gloo closes a pair on a timeout): build a new group before the next sync. A
``PlanMismatchError`` leaves the group usable: nothing was posted.

**Streamed targets**: a target given as a meta tensor (its shape and dtype only) exists only while it is
written, through a ``TargetStream``: ``open(name)`` makes it at its first received byte, ``close(name)``
follows its last. Its direct messages are posted in plan order (each pair's messages keep their order); one
that would make the stream hold more than ``staging_cap_bytes`` (less the staging arena and the stream's
reserve: what closing a target may allocate) first waits for earlier ones to land and their targets to
close, unless nothing else is in flight. So targets stream through
memory instead of all existing at once (a layer's loaded form that vLLM rebuilds into a kernel's form, on the
rollout side).

Staging (pack and unpack slots) lives in one arena per executor, allocated once and reused; its size is at
most ``staging_cap_bytes``.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from ..errors import PeerFailedError
from ..layout.dtypes import itemsize
from ..planning.plan import PlanHalf, Segment
from . import agreement, cross_memory
from .fingerprint import pair_sums, table_hash
from .groups import group_backend, group_rank, group_size
from .in_process import InProcess
from .local_check import check_storages
from .p2p import Op, Pending, Transport, transport_for
from .schedule import (
    ALIGN,
    MIN_MESSAGE_BYTES,
    Copy,
    Message,
    Schedule,
    build_schedule,
    check_half,
    part_copies,
    peers_of,
    wanted_message_bytes,
    wire_dtype,
)
from .shared_memory import SameHost, SharedSlots, sweep_stale
from .staging import StagingArena
from .stats import ExecuteOptions, SyncStats

__all__ = ["Executor", "TargetStream", "execute"]


class TargetStream(Protocol):
    """Targets that exist only while they are written (given to ``execute`` as meta tensors)."""

    def open(self, name: str) -> torch.Tensor:
        """The storage of target ``name``, made now (at its first received byte)."""
        ...

    def close(self, name: str) -> None:
        """Every element of ``name`` this rank receives has landed."""
        ...

    def held_bytes(self) -> int:
        """The memory the stream holds now for targets it made and has not released."""
        ...

    def adds_bytes(self, name: str) -> int:
        """The memory making target ``name`` would add now (0 when what holds it is already made)."""
        ...

    def reserve_bytes(self) -> int:
        """Memory to leave free beside what the stream holds (what closing a target may allocate)."""
        ...


@dataclass(frozen=True, slots=True)
class _PartProgram:
    name: str  # logical tensor name (key of sources / targets)
    wire: torch.dtype  # what the bytes on the wire are (schedule.wire_dtype)
    wire_size: int
    byte_offset: int
    count: int
    copies: tuple[Copy, ...]


@dataclass(frozen=True, slots=True)
class _Program:
    """A schedule with every copy precomputed, for one rank."""

    schedule: Schedule
    sends: dict[int, list[tuple[Message, tuple[_PartProgram, ...]]]]  # round -> packed messages
    receives: dict[int, list[tuple[Message, tuple[_PartProgram, ...]]]]
    direct_sends: list[tuple[Message, tuple[_PartProgram, ...]]]
    direct_receives: list[tuple[Message, tuple[_PartProgram, ...]]]
    bytes_sent: dict[int, int]
    bytes_received: dict[int, int]
    local_bytes: int
    bytes_handed: dict[int, int]


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _compile(half: PlanHalf, schedule: Schedule) -> _Program:
    def program(message: Message, side: str) -> tuple[_PartProgram, ...]:
        out = []
        for part in message.parts:
            t = half.tensors[part.segment.tensor]
            wire = wire_dtype(t.source_dtype, t.target_dtype)
            copies = part_copies(part, side)
            out.append(
                _PartProgram(t.name, _torch_dtype(wire), itemsize(wire), part.byte_offset, part.count, copies)
            )
        return tuple(out)

    sends: dict[int, list[tuple[Message, tuple[_PartProgram, ...]]]] = {}
    receives: dict[int, list[tuple[Message, tuple[_PartProgram, ...]]]] = {}
    direct_sends: list[tuple[Message, tuple[_PartProgram, ...]]] = []
    direct_receives: list[tuple[Message, tuple[_PartProgram, ...]]] = []
    bytes_sent: dict[int, int] = {}
    bytes_received: dict[int, int] = {}
    for m in schedule.sends:
        entry = (m, program(m, "source"))
        if m.direct:
            direct_sends.append(entry)
        else:
            sends.setdefault(m.round, []).append(entry)
        bytes_sent[m.peer] = bytes_sent.get(m.peer, 0) + _payload(entry[1])
    for m in schedule.receives:
        entry = (m, program(m, "target"))
        if m.direct:
            direct_receives.append(entry)
        else:
            receives.setdefault(m.round, []).append(entry)
        bytes_received[m.peer] = bytes_received.get(m.peer, 0) + _payload(entry[1])
    local = [*schedule.local, *(s for _, segments in schedule.handoff_from for s in segments)]
    local_bytes = sum(s.numel * itemsize(half.tensors[s.tensor].target_dtype) for s in local)
    bytes_handed: dict[int, int] = {}
    for s in half.sends:
        if s.target_rank in schedule.handoff_to:
            n = s.numel * itemsize(half.tensors[s.tensor].target_dtype)
            bytes_handed[s.target_rank] = bytes_handed.get(s.target_rank, 0) + n
    return _Program(
        schedule,
        sends,
        receives,
        direct_sends,
        direct_receives,
        bytes_sent,
        bytes_received,
        local_bytes,
        bytes_handed,
    )


def _payload(parts: tuple[_PartProgram, ...]) -> int:
    """Bytes a message carries on the wire (its parts in their wire dtype)."""
    return sum(p.count * p.wire_size for p in parts)


def _view(storage: torch.Tensor, c: Copy) -> torch.Tensor:
    return torch.as_strided(storage, c.extent, c.strides, storage.storage_offset() + c.offset)


class _Clock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - since
        return now


class Executor:
    """Runs halves of plans over one group, reusing its staging arena and schedules across syncs.

    ``group`` is a process group object (a backend object built by ``groups.build_group``, or
    ``torch.distributed.group.WORLD``); its ranks are the global ranks of the plans.
    """

    def __init__(
        self,
        group: Any,
        options: ExecuteOptions | None = None,
        local: InProcess | None = None,
        same_host: SameHost | None = None,
    ) -> None:
        self.group = group
        self.local = local  # ranks of this group in this process: their segments are handoffs
        self.options = options or ExecuteOptions()
        self.rank = group_rank(group)
        self.world = group_size(group)
        self.backend = group_backend(group)
        self.arena = StagingArena()
        # ranks on this host in other processes: their messages' bytes go through shared slots (CPU, gloo)
        use = same_host is not None and self.backend == "gloo" and self.options.shared_memory
        self.shared_slots = SharedSlots(same_host) if use and same_host is not None else None
        self.shared: frozenset[int] = frozenset()
        if self.shared_slots is not None:
            self.shared = frozenset(self.shared_slots.same_host.peers) - (
                local.peers if local else frozenset()
            )
        self.pulls_from: frozenset[int] = frozenset()  # same-host peers this rank can read (probed)
        self.pulled_by: frozenset[int] = frozenset()  # same-host peers that can read this rank
        self._probed: set[int] = set()
        self._cached: tuple[tuple[Any, ...], _Program] | None = None
        self._fingerprints: tuple[PlanHalf, bytes, tuple[int, int]] | None = None
        self._checked: PlanHalf | None = None
        self.in_process: frozenset[int] = local.peers if local is not None else frozenset()

    @property
    def depth(self) -> int:
        return 2 if self.options.overlap else 1

    # -- 1. check -------------------------------------------------------------------------------------
    def _check(
        self,
        half: PlanHalf,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        stream: TargetStream | None = None,
    ) -> tuple[str | None, torch.device | None, int]:
        if not isinstance(half, PlanHalf):
            return f"rank {self.rank} was given a {type(half).__name__}, not a PlanHalf", None, 0
        if half.rank != self.rank:
            return f"rank {self.rank} of the group was given the half of rank {half.rank}", None, 0
        if self._checked is not half:  # the half's own check is a function of the (immutable) half
            reason = check_half(half)
            if reason is not None:
                return f"rank {self.rank}: {reason}", None, 0
            self._checked = half
        if stream is None:
            meta = sorted(n for n, t in targets.items() if isinstance(t, torch.Tensor) and t.is_meta)
            if meta:
                return (
                    f"rank {self.rank}: target {meta[0]!r} is a placeholder and no stream makes it",
                    None,
                    0,
                )
        try:
            reason, device = check_storages(half, sources, targets)
        except Exception as e:  # a storage mapping that misbehaves must still not strand the other ranks
            return f"rank {self.rank}: checking the local storages failed: {e!r}", None, 0
        if reason is not None:
            return reason, None, 0
        wanted = wanted_message_bytes(half, self.options.staging_cap_bytes, self.depth, self.in_process)
        send_peers, recv_peers = peers_of(half, self.in_process)
        if (send_peers or recv_peers) and wanted < MIN_MESSAGE_BYTES:
            slots = self.depth * (len(send_peers) + len(recv_peers))
            return (
                (
                    f"rank {self.rank}: a staging cap of {self.options.staging_cap_bytes} bytes leaves {wanted} "
                    f"bytes per message for {slots} staging slots; at least {MIN_MESSAGE_BYTES} are needed"
                ),
                None,
                0,
            )
        return None, device, wanted

    def _half_fingerprints(self, half: PlanHalf) -> tuple[bytes, tuple[int, int]]:
        cached = self._fingerprints
        if cached is not None and cached[0] is half:
            return cached[1], cached[2]
        fp = table_hash(half), pair_sums(half)
        self._fingerprints = (half, *fp)
        return fp

    # -- 2. agree ---------------------------------------------------------------------------------------
    def _agree(self, half: Any, reason: str | None, wanted: int, device: torch.device) -> list[int]:
        ok = isinstance(half, PlanHalf) and reason is None
        thash, (sent, received) = self._half_fingerprints(half) if ok else (b"\0" * 16, (0, 0))
        digest = half.digest if isinstance(half, PlanHalf) else ""
        record = agreement.Record(
            group_rank=self.rank,
            half_rank=half.rank if isinstance(half, PlanHalf) else -1,
            refused=reason is not None,
            zero_copy=self.options.zero_copy,
            overlap=self.options.overlap,
            shared_memory=self.options.shared_memory,
            digest_sha=agreement.digest_sha(digest),
            digest_prefix=digest[:16],
            table_hash=thash,
            sent_sum=sent,
            received_sum=received,
            message_bytes=wanted,
            staging_cap_bytes=self.options.staging_cap_bytes,
            reason=reason or "",
        )
        records = agreement.exchange(
            self.group, agreement.encode(record), self.world, self.options.timeout, self.rank, device
        )
        return agreement.decide(records)

    # -- 3. schedule ------------------------------------------------------------------------------------
    def _program(self, half: PlanHalf, offers: list[int]) -> _Program:
        send_peers, recv_peers = peers_of(half, self.in_process)
        sizes = {p: min(offers[self.rank], offers[p]) // ALIGN * ALIGN for p in {*send_peers, *recv_peers}}
        # Keyed by content (digest, rank, fingerprints), so a half rebuilt for every sync still reuses it.
        key = (
            half.digest,
            half.rank,
            self._half_fingerprints(half),
            tuple(sorted(sizes.items())),
            self.depth,
            self.options.zero_copy,
            self.in_process,
            self.shared,
            self.pulls_from,
            self.pulled_by,
        )
        cached = self._cached
        if cached is not None and cached[0] == key:
            return cached[1]
        schedule = build_schedule(
            half,
            sizes,
            zero_copy=self.options.zero_copy,
            depth=self.depth,
            in_process=self.in_process,
            shared=self.shared,
            pulls_from=self.pulls_from,
            pulled_by=self.pulled_by,
        )
        program = _compile(half, schedule)
        self._cached = (key, program)  # one plan at a time: a new plan replaces the old
        return program

    # -- 4. transfer ------------------------------------------------------------------------------------
    def execute(
        self,
        half: PlanHalf,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        refusal: str | None = None,
        stream: TargetStream | None = None,
    ) -> SyncStats:
        """Run this rank's half. Returns when every byte this rank sends has left and every byte it receives
        has landed in its target storage (cast to the target dtype). ``refusal``: a reason, found by the
        caller, why this rank must not take part; it becomes this rank's refusal in the agreement, so every
        rank raises the same ``PlanMismatchError`` before any byte moves. ``stream`` makes the targets given
        as meta tensors (see the module docstring)."""
        clock = _Clock()
        t0 = t = time.perf_counter()
        reason, device, wanted = self._check(half, sources, targets, stream)
        if refusal is not None and reason is None:
            reason = f"rank {self.rank}: {refusal}"
        if device is None:
            device = self._default_device()
        t = clock.add("check", t)
        offers = self._agree(half, reason, wanted, device)
        self._probe_pulls(half)
        t = clock.add("agree", t)
        program = self._program(half, offers)
        schedule = program.schedule
        arena = self.arena.reserve(schedule.staging_bytes, device, self.options.staging_cap_bytes)
        segments = self._shared_segments(half, schedule, offers)
        t = clock.add("schedule", t)
        with torch.no_grad():
            streamed = _Targets(targets, stream, half, program)
            transport = transport_for(
                self.group, self.backend, self.rank, self.options.timeout, device, self.local, self.shared
            )
            taken: set[int] = set()  # in-process peers whose handoff this rank took
            try:
                self._transfer(half, program, arena, segments, sources, streamed, transport, taken, clock)
            except BaseException as e:
                if self.shared_slots is not None:  # segments a dead peer made and nobody opened
                    sweep_stale(self.shared_slots.directory)
                for peer, _ in schedule.handoff_from:
                    if peer not in taken:  # its sender must not wait for the timeout
                        transport.decline(
                            peer, f"rank {self.rank} failed before copying from rank {peer}: {e!r}"
                        )
                raise
        clock.seconds["total"] = time.perf_counter() - t0
        return SyncStats(
            rank=self.rank,
            bytes_sent=dict(program.bytes_sent),
            bytes_received=dict(program.bytes_received),
            local_bytes=program.local_bytes,
            messages_sent=len(schedule.sends),
            messages_received=len(schedule.receives),
            rounds=schedule.rounds,
            peak_staging_bytes=self.arena.allocated_bytes + self.shared_bytes,
            staging_cap_bytes=self.options.staging_cap_bytes,
            seconds=clock.seconds,
            bytes_handed=dict(program.bytes_handed),
            bytes_pulled=pulled_bytes(program, self.pulls_from),
        )

    @property
    def shared_bytes(self) -> int:
        """Bytes of shared slots this rank made (its send slots to same-host peers)."""
        return 0 if self.shared_slots is None else self.shared_slots.created_bytes

    def _shared_segments(
        self, half: PlanHalf, schedule: Schedule, offers: list[int]
    ) -> _SharedSegments | None:
        if self.shared_slots is None or not schedule.shared_bytes:
            return None
        slots = self.shared_slots

        def key(peer: int) -> str:  # the same on both ends of the pair
            return f"{half.digest}:{min(offers[self.rank], offers[peer])}:{schedule.depth}"

        for (direction, peer), nbytes in schedule.shared_bytes.items():
            if direction == "send":  # made before the first signal, so the peer finds it
                slots.send_segment(peer, nbytes, key(peer))
        return _SharedSegments(slots, schedule, key)

    def _probe_pulls(self, half: PlanHalf) -> None:
        """Once per same-host peer this half exchanges bytes with: can each of the two read the other's
        memory (``cross_memory``)? Both ends run it at the same sync (their halves mirror each other) and
        learn both answers, so both build the same schedule."""
        if self.shared_slots is None or not cross_memory.supported():
            return
        send_peers, recv_peers = peers_of(half, self.in_process)
        peers = sorted((set(send_peers) | set(recv_peers)) & self.shared - self._probed)
        if not peers:
            return
        cross_memory.allow_pulls()
        timeout = timedelta(seconds=self.options.timeout)
        magic = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
        mine = torch.tensor([magic.data_ptr(), int(magic)], dtype=torch.int64)
        theirs = {p: torch.zeros(2, dtype=torch.int64) for p in peers}
        answers = {p: torch.zeros(1, dtype=torch.int64) for p in peers}
        works: list[Any] = []
        try:
            works += [self.group.send([mine], p, PROBE_TAG) for p in peers]
            for w in [self.group.recv([theirs[p]], p, PROBE_TAG) for p in peers]:
                w.wait(timeout)
            readable = {}
            for p in peers:
                got = torch.zeros(1, dtype=torch.int64)
                address, expected = (int(v) for v in theirs[p])
                try:
                    cross_memory.pull(self.shared_slots.same_host.peers[p], [(got.data_ptr(), address, 8)])
                    readable[p] = int(got) == expected
                except OSError:
                    readable[p] = False
            replies = {p: torch.tensor([int(readable[p])], dtype=torch.int64) for p in peers}
            works += [self.group.send([replies[p]], p, PROBE_TAG + 1) for p in peers]
            works += [self.group.recv([answers[p]], p, PROBE_TAG + 1) for p in peers]
            for w in works:
                w.wait(timeout)
        except RuntimeError as e:
            raise PeerFailedError(
                f"rank {self.rank}: probing same-host peers {peers} for memory pulls failed: {e}"
            ) from e
        self._probed.update(peers)
        self.pulls_from |= {p for p in peers if readable[p]}
        self.pulled_by |= {p for p in peers if int(answers[p])}

    def close(self) -> None:
        """Release what this executor holds beyond its arena: the shared segments it made."""
        if self.shared_slots is not None:
            self.shared_slots.close()

    def _default_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _transfer(
        self,
        half: PlanHalf,
        program: _Program,
        arena: torch.Tensor,
        segments: _SharedSegments | None,
        sources: Mapping[str, torch.Tensor],
        targets: _Targets,
        transport: Transport,
        taken: set[int],
        clock: _Clock,
    ) -> None:
        schedule = program.schedule
        coalesced = self.backend == "nccl"
        depth = schedule.depth
        rounds = schedule.rounds
        pending_recv: dict[int, list[Pending]] = {}
        pending_send: dict[int, list[Pending]] = {}

        acks: list[Pending] = []  # "slot free" signals to same-host peers

        def slot(direction: str, m: Message) -> torch.Tensor:
            offset, _ = schedule.slot(direction, m)
            if m.peer in self.shared:
                assert segments is not None
                return segments.of(direction, m.peer)[offset : offset + m.nbytes]
            return arena[offset : offset + m.nbytes]

        def direct_view(storage: torch.Tensor, parts: tuple[_PartProgram, ...]) -> torch.Tensor:
            (c,) = parts[0].copies  # a direct part is dense: one flat copy
            return _view(storage, c)

        def recv(m: Message, parts: tuple[_PartProgram, ...]) -> Op:
            return Op(
                "recv",
                direct_view(targets.get(parts[0].name), parts),
                m.peer,
                m.tag,
                f"direct message {m.round}",
            )

        def post_direct() -> tuple[list[Pending], deque[tuple[Pending, str, int]]]:
            """Every direct message, at once: they hold no staging. Receives into streamed targets go in
            plan order with at most ``staging_cap_bytes`` in flight (waited here as the window moves)."""
            t = time.perf_counter()
            window: deque[tuple[Pending, str, int]] = deque()
            # direct messages of a same-host pair that pulls are not messages: the receiver pulls them
            receives = [e for e in program.direct_receives if e[0].peer not in self.pulls_from]
            ops = [] if targets.streamed else [recv(m, parts) for m, parts in receives]
            ops += [
                Op(
                    "send",
                    direct_view(sources[parts[0].name], parts),
                    m.peer,
                    m.tag,
                    f"direct message {m.round}",
                )
                for m, parts in program.direct_sends
                if m.peer not in self.pulled_by
            ]
            posted = transport.post(ops)
            if targets.streamed:
                # the staging arena, the memory the stream holds and what closing a target may allocate
                # share the cap
                budget = (
                    self.options.staging_cap_bytes
                    - arena.numel() * arena.element_size()
                    - targets.reserve_bytes()
                )
                # by tensor, then peer: each pair's messages keep their order (NCCL matches by order)
                for m, parts in sorted(
                    receives, key=lambda e: (e[0].parts[0].segment.tensor, e[0].peer, e[0].round)
                ):
                    name = parts[0].name
                    if name not in targets.streamed:
                        posted += transport.post([recv(m, parts)])
                        continue
                    while window and targets.held_bytes() + targets.adds_bytes(name) > budget:
                        pending, landed, _ = window.popleft()
                        transport.wait([pending])
                        targets.landed(landed)
                    window.append((transport.post([recv(m, parts)])[0], name, m.nbytes))
            clock.add("post", t)
            return posted, window

        def post(r: int) -> None:
            """Round ``r`` of packed messages: post its receives, pack and post its sends."""
            t = time.perf_counter()
            label = f"round {r}"
            # a shared slot is read after the peer's signal (its segment may not exist before)
            recv_ops = [
                Op("recv", _SIGNAL_ONLY if m.peer in self.shared else slot("recv", m), m.peer, m.tag, label)
                for m, _ in program.receives.get(r, ())
            ]
            send_ops = []
            if not coalesced:
                pending_recv[r] = transport.post(recv_ops)
                t = clock.add("post", t)
            sent: list[Pending] = []
            for m, parts in program.sends.get(r, ()):
                buf = slot("send", m)
                _pack(buf, parts, sources)
                t = clock.add("pack", t)
                op = Op("send", buf, m.peer, m.tag, label)
                if coalesced:
                    send_ops.append(op)
                else:
                    sent += transport.post([op])  # on the wire while the next one is packed
                    t = clock.add("post", t)
            if coalesced:
                posted = transport.post(recv_ops + send_ops)
                pending_recv[r] = posted[: len(recv_ops)]
                sent = posted[len(recv_ops) :]
                clock.add("post", t)
            pending_send[r] = sent

        # Handoffs first: a peer in this process copies from these sources while this rank goes on.
        offered = [transport.offer(peer, sources) for peer in schedule.handoff_to]
        pulls = _Pulls(program, self.pulls_from, self.pulled_by, sources, transport)
        # Round 0 first: its receivers can unpack while the direct messages stream behind it (on one
        # connection per pair, messages leave in the order they are posted). Every rank issues in the
        # same order (round 0, direct, round 1, ...), which NCCL needs.
        if rounds:
            post(0)
        direct, window = post_direct()
        for r in range(1, min(depth, rounds)):
            post(r)
        t = time.perf_counter()
        for s in schedule.local:
            tensor = half.tensors[s.tensor]
            src, dst = sources[tensor.name], targets.get(tensor.name)
            torch.as_strided(dst, s.extent, s.target_strides, dst.storage_offset() + s.target_offset).copy_(
                torch.as_strided(src, s.extent, s.source_strides, src.storage_offset() + s.source_offset)
            )
            targets.landed(tensor.name)
        for peer, handed in schedule.handoff_from:
            taken.add(peer)
            _copy_handoff(transport, peer, handed, half, targets)
        clock.add("local", t)
        for r in range(rounds):
            t = time.perf_counter()
            transport.wait(pending_recv.pop(r, []))
            t = clock.add("wait", t)
            for m, parts in program.receives.get(r, ()):
                _unpack(slot("recv", m), parts, targets)
                ack = transport.consumed(m.peer, m.tag, f"round {r}")
                if ack is not None:
                    acks.append(ack)
            t = clock.add("unpack", t)
            if r + depth < rounds:
                transport.wait(pending_send.pop(r, []))  # its slots are reused by round r + depth
                clock.add("wait", t)
                post(r + depth)
        t = time.perf_counter()
        if self.shared_slots is not None:
            pulls.run(targets, self.shared_slots.same_host.peers)
        t = clock.add("pull", t)
        transport.wait(direct)
        while window:
            pending, landed, _ = window.popleft()
            transport.wait([pending])
            targets.landed(landed)
        for r in sorted(pending_send):
            transport.wait(pending_send.pop(r))
        transport.wait(offered)
        transport.wait(acks)
        transport.wait(pulls.pending)
        clock.add("wait", t)


PROBE_TAG = 1 << 30
"""Tags of the pull probe (and + 1 its answer), of a pull's address table (+ 2) and of its "pulled" signal
(+ 3): above every message tag."""


def pulled_bytes(program: _Program, pulls_from: frozenset[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for m, _ in program.direct_receives:
        if m.peer in pulls_from:
            out[m.peer] = out.get(m.peer, 0) + m.nbytes
    return out


class _Pulls:
    """The direct messages of same-host pairs that pull. A sender sends, per peer, the address of each of
    its source storages those messages read, and waits for the peer's "pulled"; a receiver takes the table,
    pulls each message straight into its target storage, and signals."""

    def __init__(
        self,
        program: _Program,
        pulls_from: frozenset[int],
        pulled_by: frozenset[int],
        sources: Mapping[str, torch.Tensor],
        transport: Transport,
    ) -> None:
        self.transport = transport
        self.pending: list[Pending] = []
        self.incoming: dict[int, list[tuple[Message, tuple[_PartProgram, ...]]]] = {}
        for m, parts in program.direct_receives:
            if m.peer in pulls_from:
                self.incoming.setdefault(m.peer, []).append((m, parts))
        outgoing: dict[int, set[str]] = {}
        for m, parts in program.direct_sends:
            if m.peer in pulled_by:
                outgoing.setdefault(m.peer, set()).add(parts[0].name)
        for peer, names in sorted(outgoing.items()):
            table = torch.tensor([sources[n].data_ptr() for n in sorted(names)], dtype=torch.int64)
            self.pending.append(transport.signal("send", peer, PROBE_TAG + 2, "pull table", table))
            self.pending.append(transport.signal("recv", peer, PROBE_TAG + 3, "pulled"))
        self.tables = {
            peer: (
                sorted({parts[0].name for _, parts in messages}),
                torch.zeros(len({parts[0].name for _, parts in messages}), dtype=torch.int64),
            )
            for peer, messages in self.incoming.items()
        }
        self.table_work = {
            peer: transport.signal("recv", peer, PROBE_TAG + 2, "pull table", table)
            for peer, (_, table) in self.tables.items()
        }

    def run(self, targets: _Targets, pids: Mapping[int, int]) -> None:
        for peer, messages in sorted(self.incoming.items()):
            self.transport.wait([self.table_work[peer]])
            names, table = self.tables[peer]
            base = dict(zip(names, (int(v) for v in table), strict=True))
            for m, parts in messages:
                (p,) = parts
                (src,) = part_copies(m.parts[0], "source")
                (dst,) = p.copies
                target = targets.get(p.name)
                local = target.data_ptr() + dst.offset * target.element_size()
                remote = base[p.name] + src.offset * target.element_size()
                try:
                    cross_memory.pull(pids[peer], [(local, remote, m.nbytes)])
                except OSError as e:
                    raise PeerFailedError(
                        f"rank {self.transport.rank}: pulling direct message {m.round} from rank {peer} "
                        f"(pid {pids[peer]}) failed: {e}"
                    ) from e
                targets.landed(p.name)
            self.pending.append(self.transport.signal("send", peer, PROBE_TAG + 3, "pulled"))


_SIGNAL_ONLY = torch.empty(0, dtype=torch.uint8)  # the buffer of a receive whose bytes are in a shared slot


class _SharedSegments:
    """The shared segments of one transfer: made (send) at schedule time, opened (recv) at first use, after
    the peer's first signal."""

    def __init__(self, slots: SharedSlots, schedule: Schedule, key: Callable[[int], str]) -> None:
        self.slots = slots
        self.schedule = schedule
        self.key = key

    def of(self, direction: str, peer: int) -> torch.Tensor:
        nbytes = self.schedule.shared_bytes[(direction, peer)]
        if direction == "send":
            return self.slots.send_segment(peer, nbytes, self.key(peer))
        return self.slots.recv_segment(peer, nbytes, self.key(peer))


def _copy_handoff(
    transport: Transport, peer: int, segments: tuple[Segment, ...], half: PlanHalf, targets: _Targets
) -> None:
    """Copy ``segments`` straight from the source storages ``peer`` (in this process) hands over."""
    sources = transport.take(peer)
    try:
        for s in segments:
            name = half.tensors[s.tensor].name
            src, dst = sources[name], targets.get(name)
            torch.as_strided(dst, s.extent, s.target_strides, dst.storage_offset() + s.target_offset).copy_(
                torch.as_strided(src, s.extent, s.source_strides, src.storage_offset() + s.source_offset)
            )
            targets.landed(name)
    except BaseException as e:
        transport.finish(peer, f"rank {transport.rank} failed copying from rank {peer}'s storages: {e!r}")
        raise
    transport.finish(peer)


def _pack(buf: torch.Tensor, parts: tuple[_PartProgram, ...], sources: Mapping[str, torch.Tensor]) -> None:
    for p in parts:
        storage = sources[p.name]
        typed = buf[p.byte_offset : p.byte_offset + p.count * p.wire_size].view(p.wire)
        for c in p.copies:
            n = 1
            for e in c.extent:
                n *= e
            typed[c.buffer_offset : c.buffer_offset + n].view(c.extent).copy_(_view(storage, c))


def _unpack(buf: torch.Tensor, parts: tuple[_PartProgram, ...], targets: _Targets) -> None:
    for p in parts:
        storage = targets.get(p.name)
        typed = buf[p.byte_offset : p.byte_offset + p.count * p.wire_size].view(p.wire)
        for c in p.copies:
            n = 1
            for e in c.extent:
                n *= e
            _view(storage, c).copy_(typed[c.buffer_offset : c.buffer_offset + n].view(c.extent))
        targets.landed(p.name)


class _Targets:
    """This rank's target storages during one transfer: the given tensors, and the streamed ones (given as
    meta tensors) made by the stream at their first part and closed after their last."""

    def __init__(
        self,
        given: Mapping[str, torch.Tensor],
        stream: TargetStream | None,
        half: PlanHalf,
        program: _Program,
    ) -> None:
        self.given = given
        self.stream = stream
        self.streamed: frozenset[str] = frozenset()
        self.remaining: dict[str, int] = {}
        self.made: dict[str, torch.Tensor] = {}
        if stream is None:
            return
        self.streamed = frozenset(n for n, t in given.items() if t.is_meta)
        names = [parts[0].name for _, parts in program.direct_receives]
        names += [p.name for entries in program.receives.values() for _, parts in entries for p in parts]
        names += [half.tensors[s.tensor].name for s in program.schedule.local]
        names += [half.tensors[s.tensor].name for _, segs in program.schedule.handoff_from for s in segs]
        for name in names:
            if name in self.streamed:
                self.remaining[name] = self.remaining.get(name, 0) + 1

    def get(self, name: str) -> torch.Tensor:
        made = self.made.get(name)
        if made is not None:
            return made
        if name not in self.streamed or self.stream is None:
            return self.given[name]
        placeholder = self.given[name]
        storage = self.stream.open(name)
        if storage.shape != placeholder.shape or storage.dtype != placeholder.dtype:
            raise ValueError(
                f"the stream made target {name!r} as {tuple(storage.shape)} {storage.dtype}, expected "
                f"{tuple(placeholder.shape)} {placeholder.dtype}"
            )
        self.made[name] = storage
        return storage

    def held_bytes(self) -> int:
        return 0 if self.stream is None else self.stream.held_bytes()

    def adds_bytes(self, name: str) -> int:
        if name in self.made or self.stream is None:
            return 0
        return self.stream.adds_bytes(name)

    def reserve_bytes(self) -> int:
        return 0 if self.stream is None else self.stream.reserve_bytes()

    def landed(self, name: str) -> None:
        """One part of ``name`` landed; after its last, the stream closes it."""
        left = self.remaining.get(name)
        if left is None or self.stream is None:
            return
        if left > 1:
            self.remaining[name] = left - 1
            return
        del self.remaining[name]
        self.made.pop(name, None)
        self.stream.close(name)


def execute(
    half: PlanHalf,
    sources: Mapping[str, torch.Tensor],
    targets: Mapping[str, torch.Tensor],
    group: Any,
    options: ExecuteOptions | None = None,
    *,
    executor: Executor | None = None,
) -> SyncStats:
    """Run ``half`` on this rank of ``group``. Pass the same ``executor`` at every sync to reuse its staging
    and schedule; without one, a fresh executor is made for this call."""
    if executor is None:
        executor = Executor(group, options)
    elif executor.group is not group:
        raise ValueError("the executor was made for another group")
    return executor.execute(half, sources, targets)

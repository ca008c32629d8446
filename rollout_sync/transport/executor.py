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
   from the peer's source storage: ``handoff``), then the pulls from same-host peers (``pulls``). Every
   wait is bounded by ``timeout`` (a progress timeout: no single message may take longer).

Same host, other process (CPU, gloo, ``ExecuteOptions.shared_memory``): at the first sync with a peer, a
probe (``pulls.probe_pulls``) finds whether each of the two can read the other's memory; packed messages'
slots live in shared memory (``shared_memory``) and only signals cross the group.

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

Staging (pack and unpack slots) lives in one arena per executor, allocated once and reused, and in the
shared segments it made for same-host peers; together at most ``staging_cap_bytes``. ``close`` releases the
shared segments.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from ..planning.plan import PlanHalf
from . import agreement, cross_memory
from .delta import (
    DeltaCounts,
    DeltaProgram,
    Shadow,
    changed_share,
    layout_key,
    run_delta,
    take_sample,
)
from .fingerprint import pair_sums, table_hash
from .groups import group_backend, group_rank, group_size
from .handoff import copy_handoff, copy_segments
from .in_process import InProcess
from .local_check import check_storages
from .p2p import Op, Pending, Transport, transport_for
from .program import PartProgram, Program, compile_program, pack, unpack, view
from .pulls import PullPlan, Pulls, probe_pulls, pull_plan, pulled_bytes
from .schedule import (
    ALIGN,
    MIN_MESSAGE_BYTES,
    Message,
    Schedule,
    build_schedule,
    check_half,
    peers_of,
    wanted_message_bytes,
)
from .shared_memory import SIGNAL_ONLY, SameHost, SharedSegments, SharedSlots, sweep_stale
from .staging import StagingArena
from .stats import ExecuteOptions, SyncStats
from .targets import Targets, TargetStream

__all__ = ["Executor", "TargetStream", "execute"]


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
        self.in_process: frozenset[int] = local.peers if local is not None else frozenset()
        # ranks on this host in other processes: their bytes are pulled or go through shared slots (CPU, gloo)
        self.shared_slots: SharedSlots | None = None
        self.shared: frozenset[int] = frozenset()
        if same_host is not None and self.backend == "gloo" and self.options.shared_memory:
            self.shared_slots = SharedSlots(same_host)
            self.shared = frozenset(same_host.peers) - self.in_process
        self.pulls_from: frozenset[int] = frozenset()  # same-host peers this rank can read (probed)
        self.pulled_by: frozenset[int] = frozenset()  # same-host peers that can read this rank
        self._probed: set[int] = set()
        self._pulls_cached: tuple[Program, PullPlan] | None = None
        self._cached: tuple[tuple[Any, ...], Program] | None = None
        self._fingerprints: tuple[PlanHalf, bytes, tuple[int, int]] | None = None
        self._checked: PlanHalf | None = None
        # delta syncs (``delta``): the base this rank names at the next agreement, the layout of the sync in
        # flight, the sender's shadow and the all-packed program of the last layout
        self._base: tuple[int, bytes] | None = None
        self._in_flight: bytes | None = None
        self._shadow: Shadow | None = None
        self._shadow_valid = False  # it holds what this rank sent in the last sync
        self._sample: dict[str, torch.Tensor] | None = None
        self._share: float | None = None  # this sync's estimate of the changed share (a sender with a sample)
        self._delta: DeltaProgram | None = None

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
    def _agree(
        self,
        half: Any,
        reason: str | None,
        wanted: int,
        device: torch.device,
        base: tuple[int, bytes] | None = None,
    ) -> tuple[list[int], int | None]:
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
            base_version=-1 if base is None else base[0],
            base_layout=b"\0" * 8 if base is None else base[1],
        )
        records = agreement.exchange(
            self.group, agreement.encode(record), self.world, self.options.timeout, self.rank, device
        )
        offers = agreement.decide(records)
        self._in_flight = layout_key(digest, offers, self.depth)
        return offers, agreement.delta_base(records, self._in_flight)

    # -- 3. schedule ------------------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule | None:
        """The schedule of the last half this executor ran (None before the first)."""
        return None if self._cached is None else self._cached[1].schedule

    def _message_sizes(self, half: PlanHalf, offers: list[int]) -> dict[int, int]:
        """The agreed message size with each peer this half exchanges messages with: the smaller offer."""
        send_peers, recv_peers = peers_of(half, self.in_process)
        return {p: min(offers[self.rank], offers[p]) // ALIGN * ALIGN for p in {*send_peers, *recv_peers}}

    def _program(self, half: PlanHalf, offers: list[int]) -> Program:
        sizes = self._message_sizes(half, offers)
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
        program = compile_program(half, schedule)
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
        base = self._offered_base(half, sources, targets, stream)
        self._base = self._in_flight = None  # only the commit of this sync gives a base back
        t = clock.add("check", t)
        offers, delta_base = self._agree(half, reason, wanted, device, base)
        if delta_base is not None:
            clock.add("agree", t)
            return self._execute_delta(half, offers, delta_base, sources, targets, device, clock, t0)
        self._probe_pulls(half)
        t = clock.add("agree", t)
        program = self._program(half, offers)
        schedule = program.schedule
        arena = self.arena.reserve(schedule.staging_bytes, device, self.options.staging_cap_bytes)
        segments = self._shared_segments(half, schedule, offers)
        t = clock.add("schedule", t)
        with torch.no_grad():
            streamed = Targets(targets, stream, half, program)
            transport = transport_for(
                self.group, self.backend, self.rank, self.options.timeout, device, self.local, self.shared
            )
            taken: set[int] = set()  # in-process peers whose handoff this rank took
            try:
                self._transfer(half, program, arena, segments, sources, streamed, transport, taken, clock)
            except BaseException as e:
                if self.shared_slots is not None:  # segments a dead peer made and nobody opened
                    sweep_stale(self.shared_slots.directory)
                self._decline(transport, schedule, taken, e)
                raise
            if self.options.delta:
                t = time.perf_counter()
                if self._share is None or self._share <= self.options.delta_full_above:
                    self._refill_shadow(half, offers, sources, device)
                else:  # most of it changed: the next sync is full too (and refills if it is worth it)
                    self._shadow_valid = False
                self._sample = take_sample(half, sources)
                clock.add("shadow", t)
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
            bytes_pulled=pulled_bytes(self._pull_plan(program)),
            delta_state_bytes=self.delta_state_bytes,
            estimated_changed_share=self._share,
        )

    # -- delta syncs (``delta``) ------------------------------------------------------------------------
    @property
    def delta_state_bytes(self) -> int:
        """The memory this rank keeps for delta syncs: its shadow of what it last sent."""
        return 0 if self._shadow is None else self._shadow.nbytes

    def committed(self, version: int) -> None:
        """Every rank committed the sync this executor ran last, as weight version ``version``: with the
        delta option, name it as this rank's base at the next agreement."""
        if self.options.delta and self._in_flight is not None:
            self._base = (version, self._in_flight)

    def forget_base(self) -> None:
        """Something other than a sync wrote this rank's storages: the next sync is a full one."""
        self._base = None

    def _offered_base(
        self,
        half: PlanHalf,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        stream: TargetStream | None,
    ) -> tuple[int, bytes] | None:
        self._share = None
        if self.options.delta and self._sample is not None and isinstance(half, PlanHalf):
            try:
                self._share = changed_share(self._sample, half, sources)
            except Exception:  # a storage the check refuses: the agreement says why, not this estimate
                self._share = None
        base = self._base
        if not self.options.delta or base is None:
            return None
        if self._share is not None and self._share > self.options.delta_full_above:
            return None  # most of what this rank sends changed: a full sync moves it faster
        if stream is not None and any(isinstance(t, torch.Tensor) and t.is_meta for t in targets.values()):
            return None  # a streamed target (a layer's loaded form) does not hold the base's values
        delta = self._delta
        if (
            delta is not None
            and delta.shadow_bytes
            and (self._shadow is None or not self._shadow_valid or self._shadow.layout != base[1])
        ):
            return None
        return base

    def _delta_program(self, half: PlanHalf, offers: list[int]) -> DeltaProgram:
        layout = self._in_flight
        assert layout is not None  # set by the agreement
        cached = self._delta
        if cached is not None and cached.layout == layout and cached.program.schedule.rank == half.rank:
            return cached
        sizes = self._message_sizes(half, offers)
        schedule = build_schedule(
            half, sizes, zero_copy=False, depth=self.depth, in_process=self.in_process, uniform=True
        )
        self._delta = DeltaProgram.of(compile_program(half, schedule), layout)
        return self._delta

    def _refill_shadow(
        self, half: PlanHalf, offers: list[int], sources: Mapping[str, torch.Tensor], device: torch.device
    ) -> None:
        """After a full sync: the shadow holds what this rank sent (the base of the next delta sync)."""
        delta = self._delta_program(half, offers)
        if not delta.shadow_bytes:
            self._shadow = None
            return
        shadow = self._shadow
        if shadow is None or shadow.nbytes != delta.shadow_bytes:
            self._shadow = None  # release before allocating the new one
            shadow = Shadow(delta, device)
        shadow.layout = delta.layout
        self._shadow_valid = False
        shadow.refill(delta, sources)
        self._shadow = shadow
        self._shadow_valid = True

    def _execute_delta(
        self,
        half: PlanHalf,
        offers: list[int],
        base: int,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        device: torch.device,
        clock: _Clock,
        t0: float,
    ) -> SyncStats:
        t = time.perf_counter()
        delta = self._delta_program(half, offers)
        program = delta.program
        schedule = program.schedule
        arena = self.arena.reserve(schedule.staging_bytes, device, self.options.staging_cap_bytes)
        shadow = self._shadow
        if shadow is None:  # a rank that sends nothing over the group
            shadow = Shadow(delta, device)
        t = clock.add("schedule", t)

        def slot(direction: str, m: Message) -> torch.Tensor:
            offset, _ = schedule.slot(direction, m)
            return arena[offset : offset + m.nbytes]

        with torch.no_grad():
            streamed = Targets(targets, None, half, program)
            transport = transport_for(
                self.group, self.backend, self.rank, self.options.timeout, device, self.local
            )
            taken: set[int] = set()
            try:
                offered = [transport.offer(peer, sources) for peer in schedule.handoff_to]
                copy_segments(schedule.local, half, sources, streamed)
                for peer, handed in schedule.handoff_from:
                    taken.add(peer)
                    copy_handoff(transport, peer, handed, half, streamed)
                t = clock.add("local", t)
                self._shadow_valid = False  # updated in place as messages go: whole only at the end
                counts: DeltaCounts = run_delta(delta, shadow, slot, sources, streamed, transport, clock.add)
                self._shadow_valid = True
                self._sample = take_sample(half, sources)
                t = time.perf_counter()
                transport.wait(offered)
                clock.add("wait", t)
            except BaseException as e:
                self._decline(transport, schedule, taken, e)
                raise
        clock.seconds["total"] = time.perf_counter() - t0
        return SyncStats(
            rank=self.rank,
            bytes_sent=counts.bytes_sent,
            bytes_received=counts.bytes_received,
            local_bytes=program.local_bytes,
            messages_sent=counts.messages_sent,
            messages_received=counts.messages_received,
            rounds=schedule.rounds,
            peak_staging_bytes=self.arena.allocated_bytes + self.shared_bytes,
            staging_cap_bytes=self.options.staging_cap_bytes,
            seconds=clock.seconds,
            bytes_handed=dict(program.bytes_handed),
            delta_base=base,
            elements_compared=counts.compared,
            elements_changed=counts.changed,
            delta_state_bytes=self.delta_state_bytes,
            estimated_changed_share=self._share,
        )

    @staticmethod
    def _decline(transport: Transport, schedule: Schedule, taken: set[int], error: BaseException) -> None:
        for peer, _ in schedule.handoff_from:
            if peer not in taken:  # its sender must not wait for the timeout
                transport.decline(
                    peer, f"rank {transport.rank} failed before copying from rank {peer}: {error!r}"
                )

    @property
    def shared_bytes(self) -> int:
        """Bytes of shared slots this rank made (its send slots to same-host peers)."""
        return 0 if self.shared_slots is None else self.shared_slots.created_bytes

    def _shared_segments(
        self, half: PlanHalf, schedule: Schedule, offers: list[int]
    ) -> SharedSegments | None:
        if self.shared_slots is None or not schedule.shared_bytes:
            return None
        slots = self.shared_slots

        def key(peer: int) -> str:  # the same on both ends of the pair
            return f"{half.digest}:{min(offers[self.rank], offers[peer])}:{schedule.depth}"

        for (direction, peer), nbytes in schedule.shared_bytes.items():
            if direction == "send":  # made before the first signal, so the peer finds it
                slots.send_segment(peer, nbytes, key(peer))
        return SharedSegments(slots, schedule, key)

    def _pull_plan(self, program: Program) -> PullPlan:
        cached = self._pulls_cached
        if cached is None or cached[0] is not program:
            cached = (program, pull_plan(program, self.pulls_from))
            self._pulls_cached = cached
        return cached[1]

    def _probe_pulls(self, half: PlanHalf) -> None:
        """Probe the same-host peers this half exchanges bytes with and has not probed yet (``pulls``)."""
        if self.shared_slots is None or not cross_memory.supported():
            return
        send_peers, recv_peers = peers_of(half, self.in_process)
        peers = sorted((set(send_peers) | set(recv_peers)) & self.shared - self._probed)
        if not peers:
            return
        pids = self.shared_slots.same_host.peers
        can_pull, pulled_by = probe_pulls(self.group, self.rank, peers, pids, self.options.timeout)
        self._probed.update(peers)
        self.pulls_from |= can_pull
        self.pulled_by |= pulled_by

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
        program: Program,
        arena: torch.Tensor,
        segments: SharedSegments | None,
        sources: Mapping[str, torch.Tensor],
        targets: Targets,
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

        def direct_view(storage: torch.Tensor, parts: tuple[PartProgram, ...]) -> torch.Tensor:
            (c,) = parts[0].copies  # a direct part is dense: one flat copy
            return view(storage, c)

        def recv(m: Message, parts: tuple[PartProgram, ...]) -> Op:
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
                Op("recv", SIGNAL_ONLY if m.peer in self.shared else slot("recv", m), m.peer, m.tag, label)
                for m, _ in program.receives.get(r, ())
            ]
            send_ops = []
            if not coalesced:
                pending_recv[r] = transport.post(recv_ops)
                t = clock.add("post", t)
            sent: list[Pending] = []
            for m, parts in program.sends.get(r, ()):
                buf = slot("send", m)
                pack(buf, parts, sources)
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
        pulls = Pulls(program, self._pull_plan(program), self.pulled_by, sources, transport)
        # Round 0 first: its receivers can unpack while the direct messages stream behind it (on one
        # connection per pair, messages leave in the order they are posted). Every rank issues in the
        # same order (round 0, direct, round 1, ...), which NCCL needs.
        if rounds:
            post(0)
        direct, window = post_direct()
        for r in range(1, min(depth, rounds)):
            post(r)
        t = time.perf_counter()
        copy_segments(schedule.local, half, sources, targets)
        for peer, handed in schedule.handoff_from:
            taken.add(peer)
            copy_handoff(transport, peer, handed, half, targets)
        t = clock.add("local", t)
        if self.shared_slots is not None:  # while the senders pack the first rounds
            pulls.run(targets, self.shared_slots.same_host.peers)
        clock.add("pull", t)
        for r in range(rounds):
            t = time.perf_counter()
            transport.wait(pending_recv.pop(r, []))
            t = clock.add("wait", t)
            for m, parts in program.receives.get(r, ()):
                unpack(slot("recv", m), parts, targets)
                ack = transport.consumed(m.peer, m.tag, f"round {r}")
                if ack is not None:
                    acks.append(ack)
            t = clock.add("unpack", t)
            if r + depth < rounds:
                transport.wait(pending_send.pop(r, []))  # its slots are reused by round r + depth
                clock.add("wait", t)
                post(r + depth)
        t = time.perf_counter()
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

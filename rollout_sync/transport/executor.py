"""The executor: every rank of the sync group runs its half of a plan.

Lifecycle of one sync (every rank of the group calls ``Executor.execute``, even with an empty half):

1. **check** — locally: the half is well formed (``half_check``) and this rank holds every storage it needs
   with the plan's shape and dtype (``local_check``). A failure is not raised yet: it becomes the rank's
   refusal.
2. **agree** — one allgather of a fixed-size record per rank (``agreement``): plan digest, refusal and
   reason, half fingerprints, options, message size offer, delta base. Every rank decides the same way and,
   on any mismatch, every rank raises the same ``PlanMismatchError``. Nothing has moved yet.
3. **schedule** — pure, cached per (half content, agreed message sizes): per pair of ranks, the same
   messages on both ends (``schedule.build_schedule``), compiled into copies (``program``).
4. **transfer** — a full sync runs every message of the program (``full_transfer``; same-host pairs in
   other processes map the sender's storages, else go through shared memory or pull: ``same_host``); a delta sync, when every rank names
   the same base (``delta.state``), sends only what changed (``delta.run``).

After a transport failure (``PeerFailedError`` / ``SyncTimeoutError``) the group's connections to the
failed peer may be closed (gloo closes a pair on a timeout): build a new group before the next sync. A
``PlanMismatchError`` leaves the group usable: nothing was posted. After any failure the rank lets go of its
mappings of its peers' storages (a dead peer's memory is not kept alive). Staging (pack and unpack slots)
lives in one arena per executor, allocated once and reused, and in the shared segments it made for
same-host peers; together at most ``staging_cap_bytes``. ``close`` releases the shared segments.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from ..layout.dtypes import itemsize
from ..planning.half import PlanHalf
from .core import agreement
from .core.fingerprint import pair_sums, table_hash
from .core.groups import group_backend, group_rank, group_size
from .core.half_check import check_half
from .core.in_process import InProcess
from .core.local_check import check_storages
from .core.p2p import transport_for
from .core.pair_messages import Message
from .core.program import Program, ProgramCache
from .core.schedule import Schedule, message_offer, message_sizes
from .core.staging import StagingArena, slots_room
from .core.stats import ExecuteOptions, PhaseClock, SyncStats
from .core.target_streams import Targets, TargetStream
from .delta.packed_program import layout_key
from .delta.state import DeltaState
from .full_transfer import FullTransfer
from .same_host.handoff import Handoffs, copy_segments
from .same_host.pairs import SameHostPairs, lets_go_on_failure
from .same_host.pulls import pulled_bytes
from .same_host.shared_memory import SameHost

__all__ = ["Executor", "execute"]


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
        shared = self.backend == "gloo" and self.options.shared_memory
        self.pairs = SameHostPairs(same_host, self.in_process, shared, self.options.map_sources)
        self.programs = ProgramCache()  # the program of the last half
        self._fingerprints: tuple[PlanHalf, bytes, tuple[int, int]] | None = None
        self._checked: PlanHalf | None = None
        self.delta_state = DeltaState(self.options, self.rank, self.depth, self.in_process)

    @property
    def depth(self) -> int:
        return 2 if self.options.overlap else 1

    @property
    def pulls_from(self) -> frozenset[int]:
        """Same-host peers this rank can read (probed)."""
        return self.pairs.pulls_from

    @property
    def pulled_by(self) -> frozenset[int]:
        """Same-host peers that can read this rank."""
        return self.pairs.pulled_by

    @property
    def shared_bytes(self) -> int:
        """Bytes of shared slots this rank made (its send slots to same-host peers)."""
        return self.pairs.created_bytes

    @property
    def delta_state_bytes(self) -> int:
        """The memory this rank keeps for delta syncs: its shadow of what it last sent."""
        return self.delta_state.nbytes

    def committed(self, version: int) -> None:
        """Every rank committed the sync this executor ran last, as weight version ``version``: with the
        delta option, name it as this rank's base at the next agreement."""
        self.delta_state.committed(version)

    def forget_base(self) -> None:
        """Something other than a sync wrote this rank's storages: the next sync is a full one."""
        self.delta_state.forget_base()

    def close(self) -> None:
        """Release what this executor holds beyond its arena: the shared segments it made."""
        self.pairs.close()

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
        room = slots_room(self.options.staging_cap_bytes, targets, stream)
        wanted, too_small = message_offer(half, room, self.depth, self.in_process)
        if too_small is not None:
            wanted, too_small = message_offer(
                half, self.options.staging_cap_bytes, self.depth, self.in_process
            )
        if too_small is not None:
            return f"rank {self.rank}: {too_small}", None, 0
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
        fingerprints = self._half_fingerprints(half) if ok else None
        record = agreement.record_of(self.rank, half, reason, fingerprints, wanted, self.options, base)
        records = agreement.exchange(
            self.group, agreement.encode(record), self.world, self.options.timeout, self.rank, device
        )
        offers = agreement.decide(records)
        digest = half.digest if isinstance(half, PlanHalf) else ""
        layout = self.delta_state.in_flight = layout_key(digest, offers, self.depth)
        return offers, agreement.delta_base(records, layout)

    # -- 3. schedule ------------------------------------------------------------------------------------
    @property
    def schedule(self) -> Schedule | None:
        """The schedule of the last half this executor ran (None before the first)."""
        last = self.programs.last
        return None if last is None else last.schedule

    def _program(self, half: PlanHalf, offers: list[int]) -> Program:
        pairs = self.pairs
        return self.programs.get(
            half,
            message_sizes(half, offers, self.rank, self.in_process),
            self._half_fingerprints(half),
            zero_copy=self.options.zero_copy,
            depth=self.depth,
            in_process=self.in_process,
            shared=pairs.shared,
            pulls_from=pairs.pulls_from,
            pulled_by=pairs.pulled_by,
            maps_from=pairs.maps_from,
            mapped_by=pairs.mapped_by,
        )

    # -- 4. transfer ------------------------------------------------------------------------------------
    @lets_go_on_failure
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
        as meta tensors (see ``full_transfer``)."""
        clock = PhaseClock()
        t0 = t = time.perf_counter()
        reason, device, wanted = self._check(half, sources, targets, stream)
        if refusal is not None and reason is None:
            reason = f"rank {self.rank}: {refusal}"
        if device is None:
            device = self._default_device()
        # the base this rank names; forgotten now: only the commit of this sync gives one back
        base = self.delta_state.offer(half, sources, targets, stream)
        t = clock.add("check", t)
        # the agreement's tensors: on the storages' device for NCCL, on the CPU for gloo (even with CUDA storages)
        collective = device if self.backend == "nccl" else torch.device("cpu")
        offers, delta_base = self._agree(half, reason, wanted, collective, base)
        if delta_base is not None:
            clock.add("agree", t)
            self.pairs.refuse_unmapped(half, device, self.backend, self.rank, delta=True)
            return self._execute_delta(half, offers, delta_base, sources, targets, device, clock, t0)
        self.pairs.probe(self.group, self.rank, half, self.options.timeout, sources, device)
        self.pairs.refuse_unmapped(half, device, self.backend, self.rank)
        t = clock.add("agree", t)
        program = self._program(half, offers)
        schedule = program.schedule
        arena = self.arena.reserve(schedule.staging_bytes, device, self.options.staging_cap_bytes)
        segments = self.pairs.segments(half, schedule, offers, self.rank)
        t = clock.add("schedule", t)
        with torch.no_grad():
            streamed = Targets(targets, stream, half, program)
            shared = self.pairs.shared  # only signals cross the group for their messages
            transport = transport_for(
                self.group,
                self.backend,
                self.rank,
                self.options.timeout,
                device,
                self.local,
                shared,
                self.pairs.mapped,
            )
            handoffs = Handoffs(transport, schedule)
            try:
                FullTransfer(
                    half,
                    program,
                    arena,
                    segments,
                    sources,
                    streamed,
                    transport,
                    handoffs,
                    self.pairs,
                    self.options.staging_cap_bytes,
                    self.backend == "nccl",
                    clock,
                ).run()
            except BaseException as e:
                self.pairs.sweep_stale()  # segments a dead peer made and nobody opened
                handoffs.decline(e)
                raise
            if self.options.delta:
                t = time.perf_counter()
                self.delta_state.after_full_sync(half, offers, sources, device)
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
            bytes_handed={p: n for p, n in program.bytes_handed.items() if p in self.in_process},
            bytes_mapped={p: n for p, n in program.bytes_handed.items() if p not in self.in_process},
            bytes_mapped_from=_mapped_from(half, schedule, self.in_process),
            bytes_pulled=pulled_bytes(self.pairs.pull_plan(program)),
            delta_state_bytes=self.delta_state_bytes,
            estimated_changed_share=self.delta_state.share,
        )

    def _execute_delta(
        self,
        half: PlanHalf,
        offers: list[int],
        base: int,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        device: torch.device,
        clock: PhaseClock,
        t0: float,
    ) -> SyncStats:
        t = time.perf_counter()
        delta = self.delta_state.program(half, offers)
        program = delta.program
        schedule = program.schedule
        arena = self.arena.reserve(schedule.staging_bytes, device, self.options.staging_cap_bytes)
        shadow = self.delta_state.shadow_for(delta, device)
        t = clock.add("schedule", t)

        def slot(direction: str, m: Message) -> torch.Tensor:
            offset, _ = schedule.slot(direction, m)
            return arena[offset : offset + m.nbytes]

        with torch.no_grad():
            streamed = Targets(targets, None, half, program)
            transport = transport_for(
                self.group, self.backend, self.rank, self.options.timeout, device, self.local
            )
            handoffs = Handoffs(transport, schedule)
            try:
                handoffs.offer(half, sources)
                copy_segments(schedule.local, half, sources, streamed)
                handoffs.take(half, streamed)
                t = clock.add("local", t)
                counts = self.delta_state.run(
                    half, delta, shadow, slot, sources, streamed, transport, clock.add
                )
                t = time.perf_counter()
                handoffs.wait()
                clock.add("wait", t)
            except BaseException as e:
                handoffs.decline(e)
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
            unchanged_targets=frozenset(counts.quiet),
            delta_state_bytes=self.delta_state_bytes,
            estimated_changed_share=self.delta_state.share,
        )

    def _default_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def _mapped_from(half: PlanHalf, schedule: Schedule, in_process: frozenset[int]) -> dict[int, int]:
    """Per peer in another process whose storages this rank copied from (mapped handoffs), the bytes."""
    return {
        peer: sum(s.numel * itemsize(half.tensors[s.tensor].target_dtype) for s in segments)
        for peer, segments in schedule.handoff_from
        if peer not in in_process
    }


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

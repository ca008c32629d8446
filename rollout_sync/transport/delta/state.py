"""What an executor keeps between syncs for delta syncs (``delta``), and when it names a base.

``DeltaState`` holds the base this rank names at the next agreement (the version and message layout of the
last sync every rank committed), the layout of the sync in flight, the all-packed program of the last
layout, the sender's shadow (and whether it holds what this rank sent last) and its sample.

- ``offer``, before the agreement: the base this rank names (none with delta syncs off, when its sample
  shows that more than ``ExecuteOptions.delta_full_above`` of what it sends changed, when a target is
  streamed, or when its shadow does not hold the base); the rank then forgets it, and only ``committed``
  gives a base back.
- after a full sync, ``after_full_sync`` refills the shadow (unless most of it changed) and takes a new
  sample; a delta sync runs its messages with ``run`` (``delta.run``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ...planning.half import PlanHalf
from ..core.p2p import Transport
from ..core.pair_messages import Message
from ..core.program import compile_program
from ..core.schedule import build_schedule, message_sizes
from ..core.stats import ExecuteOptions
from ..core.target_streams import Targets, TargetStream
from .packed_program import DeltaProgram
from .run import DeltaCounts, run_delta
from .shadow import Shadow, changed_share, take_sample

__all__ = ["DeltaState"]


class DeltaState:
    """The delta-sync state of one executor: group rank ``rank``, ``depth`` rounds in flight, peers in this
    process ``in_process`` (their segments are handoffs)."""

    def __init__(self, options: ExecuteOptions, rank: int, depth: int, in_process: frozenset[int]) -> None:
        self.options = options
        self.rank = rank
        self.depth = depth
        self.in_process = in_process
        self.base: tuple[int, bytes] | None = None  # named at the next agreement
        self.in_flight: bytes | None = None  # the message layout of the sync in flight (agreed)
        self.last: DeltaProgram | None = None  # the all-packed program of the last layout
        self.shadow: Shadow | None = None
        self.shadow_valid = False  # it holds what this rank sent in the last sync
        self.sample: dict[str, torch.Tensor] | None = None
        self.share: float | None = None  # this sync's estimate of the changed share (a sender with a sample)

    @property
    def nbytes(self) -> int:
        """The memory this rank keeps for delta syncs: its shadow of what it last sent."""
        return 0 if self.shadow is None else self.shadow.nbytes

    def committed(self, version: int) -> None:
        """Every rank committed the sync in flight as weight version ``version``: with the delta option, name
        it as this rank's base at the next agreement."""
        if self.options.delta and self.in_flight is not None:
            self.base = (version, self.in_flight)

    def forget_base(self) -> None:
        """Something other than a sync wrote this rank's storages: the next sync is a full one."""
        self.base = None

    def offer(
        self,
        half: PlanHalf,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        stream: TargetStream | None,
    ) -> tuple[int, bytes] | None:
        """The base this rank names at this sync's agreement (None: a full sync). Estimates this sync's
        changed share first; forgets the base and the last layout (only ``committed`` gives a base back)."""
        base = self._offered(half, sources, targets, stream)
        self.base = self.in_flight = None
        return base

    def _offered(
        self,
        half: PlanHalf,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        stream: TargetStream | None,
    ) -> tuple[int, bytes] | None:
        self.share = None
        if self.options.delta and self.sample is not None and isinstance(half, PlanHalf):
            try:
                self.share = changed_share(self.sample, half, sources)
            except Exception:  # a storage the check refuses: the agreement says why, not this estimate
                self.share = None
        base = self.base
        if not self.options.delta or base is None:
            return None
        if self.share is not None and self.share > self.options.delta_full_above:
            return None  # most of what this rank sends changed: a full sync moves it faster
        if stream is not None and any(isinstance(t, torch.Tensor) and t.is_meta for t in targets.values()):
            return None  # a streamed target (a layer's loaded form) does not hold the base's values
        delta = self.last
        if (
            delta is not None
            and delta.shadow_bytes
            and (self.shadow is None or not self.shadow_valid or self.shadow.layout != base[1])
        ):
            return None
        return base

    def program(self, half: PlanHalf, offers: list[int]) -> DeltaProgram:
        """The all-packed program of ``half`` under the layout in flight (kept while the layout stays)."""
        layout = self.in_flight
        assert layout is not None  # set by the agreement
        cached = self.last
        if cached is not None and cached.layout == layout and cached.program.schedule.rank == half.rank:
            return cached
        sizes = message_sizes(half, offers, self.rank, self.in_process)
        schedule = build_schedule(
            half, sizes, zero_copy=False, depth=self.depth, in_process=self.in_process, uniform=True
        )
        self.last = DeltaProgram.of(compile_program(half, schedule), layout)
        return self.last

    def after_full_sync(
        self, half: PlanHalf, offers: list[int], sources: Mapping[str, torch.Tensor], device: torch.device
    ) -> None:
        """After a full sync: refill the shadow unless most of what this rank sends changed (the next sync is
        then full too, and refills it if it is worth it); take a new sample."""
        if self.share is None or self.share <= self.options.delta_full_above:
            self._refill_shadow(half, offers, sources, device)
        else:
            self.shadow_valid = False
        self.sample = take_sample(half, sources)

    def _refill_shadow(
        self, half: PlanHalf, offers: list[int], sources: Mapping[str, torch.Tensor], device: torch.device
    ) -> None:
        """The shadow holds what this rank sent (the base of the next delta sync)."""
        delta = self.program(half, offers)
        if not delta.shadow_bytes:
            self.shadow = None
            return
        shadow = self.shadow
        if shadow is None or shadow.nbytes != delta.shadow_bytes:
            self.shadow = None  # release before allocating the new one
            shadow = Shadow(delta, device)
        shadow.layout = delta.layout
        self.shadow_valid = False
        shadow.refill(delta, sources)
        self.shadow = shadow
        self.shadow_valid = True

    def shadow_for(self, delta: DeltaProgram, device: torch.device) -> Shadow:
        """The shadow a delta sync compares with: this rank's, or an empty one for a rank that sends nothing
        over the group."""
        shadow = self.shadow
        if shadow is None:
            shadow = Shadow(delta, device)
        return shadow

    def run(
        self,
        half: PlanHalf,
        delta: DeltaProgram,
        shadow: Shadow,
        slot: Callable[[str, Message], torch.Tensor],
        sources: Mapping[str, torch.Tensor],
        targets: Targets,
        transport: Transport,
        add: Callable[[str, float], float],
    ) -> DeltaCounts:
        """The messages of a delta sync (``delta.run.run_delta``); the shadow is whole again only at the end.
        Takes a new sample. ``quiet`` of the counts: the targets no element of which changed (no copy within
        this process wrote them either)."""
        self.shadow_valid = False  # updated in place as messages go: whole only at the end
        counts = run_delta(delta, shadow, slot, sources, targets, transport, add)
        # targets also written by copies within the rank or from a peer in its process came whole
        schedule = delta.program.schedule
        copied = list(schedule.local) + [s for _, segs in schedule.handoff_from for s in segs]
        counts.quiet -= {half.tensors[s.tensor].name for s in copied}
        self.shadow_valid = True
        self.sample = take_sample(half, sources)
        return counts

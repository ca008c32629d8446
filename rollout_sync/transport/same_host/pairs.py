"""An executor's pairs with ranks on its host in other processes (CPU, gloo,
``ExecuteOptions.shared_memory``).

At the first sync with a peer, a probe (``pulls.probe_pulls``) finds whether each of the two can map the
other's storages and read its memory. Where the receiver can map the sender's storages (``mapped``), the
pair has no messages: its segments are handoffs, copied by the receiver straight from the sender's storages.
Otherwise their packed messages' slots live in shared memory (``shared_memory``) and only signals cross the
group; where the receiver can read the sender's memory, it pulls direct messages straight from the sender's
storage (``pulls``). ``SameHostPairs`` holds what this takes across syncs: this rank's shared slots, the
peers it shares them with, which of them it maps or is mapped by, pulls from or is pulled by (each probed
once), its mappings of their storages, and the pull plan of the current program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

import torch

from ...errors import BackendDeviceError
from ...planning.half import PlanHalf
from ..core.mapped import MappedPeers, table_of
from ..core.program import Program
from ..core.schedule import Schedule, peers_of
from . import cross_memory
from .pulls import PullPlan, probe_pulls, pull_plan
from .shared_memory import SameHost, SharedSegments, SharedSlots, sweep_stale

__all__ = ["SameHostPairs", "lets_go_on_failure"]


class SameHostPairs:
    """``same_host``: this group's ranks on this host in other processes; ``enabled``: the group's backend
    and the options allow shared memory (else this rank has no same-host pairs and every byte goes over the
    group)."""

    def __init__(
        self, same_host: SameHost | None, in_process: frozenset[int], enabled: bool, map_sources: bool = True
    ) -> None:
        self.in_process = in_process
        self.map_sources = map_sources
        self.slots: SharedSlots | None = None
        self.shared: frozenset[int] = frozenset()  # peers whose bytes are pulled or go through shared slots
        if same_host is not None and enabled:
            self.slots = SharedSlots(same_host)
            self.shared = frozenset(same_host.peers) - in_process
        self.pulls_from: frozenset[int] = frozenset()  # same-host peers this rank can read (probed)
        self.pulled_by: frozenset[int] = frozenset()  # same-host peers that can read this rank
        self.maps_from: frozenset[int] = frozenset()  # same-host peers whose storages this rank maps
        self.mapped_by: frozenset[int] = frozenset()  # same-host peers that map this rank's storages
        self.mapped = MappedPeers({} if same_host is None else dict(same_host.peers))
        self._probed: set[int] = set()
        self._pulls_cached: tuple[Program, PullPlan] | None = None

    @property
    def created_bytes(self) -> int:
        """Bytes of shared slots this rank made (its send slots to same-host peers)."""
        return 0 if self.slots is None else self.slots.created_bytes

    def probe(
        self,
        group: Any,
        rank: int,
        half: PlanHalf,
        timeout: float,
        sources: Mapping[str, torch.Tensor],
        device: torch.device | None = None,
    ) -> None:
        """Probe the same-host peers this half exchanges bytes with and has not probed yet (``pulls``). A
        peer may map this rank only if every storage this rank sends it from can be shared now
        (``mapped.table_of``; a process out of file descriptors or of shared memory cannot). ``device``:
        where this rank's storages are (CUDA storages are mapped through IPC handles, never pulled)."""
        if self.slots is None or not cross_memory.supported():
            return
        device = device or torch.device("cpu")
        self.mapped.maps.device = device
        send_peers, recv_peers = peers_of(half, self.in_process)
        peers = sorted((set(send_peers) | set(recv_peers)) & self.shared - self._probed)
        if not peers:
            return
        pids = self.slots.same_host.peers
        shareable = set()
        if self.map_sources:
            for peer in peers:
                names = sorted({half.tensors[s.tensor].name for s in half.sends if s.target_rank == peer})
                if table_of(names, sources)[1] is None:
                    shareable.add(peer)
        found = probe_pulls(group, rank, peers, pids, timeout, self.map_sources, shareable, device)
        self._probed.update(peers)
        self.pulls_from |= found.pulls_from
        self.pulled_by |= found.pulled_by
        self.maps_from |= found.maps_from
        self.mapped_by |= found.mapped_by
        self.mapped.maps_from, self.mapped.mapped_by = self.maps_from, self.mapped_by

    def refuse_unmapped(
        self, half: PlanHalf, device: torch.device, backend: str, rank: int, delta: bool = False
    ) -> None:
        """A backend other than NCCL carries no bytes of device storages: every peer such a rank exchanges
        segments with must be in this process or map (be mapped by) it through CUDA IPC, else
        ``BackendDeviceError`` before any byte moves (both ends of the pair know it: the probe's answers
        are mutual). A delta sync's pairs all exchange messages."""
        if device.type == "cpu" or backend == "nccl":
            return
        send_peers, recv_peers = peers_of(half, self.in_process)
        bad = sorted(
            {p for p in send_peers if delta or p not in self.mapped_by}
            | {p for p in recv_peers if delta or p not in self.maps_from}
        )
        if bad:
            what = "a delta sync" if delta else "this sync"
            raise BackendDeviceError(
                f"rank {rank}: {what} would send {device} storages over {backend!r} to or from ranks {bad}, "
                f"which neither share this process nor map them through CUDA IPC (same host, "
                f"ExecuteOptions.shared_memory, not a delta sync); {backend!r} carries only CPU tensors"
            )

    def segments(
        self, half: PlanHalf, schedule: Schedule, offers: list[int], rank: int
    ) -> SharedSegments | None:
        """The shared segments of one transfer; this rank's send segments are made now."""
        if self.slots is None or not schedule.shared_bytes:
            return None
        slots = self.slots

        def key(peer: int) -> str:  # the same on both ends of the pair
            return f"{half.digest}:{min(offers[rank], offers[peer])}:{schedule.depth}"

        for (direction, peer), nbytes in schedule.shared_bytes.items():
            if direction == "send":  # made before the first signal, so the peer finds it
                slots.send_segment(peer, nbytes, key(peer))
        return SharedSegments(slots, schedule, key)

    def pull_plan(self, program: Program) -> PullPlan:
        """The runs this rank pulls under ``program`` (computed once per program)."""
        cached = self._pulls_cached
        if cached is None or cached[0] is not program:
            cached = (program, pull_plan(program, self.pulls_from))
            self._pulls_cached = cached
        return cached[1]

    def sweep_stale(self) -> None:
        """After a failed transfer: remove the segments a dead peer made and nobody opened."""
        if self.slots is not None:
            sweep_stale(self.slots.directory)

    def let_go(self) -> None:
        """After a failed sync: drop this rank's mappings of its peers' storages, without raising where a
        dead peer's CUDA allocation cannot be closed cleanly."""
        self.mapped.maps.clear(strict=False)

    def close(self) -> None:
        """Release the shared segments this rank made and its mappings of its peers' storages."""
        self.mapped.maps.clear()
        if self.slots is not None:
            self.slots.close()


Run = TypeVar("Run", bound=Callable[..., Any])


def lets_go_on_failure(run: Run) -> Run:
    """A method of an object with ``pairs`` (``SameHostPairs``) that, when it fails, first lets go of the
    rank's mappings of its peers' storages (``SameHostPairs.let_go``; the next sync maps them again)."""

    @functools.wraps(run)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return run(self, *args, **kwargs)
        except BaseException:
            self.pairs.let_go()
            raise

    return cast(Run, wrapped)

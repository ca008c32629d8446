"""Pulls between same-host ranks (``cross_memory``) in the executor: the probe that finds which pairs can
pull (and which can map each other's storages: ``mapped``), and one transfer's pulls (address tables out, data pulled in, "pulled" signals back)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from ...errors import PeerFailedError
from ..core.copies import part_runs
from ..core.mapped import ROW, UNSHARED, MappedStorages, row_of
from ..core.p2p import Pending, Transport
from ..core.pair_messages import Message
from ..core.program import Program
from ..core.target_streams import Targets
from . import cross_memory

__all__ = ["PROBE_TAG", "ProbeResult", "PullPlan", "Pulls", "probe_pulls", "pull_plan", "pulled_bytes"]


PROBE_TAG = 1 << 30
"""Tags of the pull probe (and + 1 its answer), of a pull's address table (+ 2) and of its "pulled" signal
(+ 3): above every message tag."""


PullPlan = dict[int, list[tuple[Message, str, torch.Tensor]]]
"""Per peer this rank pulls from: each pulled message, its tensor's name, and its runs as an int64 tensor
of rows ``(source element offset, target element offset, count)``."""


def pulled_bytes(plan: PullPlan) -> dict[int, int]:
    """Bytes this rank pulls from each peer per sync."""
    return {peer: sum(m.nbytes for m, _, _ in messages) for peer, messages in plan.items()}


def pull_plan(program: Program, pulls_from: frozenset[int]) -> PullPlan:
    """The runs of every message this rank pulls (computed once per program: a row-by-row segment has
    one run per row)."""
    plan: PullPlan = {}
    for m, parts in program.direct_receives:
        if m.peer in pulls_from:
            runs = torch.tensor(part_runs(m.parts[0]), dtype=torch.int64).reshape(-1, 3)
            plan.setdefault(m.peer, []).append((m, parts[0].name, runs))
    return plan


def _ranges(offsets: torch.Tensor, counts: torch.Tensor, size: int, base: int) -> torch.Tensor:
    """``(address, bytes)`` rows of runs at element ``offsets``; one row when they are back to back (a side
    dense over the message: the other process's pages are then pinned once, not once per run)."""
    if offsets.numel() > 1 and bool((offsets[:-1] + counts[:-1] == offsets[1:]).all()):
        return torch.tensor([[int(offsets[0]) * size + base, int(counts.sum()) * size]], dtype=torch.int64)
    return torch.stack((offsets * size + base, counts * size), 1)


class Pulls:
    """One transfer's pulls. A sender sends, per peer that pulls from it, the address of each of its source
    storages those messages read, and waits for the peer's "pulled"; a receiver takes the table, pulls each
    message's runs straight into its target storage (``cross_memory.pull_iov``), and signals."""

    def __init__(
        self,
        program: Program,
        plan: PullPlan,
        pulled_by: frozenset[int],
        sources: Mapping[str, torch.Tensor],
        transport: Transport,
    ) -> None:
        self.transport = transport
        self.plan = plan
        self.pending: list[Pending] = []
        outgoing: dict[int, set[str]] = {}
        for m, parts in program.direct_sends:
            if m.peer in pulled_by:
                outgoing.setdefault(m.peer, set()).add(parts[0].name)
        for peer, names in sorted(outgoing.items()):
            table = torch.tensor([sources[n].data_ptr() for n in sorted(names)], dtype=torch.int64)
            self.pending.append(transport.signal("send", peer, PROBE_TAG + 2, "pull table", table))
            self.pending.append(transport.signal("recv", peer, PROBE_TAG + 3, "pulled"))
        self.tables: dict[int, tuple[list[str], torch.Tensor]] = {}
        for peer, messages in plan.items():
            pulled = sorted({name for _, name, _ in messages})
            self.tables[peer] = (pulled, torch.zeros(len(pulled), dtype=torch.int64))
        self.table_work = {
            peer: transport.signal("recv", peer, PROBE_TAG + 2, "pull table", table)
            for peer, (_, table) in self.tables.items()
        }

    def run(self, targets: Targets, pids: Mapping[int, int]) -> None:
        for peer, messages in sorted(self.plan.items()):
            self.transport.wait([self.table_work[peer]])
            names, table = self.tables[peer]
            base = dict(zip(names, (int(v) for v in table), strict=True))
            for m, name, runs in messages:
                target = targets.get(name)
                size = target.element_size()
                local = _ranges(runs[:, 1], runs[:, 2], size, target.data_ptr())
                remote = _ranges(runs[:, 0], runs[:, 2], size, base[name])
                try:
                    cross_memory.pull_iov(pids[peer], local, remote)
                except OSError as e:
                    raise PeerFailedError(
                        f"rank {self.transport.rank}: pulling direct message {m.round} from rank {peer} "
                        f"(pid {pids[peer]}) failed: {e}"
                    ) from e
                targets.landed(name)
            self.pending.append(self.transport.signal("send", peer, PROBE_TAG + 3, "pulled"))


@dataclass(frozen=True)
class ProbeResult:
    """What a probe found, per peer: which this rank can pull from / map, and which can pull from / map this
    rank."""

    pulls_from: set[int]
    pulled_by: set[int]
    maps_from: set[int]
    mapped_by: set[int]


def _can_map(pid: int, row: list[int], expected: int, device: torch.device) -> bool:
    """Does the storage a peer's probe ``row`` names open here and hold ``expected``?"""
    if row[0] == UNSHARED:
        return False
    maps = MappedStorages(device)
    try:
        storage = maps.storage(pid, row)
        value = int(
            torch.empty(0, dtype=torch.int64, device=storage.device).set_(storage, row[4], (1,), (1,))[0]
        )
    except (OSError, RuntimeError):
        return False
    finally:
        with contextlib.suppress(RuntimeError):
            maps.clear()
    return value == expected


def probe_pulls(
    group: Any,
    rank: int,
    peers: list[int],
    pids: Mapping[int, int],
    timeout_s: float,
    map_sources: bool = True,
    shareable: set[int] | None = None,
    device: torch.device | None = None,
) -> ProbeResult:
    """Can this rank read each of ``peers``' memory (``process_vm_readv``) and map its storages (``mapped``),
    and can each do so with this rank's? Both ends of every pair call it at the same sync (their halves
    mirror each other) and learn both answers, so both build the same schedule. ``map_sources``: this rank
    lets its storages be mapped and maps its peers' (a pair maps only where both ends allow it);
    ``shareable``: the peers that may map this rank's storages (default: all); ``device``: where this rank's
    storages are (CUDA: no pulls, which read host memory; a peer maps it through a CUDA IPC handle)."""
    device = device or torch.device("cpu")
    on_cpu = device.type == "cpu"
    if on_cpu:
        cross_memory.allow_pulls()
    timeout = timedelta(seconds=timeout_s)
    value = secrets.randbits(62)
    magic = torch.tensor([value], dtype=torch.int64, device=device)
    unshared = [UNSHARED] + [0] * (ROW - 1)
    row = unshared
    if map_sources:
        try:
            row = row_of(magic)  # on CPU it moves into shared memory first: its address is read after
        except (OSError, RuntimeError):
            row = unshared
    address = magic.data_ptr() if on_cpu else 0
    mine = {
        p: torch.tensor(
            [address, value, *(row if shareable is None or p in shareable else unshared)], dtype=torch.int64
        )
        for p in peers
    }
    theirs = {p: torch.zeros(2 + ROW, dtype=torch.int64) for p in peers}
    answers = {p: torch.zeros(1, dtype=torch.int64) for p in peers}
    works: list[Any] = []
    try:
        works += [group.send([mine[p]], p, PROBE_TAG) for p in peers]
        for w in [group.recv([theirs[p]], p, PROBE_TAG) for p in peers]:
            w.wait(timeout)
        found = {}
        for p in peers:
            got = torch.zeros(1, dtype=torch.int64)
            their = [int(v) for v in theirs[p]]
            their_address, expected, their_row = their[0], their[1], their[2:]
            readable = False
            if on_cpu and their_address:
                try:
                    cross_memory.pull(pids[p], [(got.data_ptr(), their_address, 8)])
                    readable = int(got) == expected
                except OSError:
                    readable = False
            mappable = map_sources and _can_map(pids[p], their_row, expected, device)
            found[p] = int(readable) | int(mappable) << 1
        replies = {p: torch.tensor([found[p]], dtype=torch.int64) for p in peers}
        works += [group.send([replies[p]], p, PROBE_TAG + 1) for p in peers]
        works += [group.recv([answers[p]], p, PROBE_TAG + 1) for p in peers]
        for w in works:
            w.wait(timeout)  # also keeps ``magic`` alive until every peer has read it
    except RuntimeError as e:
        raise PeerFailedError(
            f"rank {rank}: probing same-host peers {peers} for memory pulls failed: {e}"
        ) from e
    return ProbeResult(
        pulls_from={p for p in peers if found[p] & 1},
        pulled_by={p for p in peers if int(answers[p]) & 1},
        maps_from={p for p in peers if found[p] & 2},
        mapped_by={p for p in peers if int(answers[p]) & 2},
    )

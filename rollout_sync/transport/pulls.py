"""Pulls between same-host ranks (``cross_memory``) in the executor: the probe that finds which pairs can
pull, and one transfer's pulls (address tables out, data pulled in, "pulled" signals back)."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from ..errors import PeerFailedError
from . import cross_memory
from .p2p import Pending, Transport
from .program import PartProgram, Program
from .schedule import Message, part_copies
from .targets import Targets

__all__ = ["PROBE_TAG", "Pulls", "probe_pulls", "pulled_bytes"]


PROBE_TAG = 1 << 30
"""Tags of the pull probe (and + 1 its answer), of a pull's address table (+ 2) and of its "pulled" signal
(+ 3): above every message tag."""


def pulled_bytes(program: Program, pulls_from: frozenset[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for m, _ in program.direct_receives:
        if m.peer in pulls_from:
            out[m.peer] = out.get(m.peer, 0) + m.nbytes
    return out


class Pulls:
    """The direct messages of same-host pairs that pull. A sender sends, per peer, the address of each of
    its source storages those messages read, and waits for the peer's "pulled"; a receiver takes the table,
    pulls each message straight into its target storage, and signals."""

    def __init__(
        self,
        program: Program,
        pulls_from: frozenset[int],
        pulled_by: frozenset[int],
        sources: Mapping[str, torch.Tensor],
        transport: Transport,
    ) -> None:
        self.transport = transport
        self.pending: list[Pending] = []
        self.incoming: dict[int, list[tuple[Message, tuple[PartProgram, ...]]]] = {}
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

    def run(self, targets: Targets, pids: Mapping[int, int]) -> None:
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


def probe_pulls(
    group: Any, rank: int, peers: list[int], pids: Mapping[int, int], timeout_s: float
) -> tuple[set[int], set[int]]:
    """Can this rank read each of ``peers``' memory, and can each read this rank's? Both ends of every pair
    call it at the same sync (their halves mirror each other) and learn both answers, so both build the
    same schedule. Returns (peers this rank can pull from, peers that can pull from this rank)."""
    cross_memory.allow_pulls()
    timeout = timedelta(seconds=timeout_s)
    magic = torch.tensor([secrets.randbits(62)], dtype=torch.int64)
    mine = torch.tensor([magic.data_ptr(), int(magic)], dtype=torch.int64)
    theirs = {p: torch.zeros(2, dtype=torch.int64) for p in peers}
    answers = {p: torch.zeros(1, dtype=torch.int64) for p in peers}
    works: list[Any] = []
    try:
        works += [group.send([mine], p, PROBE_TAG) for p in peers]
        for w in [group.recv([theirs[p]], p, PROBE_TAG) for p in peers]:
            w.wait(timeout)
        readable = {}
        for p in peers:
            got = torch.zeros(1, dtype=torch.int64)
            address, expected = (int(v) for v in theirs[p])
            try:
                cross_memory.pull(pids[p], [(got.data_ptr(), address, 8)])
                readable[p] = int(got) == expected
            except OSError:
                readable[p] = False
        replies = {p: torch.tensor([int(readable[p])], dtype=torch.int64) for p in peers}
        works += [group.send([replies[p]], p, PROBE_TAG + 1) for p in peers]
        works += [group.recv([answers[p]], p, PROBE_TAG + 1) for p in peers]
        for w in works:
            w.wait(timeout)  # also keeps ``magic`` alive until every peer has read it
    except RuntimeError as e:
        raise PeerFailedError(
            f"rank {rank}: probing same-host peers {peers} for memory pulls failed: {e}"
        ) from e
    return {p for p in peers if readable[p]}, {p for p in peers if int(answers[p])}

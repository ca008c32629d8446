"""A trainer rank's side of a group-free sync (backend ``nixl``; the protocol: ``sync.nixl_endpoint``)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import PeerFailedError, PlanMismatchError
from ..layout.dtypes import itemsize
from ..transport import SyncStats
from ..transport.core.target_streams import TargetStream
from ..transport.delta.nixl_export import DeltaExport
from .nixl_endpoint import CLOSED, POLL_S, READY, REFUSED, GroupFreeEndpoint, NixlSource, worker_agent

if TYPE_CHECKING:
    from .endpoint import SyncResult

__all__ = ["Reader", "SourceEndpoint"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reader:
    """A worker that reads from this trainer rank: its global rank, engine and place, and its bytes per sync."""

    rank: int
    engine: int
    local_rank: int
    label: str
    nbytes: int


class SourceEndpoint(GroupFreeEndpoint):
    """A trainer rank in a group-free sync. Its readers: the workers of the first handshake, then every
    worker that joined since (``join`` notes, taken at sync boundaries; one of an engine index and worker rank
    already there replaces it: a restarted engine). A reader that fails a sync, refuses it or says nothing
    within the timeout is dropped (named in ``SyncResult.dropped``) and the sync completes for the others; it
    comes back by joining again. Only when every reader failed does the sync raise."""

    def __init__(self, source: NixlSource, *, group_id: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.source = source
        sent: dict[int, int] = {}
        for s in self.half.sends:
            t = self.half.tensors[s.tensor]
            sent[s.target_rank] = sent.get(s.target_rank, 0) + s.numel * itemsize(t.source_dtype)
        self.readers: dict[str, Reader] = {}
        for rank, nbytes in sorted(sent.items()):
            e = self.roster.get(rank)
            self.readers[worker_agent(group_id, rank)] = Reader(
                rank, -1 if e is None or e.engine is None else e.engine, 0 if e is None else e.local_rank,
                self._who(rank), nbytes,
            )  # fmt: skip
        self.dropped_total: list[str] = []
        self.export: DeltaExport | None = None
        self.last_version: int | None = None
        if self.options.delta and source.export is not None:
            self.export = DeltaExport(
                self.half, source.message_bytes, source.export, self.options.delta_full_above
            )

    def _join(self, agent: str, note: str) -> None:
        try:
            f = json.loads(note)
            reader = Reader(
                int(f["rank"]), int(f["engine"]), int(f["local_rank"]), str(f["label"]), int(f["nbytes"])
            )
        except (ValueError, KeyError, TypeError):
            log.warning("rollout-sync: rank %d ignored a malformed join from %s: %r", self.rank, agent, note)
            return
        for name, r in list(self.readers.items()):
            if (r.engine, r.local_rank) == (reader.engine, reader.local_rank) and name != agent:
                del self.readers[name]  # a restarted engine's worker replaces the old one
        self.readers[agent] = reader

    def _notes(self) -> list[tuple[str, str, int, str]]:
        """New notes as (agent, kind, sequence number, text); joins are applied at once."""
        out = []
        for agent, notes in self.source.agent.notes().items():
            for raw in notes:
                kind, _, rest = raw.decode(errors="replace").partition(" ")
                if kind == "join":
                    self._join(agent, rest)
                    continue
                seq, _, text = rest.partition(" ")
                if seq.isdigit():
                    out.append((agent, kind, int(seq), text))
        return out

    def run(
        self,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        version: int = -1,
        refusal: str | None = None,
        stream: TargetStream | None = None,
    ) -> SyncResult:
        from .endpoint import SyncResult

        start = time.perf_counter()
        self.seq += 1
        reason = refusal or self._check(sources, targets, stream)
        if reason is None:
            moved = [
                n
                for n, t in sources.items()
                if n in self.source.bases and t.data_ptr() != self.source.bases[n]
            ]
            if moved:
                reason = (
                    f"rank {self.rank}: source {moved[0]!r} is no longer the storage registered at the "
                    "handshake: attach again"
                )
        state = self.source.state
        if reason is not None:
            state.write(self.seq, version, REFUSED, reason)
            raise PlanMismatchError(f"rank {self.rank} refused the sync: {reason}")
        self._notes()  # the sync boundary: workers that joined since the last sync are readers of this one
        readers = dict(self.readers)
        coded = None
        if self.export is not None:  # what changed, per reader, into the export (before anyone reads it)
            coded = self.export.code(sources, {r.rank for r in readers.values()}, self.seq)
        state.write(self.seq, version, READY)
        waiting = set(readers)
        dropped: dict[str, str] = {}
        read: dict[str, int] = {}
        deltas = 0  # readers that applied a delta on the last sync's version
        deadline = time.monotonic() + self.options.timeout
        try:
            while waiting:
                for agent, kind, seq, text in self._notes():
                    if agent not in waiting or seq != self.seq:
                        continue  # a late note of an earlier sync, or a worker that joined during this one
                    waiting.discard(agent)
                    nbytes, _, how = text.partition(" ")
                    if kind == "done" and nbytes.isdigit():
                        read[agent] = int(nbytes)  # what it read from this rank: a delta region or its half
                        deltas += how == "delta"
                    if kind == "fail":
                        dropped[agent] = f"{readers[agent].label} failed: {text}"
                    elif kind == "refuse":
                        dropped[agent] = f"{readers[agent].label} refused the sync: {text}"
                if waiting and time.monotonic() > deadline:
                    for agent in waiting:
                        dropped[agent] = (
                            f"{readers[agent].label}: no word within {self.options.timeout:g} s "
                            "(dead, cut off or not receiving)"
                        )
                    waiting.clear()
                if waiting:
                    time.sleep(POLL_S)
        finally:
            # a late reader fails instead of reading a storage the next optimizer step writes
            state.write(self.seq, version, CLOSED)
        lost = {readers[a].engine: readers[a] for a in sorted(dropped, key=lambda a: readers[a].rank)}
        for agent, r in readers.items():  # an engine is whole or out: it joins again as a whole
            if agent not in dropped and r.engine in lost and r.engine >= 0:
                dropped[agent] = f"{r.label}: its engine lost {lost[r.engine].label}"
        for agent in dropped:
            if self.readers.get(agent) == readers[agent]:
                del self.readers[agent]
        names = tuple(dropped[a] for a in sorted(dropped, key=lambda a: readers[a].rank))
        if names:
            self.dropped_total.extend(names)
            log.warning("rollout-sync: rank %d sync %d dropped %s", self.rank, version, "; ".join(names))
            if len(dropped) == len(readers):
                raise PeerFailedError(
                    f"rank {self.rank}: sync {version} reached no worker: " + "; ".join(names)
                )
        sent = {r.rank: read.get(a, r.nbytes) for a, r in readers.items() if a not in dropped}
        stats = SyncStats(
            self.rank,
            sent,
            {},
            0,
            len(sent),
            0,
            0,
            0,
            self.options.staging_cap_bytes,
            seconds={"total": time.perf_counter() - start},
            elements_compared=0 if coded is None else coded.compared,
            elements_changed=0 if coded is None else coded.changed,
            delta_state_bytes=0 if self.export is None else self.export.shadow.nbytes,
            delta_base=self.last_version if sent and deltas == len(sent) else None,
            estimated_changed_share=None if self.export is None else self.export.share,
        )
        self.last_version = version
        return SyncResult(version, stats, time.perf_counter() - start, names)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.source.close()

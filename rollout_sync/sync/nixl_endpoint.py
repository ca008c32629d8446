"""Group-free syncs (backend ``nixl``): every rollout worker reads its half of the plan straight from the
trainer ranks' registered storages through NIXL; no process group spans trainers and engines.

Setup rides on the handshake. Before its hello, each trainer rank starts a NIXL agent, registers the
storages it sends from and a small **state** buffer, and says hello with the agent's metadata, the address
of each source tensor and of its state (``NixlSource``). The welcome hands every worker those of all trainer
ranks; a worker starts its own agent (named after the group and its rank) and adds the trainer ranks' agents.
Nothing else is exchanged: metadata, never tensors.

One sync, on trainer rank *t* (``SourceEndpoint.run``), with a sequence number *n* that grows by one per sync:

1. checks its half and storages (nothing moves on a refusal: the state says ``REFUSED`` with the reason);
2. writes ``(n, version, READY)`` into its state;
3. waits until every worker that reads from it has said ``done n`` (or ``fail n reason``) by a NIXL
   notification, each wait bounded by the timeout; only then does it return, so the optimizer cannot step
   (overwrite the storage) while a worker still reads; then writes ``CLOSED``.

On a worker (``PullEndpoint.run``): checks its targets, reads each source trainer rank's state until it says
``READY`` for a sequence number above the last one it took (or ``REFUSED``: every worker raises the trainer's
reason), then reads its segments (``transport.nixl_reads``: in place, else staged within the staging cap),
then notifies ``done n`` to each source. A failure after ``READY`` notifies ``fail n reason``, so no trainer
rank waits for the timeout. The worker claims the version only once all of its reads have landed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import PeerFailedError, PlanMismatchError, RolloutSyncError, SyncTimeoutError
from ..layout.dtypes import itemsize
from ..planning.half import PlanHalf
from ..transport import ExecuteOptions, SyncStats
from ..transport.half_check import check_half
from ..transport.local_check import check_storages
from ..transport.nixl_agent import NixlAgent, Reading, ucx_environment
from ..transport.nixl_reads import ReadPlan, read_plan
from ..transport.program import torch_dtype, view
from ..transport.targets import TargetStream
from .roster import RosterEntry

__all__ = ["NixlSource", "PullEndpoint", "SourceEndpoint", "worker_agent"]

log = logging.getLogger(__name__)

IDLE, READY, REFUSED, CLOSED = 0, 1, 2, 3
HEADER = 3  # int64: sequence number (written last), version, phase
REASON_BYTES = 1024
STATE_BYTES = HEADER * 8 + 8 + REASON_BYTES  # + the reason's length
POLL_S = 0.002


def worker_agent(group_id: str, rank: int) -> str:
    return f"rollout-sync-{group_id}-{rank}"


@dataclass
class _State:
    """A trainer rank's state buffer (registered; workers read it)."""

    buffer: torch.Tensor = field(default_factory=lambda: torch.zeros(STATE_BYTES, dtype=torch.uint8))

    def write(self, seq: int, version: int, phase: int, reason: str = "") -> None:
        ints = self.buffer[: HEADER * 8 + 8].view(torch.int64)
        text = reason.encode()[:REASON_BYTES]
        if text:
            self.buffer[HEADER * 8 + 8 : HEADER * 8 + 8 + len(text)] = torch.tensor(
                list(text), dtype=torch.uint8
            )
        ints[3] = len(text)
        ints[2] = phase
        ints[1] = version
        ints[0] = seq  # last: a reader that sees this sequence number sees the rest of it


def _read_state(buffer: torch.Tensor) -> tuple[int, int, int, str]:
    ints = buffer[: HEADER * 8 + 8].view(torch.int64).tolist()
    n = max(0, min(int(ints[3]), REASON_BYTES))
    reason = bytes(buffer[HEADER * 8 + 8 : HEADER * 8 + 8 + n].tolist()).decode(errors="replace")
    return int(ints[0]), int(ints[1]), int(ints[2]), reason


class NixlSource:
    """A trainer rank's side of a group-free sync, made before its hello: its agent, its registered source
    storages and its state. ``fields`` go into the hello."""

    def __init__(self, sources: Mapping[str, torch.Tensor], bind: str) -> None:
        ucx_environment(bind)
        self.agent = NixlAgent(f"rollout-sync-trainer-{secrets.token_hex(6)}")
        self.state = _State()
        self.sources = dict(sources)
        self.agent.register([*sources.values(), self.state.buffer])
        self.bases = {name: int(t.data_ptr()) for name, t in sources.items()}

    def fields(self) -> dict[str, Any]:
        return {
            "nixl": {
                "agent": self.agent.name,
                "metadata": self.agent.metadata().hex(),
                "bases": self.bases,
                "state": int(self.state.buffer.data_ptr()),
            }
        }

    def close(self) -> None:
        self.agent.close()


class _Endpoint:
    """What both sides share: the interface of ``sync.endpoint.Endpoint`` that trainer hooks and rollout
    links use (``rank``, ``half``, ``closed``, ``options``, ``run``, ``close``)."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        trainer_ranks: int,
        half: PlanHalf,
        options: ExecuteOptions,
        roster: Mapping[int, RosterEntry],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.trainer_ranks = trainer_ranks
        self.half = half
        self.options = options
        self.roster = dict(roster)
        self.closed = False
        self.seq = 0

    def forget_base(self) -> None:
        """Group-free syncs are full syncs: nothing to forget."""

    def _who(self, rank: int) -> str:
        e = self.roster.get(rank)
        if e is None:
            return f"rank {rank}"
        return f"{e.role} (rank {rank}) on {e.host}" + (f" ({e.address})" if e.address else "")

    def _check(
        self,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        stream: TargetStream | None,
    ) -> str | None:
        if self.closed:
            return f"rank {self.rank}: this endpoint was closed (a failed sync or a detach): join again"
        reason = check_half(self.half)
        if reason is not None:
            return f"rank {self.rank}: {reason}"
        if stream is None:
            meta = sorted(n for n, t in targets.items() if t.is_meta)
            if meta:
                return f"rank {self.rank}: target {meta[0]!r} is a placeholder and no stream makes it"
        if self.half.local:
            return f"rank {self.rank}: a group-free sync cannot copy within a rank (trainer and worker in one process)"
        reason, _ = check_storages(self.half, sources, targets)
        return reason


@dataclass(frozen=True)
class Reader:
    """A worker that reads from this trainer rank: its global rank, engine and place, and its bytes per sync."""

    rank: int
    engine: int
    local_rank: int
    label: str
    nbytes: int


class SourceEndpoint(_Endpoint):
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
            sent[s.target_rank] = sent.get(s.target_rank, 0) + _numel(s.extent) * itemsize(t.source_dtype)
        self.readers: dict[str, Reader] = {}
        for rank, nbytes in sorted(sent.items()):
            e = self.roster.get(rank)
            self.readers[worker_agent(group_id, rank)] = Reader(
                rank, -1 if e is None or e.engine is None else e.engine, 0 if e is None else e.local_rank,
                self._who(rank), nbytes,
            )  # fmt: skip
        self.dropped_total: list[str] = []

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
    ) -> Any:
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
        state.write(self.seq, version, READY)
        waiting = set(readers)
        dropped: dict[str, str] = {}
        deadline = time.monotonic() + self.options.timeout
        try:
            while waiting:
                for agent, kind, seq, text in self._notes():
                    if agent not in waiting or seq != self.seq:
                        continue  # a late note of an earlier sync, or a worker that joined during this one
                    waiting.discard(agent)
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
        sent = {r.rank: r.nbytes for a, r in readers.items() if a not in dropped}
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
        )
        return SyncResult(version, stats, time.perf_counter() - start, names)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.source.close()


def _numel(extent: Sequence[int]) -> int:
    n = 1
    for e in extent:
        n *= e
    return n


class PullEndpoint(_Endpoint):
    """A rollout worker in a group-free sync: it reads its half from the trainer ranks' storages."""

    def __init__(
        self, *, group_id: str, sources: Mapping[int, Mapping[str, Any]], bind: str, **kw: Any
    ) -> None:
        super().__init__(**kw)
        ucx_environment(bind)
        self.agent = NixlAgent(worker_agent(group_id, self.rank))
        needed = {s.source_rank for s in self.half.receives}
        self.state_buffer = torch.zeros(STATE_BYTES * max(len(needed), 1), dtype=torch.uint8)
        self.staging = torch.empty(0, dtype=torch.uint8)
        self.agent.register([self.state_buffer])
        self.peers: dict[int, str] = {}
        self.bases: dict[int, dict[str, int]] = {}
        self.states: dict[int, int] = {}
        self.last_seq: dict[int, int] = {}
        for rank in sorted(needed):
            info = sources.get(rank) if str(rank) not in sources else sources[str(rank)]  # type: ignore[index]
            if info is None:
                raise PeerFailedError(
                    f"rank {self.rank}: the welcome names no NIXL agent for trainer rank {rank}"
                )
            self.peers[rank] = self.agent.add_peer(bytes.fromhex(str(info["metadata"])), self._who(rank))
            self.bases[rank] = {str(k): int(v) for k, v in dict(info["bases"]).items()}
            self.states[rank] = int(info["state"])
            self.last_seq[rank] = 0
        for peer in self.peers.values():  # connected ahead; else at the first read
            with contextlib.suppress(Exception):
                self.agent.connect(peer)
        me = self.roster.get(self.rank)
        reads: dict[int, int] = {}
        for s in self.half.receives:
            t = self.half.tensors[s.tensor]
            reads[s.source_rank] = reads.get(s.source_rank, 0) + _numel(s.extent) * itemsize(t.source_dtype)
        for rank, peer in self.peers.items():  # each trainer rank counts this worker from its next sync on
            join = {
                "rank": self.rank,
                "engine": -1 if me is None or me.engine is None else me.engine,
                "local_rank": 0 if me is None else me.local_rank,
                "label": self._who(self.rank),
                "nbytes": reads.get(rank, 0),
            }
            self.agent.notify(peer, b"join " + json.dumps(join).encode())
        self._plan: tuple[Any, ReadPlan] | None = None

    def _read_plan(self, in_place: frozenset[str]) -> ReadPlan:
        key = (self.half.digest, in_place, self.options.staging_cap_bytes)
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, read_plan(self.half, in_place, self.options.staging_cap_bytes))
        return self._plan[1]

    def _states(self, ranks: Collection[int], deadline: float) -> dict[int, tuple[int, int, int, str]]:
        """The states of source ranks ``ranks`` now: (sequence number, version, phase, reason) each, read in
        parallel."""
        order = sorted(ranks)
        base = self.state_buffer.data_ptr()
        readings = [
            self.agent.read(
                self.peers[rank],
                [(base + i * STATE_BYTES, STATE_BYTES, 0)],
                [(self.states[rank], STATE_BYTES, 0)],
            )
            for i, rank in enumerate(order)
        ]
        self.agent.wait(readings, deadline, f"rank {self.rank}: reading the trainer ranks' sync state")
        return {
            rank: _read_state(self.state_buffer[i * STATE_BYTES : (i + 1) * STATE_BYTES])
            for i, rank in enumerate(order)
        }

    def _wait_ready(self, deadline: float) -> tuple[int, dict[int, int]]:
        """Each source's state until every one is READY for a new sync; (version, seq per source)."""
        pending = set(self.peers)
        seen: dict[int, tuple[int, int]] = {}
        while True:
            try:
                states = self._states(pending, deadline)
            except SyncTimeoutError as exc:
                if time.monotonic() < deadline:
                    raise
                states = {}  # the deadline passed while a read was out: said below, as any late start
                late: Exception | None = exc
            else:
                late = None
            for rank, (seq, version, phase, reason) in states.items():
                if seq <= self.last_seq[rank]:
                    continue
                if phase == REFUSED:
                    self.last_seq[rank] = seq
                    self._tell(seen, b"fail", f"{self._who(rank)} refused")
                    raise PlanMismatchError(
                        f"rank {self.rank}: {self._who(rank)} refused sync {version}: {reason}"
                    )
                if phase == READY:
                    seen[rank] = (seq, version)
                    pending.discard(rank)
            if not pending:
                break
            if time.monotonic() > deadline:
                self._tell(seen, b"fail", "timed out waiting for the other trainer ranks")
                missing = ", ".join(self._who(r) for r in sorted(pending))
                raise SyncTimeoutError(
                    f"rank {self.rank}: {missing} did not start a sync within {self.options.timeout:g} s"
                ) from late
            time.sleep(POLL_S)
        versions = {v for _, v in seen.values()}
        if len(versions) > 1:
            self._tell(seen, b"fail", f"trainer ranks offered versions {sorted(versions)}")
            raise PeerFailedError(
                f"rank {self.rank}: the trainer ranks offered different versions {sorted(versions)}"
            )
        return versions.pop(), {r: s for r, (s, _) in seen.items()}

    def _still_ready(self, seqs: Mapping[int, int], version: int, deadline: float) -> None:
        """Every source still offers the sync this worker read (a seqlock's second look): a trainer rank that
        gave up waiting (its timeout) may have let the optimizer step while the reads were in flight, so
        what they read may be torn; then this worker fails and claims nothing."""
        for rank, (seq, _, phase, _) in self._states(seqs, deadline).items():
            if seq != seqs[rank] or phase != READY:
                raise PeerFailedError(
                    f"rank {self.rank}: {self._who(rank)} ended sync {version} before this worker's reads were "
                    "done (it timed out or failed): what was read may mix two versions"
                )

    def _tell(self, seen: Mapping[int, Any], kind: bytes, why: str) -> None:
        for rank, entry in seen.items():
            seq = entry[0] if isinstance(entry, tuple) else int(entry)
            with contextlib.suppress(PeerFailedError):
                self.agent.notify(self.peers[rank], kind + b" %d " % seq + why.encode()[:900])

    def run(
        self,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        version: int = -1,
        refusal: str | None = None,
        stream: TargetStream | None = None,
    ) -> Any:
        from .endpoint import SyncResult

        start = time.perf_counter()
        reason = refusal or self._check(sources, targets, stream)
        deadline = time.monotonic() + self.options.timeout
        try:
            got, seqs = self._wait_ready(deadline)
        except PlanMismatchError:
            raise
        except (RolloutSyncError, RuntimeError):
            self.close()
            raise
        if reason is not None:  # nothing is read; the trainer ranks learn why at once
            self._tell(seqs, b"refuse", reason)
            for rank, seq in seqs.items():
                self.last_seq[rank] = seq
            raise PlanMismatchError(reason)
        try:
            received = self._read(targets, stream, deadline)
            self._still_ready(seqs, got, deadline)
        except (RolloutSyncError, RuntimeError) as exc:
            self._tell(seqs, b"fail", f"{type(exc).__name__}: {exc}")
            self.close()
            raise
        for rank, seq in seqs.items():
            self.last_seq[rank] = seq
        self._tell(seqs, b"done", "")
        plan = self._plan[1] if self._plan else None
        stats = SyncStats(
            self.rank,
            {},
            received,
            0,
            0,
            len(received),
            len(plan.batches) if plan else 0,
            plan.staging_bytes if plan else 0,
            self.options.staging_cap_bytes,
            seconds={"total": time.perf_counter() - start},
        )
        return SyncResult(got, stats, time.perf_counter() - start)

    def _read(
        self, targets: Mapping[str, torch.Tensor], stream: TargetStream | None, deadline: float
    ) -> dict[int, int]:
        given = {n: t for n, t in targets.items() if not t.is_meta}
        watched = {n for n in given if stream is not None and stream.watches(n)}
        plan = self._read_plan(frozenset(n for n in given if n not in watched))
        self.agent.register(given[r.name] for r in plan.in_place)
        if self.staging.numel() < plan.staging_bytes:
            self.staging = torch.empty(plan.staging_bytes, dtype=torch.uint8)
        if plan.staging_bytes:
            self.agent.register([self.staging])
        remaining: dict[str, int] = {}
        for b in plan.batches:
            for p in b:
                remaining[p.name] = remaining.get(p.name, 0) + 1
        made: dict[str, torch.Tensor] = {}

        def target(name: str) -> torch.Tensor:
            t = made.get(name)
            if t is None:
                t = given[name] if name in given else stream.open(name)  # type: ignore[union-attr]
                made[name] = t
            return t

        what = f"rank {self.rank}"
        by_source: dict[int, tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]] = {}
        for r in plan.in_place:
            t = given[r.name]
            base, remote = t.data_ptr(), self.bases[r.source][r.name]
            local_rows, remote_rows = by_source.setdefault(r.source, ([], []))
            for src, dst, n in r.runs:
                local_rows.append((base + dst * r.itemsize, n * r.itemsize, 0))
                remote_rows.append((remote + src * r.itemsize, n * r.itemsize, 0))
        readings: list[Reading] = [
            self.agent.read(self.peers[rank], local, remote)
            for rank, (local, remote) in sorted(by_source.items())
        ]
        self.agent.wait(readings, deadline, what)
        staging = self.staging.data_ptr()
        for batch in plan.batches:
            rows: dict[int, tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]] = {}
            for p in batch:
                remote = self.bases[p.source][p.name]
                local_rows, remote_rows = rows.setdefault(p.source, ([], []))
                for src, at, n in p.runs:
                    local_rows.append((staging + p.offset + at * p.itemsize, n * p.itemsize, 0))
                    remote_rows.append((remote + src * p.itemsize, n * p.itemsize, 0))
            self.agent.wait(
                [self.agent.read(self.peers[rank], lr, rr) for rank, (lr, rr) in sorted(rows.items())],
                deadline,
                what,
            )
            for p in batch:
                typed = self.staging[p.offset : p.offset + p.count * p.itemsize].view(
                    torch_dtype(p.source_dtype)
                )
                storage = target(p.name)
                for c in p.copies:
                    n = 1
                    for e in c.extent:
                        n *= e
                    view(storage, c).copy_(typed[c.buffer_offset : c.buffer_offset + n].view(c.extent))
                remaining[p.name] -= 1
                if (
                    remaining[p.name] == 0
                    and stream is not None
                    and (p.name not in given or p.name in watched)
                ):
                    made.pop(p.name, None)
                    stream.close(p.name)
        return plan.bytes_from()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.agent.close()

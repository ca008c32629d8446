"""A rollout worker's side of a group-free sync (backend ``nixl``; the protocol: ``sync.nixl_endpoint``): it
reads its half of the plan from the trainer ranks' registered storages."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..errors import PeerFailedError, PlanMismatchError, RolloutSyncError, SyncTimeoutError
from ..layout.dtypes import itemsize
from ..transport import SyncStats
from ..transport.core.program import torch_dtype, view
from ..transport.core.target_streams import Targets, TargetStream
from ..transport.delta.nixl_export import TABLE_BYTES, apply_region, delta_program, read_table
from ..transport.delta.packed_program import DeltaProgram
from ..transport.nixl.agent import NixlAgent, Reading, ucx_environment
from ..transport.nixl.reads import ReadPlan, read_plan
from .nixl_endpoint import (
    POLL_S,
    READY,
    REFUSED,
    STATE_BYTES,
    GroupFreeEndpoint,
    read_state,
    worker_agent,
)

if TYPE_CHECKING:
    from .endpoint import SyncResult

__all__ = ["PullEndpoint"]


def _seqs(seen: Mapping[int, tuple[int, int]]) -> dict[int, int]:
    """The sequence numbers of ``(sequence number, version)`` pairs by trainer rank."""
    return {rank: seq for rank, (seq, _) in seen.items()}


class PullEndpoint(GroupFreeEndpoint):
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
            reads[s.source_rank] = reads.get(s.source_rank, 0) + s.numel * itemsize(t.source_dtype)
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
        self.phases: dict[str, float] = {}
        # delta syncs: each trainer rank's export (transport.nixl_delta), where it codes what changed
        self.exports: dict[int, tuple[int, int]] = {}
        self.delta: DeltaProgram | None = None
        sizes = set()
        for rank in self.peers:
            info = sources.get(rank) if str(rank) not in sources else sources[str(rank)]  # type: ignore[index]
            if info is not None and "export" in info:
                self.exports[rank] = (int(info["export"]), int(info["export_bytes"]))
                sizes.add(int(info["message_bytes"]))
        if self.options.delta and self.peers and len(self.exports) == len(self.peers) and len(sizes) == 1:
            self.delta = delta_program(self.half, sizes.pop())
            self.tables = torch.zeros(TABLE_BYTES * len(self.peers), dtype=torch.uint8)
            self.regions = torch.empty(0, dtype=torch.uint8)
            self.agent.register([self.tables])

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
            rank: read_state(self.state_buffer[i * STATE_BYTES : (i + 1) * STATE_BYTES])
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
                    self._tell(_seqs(seen), b"fail", f"{self._who(rank)} refused")
                    raise PlanMismatchError(
                        f"rank {self.rank}: {self._who(rank)} refused sync {version}: {reason}"
                    )
                if phase == READY:
                    seen[rank] = (seq, version)
                    pending.discard(rank)
            if not pending:
                break
            if time.monotonic() > deadline:
                self._tell(_seqs(seen), b"fail", "timed out waiting for the other trainer ranks")
                missing = ", ".join(self._who(r) for r in sorted(pending))
                raise SyncTimeoutError(
                    f"rank {self.rank}: {missing} did not start a sync within {self.options.timeout:g} s"
                ) from late
            time.sleep(POLL_S)
        versions = {v for _, v in seen.values()}
        if len(versions) > 1:
            self._tell(_seqs(seen), b"fail", f"trainer ranks offered versions {sorted(versions)}")
            raise PeerFailedError(
                f"rank {self.rank}: the trainer ranks offered different versions {sorted(versions)}"
            )
        return versions.pop(), _seqs(seen)

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

    def _tell(self, seqs: Mapping[int, int], kind: bytes, why: str) -> None:
        """Notify each trainer rank of ``seqs`` (its sync's sequence number) ``kind`` and why."""
        for rank, seq in seqs.items():
            with contextlib.suppress(PeerFailedError):
                self.agent.notify(self.peers[rank], kind + b" %d " % seq + why.encode()[:900])

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
        reason = refusal or self._check(sources, targets, stream)
        deadline = time.monotonic() + self.options.timeout
        self.phases = {"ready": 0.0, "read": 0.0, "land": 0.0}  # this sync's seconds: waiting, reads, copies
        try:
            got, seqs = self._wait_ready(deadline)
            self.phases["ready"] = time.perf_counter() - start
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
        base, self.delta_base = self.delta_base, None  # given back only by this sync's success
        held, self.held = self.held, None
        try:
            applied = self._read_delta(seqs, held, targets, deadline)
            received = self._read(targets, stream, deadline) if applied is None else applied[0]
            self._still_ready(seqs, got, deadline)
        except (RolloutSyncError, RuntimeError) as exc:
            self._tell(seqs, b"fail", f"{type(exc).__name__}: {exc}")
            self.close()
            raise
        for rank, seq in seqs.items():
            self.last_seq[rank] = seq
            with contextlib.suppress(PeerFailedError):  # with what it read from that trainer rank
                how = b"full" if applied is None else b"delta"
                self.agent.notify(self.peers[rank], b"done %d %d %s" % (seq, received.get(rank, 0), how))
        if self.delta is not None:
            self.delta_base, self.held = got, dict(seqs)
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
            seconds={"total": time.perf_counter() - start, **self.phases},
            delta_base=None if applied is None else base,
            unchanged_targets=frozenset() if applied is None else frozenset(applied[1]),
        )
        return SyncResult(got, stats, time.perf_counter() - start)

    def _read_delta(
        self,
        seqs: Mapping[int, int],
        held: Mapping[int, int] | None,
        targets: Mapping[str, torch.Tensor],
        deadline: float,
    ) -> tuple[dict[int, int], set[str]] | None:
        """A delta sync: when every trainer rank coded this sync for this worker against the sync this worker
        took last from it (``held``: sequence numbers by trainer rank), read each one's region and apply it;
        the bytes read per trainer rank and the targets that came with no change. None: read the whole half
        instead (``_read``)."""
        if self.delta is None or held is None or any(t.is_meta for t in targets.values()):
            return None
        order = sorted(self.peers)
        at = self.tables.data_ptr()
        readings = [
            self.agent.read(
                self.peers[rank],
                [(at + i * TABLE_BYTES, TABLE_BYTES, 0)],
                [(self.exports[rank][0], TABLE_BYTES, 0)],
            )
            for i, rank in enumerate(order)
        ]
        self.agent.wait(readings, deadline, f"rank {self.rank}: reading the trainer ranks' delta tables")
        rows = {}
        for i, rank in enumerate(order):
            row = read_table(self.tables[i * TABLE_BYTES : (i + 1) * TABLE_BYTES]).get(self.rank)
            if row is None or row.seq != seqs[rank] or row.base != held.get(rank):
                return None
            if row.offset < TABLE_BYTES or row.offset + row.nbytes > self.exports[rank][1]:
                raise PeerFailedError(
                    f"rank {self.rank}: {self._who(rank)} named a delta region ({row.offset}, {row.nbytes} bytes) "
                    f"outside its export of {self.exports[rank][1]} bytes"
                )
            rows[rank] = row
        total = sum(r.nbytes for r in rows.values())
        if self.regions.numel() < total:
            self.regions = torch.empty(total, dtype=torch.uint8)
            self.agent.register([self.regions])
        spans: dict[int, torch.Tensor] = {}
        readings = []
        offset = 0
        for rank in order:
            row = rows[rank]
            spans[rank] = self.regions[offset : offset + row.nbytes]
            if row.nbytes:
                local = [(self.regions.data_ptr() + offset, row.nbytes, 0)]
                readings.append(
                    self.agent.read(
                        self.peers[rank], local, [(self.exports[rank][0] + row.offset, row.nbytes, 0)]
                    )
                )
            offset += row.nbytes
        self.agent.wait(readings, deadline, f"rank {self.rank}: reading the trainer ranks' delta regions")
        # as the group path's delta syncs: no target is closed early; what was written is rebuilt after
        # the sync, what came without a change is not (``SyncStats.unchanged_targets``)
        sink = Targets(targets, None, self.half, self.delta.program)
        quiet: set[str] = set()
        touched: set[str] = set()
        for rank in order:
            q, t = apply_region(self.delta, rank, spans[rank], sink, self.rank)
            quiet |= q
            touched |= t
        return {rank: rows[rank].nbytes for rank in order}, quiet - touched

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
            base, remote = given[r.name].data_ptr(), self.bases[r.source][r.name]
            local_rows, remote_rows = by_source.setdefault(r.source, ([], []))
            for src, dst, n in r.runs:
                local_rows.append((base + dst * r.itemsize, n * r.itemsize, 0))
                remote_rows.append((remote + src * r.itemsize, n * r.itemsize, 0))
        readings: list[Reading] = [
            self.agent.read(self.peers[rank], local, remote)
            for rank, (local, remote) in sorted(by_source.items())
        ]
        clock = time.perf_counter()
        self.agent.wait(readings, deadline, what)
        clock = self._tick("read", clock)
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
            clock = self._tick("read", clock)
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
            clock = self._tick("land", clock)
        return plan.bytes_from()

    def _tick(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - since
        return now

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.agent.close()

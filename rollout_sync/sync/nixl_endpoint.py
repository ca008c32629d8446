"""Group-free syncs (backend ``nixl``): every rollout worker reads its half of the plan straight from the
trainer ranks' registered storages through NIXL; no process group spans trainers and engines.

Setup rides on the handshake. Before its hello, each trainer rank starts a NIXL agent, registers the
storages it sends from and a small **state** buffer, and says hello with the agent's metadata, the address
of each source tensor and of its state (``NixlSource``). The welcome hands every worker those of all trainer
ranks; a worker starts its own agent (named after the group and its rank) and adds the trainer ranks' agents.
Nothing else is exchanged: metadata, never tensors.

This module holds what both sides share; ``sync.nixl_source`` the trainer rank's side, ``sync.nixl_pull`` the
worker's. One sync, on trainer rank *t* (``SourceEndpoint.run``), with a sequence number *n* that grows by one per sync:

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

**Delta syncs** (``delta=True`` at attach): each trainer rank also registers an export (of at most the staging
cap) and, in step 2 before it writes ``READY``, codes for each worker what changed since the version that worker
holds (``transport.nixl_delta``). A worker whose base every trainer rank coded against reads each one's table,
then only its region, and applies it; any other worker reads its whole half as above. Its ``done`` note says
how many bytes it read and which way (``done n BYTES delta|full``).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..planning.half import PlanHalf
from ..transport import ExecuteOptions
from ..transport.core.half_check import check_half
from ..transport.core.local_check import check_storages
from ..transport.core.target_streams import TargetStream
from ..transport.delta.nixl_export import export_buffer
from ..transport.nixl.agent import NixlAgent, ucx_environment
from .roster import RosterEntry

__all__ = ["GroupFreeEndpoint", "NixlSource", "read_state", "worker_agent"]

log = logging.getLogger(__name__)

IDLE, READY, REFUSED, CLOSED = 0, 1, 2, 3
HEADER = 3  # int64: sequence number (written last), version, phase
REASON_BYTES = 1024
STATE_BYTES = HEADER * 8 + 8 + REASON_BYTES  # + the reason's length
POLL_S = 0.002
DELTA_MESSAGE_BYTES = 1 << 20
"""The messages of a delta sync without a group: what is coded, or sent whole, at once (a trainer rank's; its
workers take it from its hello)."""


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


def read_state(buffer: torch.Tensor) -> tuple[int, int, int, str]:
    ints = buffer[: HEADER * 8 + 8].view(torch.int64).tolist()
    n = max(0, min(int(ints[3]), REASON_BYTES))
    reason = bytes(buffer[HEADER * 8 + 8 : HEADER * 8 + 8 + n].tolist()).decode(errors="replace")
    return int(ints[0]), int(ints[1]), int(ints[2]), reason


class NixlSource:
    """A trainer rank's side of a group-free sync, made before its hello: its agent, its registered source
    storages and its state. ``fields`` go into the hello."""

    def __init__(self, sources: Mapping[str, torch.Tensor], bind: str, *, export_bytes: int = 0) -> None:
        ucx_environment(bind)
        self.agent = NixlAgent(f"rollout-sync-trainer-{secrets.token_hex(6)}")
        self.state = _State()
        self.sources = dict(sources)
        # delta syncs: what changed is coded into this export for the workers to read (transport.nixl_delta)
        self.export = export_buffer(export_bytes) if export_bytes else None
        self.message_bytes = DELTA_MESSAGE_BYTES
        extra = [] if self.export is None else [self.export]
        self.agent.register([*sources.values(), self.state.buffer, *extra])
        self.bases = {name: int(t.data_ptr()) for name, t in sources.items()}

    def fields(self) -> dict[str, Any]:
        export = {}
        if self.export is not None:
            export = {
                "export": int(self.export.data_ptr()),
                "export_bytes": int(self.export.numel()),
                "message_bytes": self.message_bytes,
            }
        return {
            "nixl": {
                "agent": self.agent.name,
                "metadata": self.agent.metadata().hex(),
                "bases": self.bases,
                "state": int(self.state.buffer.data_ptr()),
                **export,
            }
        }

    def close(self) -> None:
        self.agent.close()


class GroupFreeEndpoint:
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
        self.delta_base: int | None = None  # a worker: the version its targets hold, from its last sync
        self.held: dict[int, int] | None = None  # and that sync's sequence number by trainer rank

    def forget_base(self) -> None:
        """Something other than a sync wrote this rank's storages: the next sync is a full one."""
        self.delta_base = None
        self.held = None

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

"""The admission desk of a group-free sync (backend ``nixl``): after the first handshake, trainer rank 0 keeps
the coordinator's address open, and an engine that starts later, or restarts, joins there at any time.

An engine's workers say hello as to any handshake. Once all of an engine's workers are in, the desk gives them
new global ranks (never reused), plans the trainer's maps onto their storages, and welcomes each with its half,
the trainer ranks' NIXL metadata and the roster of the trainer ranks and this engine. Nobody else takes part:
the trainer ranks learn of the new workers from the workers themselves (a NIXL notification, taken at the next
sync boundary), and the other engines learn nothing. A worker of an engine index that is already in replaces
it (a restarted engine). An engine whose workers do not all arrive within the timeout is refused.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..handshake import ROLLOUT, Coordinator, PeerInfo
from ..handshake.messages import HELLO, Message
from ..planning.policy import Balanced, ReplicaPolicy
from ..planning.wire import encode_half
from .fleet_plan import Coordinated, entry_of, plan_engines
from .roster import encode_roster

__all__ = ["AdmissionDesk"]

log = logging.getLogger(__name__)


def _hello(identity: bytes, message: Message) -> PeerInfo | str:
    f = message.fields
    try:
        info = PeerInfo(
            identity,
            str(f["role"]),
            int(f["group"]),
            int(f["local_rank"]),
            int(f["local_size"]),
            dict(f),
            message.payload,
        )
    except (KeyError, TypeError, ValueError):
        return f"hello lacks role/group/local_rank/local_size: {sorted(f)}"
    if info.role != ROLLOUT:
        return f"{info.name}: the sync is running; only rollout workers join it now"
    if info.group < 0 or not 0 <= info.local_rank < info.local_size:
        return f"{info.name}: worker rank {info.local_rank} outside 0..{info.local_size - 1}"
    return info


class AdmissionDesk:
    """Admits engines into a running group-free sync, in a thread on trainer rank 0, until ``close``."""

    def __init__(
        self, coord: Coordinator, coordinated: Coordinated, *, policy: ReplicaPolicy, timeout: float
    ) -> None:
        self.coord = coord
        self.trainer_maps = coordinated.trainer_maps
        self.trainers = [e for e in coordinated.roster if e.engine is None]
        self.fields = dict(coordinated.welcome)
        self.next_rank = coordinated.world_size
        self.policy = policy
        self.timeout = timeout
        self.admitted: list[tuple[int, tuple[int, ...]]] = []  # (engine, global ranks), in order of admission
        self.refused: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rollout-sync-admission", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        pending: dict[int, dict[bytes, PeerInfo]] = {}
        since: dict[int, float] = {}
        while not self._stop.is_set():
            try:
                self._step(pending, since)
            except Exception:  # the desk outlives any one peer's trouble (a socket gone before its welcome)
                log.exception("rollout-sync: the admission desk failed to handle a message")

    def _step(self, pending: dict[int, dict[bytes, PeerInfo]], since: dict[int, float]) -> None:
        got = self.coord.next_message(0.2)
        now = time.monotonic()
        for engine in [e for e, t in since.items() if now - t > self.timeout]:
            self._refuse(
                list(pending.pop(engine).values()),
                f"engine {engine}: not every worker said hello within {self.timeout:g} s",
            )
            del since[engine]
        if got is None:
            return
        identity, message = got
        if message.kind != HELLO:
            return  # a welcomed worker's ready, or its failure to start (it raises on its side)
        info = _hello(identity, message)
        if isinstance(info, str):
            self.coord.refuse_one(identity, info)
            self.refused.append(info)
            return
        workers = pending.setdefault(info.group, {})
        for earlier in [p for p in workers.values() if p.local_rank == info.local_rank]:
            del workers[earlier.identity]  # the same worker again (its first wait ended)
        sizes = {p.local_size for p in workers.values()}
        if sizes and info.local_size not in sizes:
            self.coord.refuse_one(
                identity,
                f"{info.name}: engine size {info.local_size}, its other workers said {sizes.pop()}",
            )
            return
        workers[identity] = info
        since.setdefault(info.group, now)
        if len(workers) == info.local_size:
            del pending[info.group], since[info.group]
            self._admit(sorted(workers.values(), key=lambda p: p.local_rank))

    def _refuse(self, workers: Sequence[PeerInfo], reason: str) -> None:
        for p in workers:
            self.coord.refuse_one(p.identity, reason)
        self.refused.append(reason)
        log.warning("rollout-sync: refused %s", reason)

    def _admit(self, workers: Sequence[PeerInfo]) -> None:
        ranks = tuple(range(self.next_rank, self.next_rank + len(workers)))
        self.next_rank += len(workers)
        entries = [entry_of(p, r) for p, r in zip(workers, ranks, strict=True)]
        roster = [*self.trainers, *entries]
        places = {e.rank: (e.machine, e.pid) for e in roster if e.machine}
        policy: ReplicaPolicy = Balanced(places) if self.policy == "balanced" else self.policy
        try:
            plan = plan_engines(self.trainer_maps, list(zip(workers, ranks, strict=True)), roster, policy)
        except Exception as exc:  # a layout the trainer cannot serve: refused, the sync goes on
            self._refuse(workers, f"engine {workers[0].group}: {type(exc).__name__}: {exc}")
            return
        fields: dict[str, Any] = {
            **self.fields,
            "roster": encode_roster(roster),
            "world_size": ranks[-1] + 1,
            "digest": plan.digest,
            "layout_version": "",
        }
        for p, rank in zip(workers, ranks, strict=True):
            self.coord.welcome_one(p.identity, {**fields, "rank": rank}, encode_half(plan.half(rank)))
        self.admitted.append((workers[0].group, ranks))
        log.info("rollout-sync: admitted engine %d as ranks %s", workers[0].group, list(ranks))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.coord.close()

"""The coordinator's work on trainer rank 0: admit every peer, build the plan, hand out halves.

Runs in a thread beside trainer rank 0's own endpoint (rank 0 is also a peer). The source maps come from
trainer rank 0's hello (every trainer rank builds the same maps from the same layout facts; the others
send only their maps' digest, which must match). Each vLLM worker describes only its own storage, in
engine-local ranks; the coordinator renumbers the parts into global ranks and merges them.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ..errors import PlanMismatchError
from ..handshake import ROLLOUT, TRAINER, Coordinator
from ..layout.combine import alone, merge
from ..layout.maps import TensorMap
from ..planning.plan import Plan
from ..planning.planner import plan_model
from ..planning.policy import ReplicaPolicy
from ..planning.wire import decode_maps, encode_half
from ..transport.groups import connect_store


def maps_digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


@dataclass
class Coordinated:
    plan: Plan
    store: Any  # the group's TCPStore: keep it alive as long as the group lives
    world_size: int


def coordinate(
    coord: Coordinator,
    *,
    policy: ReplicaPolicy = "balanced",
    store_host: str = "127.0.0.1",
    backend: str = "gloo",
    timeout: float = 120.0,
) -> Coordinated:
    """Admit, plan, welcome. On any failure every admitted peer is told why (ABORT) before this raises."""
    try:
        peers = coord.admit()
        trainers = [p for p in peers if p.role == TRAINER]
        first = next(p for p in trainers if p.local_rank == 0)
        expected = maps_digest(first.payload)
        for p in trainers:
            if p.fields.get("maps_digest") != expected:
                raise PlanMismatchError(
                    f"trainer rank {p.local_rank} describes its storage differently from trainer rank 0 "
                    f"(maps digest {str(p.fields.get('maps_digest'))[:12]}, rank 0 has {expected[:12]})"
                )
        sources = decode_maps(first.payload)
        parts: dict[str, list[TensorMap]] = defaultdict(list)
        for p in peers:
            if p.role != ROLLOUT:
                continue
            described, rank = int(p.fields.get("map_rank", p.local_rank)), coord.global_rank(p)
            for m in decode_maps(p.payload):
                if set(m.ranks) != {described}:
                    raise PlanMismatchError(
                        f"{p.name} describes ranks {sorted(m.ranks)} of tensor {m.name!r}; a worker describes "
                        f"its own storage only (rank {described})"
                    )
                parts[m.name].append(alone(m, described, rank))
        targets = [merge(ms) for _, ms in sorted(parts.items())]
        plan = plan_model(sources, targets, policy=policy)
        world = coord.world_size
        store = connect_store(store_host, 0, world, is_master=True, timeout=timeout)
        common = {
            "world_size": world,
            "trainer_ranks": coord.trainer_world,
            "store_host": store_host,
            "store_port": int(store.port),
            "backend": backend,
            "digest": plan.digest,
        }
        replies = {}
        for p in peers:
            rank = coord.global_rank(p)
            replies[p.identity] = ({**common, "rank": rank}, encode_half(plan.half(rank)))
        coord.welcome(replies)
        return Coordinated(plan, store, world)
    except BaseException as exc:
        coord.abort(f"{type(exc).__name__}: {exc}")
        raise

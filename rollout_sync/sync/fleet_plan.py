"""The coordinator's work on trainer rank 0: admit every peer, build the plan, hand out halves.

Runs in a thread beside trainer rank 0's own endpoint (rank 0 is also a peer). The source maps come from
trainer rank 0's hello (every trainer rank builds the same maps from the same layout facts; the others
send only their maps' digest, which must match). Each vLLM worker describes only its own storage, in
engine-local ranks; the coordinator renumbers the parts into global ranks and merges them.

Plans are built once per layout: the layout version is a digest of every side's maps digest (and the
policy); a later handshake in the same process that presents the same version (a reconnect after a failure,
a restarted engine of the same shape) reuses the cached plan, and one whose layout changed builds a new
plan. Every peer's welcome carries the version.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import BackendDeviceError, HandshakeError, PlanMismatchError, UnsupportedLayoutError
from ..handshake import ROLLOUT, TRAINER, Coordinator, PeerInfo
from ..layout.combine import alone, merge
from ..layout.coverage import check_engine_coverage
from ..layout.maps import TensorMap
from ..planning.plan import Plan
from ..planning.planner import plan_model
from ..planning.policy import Balanced, ReplicaPolicy
from ..planning.wire import decode_maps, encode_half
from ..transport.core.groups import connect_store
from ..transport.core.network import is_loopback
from .options import SyncOptions
from .roster import RosterEntry, encode_roster


def maps_digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def layout_version(
    trainer_maps: str,
    workers: Sequence[tuple[int, int, str]],
    policy: object,
    places: Mapping[int, tuple[str, int]] | None = None,
) -> str | None:
    """The version of a sync's layout: a digest of the trainer's maps digest, each worker's (global rank,
    described rank, maps digest), the replica policy and which ranks share a process or a host (``places``:
    rank -> (host, pid); the balanced policy prefers near holders). None for a callable policy (not
    comparable)."""
    if not isinstance(policy, str):
        return None
    text = json.dumps([trainer_maps, sorted(workers), policy, *locality(places or {})], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


BACKEND_DEVICES = {"gloo": "cpu", "nccl": "cuda"}


def check_backend(backend: str, devices: Mapping[str, object], *, ipc: bool = False) -> None:
    """Refuse (``BackendDeviceError``) a backend that cannot carry a peer's storage device (``devices``:
    peer name -> the device type its hello reported; peers that report none are not checked). ``ipc``:
    every rank is on one host and syncs may map each other's storages (``shared_memory``, no delta); then
    gloo also takes a group whose every rank holds CUDA storages, as a trainer and a vLLM engine sharing a
    GPU (NCCL cannot put two ranks on one device): their bytes move through CUDA IPC handles and only tables
    and signals cross gloo. A pair that does not map is refused at the first sync
    (``SameHostPairs.refuse_unmapped``), before any byte moves."""
    if backend == "nixl":  # group-free reads (``sync.nixl_endpoint``): host memory, or GPU memory (untested)
        return
    want = BACKEND_DEVICES.get(backend)
    if want is None:
        raise BackendDeviceError(f"backend {backend!r} is not one of {sorted([*BACKEND_DEVICES, 'nixl'])}")
    if backend == "gloo" and ipc and devices and all(d == "cuda" for d in devices.values()):
        return
    wrong = {name: d for name, d in devices.items() if d is not None and d != want}
    if wrong:
        listed = ", ".join(f"{name} holds {d} storages" for name, d in sorted(wrong.items()))
        fits = {d: b for b, d in BACKEND_DEVICES.items()}
        hint = "; ".join(
            f"{d}: backend {fits[str(d)]!r}" for d in sorted({str(d) for d in wrong.values()}) if d in fits
        )
        raise BackendDeviceError(
            f"the sync group's backend {backend!r} carries {want} tensors only: {listed}"
            + (f" (use {hint})" if hint else "")
        )


def check_reachable(roster: Sequence[RosterEntry], peers: Sequence[PeerInfo], address: str) -> None:
    """Refuse (``HandshakeError``, before the group is built) a rank whose group connections would listen
    on a loopback address while a peer of the group sits in another network namespace or on another host:
    that peer would be refused and wait. A rank binds its route to the coordinator, so this happens when
    the coordinator is named by a loopback address (``tcp://127.0.0.1:...``, or a hostname that resolves
    to one) on a host that not every peer shares."""
    networks = {e.rank: str(p.fields.get("network", "")) for e, p in zip(roster, peers, strict=True)}
    for e, p in zip(roster, peers, strict=True):
        bind = str(p.fields.get("bind", ""))
        if not is_loopback(bind):
            continue
        mine = networks[e.rank]
        away = [o for o in roster if mine and networks[o.rank] and networks[o.rank] != mine]
        if away:
            others = ", ".join(f"{o.role} ({o.host})" for o in away[:4]) + (", ..." if len(away) > 4 else "")
            raise HandshakeError(
                f"{e.role} on {e.host} reaches the coordinator {address} over loopback ({bind}), so its sync "
                f"connections would listen on loopback, but {others} run on another host or network "
                "namespace and could not connect: name the coordinator by an address every host reaches "
                "(its hostname or its IP on the shared network), on every rank"
            )


def check_group_free(roster: Sequence[RosterEntry], peers: Sequence[PeerInfo], delta: bool) -> dict[str, Any]:
    """What the workers of a group-free sync (backend ``nixl``) are told of each trainer rank (its agent's
    metadata, the addresses of its storages and of its state), by global rank; refuses (``HandshakeError``,
    before any byte moves) what it cannot do: two ranks in one process, a trainer rank without a NIXL agent,
    delta syncs with a trainer rank that has no export to code them into."""
    places: dict[tuple[str, int], RosterEntry] = {}
    for e in roster:
        if e.machine and (e.machine, e.pid) in places:
            other = places[(e.machine, e.pid)]
            raise HandshakeError(
                f"{e.role} and {other.role} run in one process (pid {e.pid} on {e.host}): the 'nixl' backend "
                "reads across processes only; use backend 'gloo' for a colocated engine"
            )
        places[(e.machine, e.pid)] = e
    out: dict[str, Any] = {}
    for e, p in zip(roster, peers, strict=True):
        if p.role != TRAINER:
            continue
        info = p.fields.get("nixl")
        if not isinstance(info, dict) or not info.get("metadata"):
            raise HandshakeError(
                f"{e.role} on {e.host} did not start a NIXL agent, and the backend is 'nixl'"
            )
        if delta and "export" not in info:
            raise HandshakeError(
                f"{e.role} on {e.host} has no delta export, and delta syncs were asked for: attach every "
                "trainer rank with delta=True"
            )
        out[str(e.rank)] = info
    return out


def check_adapters(roster: Sequence[RosterEntry], peers: Sequence[PeerInfo]) -> None:
    """An adapter sync reaches workers that serve that adapter: the LoRA rank and scaling the trainer trains
    (``hello`` field ``adapter``) must be what every worker's slot was set up with, and a worker whose
    targets are the model's weights takes no adapter (nor the reverse). Raised on every rank through the
    coordinator's abort, before anything moves."""
    trainer = next((p.fields.get("adapter") or None for p in peers if p.role == TRAINER), None)
    for e, p in zip(roster, peers, strict=True):
        if p.role != ROLLOUT:
            continue
        found = p.fields.get("adapter") or None
        if found != trainer:
            raise UnsupportedLayoutError(
                "a worker is set up for another LoRA adapter than the trainer syncs (setup_engines(lora=...) "
                "must name the trainer's rank and scaling; None: the model's weights)",
                rank=e.rank,
                expected=trainer,
                found=found,
            )


def entry_of(p: PeerInfo, rank: int) -> RosterEntry:
    """A peer's roster entry, from its hello."""
    return RosterEntry(
        rank,
        None if p.role == TRAINER else p.group,
        p.local_rank,
        str(p.fields.get("host", "")),
        int(p.fields.get("pid", 0) or 0),
        str(p.fields.get("machine", "")),
        str(p.fields.get("bind", "")),
    )


def plan_engines(
    trainer_maps: bytes,
    workers: Sequence[tuple[PeerInfo, int]],
    roster: Sequence[RosterEntry],
    policy: ReplicaPolicy,
) -> Plan:
    """The plan from the trainer's maps (trainer rank 0's hello payload) to the workers' storages (each
    worker's hello and its global rank); every engine in ``roster`` must hold every element of every tensor
    it takes."""
    sources = decode_maps(trainer_maps)
    parts: dict[str, list[TensorMap]] = defaultdict(list)
    for p, rank in workers:
        described = int(p.fields.get("map_rank", p.local_rank))
        for m in decode_maps(p.payload):
            if set(m.ranks) != {described}:
                raise PlanMismatchError(
                    f"{p.name} describes ranks {sorted(m.ranks)} of tensor {m.name!r}; a worker "
                    f"describes its own storage only (rank {described})"
                )
            parts[m.name].append(alone(m, described, rank))
    targets = [merge(ms) for _, ms in sorted(parts.items())]
    engines: dict[int, list[int]] = defaultdict(list)
    for e in roster:
        if e.engine is not None:
            engines[e.engine].append(e.rank)
    # every engine holds every element of every tensor it takes, exactly once: nothing stays stale
    check_engine_coverage({m.name: m for m in targets}, [sorted(r) for _, r in sorted(engines.items())])
    return plan_model(sources, targets, policy=policy)


def locality(places: Mapping[int, tuple[str, int]]) -> tuple[list[list[int]], list[list[int]]]:
    """The ranks that share a process, and those that share a host (groups of two or more, sorted): what
    the plan depends on, not the pids themselves."""
    by_process: dict[tuple[str, int], list[int]] = defaultdict(list)
    by_host: dict[str, list[int]] = defaultdict(list)
    for rank, (host, pid) in places.items():
        by_process[(host, pid)].append(rank)
        by_host[host].append(rank)
    groups = lambda d: sorted(sorted(g) for g in d.values() if len(g) > 1)  # noqa: E731
    return groups(by_process), groups(by_host)


class PlanCache:
    """Plans by layout version. A new handshake that presents the same layout (a reconnect, a restarted
    engine of the same shape) reuses the plan; a changed layout (any map digest differs) builds a new one."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._plans: OrderedDict[str, Plan] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get_or_build(self, version: str | None, build: Callable[[], Plan]) -> tuple[Plan, bool]:
        """The plan for ``version`` and whether it was reused."""
        if version is not None and version in self._plans:
            self._plans.move_to_end(version)
            self.hits += 1
            return self._plans[version], True
        plan = build()
        self.misses += 1
        if version is not None:
            self._plans[version] = plan
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
        return plan, False


DEFAULT_PLAN_CACHE = PlanCache()


@dataclass
class Coordinated:
    plan: Plan
    store: Any  # the group's TCPStore: keep it alive as long as the group lives
    world_size: int
    layout_version: str | None = None
    reused_plan: bool = False
    trainer_maps: bytes = b""  # trainer rank 0's maps (what an admission desk plans new engines from)
    roster: tuple[RosterEntry, ...] = ()
    welcome: dict[str, Any] = field(default_factory=dict)  # the fields every welcome had (rank aside)


def coordinate(
    coord: Coordinator,
    options: SyncOptions | None = None,
    *,
    cache: PlanCache | None = DEFAULT_PLAN_CACHE,
) -> Coordinated:
    """Admit, plan (or reuse the cached plan of the same layout version), welcome. On any failure every
    admitted peer is told why (ABORT) before this raises. ``options`` (``SyncOptions``): the policy, the
    backend, the timeout; ``shared_memory`` and ``delta``, which every rank is told."""
    opts = options if options is not None else SyncOptions()
    policy, backend, timeout = opts.policy, opts.backend, opts.timeout
    shared_memory, delta = opts.shared_memory, opts.delta
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
        roster = [entry_of(p, coord.global_rank(p)) for p in peers]
        check_reachable(roster, peers, coord.address)
        check_adapters(roster, peers)
        one_host = len({e.machine for e in roster}) == 1 and all(e.machine for e in roster)
        check_backend(
            backend,
            {e.role: p.fields.get("device") for e, p in zip(roster, peers, strict=True)},
            ipc=shared_memory and not delta and one_host,
        )
        rollout = [p for p in peers if p.role == ROLLOUT]
        places = {e.rank: (e.machine, e.pid) for e in roster if e.machine}
        if policy == "balanced":  # nearest holders first (a colocated trainer rank copies in its own process)
            policy_used: ReplicaPolicy = Balanced(places)
        else:
            policy_used = policy
        version = layout_version(
            expected,
            [
                (coord.global_rank(p), int(p.fields.get("map_rank", p.local_rank)), maps_digest(p.payload))
                for p in rollout
            ],
            policy,
            places,
        )

        def build() -> Plan:
            return plan_engines(
                first.payload, [(p, coord.global_rank(p)) for p in rollout], roster, policy_used
            )

        nixl_sources = check_group_free(roster, peers, delta) if backend == "nixl" else {}
        plan, reused = cache.get_or_build(version, build) if cache is not None else (build(), False)
        world = coord.world_size
        # the store listens on every interface; each peer reaches it as it reached the coordinator
        store = (
            None
            if backend == "nixl"
            else connect_store(coord.host, 0, world, is_master=True, timeout=timeout)
        )
        common = {
            "group_id": secrets.token_hex(8),  # names this group in ranks' in-process mailboxes
            "roster": encode_roster(roster),
            "world_size": world,
            "trainer_ranks": coord.trainer_world,
            "store_port": 0 if store is None else int(store.port),
            "backend": backend,
            "shared_memory": shared_memory,
            "delta": delta,
            "digest": plan.digest,
            "layout_version": version or "",
        }
        replies = {}
        for p in peers:
            rank = coord.global_rank(p)
            more = {"nixl_sources": nixl_sources} if nixl_sources and p.role == ROLLOUT else {}
            replies[p.identity] = ({**common, **more, "rank": rank}, encode_half(plan.half(rank)))
        coord.welcome(replies)
        return Coordinated(
            plan,
            store,
            world,
            version,
            reused,
            first.payload,
            tuple(roster),
            {**common, **({"nixl_sources": nixl_sources} if nixl_sources else {})},
        )
    except BaseException as exc:
        coord.abort(f"{type(exc).__name__}: {exc}")
        raise

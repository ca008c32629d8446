"""One rank's membership of the sync group, on either side.

``Endpoint.join`` runs the peer side of the handshake (hello with this rank's maps, welcome with its global
rank, the group's address and its half of the plan), joins the process group and says ready. After that,
``Endpoint.run`` executes the half at every sync and commits: every rank learns whether every other rank
completed, and the weight version the trainer sent.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import HandshakeError, PeerFailedError, PlanMismatchError, RolloutSyncError, SyncTimeoutError
from ..handshake import Peer
from ..planning.half import PlanHalf
from ..planning.wire import decode_half
from ..transport import ExecuteOptions, Executor, SyncStats
from ..transport.core.groups import connect_store, new_group
from ..transport.core.in_process import InProcess
from ..transport.core.network import route_source, split_address
from ..transport.core.target_streams import TargetStream
from ..transport.same_host.shared_memory import SameHost
from .commit import commit
from .nixl_endpoint import NixlSource
from .nixl_pull import PullEndpoint
from .nixl_source import SourceEndpoint
from .roster import RosterEntry, blame, decode_roster, in_process_peers, same_host_peers, this_process

TOKEN_ENV = "ROLLOUT_SYNC_TOKEN"
FAILURE_NOTICE_AFTER_TIMEOUT_S = 1.0
"""How long a rank whose wait timed out spends telling its peers, before it raises."""


def resolve_token(token: str | None) -> str:
    """The shared token: the argument, else the ``ROLLOUT_SYNC_TOKEN`` environment variable."""
    import os

    token = token or os.environ.get(TOKEN_ENV, "")
    if not token:
        raise HandshakeError(f"a shared token is required: pass token=... or set {TOKEN_ENV}")
    return token


@dataclass(frozen=True)
class SyncResult:
    version: int
    stats: SyncStats
    seconds: float
    dropped: tuple[str, ...] = ()
    """A trainer rank of a group-free sync (``nixl``): the workers it dropped in this sync, each named with why
    (the sync completed for the others)."""


class Endpoint:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        trainer_ranks: int,
        group: Any,
        half: PlanHalf,
        options: ExecuteOptions,
        device: Any = "cpu",
        roster: Mapping[int, RosterEntry] | None = None,
        group_id: str = "",
    ) -> None:
        self.rank = rank
        self.roster = dict(roster or {})
        self.closed = False
        self.world_size = world_size
        self.trainer_ranks = trainer_ranks
        self.group = group
        self.half = half
        self.options = options
        self.device = device
        self.in_process = in_process_peers(rank, self.roster)
        self.local = InProcess(group_id, rank, self.in_process) if self.in_process else None
        same_host = same_host_peers(rank, self.roster)
        self.same_host = SameHost(group_id, rank, same_host) if same_host and group_id else None
        self.executor = Executor(group, options, self.local, self.same_host)

    @classmethod
    def join(
        cls,
        address: str,
        *,
        token: str,
        role: str,
        group: int,
        local_rank: int,
        local_size: int,
        payload: bytes,
        fields: Mapping[str, Any] | None = None,
        timeout: float = 120.0,
        options: ExecuteOptions | None = None,
        nixl_source: NixlSource | None = None,
    ) -> Endpoint | SourceEndpoint | PullEndpoint:
        """Join through the handshake at ``address``. ``nixl_source``: a trainer rank's registered storages
        for a group-free sync (``sync.nixl_endpoint``; the coordinator's backend is then ``nixl``): the
        welcome then builds no group, and this returns a ``SourceEndpoint`` (a worker: a ``PullEndpoint``)."""
        host, port = split_address(address)
        bind = route_source(host, port)  # the local address that reaches the coordinator: the group binds it
        peer = Peer(address, token=token, timeout=timeout)
        extra = nixl_source.fields() if nixl_source is not None else {}
        try:
            welcome = peer.hello(
                role=role,
                group=group,
                local_rank=local_rank,
                local_size=local_size,
                fields={**this_process(), "bind": bind, **dict(fields or {}), **extra},
                payload=payload,
            )
            f = welcome.fields
            rank, world, trainers = int(f["rank"]), int(f["world_size"]), int(f["trainer_ranks"])
            half = decode_half(welcome.payload)
            if half.digest != f["digest"] or half.rank != rank:
                peer.failed(f"rank {rank}: the half received does not belong to plan {f['digest'][:12]}")
                raise PlanMismatchError(
                    f"rank {rank}: received the half of rank {half.rank} of plan {half.digest[:12]}, "
                    f"expected rank {rank} of plan {str(f['digest'])[:12]}"
                )
            if f["backend"] == "nixl":
                return cls._join_without_group(peer, f, half, bind, timeout, options, nixl_source)
            try:
                # the store runs beside the coordinator, on every interface: reached as the coordinator is
                store = connect_store(host, int(f["store_port"]), world, is_master=False, timeout=timeout)
                pg = new_group(store, rank, world, backend=str(f["backend"]), timeout=timeout, bind=bind)
            except Exception as exc:
                peer.failed(f"rank {rank} could not join the sync group: {exc}")
                raise
            peer.ready()
        finally:
            peer.close()
        device = torch.device("cuda", torch.cuda.current_device()) if f["backend"] == "nccl" else "cpu"
        return cls(
            rank=rank,
            world_size=world,
            trainer_ranks=trainers,
            group=pg,
            half=half,
            # the coordinator's choice, the same for every rank (agreed again at every sync)
            options=replace(
                options or ExecuteOptions(timeout=timeout),
                shared_memory=bool(f.get("shared_memory", True)),
                delta=bool(f.get("delta", False)),
            ),
            device=device,
            roster=decode_roster(f.get("roster")),
            group_id=str(f.get("group_id", "")),
        )

    @staticmethod
    def _join_without_group(
        peer: Peer,
        f: Mapping[str, Any],
        half: PlanHalf,
        bind: str,
        timeout: float,
        options: ExecuteOptions | None,
        nixl_source: NixlSource | None,
    ) -> SourceEndpoint | PullEndpoint:
        rank = int(f["rank"])
        common = {
            "rank": rank,
            "world_size": int(f["world_size"]),
            "trainer_ranks": int(f["trainer_ranks"]),
            "half": half,
            "options": replace(options or ExecuteOptions(timeout=timeout), delta=bool(f.get("delta", False))),
            "roster": decode_roster(f.get("roster")),
        }
        try:
            side: SourceEndpoint | PullEndpoint
            if nixl_source is not None:
                side = SourceEndpoint(nixl_source, group_id=str(f["group_id"]), **common)
            else:
                side = PullEndpoint(
                    group_id=str(f["group_id"]), sources=f["nixl_sources"], bind=bind, **common
                )
        except Exception as exc:
            peer.failed(f"rank {rank} could not start its NIXL agent: {exc}")
            raise
        peer.ready()
        return side

    def forget_base(self) -> None:
        """Something other than a sync wrote this rank's storages: the next sync is a full one."""
        self.executor.forget_base()

    def close(self) -> None:
        """Leave the sync group: shut this rank's side of the group down and drop it (its connections and
        the store it keeps alive). Idempotent; a later ``run`` raises. After a failed sync the group may be
        broken (a dead peer, connections gloo closed on a timeout): close it, then join a new one.

        Only destroying the group object closes its connections: gloo's ``shutdown`` and ``abort`` leave
        them open, and a message that arrives later for a receive this rank no longer waits for (a late
        peer's commit record, say) is never read, so gloo's event loop spins a core on it for as long as
        the group lives (measured: 100 % of a core in a vLLM worker, starving the engine beside it). So
        the group must have no other owner when this returns; ``_leave`` frees the frames of a failed sync
        that still hold it."""
        if self.closed:
            return
        self.closed = True
        if self.local is not None:
            self.local.leave("its endpoint closed")
        if self.executor is not None:
            self.executor.close()  # the shared segments it made
        group, self.group = self.group, None
        self.executor = None  # type: ignore[assignment]
        # NCCL: abort (a shutdown may wait on a dead peer); gloo: shutdown (both return at once there).
        stop = getattr(group, "abort" if self.is_nccl else "shutdown", None)
        if callable(stop):
            with contextlib.suppress(Exception):
                stop()
        del group  # the last reference: the group's connections close and its event loop ends

    def _leave(self, exc: BaseException) -> None:
        """Close after a failed sync. The frames of the failure (executor, transport, posted messages)
        still reference the group through ``exc``'s traceback, and the exception about to be raised forms a
        reference cycle with them that only a full garbage collection would free: clear their locals
        first (the traceback keeps file, line and function), so that ``close`` destroys the group now."""
        traceback.clear_frames(exc.__traceback__)
        self.close()

    @property
    def is_nccl(self) -> bool:
        return str(self.device).startswith("cuda")

    def _named(self, exc: BaseException) -> BaseException | None:
        """``exc`` again with the peers at fault named (``roster.blame``), or None if nothing to add."""
        sentence = blame(str(exc), self.rank, self.roster)
        if not sentence:
            return None
        cls = type(exc) if isinstance(exc, (PeerFailedError, SyncTimeoutError)) else PeerFailedError
        return cls(f"{exc} [{sentence}]")

    def run(
        self,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        version: int = -1,
        refusal: str | None = None,
        stream: TargetStream | None = None,
    ) -> SyncResult:
        """Execute this rank's half, then commit. Returns the version the trainer ranks sent; raises on every
        rank if any rank failed (a rank whose agreement refused the plan raises the same error everywhere).
        A transport or commit failure names the peers at fault (``roster.blame``) and closes this endpoint:
        its group cannot be trusted after it (and gloo's connection loop to a dead peer was seen spinning a
        core in a vLLM worker, starving the engine sharing that core); join again through a new handshake.
        ``refusal``: why this rank must not send (its storage views are stale); every rank then raises a
        ``PlanMismatchError`` naming it, at the agreement, before any byte moves. ``stream``: makes the
        targets given as meta tensors while they are written (``transport.full_transfer``)."""
        if self.closed:
            raise PeerFailedError(
                f"rank {self.rank}: this endpoint left its sync group (a failed sync or a detach closed it); "
                "join again through a new handshake"
            )
        start = time.perf_counter()
        try:
            stats = self.executor.execute(self.half, sources, targets, refusal, stream)
        except PlanMismatchError:
            raise  # raised on every rank by the agreement: no commit follows
        except (RolloutSyncError, RuntimeError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            # NCCL: a failed or timed-out operation may have aborted the communicator (its watchdog does
            # on a timeout), and a collective over an aborted communicator hangs or crashes the process:
            # no failure commit there; the group is aborted below and every other rank's own wait fails.
            # gloo: the failure commit tells the peers why, within 10 s; after a wait that timed out, within
            # FAILURE_NOTICE_AFTER_TIMEOUT_S: the peer it waited for is dead, stalled or cut off, and those
            # still waiting time out on their own, so the failure surfaces within the timeout, not after it.
            if not self.is_nccl:
                with contextlib.suppress(RolloutSyncError):
                    commit(
                        self.group,
                        rank=self.rank,
                        world=self.world_size,
                        trainer_ranks=self.trainer_ranks,
                        version=version,
                        ok=False,
                        reason=reason,
                        timeout=min(
                            self.options.timeout,
                            FAILURE_NOTICE_AFTER_TIMEOUT_S if isinstance(exc, SyncTimeoutError) else 10.0,
                        ),
                        device=self.device,
                    )
            named = self._named(exc)
            self._leave(exc)
            if named is not None:
                raise named from exc
            raise
        try:
            agreed = commit(
                self.group,
                rank=self.rank,
                world=self.world_size,
                trainer_ranks=self.trainer_ranks,
                version=version,
                ok=True,
                timeout=self.options.timeout,
                device=self.device,
            )
        except (PeerFailedError, SyncTimeoutError) as exc:
            named = self._named(exc)
            self._leave(exc)
            if named is not None:
                raise named from exc
            raise
        self.executor.committed(agreed)
        return SyncResult(agreed, stats, time.perf_counter() - start)

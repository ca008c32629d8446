"""The rollout side's link to the sync group, independent of vLLM.

A vLLM worker describes its own storage (maps in engine-local ranks: the worker's TP rank), connects
through the handshake, and at each sync receives its half into the storage views it is handed. The vLLM
worker extension wraps this with vLLM's parts: probing the loaders for the maps, opening an update (the
views to receive into), refreshing derived copies after the write.

A sync that fails leaves ``incomplete`` set and ``version`` unchanged: the worker never claims a version
it did not fully receive. The next successful sync clears ``incomplete``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..handshake import ROLLOUT
from ..layout.maps import TensorMap
from ..planning.wire import encode_maps
from ..sync.endpoint import Endpoint, SyncResult, resolve_token
from ..sync.nixl_pull import PullEndpoint
from ..sync.nixl_source import SourceEndpoint
from ..sync.options import SyncOptions
from ..transport import ExecuteOptions
from ..transport.core.target_streams import TargetStream
from .delta_base import DeltaBase


class RolloutLink:
    def __init__(
        self,
        endpoint: Endpoint | SourceEndpoint | PullEndpoint,
        engine: int,
        local_rank: int,
        atomic: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.atomic = atomic  # the owner keeps every old weight when a sync fails (``UpdateSession``)
        self.engine = engine
        self.local_rank = local_rank
        self.version: int | None = None
        self.incomplete = False
        self.last_error: str | None = None
        self.base = DeltaBase()  # may the next sync apply on what the last one left (``rollout.delta_base``)
        half = endpoint.half
        self.target_names: tuple[str, ...] = tuple(
            sorted({half.tensors[s.tensor].name for s in (*half.receives, *half.local)})
        )

    @classmethod
    def connect(
        cls,
        address: str,
        *,
        engine: int,
        local_rank: int,
        local_size: int,
        maps: Sequence[TensorMap],
        map_rank: int | None = None,
        token: str | None = None,
        timeout: float = SyncOptions.timeout,
        staging_cap_bytes: int = SyncOptions.staging_cap_bytes,
        device: str | None = None,
        atomic: bool = False,
        adapter: Mapping[str, Any] | None = None,
    ) -> RolloutLink:
        """Join the handshake as worker ``local_rank`` of engine ``engine``. ``maps`` describe this worker's
        storage alone, under rank ``map_rank`` (default ``local_rank``); the coordinator renumbers it to the
        worker's global rank. ``device``: the device type of its storages (the coordinator checks the
        group's backend carries it). ``atomic``: the owner writes a sync into its weights only once it
        committed (``rollout.update.UpdateSession``). ``adapter``: the LoRA adapter this worker's maps are
        the A and B of (``rank``, ``scaling``), checked against the trainer's at the handshake."""
        map_rank = local_rank if map_rank is None else map_rank
        for m in maps:
            if set(m.ranks) - {map_rank}:
                raise ValueError(
                    f"map {m.name!r} describes ranks {sorted(m.ranks)}; a worker describes only itself "
                    f"(rank {map_rank})"
                )
        endpoint = Endpoint.join(
            address,
            token=resolve_token(token),
            role=ROLLOUT,
            group=engine,
            local_rank=local_rank,
            local_size=local_size,
            payload=encode_maps(list(maps)),
            fields={"map_rank": map_rank, "device": device, "adapter": dict(adapter) if adapter else None},
            timeout=timeout,
            options=ExecuteOptions(staging_cap_bytes=staging_cap_bytes, timeout=timeout),
        )
        return cls(endpoint, engine, local_rank, atomic)

    @property
    def rank(self) -> int:
        return self.endpoint.rank

    @property
    def delta(self) -> bool:
        """Whether this group's syncs after a committed one send only what changed (the trainer's choice,
        told to every rank at the handshake)."""
        return self.endpoint.options.delta

    def forget_base(self) -> None:
        """The targets were written by something other than a sync, or do not outlive one: the next sync
        is a full one (a delta sync applies only on the values the last sync left)."""
        self.endpoint.forget_base()

    def receive(self, targets: Mapping[str, torch.Tensor], stream: TargetStream | None = None) -> SyncResult:
        """Receive this worker's half into ``targets`` (storage views by logical name; meta tensors for
        those ``stream`` makes while they are written) and commit."""
        self.incomplete = True
        try:
            result = self.endpoint.run({}, targets, stream=stream)
        except BaseException as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            raise
        self.incomplete = False
        self.last_error = None
        self.version = result.version
        return result

    def status(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "engine": self.engine,
            "local_rank": self.local_rank,
            "version": self.version,
            "incomplete": self.incomplete,
            "last_error": self.last_error,
            "atomic": self.atomic,
        }

"""The trainer hook: attach rollout-sync to a DeepSpeed engine in a few lines.

    sync = TrainerSync.attach(engine, address="tcp://127.0.0.1:29700", engines=1, token=...)
    ...
    engine.backward(loss); engine.step()      # syncs after each applied optimizer step
    sync.sync()                               # or explicitly

Every trainer rank calls ``attach`` (collectively with the rollout side's connect). Trainer rank 0 also
runs the coordinator, bound to the address's host and port (loopback unless told otherwise). Each rank
describes its storage with ``rollout_sync.trainer.trainer_storage`` (no collective), joins the handshake,
and keeps the views of DeepSpeed's own buffers: a sync reads the buffers the engine trains, in place.

Before every sync each rank checks that DeepSpeed still holds the buffers its views alias (a few
microseconds per buffer, no collective; ``rollout_sync.trainer.fresh_views``). After ``engine.load_checkpoint``
(which replaces the Adam states) or anything else that replaces a buffer, the views are re-derived when the
layout is unchanged; otherwise every rank refuses the sync and this rank raises ``StaleStorageError``:
re-attach.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import HandshakeError, PlanMismatchError, SyncTimeoutError
from ..handshake import TRAINER, Coordinator
from ..layout.maps import TensorMap
from ..planning.wire import encode_maps
from ..sync.admission import AdmissionDesk
from ..sync.endpoint import Endpoint, SyncResult, resolve_token
from ..sync.fleet_plan import Coordinated, coordinate, maps_digest
from ..sync.nixl_endpoint import NixlSource
from ..sync.nixl_pull import PullEndpoint
from ..sync.nixl_source import SourceEndpoint
from ..sync.options import SyncOptions
from ..sync.roster import device_kind
from ..transport.core.network import route_source, split_address
from .adapter import adapter_storage, peft_adapter
from .fresh_views import FreshViews
from .merged import MergedSources, merged_storage
from .step_hook import StepHook


class TrainerSync:
    def __init__(
        self,
        engine: Any,
        endpoint: Endpoint | SourceEndpoint | PullEndpoint,
        sources: dict[str, Any],
        coordinated: Coordinated | None,
    ):
        self.engine = engine
        self.endpoint = endpoint
        self.sources = sources
        self.coordinated = coordinated
        self.views = FreshViews(sources, None, "", None, endpoint.rank)
        self.hook: StepHook | None = None
        self.desk: AdmissionDesk | None = None  # trainer rank 0 of a group-free sync: admits engines any time
        self.last: SyncResult | None = None
        self.history: list[SyncResult] = []
        self.merged: MergedSources | None = None  # a merged LoRA sync: refreshed before each sync

    @classmethod
    def attach(
        cls,
        engine: Any,
        *,
        address: str,
        engines: int,
        token: str | None = None,
        every: int | None = 1,
        state: str = "param",
        lora: str = "adapter",
        options: SyncOptions | None = None,
        **overrides: Any,
    ) -> TrainerSync:
        """Join the sync group with a live DeepSpeed engine. ``options`` (``SyncOptions``; or its fields as
        keywords: ``timeout``, ``staging_cap_bytes``, ``shared_memory``, ``delta``, ``backend``, ``policy``):
        the sync's options, decided by trainer rank 0 for the whole group. ``engines``: how many vLLM engines take part;
        ``every``: sync after every N-th applied optimizer step (``None``: only explicit ``sync()`` calls);
        ``state``: which trainer state to send (``param`` for the low-precision weights, ``fp32`` for the
        master weights); ``shared_memory``: ranks on one host in other processes move bytes through shared
        memory instead of gloo (CPU; decided by trainer rank 0 for the whole group): each vLLM worker maps
        the storages this rank sends from, which move into shared memory in place at the first sync
        (``transport.mapped``); ``delta``: after a sync
        every rank committed, send only the elements that changed (``transport.delta``; each trainer rank
        keeps a copy of what it sent, ``SyncStats.delta_state_bytes``; decided by trainer rank 0). A PEFT
        LoRA model (``engine.module.peft_config``) syncs, with ``lora="adapter"`` (default), only its adapter's
        A and B, into a LoRA slot of engines set up with ``setup_engines(..., lora=...)``
        (``trainer.adapter``); with ``lora="merged"``, its base weights merged with the adapter, into engines
        without LoRA (``trainer.merged``: each rank merges the base storage it holds; nothing is gathered
        but A and B)."""
        import torch.distributed as dist

        from .storage import watched_storage

        opts = SyncOptions.of(options, **overrides)

        # allow_gathered: after a training step ZeRO-3 keeps persistent parameters gathered; the maps and
        # views describe the partitions (ds_tensor) either way. A re-attach of a trained engine (after a
        # failed sync, a restarted engine) must not be refused for it.
        adapter = peft_adapter(engine)
        if lora not in ("adapter", "merged"):
            raise ValueError(f"lora must be 'adapter' or 'merged', found {lora!r}")

        def described() -> tuple[list[TensorMap], dict[str, Any], Any]:
            (m, v), w = watched_storage(engine, state, allow_gathered=True)
            if adapter is not None and lora == "adapter":  # the adapter's A and B only (trainer.adapter)
                m, v = adapter_storage(m, v, adapter.adapter)
            elif adapter is not None:  # the base weights, merged with the adapter (trainer.merged)
                m, v = merged_storage(m, v)
            return m, v, w

        maps, sources, watch = described()
        merged = None
        if adapter is not None and lora == "merged":
            merged = MergedSources(engine.module, maps, sources, adapter, dist.get_rank())
        self = cls.connect(
            maps,
            sources,
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            address=address,
            engines=engines,
            token=token,
            engine=engine,
            options=opts,
            adapter=None
            if adapter is None or merged is not None
            else {"rank": adapter.rank, "scaling": adapter.scaling},
        )
        self.merged = merged

        # Persistent ZeRO-3 parameters stay gathered between steps; the views are of the partitions.
        self.views = FreshViews(
            sources, watch, maps_digest(encode_maps(list(maps))), described, dist.get_rank()
        )
        if every is not None:
            self.hook = StepHook(engine, self._after_step, every=every)
        return self

    @classmethod
    def connect(
        cls,
        maps: Sequence[TensorMap],
        sources: dict[str, Any],
        *,
        rank: int,
        world_size: int,
        address: str,
        engines: int,
        token: str | None = None,
        engine: Any = None,
        adapter: Mapping[str, Any] | None = None,
        options: SyncOptions | None = None,
        **overrides: Any,
    ) -> TrainerSync:
        """Join the sync group as trainer rank ``rank`` of ``world_size``, with maps of every trainer rank
        (the same on every rank) and this rank's storage views. Trainer rank 0 also runs the coordinator.
        ``options``: as ``attach``'s."""
        opts = SyncOptions.of(options, **overrides)
        timeout, backend = opts.timeout, opts.backend
        token = resolve_token(token)
        host, port = split_address(address)
        payload = encode_maps(list(maps))
        coordinated: dict[str, Any] = {}
        thread = None
        if rank == 0:
            coord = Coordinator(
                token=token, trainer_world=world_size, engines=engines, host=host, port=port, timeout=timeout
            )

            def serve() -> None:
                try:
                    coordinated["value"] = coordinate(coord, opts)
                except BaseException as exc:
                    coordinated["error"] = exc
                finally:
                    if backend != "nixl" or "error" in coordinated:
                        coord.close()  # group-free: it stays open as the admission desk

            thread = threading.Thread(target=serve, name="rollout-sync-coordinator", daemon=True)
            thread.start()
        nixl_source = None
        if backend == "nixl":  # group-free: workers read this rank's registered storages (sync.nixl_endpoint)
            # delta: what changed is coded into an export of at most the staging cap (else a full sync)
            export = opts.staging_cap_bytes if opts.delta else 0
            nixl_source = NixlSource(sources, route_source(host, port), export_bytes=export)
        try:
            endpoint = Endpoint.join(
                address,
                token=token,
                role=TRAINER,
                group=0,
                local_rank=rank,
                local_size=world_size,
                payload=payload if rank == 0 else b"",
                fields={
                    "maps_digest": maps_digest(payload),
                    "device": device_kind(sources.values()),
                    "adapter": dict(adapter) if adapter else None,
                },
                timeout=timeout,
                options=opts.execute_options(),
                nixl_source=nixl_source,
            )
        except (HandshakeError, SyncTimeoutError) as exc:
            if nixl_source is not None:
                nixl_source.close()
            if thread is not None:
                thread.join(timeout)
                if "error" in coordinated:
                    raise coordinated["error"] from exc
            raise
        desk = None
        if thread is not None:
            thread.join(timeout)
            if "error" in coordinated:
                raise coordinated["error"]
            if backend == "nixl":  # engines that start later, or restart, join here at any time
                desk = AdmissionDesk(coord, coordinated["value"], policy=opts.policy, timeout=timeout)
        self = cls(engine, endpoint, sources, coordinated.get("value"))
        self.desk = desk
        return self

    def _after_step(self, version: int) -> None:
        self.sync(version)

    def sync(self, version: int | None = None) -> SyncResult:
        """Send this rank's half now; returns once every rank of the group has committed the sync. Raises
        ``StaleStorageError`` (on the rank that found it; ``PlanMismatchError`` naming it on every other
        rank) when DeepSpeed replaced a buffer and the views cannot be re-derived under the plan's maps."""
        if version is None:
            version = int(getattr(self.engine, "global_steps", 0))
        stale = self.views.check()
        if self.views.sources is not self.sources:
            self.sources = dict(self.views.sources)  # re-derived views (same maps)
        sources = self.sources if self.merged is None else self.merged.refresh(self.sources)
        try:
            result = self.endpoint.run(sources, {}, version, None if stale is None else str(stale))
        except PlanMismatchError as exc:
            if stale is not None:
                raise stale from exc
            raise
        self.last = result
        self.history.append(result)
        return result

    def save_reference(self, model_dir: str, out: str) -> str | None:
        """Write the trainer's current weights as a checkpoint at ``out``, gathered by DeepSpeed's own
        collectives (not through rollout-sync's maps), with ``model_dir``'s config and tokenizer files; a
        PEFT model is merged by PEFT itself first. Written into vLLM (``rollout_sync_apply_checkpoint``), it
        changes no bit of any parameter after an exact sync: the check of a sync. Collective: every rank
        calls it; rank 0 writes and gets the path, the others None. Slow next to a sync (whole tensors)."""
        import torch.distributed as dist

        from .reference import full_logical_tensors, save_checkpoint, save_merged

        if getattr(self.engine.module, "peft_config", None):
            path = save_merged(self.engine, model_dir, out)
        else:
            full = full_logical_tensors(self.engine)
            path = save_checkpoint(full, model_dir, out) if dist.get_rank() == 0 else None
        dist.barrier()
        return None if path is None else str(path)

    @property
    def plan(self) -> Any:
        """The whole plan (trainer rank 0 only; None elsewhere)."""
        return self.coordinated.plan if self.coordinated else None

    def detach(self) -> None:
        """Stop syncing: restore the engine's ``step``, leave the sync group (its connections closed, rank
        0's store released). Then ``attach`` again for a new handshake: the same trainer processes rejoin
        a restarted or replaced engine (after a failed sync the old group cannot be trusted)."""
        if self.hook is not None:
            self.hook.detach()
            self.hook = None
        self.endpoint.close()
        if self.desk is not None:
            self.desk.close()
            self.desk = None
        if self.coordinated is not None:
            self.coordinated.store = None

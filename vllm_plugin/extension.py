"""The vLLM worker extension: ``--worker-extension-cls vllm_plugin.extension.RolloutSyncExtension`` (server)
or ``LLM(worker_extension_cls="vllm_plugin.extension.RolloutSyncExtension")`` (offline).

vLLM mixes this class into its worker class and refuses to start if a name collides with the worker's, so
every method and attribute is prefixed ``rollout_sync_``. Each method is a thin shell: it reads the worker's
model, TP rank and config, and delegates to ``vllm_plugin.worker_state.RolloutWorker``. Results are plain
JSON-able data, so they travel through ``collective_rpc`` offline and over HTTP alike. Call them with
``llm.collective_rpc("rollout_sync_setup", kwargs={"first_rank": ...})``; ``vllm_plugin.driver`` wraps the
calls for several engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_sync.errors import IncompleteUpdateError
from rollout_sync.rollout.landing_maps import DEFAULT_MAX_PIECES
from rollout_sync.sync.options import SyncOptions

from .worker_state import RolloutWorker

__all__ = ["RolloutSyncExtension"]


class RolloutSyncExtension:
    """Worker extension: target maps of this worker and in-place weight updates."""

    rollout_sync_worker: RolloutWorker | None = None
    rollout_sync_link: Any = None

    def rollout_sync_get(self) -> RolloutWorker:
        worker = self.rollout_sync_worker
        if worker is None:
            raise IncompleteUpdateError("rollout_sync_setup has not run on this worker")
        return worker

    def rollout_sync_setup(
        self,
        first_rank: int = 0,
        tensors: Mapping[str, Sequence[int]] | None = None,
        max_pieces: int = DEFAULT_MAX_PIECES,
        maps: str = "fast",
        lora: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Learn this worker's targets (``maps``: ``"fast"``, ``"probe"`` or ``"verify"``,
        ``vllm_plugin.worker_maps``); this worker is global rank ``first_rank + tp_rank``. ``lora``: the targets
        are a LoRA adapter's A and B in a slot held for it (``vllm_plugin.lora_slots.AdapterSpec`` as a
        dict), not the model's weights. Returns a summary (rank, refused tensors with reasons, derived
        copies, setup report and times)."""
        from vllm.distributed.parallel_state import get_tp_group

        if lora is not None:
            self.rollout_sync_worker = RolloutWorker.setup_adapter(
                self.model_runner.model,  # type: ignore[attr-defined]
                self.model_runner,  # type: ignore[attr-defined]
                self.vllm_config,  # type: ignore[attr-defined]
                lora,
                tp_rank=get_tp_group().rank_in_group,
                first_rank=first_rank,
            )
            return self.rollout_sync_worker.summary()
        worker = RolloutWorker.setup(
            self.model_runner.model,  # type: ignore[attr-defined]
            self.vllm_config,  # type: ignore[attr-defined]
            tp_rank=get_tp_group().rank_in_group,
            first_rank=first_rank,
            tensors=tensors,
            max_pieces=max_pieces,
            maps=maps,
        )
        self.rollout_sync_worker = worker
        return worker.summary()

    def rollout_sync_summary(self) -> dict[str, Any]:
        """This worker's setup summary (as ``rollout_sync_setup`` returned it, current)."""
        return self.rollout_sync_get().summary()

    def rollout_sync_fallback(self, names: Sequence[str], reason: str) -> dict[str, Any]:
        """Stage ``names`` whole and load them through ``load_weights`` on this worker too (refused
        elsewhere; a map's boxes must agree on every rank)."""
        worker = self.rollout_sync_get()
        worker.force_fallback(list(names), reason)
        return worker.summary()

    def rollout_sync_local_targets(self) -> dict[str, Any]:
        """This worker's part of every target map, with storage views (``rollout_sync.rollout.codec``)."""
        return self.rollout_sync_get().local_targets_dict()

    def rollout_sync_apply_checkpoint(self, path: str, names: Sequence[str] | None = None) -> dict[str, Any]:
        """Write a checkpoint's tensors into this worker's parameters through the maps (in place), rebuild
        derived copies. The caller resets the prefix cache afterwards (``LLM.reset_prefix_cache``)."""
        return self.rollout_sync_get().apply_checkpoint(path, names)

    def rollout_sync_param_digests(self) -> dict[str, str]:
        """SHA-256 of every parameter's bytes (bit-for-bit comparison between engines)."""
        if self.rollout_sync_worker is not None:
            return self.rollout_sync_worker.param_digests()
        from .worker_state import param_digest

        model = self.model_runner.model  # type: ignore[attr-defined]
        return {n: param_digest(p.data) for n, p in model.named_parameters()}

    def rollout_sync_record_loaded(self, on: bool = True) -> int:
        """Digest every layer's loaded form as a sync completes it, before vLLM rebuilds the kernel's form
        from it (off by default: it reads every byte). Returns how many layers are kept in another form."""
        worker = self.rollout_sync_get()
        worker.record_loaded = bool(on)
        worker.loaded_digests.clear()
        return 0 if worker.loaded_forms is None else len(worker.loaded_forms.layers)

    def rollout_sync_loaded_digests(self) -> dict[str, str]:
        """SHA-256 of the loaded form of every parameter of a layer kept in another form, as the last
        update wrote it (``rollout_sync_record_loaded``; empty before setup)."""
        worker = self.rollout_sync_worker
        return {} if worker is None else dict(worker.loaded_digests)

    def rollout_sync_uncovered(self) -> dict[str, list[list[int]]]:
        """Per parameter, the flat element ranges no storage view covers (padding the sync never writes)."""
        return {n: [list(r) for r in ranges] for n, ranges in self.rollout_sync_get().uncovered().items()}

    def rollout_sync_connect(
        self,
        address: str,
        engine: int = 0,
        token: str | None = None,
        timeout: float = SyncOptions.timeout,
        staging_cap_bytes: int | None = None,
        atomic: bool = False,
    ) -> dict[str, Any]:
        """Join the sync group through the coordinator at ``address`` as a worker of engine ``engine``
        (after ``rollout_sync_setup``). Blocks until every trainer rank and worker has joined. ``atomic``:
        a sync lands whole or not at all (``UpdateSession``)."""
        from vllm.distributed.parallel_state import get_tp_group

        from rollout_sync.transport import DEFAULT_STAGING_CAP_BYTES

        from .worker_link import connect

        tp = get_tp_group()
        self.rollout_sync_link = connect(
            self.rollout_sync_get(),
            address,
            engine=engine,
            tp_rank=tp.rank_in_group,
            tp_size=tp.world_size,
            token=token,
            timeout=timeout,
            staging_cap_bytes=staging_cap_bytes or DEFAULT_STAGING_CAP_BYTES,
            atomic=atomic,
        )
        return dict(self.rollout_sync_link.status())

    def rollout_sync_receive(self) -> dict[str, Any]:
        """Receive one sync into this worker's parameters, in place (call while no generation runs: one
        ``collective_rpc`` runs between engine steps). Returns the version the trainer sent."""
        from .worker_link import receive

        if self.rollout_sync_link is None:
            raise IncompleteUpdateError("rollout_sync_connect has not run on this worker")
        return receive(self.rollout_sync_get(), self.rollout_sync_link)

    def rollout_sync_call(
        self,
        method: str,
        nonce: str,
        kwargs: Mapping[str, Any] | None = None,
        args: Sequence[Any] = (),
    ) -> dict[str, Any]:
        """Run ``rollout_sync_<method>(*args, **kwargs)`` and return ``{"nonce": nonce, "result": ...}``. The driver
        sends a fresh nonce per call and checks it (``vllm_plugin.http_driver``): vLLM at TP > 1 once
        answered a call with the previous call's error, so no result is trusted without its own nonce. An
        error is returned (with the nonce), not raised, so the driver sees which call failed and why."""
        if not method.isidentifier() or method in {"call", "get"}:
            return {"nonce": nonce, "error": f"unknown rollout_sync method {method!r}"}
        target = getattr(self, f"rollout_sync_{method}", None)
        if not callable(target):
            return {"nonce": nonce, "error": f"unknown rollout_sync method {method!r}"}
        try:
            return {"nonce": nonce, "result": target(*args, **dict(kwargs or {}))}
        except Exception as exc:  # reported to the driver, which raises with the cause
            return {"nonce": nonce, "error": f"{type(exc).__name__}: {exc}"}

    def rollout_sync_status(self) -> dict[str, Any]:
        """The link's state: global rank, last complete version, whether the last sync was incomplete."""
        link = self.rollout_sync_link
        return {"connected": False} if link is None else {"connected": True, **link.status()}

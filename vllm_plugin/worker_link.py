"""Joining the sync group and receiving a sync inside one vLLM worker (shared by the worker extension and
the weight-transfer backend).

``connect`` sends this worker's target maps (from its ``RolloutWorker``) through the handshake and joins
the group. ``receive`` opens an update (forwards refuse to run meanwhile), receives this worker's half
straight into the storage views (staging buffers for tensors refused for in-place writes; the loaded form
of a layer vLLM keeps in another form, made when its first tensor arrives and rebuilt by vLLM as soon as
its last one has landed), commits with every other rank, then loads staged tensors and rebuilds derived
copies. A failed receive aborts the update
and leaves the link ``incomplete``: the worker does not claim the new version; with ``atomic`` it also keeps
every old weight (nothing is written into the engine's weights before the commit).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from rollout_sync.rollout.delta_base import unchanged_targets
from rollout_sync.rollout.group_link import RolloutLink
from rollout_sync.rollout.update import UpdateSession
from rollout_sync.sync.options import SyncOptions
from rollout_sync.sync.roster import device_kind

from .worker_state import RolloutWorker

__all__ = ["connect", "receive"]


class _SessionStream:
    """The executor's ``TargetStream`` over an update: a streamed tensor's storage is made by opening its
    layer's loaded form; its last landed part marks it written (which rebuilds a completed layer)."""

    def __init__(self, session: UpdateSession) -> None:
        self.session = session

    def open(self, name: str) -> torch.Tensor:
        return self.session.storage(name)

    def close(self, name: str) -> None:
        self.session.mark_written(name)

    def watches(self, name: str) -> bool:
        return self.session.rebuilds_early(name)

    def held_bytes(self) -> int:
        return self.session.held_bytes()

    def adds_bytes(self, name: str) -> int:
        return self.session.adds_bytes(name)

    def reserve_bytes(self) -> int:
        return self.session.reserve_bytes()

    def room_bytes(self) -> int:
        return self.session.room_bytes()


def connect(
    worker: RolloutWorker,
    address: str,
    *,
    engine: int,
    tp_rank: int,
    tp_size: int,
    token: str | None = None,
    timeout: float = SyncOptions.timeout,
    staging_cap_bytes: int = SyncOptions.staging_cap_bytes,
    atomic: bool = False,
) -> RolloutLink:
    return RolloutLink.connect(
        address,
        engine=engine,
        local_rank=tp_rank,
        local_size=tp_size,
        maps=list(worker.targets.maps.values()),
        map_rank=worker.rank,
        token=token,
        timeout=timeout,
        staging_cap_bytes=staging_cap_bytes,
        device=device_kind(worker.model.parameters()),
        atomic=atomic,
        adapter=worker.adapter,
    )


def receive(worker: RolloutWorker, link: RolloutLink, *, open_update: bool = True) -> dict[str, Any]:
    """Receive one sync; returns a JSON-able report (version, bytes, derived copies rebuilt; ``seconds``: the
    transfer and commit, ``total_seconds``: the whole call, with what is rebuilt after the commit). With
    ``open_update=False`` the caller has already opened the update (vLLM's ``start_weight_update``) and
    will finish it (``finish_weight_update``)."""
    started = time.perf_counter()
    forms = worker.loaded_forms
    if forms is not None:
        forms.reset_seconds()
        if not forms.open_layers:
            # Delta syncs need the last sync's values: layers kept in another form then keep their loaded
            # form between syncs (its memory, ``kept_bytes``); full syncs stream them through memory.
            forms.keep(link.delta)
    session = worker.begin(atomic=link.atomic) if open_update else worker.session
    if session is None:
        raise RuntimeError(f"rank {worker.rank}: no weight update is open (call start_weight_update first)")
    # A delta sync applies on the values the last sync left: not when something else wrote the weights
    # since (another update: a checkpoint, vLLM's own loader), nor into buffers that do not outlive an update.
    if not link.base.begin(worker.updates, all(map(session.persistent, link.target_names))):
        link.forget_base()
    try:
        targets = {
            name: session.placeholder(name) if session.streamed(name) else session.storage(name)
            for name in link.target_names
        }
        result = link.receive(targets, _SessionStream(session))
        # in a delta sync, what arrived without a change keeps what was derived from it (a layer's
        # kernel's form, a derived copy): not rebuilt
        unchanged = unchanged_targets(result.stats.delta_base, result.stats.unchanged_targets)
        for name in link.target_names:
            if name in unchanged:
                session.mark_unchanged(name)
            else:
                session.mark_written(name)
        report = worker.finish() if open_update else {}
    except BaseException:
        worker.abort()
        raise
    if forms is not None:
        forms.memory.settle()  # the rebuilt layers' buffers back in the pool: what it keeps until the next
    return {
        **link.status(),
        "seconds": result.seconds,
        "total_seconds": time.perf_counter() - started,
        "stats": result.stats.to_dict(),
        "refreshed": report.get("refreshed", []),
        "loaded_forms": None
        if forms is None
        else {
            "rebuilt": forms.rebuilt,
            "lent": forms.lent,  # of them, rebuilt from the kept loaded form itself (no copy)
            "unchanged": forms.unchanged,
            "kept_bytes": forms.kept_bytes,
            "pool_bytes": forms.held_bytes(),  # buffers loaded forms are written into, kept between syncs
            "peak_open_layers": forms.peak_open,
            "peak_pool_bytes": forms.peak_held_bytes,
            **{f"{k}_s": round(v, 4) for k, v in forms.seconds.items()},
        },
    }

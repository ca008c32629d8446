"""Commands for trainer ranks held in a ``RankPool`` (end-to-end tests, the example, the benchmarks).

Each function runs inside one rank: ``fn(ctx, ...)``; the DeepSpeed engine and the trainer's sync live in
``ctx.state`` between commands.
"""

from __future__ import annotations

import time
from typing import Any

from .deepspeed import DeepSpeedSpec, build_engine, init_distributed_from_env
from .rank_pool import RankContext

__all__ = ["attach", "last_sync", "setup", "sync_now", "train_step"]


def setup(ctx: RankContext, spec: DeepSpeedSpec, model_path: str) -> float:
    """Initialise DeepSpeed's default group and build the engine; returns the seconds it took."""
    import torch

    torch.set_num_threads(1)
    start = time.perf_counter()
    init_distributed_from_env()
    ctx.state["engine"] = build_engine(spec, model_path)
    ctx.state["spec"] = spec
    return time.perf_counter() - start


def attach(
    ctx: RankContext,
    address: str,
    token: str,
    engines: int,
    every: int | None = 1,
    policy: str = "balanced",
    timeout: float = 120.0,
    staging_cap_bytes: int | None = None,
    shared_memory: bool = True,
    delta: bool = False,
    backend: str = "gloo",
    lora: str = "adapter",
) -> int:
    """Attach rollout-sync to the engine (joins the handshake); returns this rank's global rank."""
    from rollout_sync.trainer.hook import TrainerSync
    from rollout_sync.transport import DEFAULT_STAGING_CAP_BYTES

    sync = TrainerSync.attach(
        ctx.state["engine"],
        address=address,
        engines=engines,
        token=token,
        every=every,
        policy=policy,  # type: ignore[arg-type]
        timeout=timeout,
        staging_cap_bytes=staging_cap_bytes or DEFAULT_STAGING_CAP_BYTES,
        shared_memory=shared_memory,
        delta=delta,
        backend=backend,
        lora=lora,
    )
    ctx.state["sync"] = sync
    return sync.endpoint.rank


def train_step(ctx: RankContext, seed: int, seq_len: int = 16) -> dict[str, Any]:
    """One training step on random tokens (the same on every rank); the hook syncs after it. Returns the
    loss and the sync this step triggered (None when the hook did not fire)."""
    from .deepspeed import train_step as step

    sync = ctx.state.get("sync")
    before = len(sync.history) if sync is not None else 0
    loss = step(ctx.state["engine"], seed=seed, seq_len=seq_len)
    if sync is None or len(sync.history) == before:
        return {"loss": loss, "sync": None}
    return {"loss": loss, "sync": _describe(sync.history[-1])}


def sync_now(ctx: RankContext, version: int | None = None) -> dict[str, Any]:
    return _describe(ctx.state["sync"].sync(version))


def last_sync(ctx: RankContext) -> dict[str, Any] | None:
    sync = ctx.state.get("sync")
    return _describe(sync.last) if sync is not None and sync.last is not None else None


def _describe(result: Any) -> dict[str, Any]:
    return {"version": result.version, "seconds": result.seconds, "stats": result.stats.to_dict()}

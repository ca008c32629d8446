"""Syncing into vLLM ``AsyncLLM`` engines that keep generating (asynchronous RL).

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(..., worker_extension_cls=EXTENSION))
    await setup_engines_async([engine], first_rank=trainer_world_size)
    await connect_engine_async(engine, "tcp://trainer-0:29700", 0, atomic=True)
    ...                                     # generation runs all the time
    reports = await receive_sync_async([engine])   # per sync, while requests are in flight

``receive_sync_async`` pauses each engine with vLLM's own ``pause_generation(mode=...)``, receives the sync
into its workers, sets vLLM's weight version to the version the trainer sent, and resumes:

- ``mode="keep"`` (the default): requests in flight are frozen where they are, neither aborted nor
  drained, and go on from their next token with the new weights. The stall is the sync itself plus the
  engine step in flight when the pause came.
- ``mode="wait"``: they finish on the old weights first, then the sync runs (the stall is the longest of
  them); ``mode="abort"``: they are aborted (their tokens so far come back, finished as aborted), then the
  sync runs.

``kv`` (keep mode): ``"keep"`` leaves the frozen requests' KV cache as it is, so their later tokens attend
to keys and values the old weights computed (as PipelineRL does; free). ``"recompute"`` preempts them
instead: on resuming, vLLM recomputes their KV cache with the new weights from their tokens so far, so no
token is computed over mixed-version KV (the cost: one prefill of every frozen request's tokens). In every
mode, no request after the sync reuses a prefix block the old weights computed: a new weight version makes
the engine forget its prefix cache (``prefix_cache``; blocks in use stay with their requests).

**Which weights produced which token.** vLLM stamps every engine step's outputs with the engine's weight
version, and a finished ``RequestOutput``'s completions carry ``weight_versions``: spans ``[start, end)``
of output tokens and the version that sampled them. The version is set here after the sync has committed
and before generation resumes, so each span boundary is exactly the token at which the request resumed.
A failed sync leaves the version as it was. Connect with ``atomic=True`` so that a failed sync also leaves
every weight as it was: the frozen requests then resume on the old weights. Without it, a failed sync may
leave the weights part new, so the frozen requests are aborted instead (they would otherwise go on with
weights no version names).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

from rollout_sync.errors import PeerFailedError

from .calls import call
from .driver import connect_engine, setup_engines

__all__ = ["Blocking", "connect_engine_async", "in_thread", "receive_sync_async", "setup_engines_async"]

PauseMode = Literal["keep", "wait", "abort"]
KvMode = Literal["keep", "recompute"]
_T = TypeVar("_T")


class Blocking:
    """An ``AsyncLLM`` seen from a thread as an engine with a blocking ``collective_rpc`` (what the driver's
    functions call), its calls run on the engine's event loop ``loop``."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.loop = loop

    def _run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: Sequence[Any] = (), kwargs: Any = None
    ) -> list[Any]:
        return list(
            self._run(self.engine.collective_rpc(method, timeout=timeout, args=tuple(args), kwargs=kwargs))
        )

    def reset_prefix_cache(self) -> bool:
        return bool(self._run(self.engine.reset_prefix_cache()))


async def in_thread(fn: Callable[..., _T], engines: Sequence[Any], *args: Any, **kwargs: Any) -> _T:
    """``fn(blocking engines, *args, **kwargs)`` in a thread: any of ``vllm_plugin.driver``'s functions for
    ``AsyncLLM`` engines, e.g. ``await in_thread(apply_checkpoint, [engine], path)``."""
    loop = asyncio.get_running_loop()
    return await asyncio.to_thread(fn, [Blocking(e, loop) for e in engines], *args, **kwargs)


async def setup_engines_async(engines: Sequence[Any], first_rank: int = 0, **options: Any) -> Any:
    """``driver.setup_engines`` for ``AsyncLLM`` engines (generation may run meanwhile)."""
    return await in_thread(setup_engines, engines, first_rank, **options)


async def connect_engine_async(
    engine: Any, address: str, index: int = 0, **options: Any
) -> list[dict[str, Any]]:
    """``driver.connect_engine`` for an ``AsyncLLM`` (blocks until every trainer rank and worker has joined;
    generation may run meanwhile)."""
    loop = asyncio.get_running_loop()
    return await asyncio.to_thread(connect_engine, Blocking(engine, loop), address, index, **options)


async def _call(engine: Any, method: str, k: int) -> list[Any]:
    loop = asyncio.get_running_loop()
    return await asyncio.to_thread(call, Blocking(engine, loop), method, name=str(k))


OnPaused = Callable[[int], Awaitable[None]]


async def _receive_one(
    engine: Any, k: int, mode: PauseMode, kv: KvMode, on_paused: OnPaused | None
) -> list[dict[str, Any]]:
    """Pause engine ``k``, receive, resume whatever happened; on a failed non-atomic sync, abort what was
    frozen first."""
    await engine.pause_generation(mode=mode, clear_cache=False)
    try:
        if on_paused is not None:
            await on_paused(k)
        reports = await _call(engine, "receive", k)
    except BaseException:
        status = await _call(engine, "status", k)
        if mode == "keep" and not all(s.get("atomic") for s in status):
            await engine.pause_generation(mode="abort", clear_cache=False)  # no version names these weights
        await engine.resume_generation()
        raise
    try:
        if mode == "keep" and kv == "recompute":
            await engine.reset_prefix_cache(reset_running_requests=True)
    finally:
        versions = {int(r["version"]) for r in reports}
        if len(versions) == 1:
            await engine.update_weight_version(str(versions.pop()))
        await engine.resume_generation()
    return reports


async def receive_sync_async(
    engines: Sequence[Any],
    *,
    mode: PauseMode = "keep",
    kv: KvMode = "keep",
    on_paused: OnPaused | None = None,
) -> list[list[dict[str, Any]]]:
    """Receive one sync on every engine while their requests are paused (``mode``) and resume them (module
    doc); returns each engine's worker reports. Raises if a worker reports another version than the others:
    no engine claims a version it did not get. ``on_paused(k)`` is awaited once engine ``k`` has paused,
    before it receives (to look at the requests where they stopped)."""
    if mode not in ("keep", "wait", "abort") or kv not in ("keep", "recompute"):
        raise ValueError(f"mode must be keep, wait or abort and kv keep or recompute, not {mode!r}, {kv!r}")
    receiving = (_receive_one(e, k, mode, kv, on_paused) for k, e in enumerate(engines))
    reports = list(await asyncio.gather(*receiving))
    versions = {int(r["version"]) for per_engine in reports for r in per_engine}
    if len(versions) != 1:
        raise PeerFailedError(f"workers report different weight versions after a sync: {sorted(versions)}")
    return reports

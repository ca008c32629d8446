"""The engine core's ``rollout_sync_forget_prefixes`` utility: after a sync into an engine that keeps its
requests in flight, no later request may reuse a prefix block that the old weights computed.

vLLM's own ``reset_prefix_cache`` refuses while any request holds blocks (as frozen requests do) unless it
preempts them all. This utility instead evicts every cached block from the prefix cache's index through
vLLM's ``KVCacheManager.evict_blocks`` (what KV connectors use): blocks in use stay with their requests,
which go on with them; nothing can find them by prefix any more. ``install`` (called by the
``vllm.general_plugins`` entry point in every vLLM process) adds the method to ``EngineCore``, where
``engine_core.call_utility_async("rollout_sync_forget_prefixes")`` finds it. Where vLLM's internals differ
(another version), it returns -1 and forgets nothing.
"""

from __future__ import annotations

from typing import Any

__all__ = ["forget_prefixes", "install"]

_NAME = "rollout_sync_forget_prefixes"


def forget_prefixes(core: Any) -> int:
    """Evict every cached block of ``core``'s scheduler from the prefix cache; how many (-1: not possible)."""
    manager = getattr(getattr(core, "scheduler", None), "kv_cache_manager", None)
    pool = getattr(manager, "block_pool", None)
    blocks = getattr(pool, "blocks", None)
    if manager is None or blocks is None or not hasattr(manager, "evict_blocks"):
        return -1
    cached = {b.block_id for b in blocks if getattr(b, "block_hash", None) is not None}
    manager.evict_blocks(cached)
    return len(cached)


def install() -> bool:
    """Add ``rollout_sync_forget_prefixes`` to vLLM's ``EngineCore`` (idempotent); whether it is there."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return False
    if not hasattr(EngineCore, _NAME):
        setattr(EngineCore, _NAME, forget_prefixes)
    return True

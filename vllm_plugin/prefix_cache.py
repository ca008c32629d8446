"""A new weight version forgets the prefix cache: no request after a sync reuses a prefix block the old
weights computed, even while requests of the old version are still in flight (frozen by a keep-mode pause).

vLLM's own ``reset_prefix_cache`` refuses while any request holds blocks (as frozen requests do) unless it
preempts them all. ``install`` (called by the ``vllm.general_plugins`` entry point in every vLLM process)
wraps ``EngineCore.set_weight_version`` (what ``update_weight_version``, ``/update_weight_version`` and
``finish_weight_update(weight_version=...)`` reach) so that a change of version also evicts every cached
block from the prefix cache's index, through vLLM's ``KVCacheManager.evict_blocks`` (what KV connectors
use): blocks in use stay with their requests, which go on with them; nothing finds them by prefix any more.
Where vLLM's internals differ (another version), nothing is wrapped or forgotten.

Blocks that a frozen request fills after it resumed (new tokens over keys and values of the old version)
are cached as usual; a later request whose tokens equal that request's prompt and output so far could
reuse them. ``kv="recompute"`` (``async_driver``) avoids mixed-version KV altogether.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["forget_prefixes", "install", "wrap"]

_MARK = "_rollout_sync_forgets_prefixes"


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


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` (``EngineCore.set_weight_version``), forgetting the prefix cache when the version
    changes."""

    @functools.wraps(original)
    def set_weight_version(self: Any, weight_version: str) -> Any:
        changed = getattr(self, "_weight_version", None) != weight_version
        out = original(self, weight_version)
        if changed:
            forget_prefixes(self)
        return out

    setattr(set_weight_version, _MARK, True)
    return set_weight_version


def install() -> bool:
    """Wrap ``EngineCore.set_weight_version`` once per process; False where it cannot be found."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return False
    original = getattr(EngineCore, "set_weight_version", None)
    if original is None:
        return False
    if not getattr(original, _MARK, False):
        EngineCore.set_weight_version = wrap(original)  # type: ignore[method-assign]
    return True

"""Whether a worker's next sync may apply as a delta on what the last sync left (pure).

A delta sync writes only the elements that changed since its base version, so the worker's weights must
still be exactly what the last sync wrote. The owner of the weights (``vllm_plugin.worker_link``) counts its
finished weight updates; ``DeltaBase`` remembers that count when a sync begins. The base stands only when the
update now opening directly follows the last sync's (nothing else, a checkpoint or vLLM's own loader, wrote
the weights in between) and every target outlives an update (a buffer made per update has no old values).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["DeltaBase", "unchanged_targets"]


class DeltaBase:
    def __init__(self) -> None:
        self.updates_seen: int | None = None  # the owner's count of finished updates when the last sync began

    def begin(self, updates: int, persistent: bool) -> bool:
        """A sync begins as the owner's update number ``updates + 1`` opens; ``persistent``: every target
        outlives an update. Returns whether the last sync's values may serve as this sync's base (else the
        caller forgets the base, and the sync is full); remembers ``updates`` either way."""
        before, self.updates_seen = self.updates_seen, updates
        return before is not None and updates == before + 1 and persistent


def unchanged_targets(delta_base: int | None, unchanged: Iterable[str]) -> frozenset[str]:
    """The targets whose derived forms (a packed layer's kernel form, a derived copy) a sync may leave as
    they were: those it delivered without a change, in a delta sync only (a full sync rewrites all)."""
    return frozenset(unchanged) if delta_base is not None else frozenset()

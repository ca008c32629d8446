"""A trainer rank's storage views, kept fresh between syncs.

Before every sync the trainer hook asks the watch (``rollout_sync.trainer.freshness``) whether DeepSpeed
still holds every buffer the views were cut from. When it does (the usual case) nothing else runs. When a
buffer was replaced, the views are re-derived from the engine, and the maps of the new description are
compared with the maps the plan was built from (their digest, the one this rank presented at the
handshake):

- same digest: the new views replace the old ones and the sync goes on (the plan still holds);
- different digest, or the engine can no longer be described: the sync must not run. ``check`` returns a
  ``StaleStorageError`` naming the tensor and the rank; the trainer hook turns it into this rank's refusal
  in the sync's agreement, so every rank of the group raises before any byte moves (no collective beyond the
  sync's own), and raises it here.

Each rank decides for itself from its own buffers; the agreement makes the outcome the same everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from ..errors import LayoutError, StaleStorageError
from ..layout.maps import TensorMap
from ..planning.wire import encode_maps
from ..sync.fleet_plan import maps_digest

__all__ = ["FreshViews", "Rebuild", "Watch"]


class Watch(Protocol):
    def stale(self) -> Sequence[Any]: ...  # items with ``names`` and ``describe()``


#: Describes the engine again: (maps of every rank, this rank's views, a new watch).
Rebuild = Callable[[], tuple[Sequence[TensorMap], Mapping[str, Any], Watch]]


class FreshViews:
    def __init__(
        self, sources: Mapping[str, Any], watch: Watch | None, digest: str, rebuild: Rebuild | None, rank: int
    ) -> None:
        self.sources = sources
        self.watch = watch
        self.digest = digest
        self.rebuild = rebuild
        self.rank = rank
        self.rederived = 0  # how many times the views were re-derived under the same maps
        self.check_seconds = 0.0  # the last check's duration (the watch alone, in the usual case)

    def check(self) -> StaleStorageError | None:
        """Re-derive the views if a buffer was replaced; the error to refuse the sync with, or None."""
        start = time.perf_counter()
        try:
            return self._check()
        finally:
            self.check_seconds = time.perf_counter() - start

    def _check(self) -> StaleStorageError | None:
        if self.watch is None:
            return None
        stale = list(self.watch.stale())
        if not stale:
            return None
        first = stale[0]
        tensor = first.names[0] if first.names else None
        replaced = "; ".join(s.describe() for s in stale[:3]) + (
            f"; and {len(stale) - 3} more" if len(stale) > 3 else ""
        )
        if self.rebuild is None:
            return StaleStorageError(
                "DeepSpeed replaced a buffer the storage views alias and this sync cannot describe the "
                "engine again; nothing was sent: re-attach",
                tensor=tensor,
                rank=self.rank,
                found=replaced,
            )
        try:
            maps, sources, watch = self.rebuild()
        except LayoutError as exc:
            return StaleStorageError(
                "DeepSpeed replaced a buffer the storage views alias and the engine can no longer be "
                "described; nothing was sent: re-attach",
                tensor=tensor,
                rank=self.rank,
                expected="a description under the plan's maps",
                found=f"{exc} (replaced: {replaced})",
            )
        digest = maps_digest(encode_maps(list(maps)))
        if digest != self.digest:
            return StaleStorageError(
                "DeepSpeed replaced a buffer the storage views alias and the layout changed; nothing was "
                "sent: re-attach to plan anew",
                tensor=tensor,
                rank=self.rank,
                expected=f"maps digest {self.digest[:12]}",
                found=f"maps digest {digest[:12]} (replaced: {replaced})",
            )
        self.sources, self.watch = sources, watch
        self.rederived += 1
        return None

"""All target maps of a rollout fleet: the parts of every worker of every engine, merged and checked.

Each worker describes only its own storage (``LocalTargets``, one rank). ``assemble`` merges the parts into
one map per logical tensor (replicas, i.e. holders, are the ranks whose storage holds exactly the same box:
TP-replicated norms inside an engine, every data-parallel engine) and checks that **each engine** covers
every element of every logical tensor exactly once, replicas aside: the distinct boxes held by the engine's
ranks tile the tensor. A tensor no engine holds, or one some engine covers partly, is refused before any
byte moves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import LayoutError
from ..layout.combine import merge
from ..layout.coverage import check_engine_coverage
from ..layout.maps import TensorMap
from .local_targets import LocalTargets
from .storage_view import StorageView

__all__ = ["RolloutTargets", "assemble"]


@dataclass(frozen=True)
class RolloutTargets:
    """Merged target maps (``maps``, by tensor name) of ``engines`` (each a tuple of global ranks in TP-rank
    order), with every worker's storage views and the tensors refused for in-place writes (``refused[name]
    [rank] = reason``: those ranks receive the whole tensor into a staging buffer). ``ignored``: logical
    tensors every worker of every engine reported absent (vLLM keeps no storage for them: an alias of a
    tied weight, a bias its loader skips); a sync never sends them, so they are listed, not hidden."""

    engines: tuple[tuple[int, ...], ...]
    maps: Mapping[str, TensorMap]
    views: Mapping[int, Mapping[str, StorageView]]
    refused: Mapping[str, Mapping[int, str]]
    ignored: tuple[str, ...] = ()

    def map_list(self) -> list[TensorMap]:
        return [self.maps[name] for name in sorted(self.maps)]


def assemble(workers: Sequence[LocalTargets], engines: Sequence[Sequence[int]]) -> RolloutTargets:
    """Merge every worker's part into one map per tensor and check each engine's coverage.

    ``engines``: the global ranks of each engine; every worker's rank must be in exactly one of them.
    """
    by_rank = {w.rank: w for w in workers}
    if len(by_rank) != len(workers):
        raise LayoutError("two workers claim the same global rank", found=sorted(w.rank for w in workers))
    listed = [r for ranks in engines for r in ranks]
    if sorted(listed) != sorted(by_rank) or len(set(listed)) != len(listed):
        raise LayoutError(
            "engine rank lists and worker ranks differ",
            expected=sorted(by_rank),
            found=[list(e) for e in engines],
        )
    names = sorted({n for w in workers for n in w.maps})
    maps: dict[str, TensorMap] = {}
    for name in names:
        maps[name] = merge([w.maps[name] for w in workers if name in w.maps])
    check_engine_coverage(maps, engines)
    refused: dict[str, dict[int, str]] = {}
    for w in workers:
        for name, reason in w.refused.items():
            refused.setdefault(name, {})[w.rank] = reason
    absent_everywhere = set.intersection(*(set(w.absent) for w in workers)) if workers else set()
    return RolloutTargets(
        engines=tuple(tuple(e) for e in engines),
        maps=maps,
        views={w.rank: dict(w.views) for w in workers},
        refused=refused,
        ignored=tuple(sorted(absent_everywhere - set(maps))),
    )

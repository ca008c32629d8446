"""Does every engine hold every element of every tensor exactly once? Pure: the coordinator checks the merged
target maps of a fleet with it before planning (``rollout.fleet_maps.assemble`` and ``sync``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import prod

from ..errors import CoverageError, HoleError, OverlapError
from .box import Box
from .maps import TensorMap
from .sweep import first_overlap, first_uncovered

__all__ = ["check_engine_coverage"]


def _boxes_tile(name: str, shape: tuple[int, ...], boxes: Sequence[Box], engine: int) -> None:
    tuples = [(b.origin, b.extent) for b in boxes if b.numel]
    pair = first_overlap(tuples)
    if pair is not None:
        a, b = (Box(*tuples[i]) for i in pair)
        raise OverlapError(
            f"engine {engine} holds two different boxes that overlap",
            tensor=name,
            box=a,
            expected="disjoint boxes (replicas hold the same box)",
            found=b,
        )
    hole = first_uncovered(shape, tuples)
    if hole is not None:
        raise HoleError(
            f"engine {engine} does not hold every element: first uncovered position {list(hole)}",
            tensor=name,
            expected=f"{prod(shape)} elements of {shape}",
            found=f"{sum(b.numel for b in boxes)} elements in {len(boxes)} boxes",
        )


def check_engine_coverage(maps: Mapping[str, TensorMap], engines: Sequence[Sequence[int]]) -> None:
    """Raise unless every engine's ranks hold every element of every map exactly once (replicas aside):
    ``CoverageError`` for an engine that holds none of a tensor, ``OverlapError`` for two different boxes
    that share elements, ``HoleError`` naming the engine, the tensor and the first uncovered position."""
    for name, tmap in maps.items():
        for index, ranks in enumerate(engines):
            boxes = {p.box for r in ranks if r in tmap.ranks for p in tmap.ranks[r].pieces}
            if not boxes:
                raise CoverageError(
                    f"engine {index} holds none of this tensor",
                    tensor=name,
                    expected=f"storage on some of ranks {list(ranks)}",
                    found="none",
                )
            _boxes_tile(name, tmap.shape, sorted(boxes, key=lambda b: b.origin), index)

"""Pairing source and target maps for planning, shared by the planners (``planner``, ``rank_half``,
``by_layout``): which source map fills which target map (``matched_pairs``), the plan's tensor table entry
of a pair (``planned_tensor``), and which pairs share their segments with every pair of the same layout
(``SharedLayouts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from math import prod
from operator import attrgetter

from ..errors import CoverageError, HoleError, LayoutError, ShapeMismatchError
from ..layout.maps import TensorMap
from ..layout.sweep import first_uncovered
from .records import PlannedTensor

__all__ = [
    "LayoutKey",
    "SharedLayouts",
    "check_shapes",
    "check_target_covers",
    "choice_free",
    "matched_pairs",
    "planned_tensor",
]

LayoutKey = tuple[int, int, tuple[int, ...]]  # (id of source regions, id of target regions, shape)


def matched_pairs(
    sources: Sequence[TensorMap], targets: Sequence[TensorMap]
) -> list[tuple[TensorMap, TensorMap]]:
    """``(source, target)`` maps of the same logical tensor, in the plan's tensor order (target names
    sorted), with the planner's refusals: a name described twice on one side, a target without a source
    (``CoverageError``), a target that leaves some element of its tensor to no rank (``HoleError``, naming
    the first uncovered position: those elements would stay stale), different logical shapes
    (``ShapeMismatchError``)."""
    by_name = {m.name: m for m in sources}
    if len(by_name) != len(sources):
        seen: set[str] = set()
        for m in sources:
            if m.name in seen:
                raise LayoutError("two source maps describe one logical tensor", tensor=m.name)
            seen.add(m.name)
    ordered = sorted(targets, key=attrgetter("name"))
    names = [t.name for t in ordered]
    for a, b in pairwise(names):
        if a == b:
            raise LayoutError("two target maps describe one logical tensor", tensor=a)
    found = [by_name.get(name) for name in names]
    pairs: list[tuple[TensorMap, TensorMap]] = []
    for s, t in zip(found, ordered, strict=True):
        if s is None:
            raise CoverageError(
                "no source map holds a logical tensor the targets need",
                tensor=t.name,
                expected="a source map of the same name",
                found="none",
            )
        check_target_covers(t)
        pairs.append((s, t))
    check_all_shapes(pairs)
    return pairs


def check_target_covers(target: TensorMap) -> None:
    """``HoleError`` unless the target map's boxes (over all its ranks) cover every element of its tensor
    (as DeepSpeed's planner refuses "target pieces do not cover the full logical parameter")."""
    regions = target.regions
    held = sum(prod(extent) for _, extent, _ in regions)
    if held == prod(target.shape):
        return
    hole = first_uncovered(target.shape, [(origin, extent) for origin, extent, _ in regions])
    raise HoleError(
        f"no target rank holds some elements of this tensor: first uncovered position {list(hole or ())}",
        tensor=target.name,
        expected=f"every element of {target.shape} held by some target rank",
        found=f"{held} of {prod(target.shape)} elements",
    )


def check_all_shapes(pairs: Sequence[tuple[TensorMap, TensorMap]], most: int = 10) -> None:
    """``ShapeMismatchError`` naming every pair whose logical shapes differ (the first ``most`` and a
    count of the others), with both shapes; its ``tensor`` is the first."""
    wrong = [(s, t) for s, t in pairs if s.shape != t.shape]
    if not wrong:
        return
    if len(wrong) == 1:
        check_shapes(*wrong[0])
    listed = "; ".join(f"{t.name!r}: target {t.shape}, source {s.shape}" for s, t in wrong[:most])
    more = f"; and {len(wrong) - most} more" if len(wrong) > most else ""
    raise ShapeMismatchError(
        f"source and target maps describe different logical shapes for {len(wrong)} tensors",
        tensor=wrong[0][1].name,
        expected="the same logical shape on both sides",
        found=listed + more,
    )


def check_shapes(source: TensorMap, target: TensorMap) -> None:
    """``ShapeMismatchError`` unless both maps describe the same logical shape."""
    if source.shape != target.shape:
        raise ShapeMismatchError(
            "source and target maps describe different logical shapes",
            tensor=target.name,
            expected=f"target shape {target.shape}",
            found=f"source shape {source.shape} (source map {source.name!r})",
        )


def choice_free(source: TensorMap) -> bool:
    """Whether every source region has a single holder: no replica choice, so the tensor's segments depend
    only on its layout, under every policy."""
    return all(len(region[2]) == 1 for region in source.regions)


def planned_tensor(source: TensorMap, target: TensorMap) -> PlannedTensor:
    """The plan's tensor table entry of one pair (the same as ``plan_model`` writes)."""
    return PlannedTensor(
        target.name, target.shape, source.dtype, target.dtype, source.storage_shapes, target.storage_shapes
    )


class SharedLayouts:
    """Which pairs may share their segments with every other pair of the same layout, and that layout's
    key. A pair's segments depend only on its layout (shape, source regions, target regions) when no
    replica choice can depend on its name: always when ``every_pair`` (the ``lowest`` policy), else when
    its source is ``choice_free``.

    Layouts are recognised by the identity of the maps' regions objects (maps built from the same storages
    share them, see ``TensorMap``); the regions behind every key handed out are kept alive here, so their
    ids stay theirs as long as this object lives."""

    __slots__ = ("_every_pair", "_free", "_keep")

    def __init__(self, every_pair: bool) -> None:
        self._every_pair = every_pair
        self._free: dict[int, tuple[object, bool]] = {}  # id(source regions) -> (regions, choice free)
        self._keep: dict[LayoutKey, tuple[object, object]] = {}

    def key(self, source: TensorMap, target: TensorMap) -> LayoutKey | None:
        """The layout key of the pair, or None when its segments must be planned for it alone."""
        if not self._every_pair:
            got = self._free.get(id(source.regions))
            if got is None:
                got = self._free[id(source.regions)] = (source.regions, choice_free(source))
            if not got[1]:
                return None
        key = (id(source.regions), id(target.regions), source.shape)
        if key not in self._keep:
            self._keep[key] = (source.regions, target.regions)
        return key

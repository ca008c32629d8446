"""The planner: from source and target maps to a deterministic plan of point-to-point copies.

Lifecycle (every rank runs the same pure function on the same maps and gets the same plan, byte for byte):

1. Maps were validated when built (``TensorMap``): each side's distinct boxes (regions) are disjoint and
   every storage is tiled exactly.
2. ``plan_model`` matches target maps to source maps by name (``map_pairs.matched_pairs``; the target
   decides what is needed; a target without a source is a ``CoverageError``), checks logical shapes
   (``ShapeMismatchError``), and plans the tensors in name order.
3. Per tensor, a sweep (``rollout_sync.layout.sweep``) finds every (source region, target region) pair that
   shares elements; each target region must be covered exactly by its intersections (``CoverageError``
   otherwise; source regions are disjoint, so volumes decide). Never all pairs of pieces.
4. For each intersection and each target holder, the replica policy picks a source holder
   (``rollout_sync.planning.policy``); the segment reads the intersected sub-box at the source holder's
   address and writes it at the target holder's address (offset moved to the sub-box origin, strides of
   the pieces).
5. Segments whose address maps continue are merged (``rollout_sync.planning.merge``), then sorted by
   target rank, target offset, source rank, source offset.

With the ``lowest`` policy a tensor's segments depend only on its shape and both maps' regions, so tensors
with identical layouts (the layers of a model) are planned once and share their records.
"""

from __future__ import annotations

import gc
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from math import prod
from operator import add, mul

from ..errors import CoverageError, LayoutError
from ..layout.box import Box
from ..layout.dtypes import ITEMSIZE
from ..layout.maps import TensorMap
from ..layout.sweep import overlapping_pairs
from ..layout.validate import Address, Region
from .map_pairs import check_shapes, check_target_covers, matched_pairs, planned_tensor
from .merge import Raw
from .plan import Plan
from .policy import Balanced, ReplicaPolicy, ReplicaRequest, check_choice
from .records import PlannedTensor, Segment
from .segments import intersection, sorted_rows

__all__ = ["plan_model", "plan_tensor"]

_LOWEST, _BALANCED, _CALLABLE = 0, 1, 2


class _Chooser:
    """The resolved replica policy of one plan."""

    __slots__ = ("balanced", "fn", "mode", "recorder")

    def __init__(self, policy: ReplicaPolicy) -> None:
        self.balanced: Balanced | None = None
        self.fn: Callable[[ReplicaRequest], int] | None = None
        self.recorder: Callable[[int, int], None] | None = None
        if policy == "lowest":
            self.mode = _LOWEST
        elif policy == "balanced" or isinstance(policy, Balanced):
            self.mode = _BALANCED
            self.balanced = policy if isinstance(policy, Balanced) else Balanced()
            self.recorder = self.balanced.record
        elif callable(policy):
            self.mode = _CALLABLE
            self.fn = policy
            record = getattr(policy, "record", None)
            self.recorder = record if callable(record) else None
        else:
            raise LayoutError(
                "unknown replica policy", expected='"lowest", "balanced" or a callable', found=repr(policy)
            )


def plan_tensor(source: TensorMap, target: TensorMap, policy: ReplicaPolicy = "lowest") -> list[Segment]:
    """The segments that fill ``target`` from ``source`` (one logical tensor; ``Segment.tensor`` is 0),
    in plan order. Names are not compared; shapes are, and the target must cover its tensor."""
    check_shapes(source, target)
    check_target_covers(target)
    rows = _plan_records(source, target, _Chooser(policy))
    n = len(source.shape)
    return [
        Segment(0, r[0], r[1], r[4 : 4 + n], r[2], r[3], r[4 + n : 4 + 2 * n], r[4 + 2 * n :]) for r in rows
    ]


def plan_model(
    sources: Sequence[TensorMap], targets: Sequence[TensorMap], policy: ReplicaPolicy = "lowest"
) -> Plan:
    """The plan that fills every target map from the source maps of the same name.

    ``policy``: ``"lowest"``, ``"balanced"`` (one fresh ``Balanced`` for this plan) or a callable (see
    ``rollout_sync.planning.policy``). Extra source maps are ignored. Raises ``LayoutError`` subclasses
    naming the tensor (and rank and box where there is one) before returning any plan.
    """
    with _gc_paused():
        return _plan_model(sources, targets, policy)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Planning allocates many small acyclic tuples; the cyclic collector would rescan them again and again
    (a large share of the time on big plans). Pause it while planning, restore it after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan_model(sources: Sequence[TensorMap], targets: Sequence[TensorMap], policy: ReplicaPolicy) -> Plan:
    pairs = matched_pairs(sources, targets)
    chooser = _Chooser(policy)
    # Tensors with the same shape and regions on both sides (the layers of a model) share their geometry;
    # with the lowest policy they share their records too.
    records_cache: dict[int, array] = {}
    geometry_cache: dict[int, list[_Entry]] = {}
    tensors: list[PlannedTensor] = []
    records: list[array] = []
    layouts: dict[object, int] = {}
    known: dict[tuple[int, int, tuple[int, ...]], tuple[object, object, int]] = {}
    for s, t in pairs:
        # A layout is (shape, source regions, target regions). Maps rebuilt from the same storages share
        # their regions object: look those up by identity first (the stored value keeps both objects alive,
        # so the ids stay theirs), by content otherwise.
        fast = (id(s.regions), id(t.regions), s.shape)
        hit = known.get(fast)
        if hit is None:
            key = layouts.setdefault((s.shape, s.regions, t.regions), len(layouts))
            known[fast] = (s.regions, t.regions, key)
        else:
            key = hit[2]
        rec = records_cache.get(key) if chooser.mode == _LOWEST else None
        if rec is None:
            entries = geometry_cache.get(key)
            if entries is None:
                entries = geometry_cache[key] = _geometry(s, t)
            rows = _emit(t.name, len(t.shape), entries, chooser, ITEMSIZE[s.dtype])
            rec = array("q", [v for r in rows for v in r])
            if chooser.mode == _LOWEST:
                records_cache[key] = rec
        records.append(rec)
        tensors.append(planned_tensor(s, t))
    return Plan.from_records(tensors, records, validate=False)


# One copy to make, before the replica choice: (target rank, target offset, target strides, logical origin,
# extent, numel, candidates), the candidates being (source rank, source offset, source strides) per holder.
_Entry = tuple[
    int,
    int,
    tuple[int, ...],
    tuple[int, ...],
    tuple[int, ...],
    int,
    tuple[tuple[int, int, tuple[int, ...]], ...],
]


def _plan_records(source: TensorMap, target: TensorMap, chooser: _Chooser) -> list[tuple[int, ...]]:
    """Sorted flat records (see ``rollout_sync.planning.records``) of one tensor."""
    return _emit(target.name, len(target.shape), _geometry(source, target), chooser, ITEMSIZE[source.dtype])


def _geometry(source: TensorMap, target: TensorMap) -> list[_Entry]:
    """Every intersection of a source region with a target region, once per target holder, with each
    source holder's address of it; ``CoverageError`` when a target region is not covered exactly."""
    name = target.name
    src = source.regions
    tgt = target.regions
    pairs = overlapping_pairs([(r[0], r[1]) for r in src], [(r[0], r[1]) for r in tgt])
    by_target: list[list[int]] = [[] for _ in tgt]
    for si, ti in pairs:
        by_target[ti].append(si)
    entries: list[_Entry] = []
    for ti, (to, te, taddrs) in enumerate(tgt):
        sis = by_target[ti]
        sis.sort()
        got = 0
        t_end = tuple(map(add, to, te))
        first = len(entries)
        if len(to) == 2:
            got = _intersect_2d(src, sis, to, t_end, taddrs, entries)
        else:
            for si in sis:
                so, se, saddrs = src[si]
                xo, xe, sdelta, tdelta = intersection(so, se, to, t_end)
                n = prod(xe)
                got += n
                cands = tuple((r, off + sum(map(mul, sdelta, st)), st) for r, off, st in saddrs)
                for trank, toff, tstr in taddrs:
                    entries.append((trank, toff + sum(map(mul, tdelta, tstr)), tstr, xo, xe, n, cands))
        volume = prod(te)
        if got != volume:
            parts = [(e[3], e[4]) for e in entries[first :: max(1, len(taddrs))]]
            raise CoverageError(
                "target elements that no source holds",
                tensor=name,
                rank=taddrs[0][0],
                box=Box(to, te),
                expected=f"{volume} elements held by sources",
                found=f"{got}; for example no source holds {_uncovered(to, te, parts)}",
            )
    return entries


def _intersect_2d(
    src: tuple[Region, ...],
    sis: list[int],
    to: tuple[int, ...],
    t_end: tuple[int, ...],
    taddrs: tuple[Address, ...],
    entries: list[_Entry],
) -> int:
    """The loop of ``_geometry`` for matrices, unrolled (the common case); returns the covered volume."""
    t0, t1 = to
    e0, e1 = t_end
    got = 0
    for si in sis:
        (s0, s1), (n0, n1), saddrs = src[si]
        x0 = s0 if s0 > t0 else t0
        x1 = s1 if s1 > t1 else t1
        y0 = s0 + n0
        y1 = s1 + n1
        xe = ((y0 if y0 < e0 else e0) - x0, (y1 if y1 < e1 else e1) - x1)
        xo = (x0, x1)
        n = xe[0] * xe[1]
        got += n
        d0 = x0 - s0
        d1 = x1 - s1
        if len(saddrs) == 1:
            r, off, st = saddrs[0]
            cands: tuple[Address, ...] = ((r, off + d0 * st[0] + d1 * st[1], st),)
        else:
            cands = tuple((r, off + d0 * st[0] + d1 * st[1], st) for r, off, st in saddrs)
        d0 = x0 - t0
        d1 = x1 - t1
        for trank, toff, tstr in taddrs:
            entries.append((trank, toff + d0 * tstr[0] + d1 * tstr[1], tstr, xo, xe, n, cands))
    return got


def _emit(
    name: str, ndim: int, entries: list[_Entry], chooser: _Chooser, itemsize: int
) -> list[tuple[int, ...]]:
    """Choose a source holder for every entry, merge, and sort: the tensor's records."""
    mode = chooser.mode
    choose_balanced = chooser.balanced.choose if chooser.balanced is not None else None
    fn = chooser.fn
    recorder = chooser.recorder
    raw: list[Raw] = []
    append = raw.append
    for trank, toff, tstr, xo, xe, n, cands in entries:
        if len(cands) == 1 or mode == _LOWEST:
            c = cands[0]
        else:
            holders = tuple(x[0] for x in cands)
            if choose_balanced is not None:
                chosen = choose_balanced(trank, holders)
            elif fn is not None:
                request = ReplicaRequest(name, trank, Box(xo, xe), holders, n * itemsize)
                chosen = check_choice(request, fn(request))
            else:
                chosen = holders[0]
            c = cands[holders.index(chosen)]
        if recorder is not None:
            recorder(c[0], n * itemsize)
        append((c[0], c[1], c[2], trank, toff, tstr, xo, xe))
    return sorted_rows(raw, ndim)


def _uncovered(
    origin: tuple[int, ...], extent: tuple[int, ...], parts: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> Box | str:
    """Some box of ``origin, extent`` outside every part (for error messages; bounded work)."""
    gaps = [(origin, extent)]
    budget = 1 << 14
    for po, pe in parts:
        nxt = []
        for go, ge in gaps:
            budget -= 1
            if budget < 0:
                return "(not located)"
            nxt.extend(_subtract(go, ge, po, pe))
        gaps = nxt
        if not gaps:
            return "(not located)"
    return Box(gaps[0][0], gaps[0][1])


def _subtract(
    go: tuple[int, ...], ge: tuple[int, ...], po: tuple[int, ...], pe: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    lo = [max(a, b) for a, b in zip(go, po, strict=True)]
    hi = [min(a + x, b + y) for a, x, b, y in zip(go, ge, po, pe, strict=True)]
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return [(go, ge)]
    origin = list(go)
    extent = list(ge)
    out = []
    for d in range(len(go)):
        if origin[d] < lo[d]:
            e = list(extent)
            e[d] = lo[d] - origin[d]
            out.append((tuple(origin), tuple(e)))
            extent[d] -= e[d]
            origin[d] = lo[d]
        end = origin[d] + extent[d]
        if hi[d] < end:
            o = list(origin)
            e = list(extent)
            o[d] = hi[d]
            e[d] = end - hi[d]
            out.append((tuple(o), tuple(e)))
            extent[d] = hi[d] - origin[d]
    return out

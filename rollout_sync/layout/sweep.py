"""Which boxes overlap (a plane sweep, not all pairs), and where a set of boxes leaves a hole.

Boxes are plain ``(origin, extent)`` tuples of ints, all of one ndim and none empty (every extent >= 1).
Two queries serve validation and planning:

- ``first_overlap(boxes)``: some pair of boxes of one set that share an element, or None;
- ``overlapping_pairs(a, b)``: every pair ``(i, j)`` with ``a[i]`` and ``b[j]`` sharing an element, where
  the boxes of ``a`` are pairwise disjoint and so are those of ``b`` (validated maps guarantee this);
- ``first_uncovered(shape, boxes)``: the first position of a tensor that disjoint boxes leave uncovered.

The sweep runs along axis 0. A box is *active* while the sweep coordinate is inside its axis-0 range; a pair
is reported when the later of its two boxes enters, against the boxes of the other set that are active.
Active boxes of one (disjoint) set that share a coordinate on axis 0 are disjoint on the remaining axes, so
in 2-D their axis-1 ranges are disjoint intervals: a sorted list answers "which overlap [lo, hi)" by
bisection. In 3-D and more, the axis-1 ranges of active boxes may overlap; there the candidates are those
whose axis-1 start lies within the longest axis-1 extent of the query's range, checked on every axis.
Cost: ``O((n + m) log(n + m) + pairs)`` for the layouts maps describe (partitions of a tensor); small
inputs are compared pair by pair, which is faster than sorting events.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from operator import add, lt

BoxTuple = tuple[tuple[int, ...], tuple[int, ...]]

_SMALL = 48  # up to this many pair tests, compare directly
_BIG = 1 << 62


def boxes_overlap(ao: tuple[int, ...], ae: tuple[int, ...], bo: tuple[int, ...], be: tuple[int, ...]) -> bool:
    """Whether two non-empty boxes share an element."""
    return all(map(lt, ao, map(add, bo, be))) and all(map(lt, bo, map(add, ao, ae)))


def first_overlap(boxes: Sequence[BoxTuple]) -> tuple[int, int] | None:
    """A pair ``(i, j)``, ``i < j``, of boxes that share an element, or None when all are disjoint."""
    n = len(boxes)
    if n < 2:
        return None
    ndim = len(boxes[0][1])
    if ndim == 0:
        return (0, 1)
    if n * (n - 1) // 2 <= _SMALL:
        for i in range(n):
            ao, ae = boxes[i]
            for j in range(i + 1, n):
                bo, be = boxes[j]
                if boxes_overlap(ao, ae, bo, be):
                    return (i, j)
        return None
    if ndim == 1:
        order = sorted(range(n), key=lambda k: boxes[k][0][0])
        prev = order[0]
        prev_end = boxes[prev][0][0] + boxes[prev][1][0]
        for k in order[1:]:
            start = boxes[k][0][0]
            if start < prev_end:
                return (min(prev, k), max(prev, k))
            end = start + boxes[k][1][0]
            if end > prev_end:
                prev, prev_end = k, end
        return None
    events: list[tuple[int, int, int]] = []
    for i, (o, e) in enumerate(boxes):
        events.append((o[0], 1, i))
        events.append((o[0] + e[0], 0, i))
    events.sort()
    active: list[tuple[int, int, int]] = []
    maxlen = max(e[1] for _, e in boxes)
    for _, kind, i in events:
        o, e = boxes[i]
        key = (o[1], o[1] + e[1], i)
        if kind == 0:
            del active[bisect_left(active, key)]
            continue
        for j in _candidates(active, key[0], key[1], ndim, maxlen):
            if ndim == 2 or boxes_overlap(o, e, boxes[j][0], boxes[j][1]):
                return (min(i, j), max(i, j))
        insort(active, key)
    return None


def overlapping_pairs(a: Sequence[BoxTuple], b: Sequence[BoxTuple]) -> list[tuple[int, int]]:
    """Every ``(i, j)`` such that ``a[i]`` and ``b[j]`` share an element (in no particular order).

    Precondition: the boxes of ``a`` are pairwise disjoint, and so are those of ``b``.
    """
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return []
    ndim = len(a[0][1])
    if ndim == 0:
        return [(i, j) for i in range(n) for j in range(m)]
    if n * m <= _SMALL:
        out = []
        b_ends = [tuple(map(add, o, e)) for o, e in b]
        for i in range(n):
            ao, ae = a[i]
            a_end = tuple(map(add, ao, ae))
            for j in range(m):
                # overlap on every axis: each start is below the other's end
                if all(map(lt, ao, b_ends[j])) and all(map(lt, b[j][0], a_end)):
                    out.append((i, j))
        return out
    if ndim == 1:
        return _interval_pairs(a, b)
    # Event kinds, in processing order at one coordinate: ends (a, b), then starts of a, then starts of b.
    events: list[tuple[int, int, int]] = []
    for i, (o, e) in enumerate(a):
        events.append((o[0], 2, i))
        events.append((o[0] + e[0], 0, i))
    for j, (o, e) in enumerate(b):
        events.append((o[0], 3, j))
        events.append((o[0] + e[0], 1, j))
    events.sort()
    active_a: list[tuple[int, int, int]] = []
    active_b: list[tuple[int, int, int]] = []
    max_a = max(e[1] for _, e in a)
    max_b = max(e[1] for _, e in b)
    found: list[tuple[int, int]] = []
    for _, kind, k in events:
        if kind == 0:
            o, e = a[k]
            del active_a[bisect_left(active_a, (o[1], o[1] + e[1], k))]
        elif kind == 1:
            o, e = b[k]
            del active_b[bisect_left(active_b, (o[1], o[1] + e[1], k))]
        elif kind == 2:
            o, e = a[k]
            key = (o[1], o[1] + e[1], k)
            for j in _candidates(active_b, key[0], key[1], ndim, max_b):
                if ndim == 2 or boxes_overlap(o, e, b[j][0], b[j][1]):
                    found.append((k, j))
            insort(active_a, key)
        else:
            o, e = b[k]
            key = (o[1], o[1] + e[1], k)
            for i in _candidates(active_a, key[0], key[1], ndim, max_a):
                if ndim == 2 or boxes_overlap(a[i][0], a[i][1], o, e):
                    found.append((i, k))
            insort(active_b, key)
    return found


def _candidates(active: list[tuple[int, int, int]], lo: int, hi: int, ndim: int, maxlen: int) -> list[int]:
    """Indices of active boxes whose axis-1 range meets ``[lo, hi)``.

    In 2-D the active ranges are disjoint and sorted, so their ends are sorted too: the answer is one run of
    the list. In more dimensions, scan the starts in ``(lo - maxlen, hi)`` and keep those ending after lo.
    """
    if ndim == 2:
        pos = bisect_right(active, (lo, _BIG, _BIG)) - 1
        if pos < 0 or active[pos][1] <= lo:
            pos += 1
        out = []
        size = len(active)
        while pos < size:
            start, _, idx = active[pos]
            if start >= hi:
                break
            out.append(idx)
            pos += 1
        return out
    pos = bisect_left(active, (lo - maxlen + 1,))
    out = []
    size = len(active)
    while pos < size:
        start, end, idx = active[pos]
        if start >= hi:
            break
        if end > lo:
            out.append(idx)
        pos += 1
    return out


def _interval_pairs(a: Sequence[BoxTuple], b: Sequence[BoxTuple]) -> list[tuple[int, int]]:
    """1-D: two sorted lists of disjoint intervals, walked together."""
    sa = sorted(range(len(a)), key=lambda k: a[k][0][0])
    sb = sorted(range(len(b)), key=lambda k: b[k][0][0])
    out = []
    i = j = 0
    while i < len(sa) and j < len(sb):
        ia, jb = sa[i], sb[j]
        a0 = a[ia][0][0]
        a1 = a0 + a[ia][1][0]
        b0 = b[jb][0][0]
        b1 = b0 + b[jb][1][0]
        if a0 < b1 and b0 < a1:
            out.append((ia, jb))
        if a1 <= b1:
            i += 1
        else:
            j += 1
    return out


def first_uncovered(shape: Sequence[int], boxes: Sequence[BoxTuple]) -> tuple[int, ...] | None:
    """The first position of a tensor of ``shape``, in row-major order, that no box of ``boxes`` (pairwise
    disjoint, inside the tensor) contains; None when they cover it all.

    Along axis 0 the boxes containing a coordinate change only at box origins and ends, so only those
    coordinates (and 0) are candidates; at each, in order, the boxes containing it are projected onto the
    remaining axes and searched the same way. Cost: ``O(n²)`` in the number of boxes per axis, fine for the
    boxes one engine holds of one tensor."""
    if not shape:
        return None if boxes else ()
    if 0 in shape:
        return None
    n = shape[0]
    cuts = sorted({0, *(o[0] for o, _ in boxes), *(o[0] + e[0] for o, e in boxes)})
    for c in cuts:
        if c >= n:
            break
        inside = [(o[1:], e[1:]) for o, e in boxes if o[0] <= c < o[0] + e[0]]
        rest = first_uncovered(shape[1:], inside)
        if rest is not None:
            return (c, *rest)
    return None

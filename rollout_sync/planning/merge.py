"""Merging segments whose address maps continue, so plans stay small.

Two segments of one tensor merge along axis ``d`` when they go between the same source and target ranks,
are adjacent in the logical tensor along ``d`` (same origin and extent on every other axis), and on each
side one ``as_strided`` view covers both: the strides of axes with extent > 1 agree, and the second
segment starts exactly one step of the merged stride along ``d`` after the first one ends. The merged
stride along ``d`` is the stride of whichever segment spans more than one index there, or, when both span
one, the (positive) distance between their offsets.

Linear per pass: segments are indexed by where they start, each segment looks up the one that would
continue it, and chains are folded in input order. Passes run over the axes from last to first until a
full round merges nothing. Deterministic: the result depends only on the input order.
"""

from __future__ import annotations

# A raw segment: (source rank, source offset, source strides, target rank, target offset, target strides,
# logical origin, extent).
Raw = tuple[int, int, tuple[int, ...], int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def merge_segments(segments: list[Raw], ndim: int) -> list[Raw]:
    """Fold mergeable segments (see the module docstring); the input list is not modified. Only segments
    between the same two ranks can merge, so each (source rank, target rank) group is folded alone."""
    if len(segments) < 2 or ndim == 0:
        return segments
    groups: dict[tuple[int, int], list[Raw]] = {}
    for s in segments:
        key = (s[0], s[3])
        got = groups.get(key)
        if got is None:
            groups[key] = [s]
        else:
            got.append(s)
    if len(groups) == len(segments):
        return segments
    out: list[Raw] = []
    for group in groups.values():
        if len(group) == 1:
            out.append(group[0])
            continue
        while True:
            before = len(group)
            for d in range(ndim - 1, -1, -1):
                group = _merge_axis(group, d)
            if len(group) == before or len(group) < 2:
                break
        out.extend(group)
    return out


def _merge_axis(segs: list[Raw], d: int) -> list[Raw]:
    """One pass along axis ``d`` over segments that all go between the same two ranks."""
    n = len(segs)
    if n < 2:
        return segs
    start: dict[tuple[int, ...], int] = {s[6]: i for i, s in enumerate(segs)}
    nxt = [-1] * n
    has_prev = bytearray(n)
    linked = False
    for i, s in enumerate(segs):
        o = list(s[6])
        o[d] += s[7][d]
        j = start.get(tuple(o))
        if j is not None and segs[j][7][:d] == s[7][:d] and segs[j][7][d + 1 :] == s[7][d + 1 :]:
            nxt[i] = j
            has_prev[j] = 1
            linked = True
    if not linked:
        return segs
    out: list[Raw] = []
    for i in range(n):
        if has_prev[i]:
            continue
        cur = segs[i]
        j = nxt[i]
        while j >= 0:
            joined = _join(cur, segs[j], d)
            if joined is None:
                out.append(cur)
                cur = segs[j]
            else:
                cur = joined
            j = nxt[j]
        out.append(cur)
    return out


def _join(a: Raw, b: Raw, d: int) -> Raw | None:
    ea = a[7]
    eb = b[7]
    src = _continue(a[1], a[2], b[1], b[2], ea, eb, d)
    if src is None:
        return None
    tgt = _continue(a[4], a[5], b[4], b[5], ea, eb, d)
    if tgt is None:
        return None
    extent = (*ea[:d], ea[d] + eb[d], *ea[d + 1 :])
    return (a[0], a[1], src, a[3], a[4], tgt, a[6], extent)


def _continue(
    oa: int,
    sa: tuple[int, ...],
    ob: int,
    sb: tuple[int, ...],
    ea: tuple[int, ...],
    eb: tuple[int, ...],
    d: int,
) -> tuple[int, ...] | None:
    """The merged strides of one side, or None when one view cannot cover both segments."""
    for k in range(len(ea)):
        if k != d and ea[k] > 1 and sa[k] != sb[k]:
            return None
    if ea[d] > 1:
        step = sa[d]
        if eb[d] > 1 and sb[d] != step:
            return None
    elif eb[d] > 1:
        step = sb[d]
    else:
        step = ob - oa
        if step <= 0:
            return None
    if ob != oa + ea[d] * step:
        return None
    if sa[d] == step:
        return sa
    return (*sa[:d], step, *sa[d + 1 :])

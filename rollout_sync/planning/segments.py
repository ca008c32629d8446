"""Segment construction shared by the planners (``planner``, ``rank_half``): the intersection of a source
region with a target region, and a tensor's flat records from its raw segments.

A segment reads the intersected box at the source holder's address and writes it at the target holder's
address; both addresses move to the intersection's origin by ``offset + Σ shift[d] · strides[d]``.
"""

from __future__ import annotations

from operator import add, sub

from .merge import Raw, merge_segments

__all__ = ["intersection", "sorted_rows"]


def intersection(
    so: tuple[int, ...], se: tuple[int, ...], to: tuple[int, ...], t_end: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(origin, extent, source shift, target shift)`` of the box where the source region ``(so, se)``
    meets the target region that starts at ``to`` and ends before ``t_end``; the shifts are the
    intersection's origin relative to each region's origin. The regions must overlap."""
    xo = tuple(map(max, so, to))
    xe = tuple(map(sub, map(min, map(add, so, se), t_end), xo))
    return xo, xe, tuple(map(sub, xo, so)), tuple(map(sub, xo, to))


def sorted_rows(raw: list[Raw], ndim: int) -> list[tuple[int, ...]]:
    """A tensor's flat records (``rollout_sync.planning.records`` layout) from its raw segments: merged
    (``merge_segments``), then sorted by target rank, target offset, source rank, source offset."""
    merged = merge_segments(raw, ndim)
    rows = [(r[0], r[1], r[3], r[4], *r[2], *r[5], *r[7]) for r in merged]
    rows.sort(key=lambda r: (r[2], r[3], r[0], r[1]))
    return rows

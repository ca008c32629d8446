"""The pieces one shard storage holds, before their holders are known: for a ``Whole`` storage or one
``FlatRun`` of a shard (``layout.shards``), every block part it stores as an **entry** ``(logical origin,
extent, offset, strides)``. ``layout.nesting.nest`` turns entries into ``Piece`` objects once it knows which
ranks hold each box.

A flat run of an N-D shard becomes at most ``2·ndim − 1`` boxes per block of the shard (``flat_run_boxes``),
never one piece per row. Address conventions (the live adapters take exactly these views):

- ``Whole``: the storage is the shard itself, shape ``Shard.shape``, row-major. A block at
  ``shard_origin`` has ``offset = Σ shard_origin[d]·S[d]`` and ``strides = S``, ``S`` the row-major strides
  of the shard shape.
- ``FlatRuns``: the storage of ``FlatRun(rank, start, stop)`` is the 1-D tensor of ``stop − start``
  elements holding elements ``[start, stop)`` of the shard's row-major flattening. Every piece is one dense
  run there: ``offset`` = its first element's flat position minus ``start``, ``strides`` = the row-major
  strides of the piece's own extent. A run of zero length is an empty storage of shape ``(0,)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from math import prod

from .box import row_major_strides
from .runs import flat_run_boxes
from .shards import Shard

__all__ = ["Entry", "Span", "run_entries", "whole_entries"]

# A piece without its holders: (logical origin, extent, offset, strides). Plain tuples keep the inner loops
# cheap.
Entry = tuple[tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]

Span = tuple[tuple[int, ...], tuple[int, ...]]  # (origin, extent) of a box


def whole_entries(shard: Shard) -> list[Entry]:
    """The entries of a shard stored whole (``Whole``), in storage order."""
    strides = row_major_strides(shard.shape)
    entries: list[Entry] = []
    for block in shard.blocks:
        if 0 in block.extent:
            continue
        offset = 0
        for o, s in zip(block.shard_origin, strides, strict=True):
            offset += o * s
        entries.append((block.logical_origin, block.extent, offset, strides))
    entries.sort(key=lambda e: e[2])
    return entries


def run_entries(shard: Shard, start: int, stop: int) -> list[Entry]:
    """The entries of the flat run ``[start, stop)`` of a shard (one ``FlatRun``), each one dense run of that
    storage, in storage order."""
    if start == stop:
        return []
    shard_shape = shard.shape
    sboxes = _run_boxes(shard_shape, start, stop)
    blocks = shard.blocks
    entries: list[Entry] = []
    if len(blocks) == 1 and blocks[0].extent == shard_shape:
        # One block covers the shard: translate each run box by the block's logical origin.
        lo = blocks[0].logical_origin
        pos = 0
        if len(shard_shape) == 2:
            l0, l1 = lo
            for (o0, o1), ext in sboxes:
                e1 = ext[1]
                entries.append(((o0 + l0, o1 + l1), ext, pos, (e1, 1)))
                pos += ext[0] * e1
            return entries
        for origin, ext in sboxes:
            entries.append(
                (tuple(o + g for o, g in zip(origin, lo, strict=True)), ext, pos, row_major_strides(ext))
            )
            pos += prod(ext)
        return entries
    sstrides = row_major_strides(shard_shape)
    for b_origin, b_extent in sboxes:
        for block in blocks:
            sub = _intersect(b_origin, b_extent, block.shard_origin, block.extent)
            if sub is None:
                continue
            for origin, extent in _dense_parts(sub[0], sub[1], shard_shape):
                flat = 0
                for o, s in zip(origin, sstrides, strict=True):
                    flat += o * s
                logical = tuple(
                    o - so + lo
                    for o, so, lo in zip(origin, block.shard_origin, block.logical_origin, strict=True)
                )
                entries.append((logical, extent, flat - start, row_major_strides(extent)))
    entries.sort(key=lambda e: e[2])
    return entries


def _run_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Span]:
    """``flat_run_boxes`` on plain tuples (same boxes, same order; a hot loop of every ZeRO-3 map)."""
    if start == stop:
        return []
    ndim = len(shape)
    if ndim == 1:
        return [((start,), (stop - start,))]
    if ndim == 2:
        cols = shape[1]
        r0, c0 = divmod(start, cols)
        r1, c1 = divmod(stop, cols)
        if r0 == r1:
            return [((r0, c0), (1, c1 - c0))]
        out: list[Span] = []
        if c0:
            out.append(((r0, c0), (1, cols - c0)))
            r0 += 1
        if r1 > r0:
            out.append(((r0, 0), (r1 - r0, cols)))
        if c1:
            out.append(((r1, 0), (1, c1)))
        return out
    return [(b.origin, b.extent) for b in flat_run_boxes(shape, start, stop)]


def _intersect(
    a0: tuple[int, ...], ae: tuple[int, ...], b0: tuple[int, ...], be: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    origin = []
    extent = []
    for x0, xe, y0, ye in zip(a0, ae, b0, be, strict=True):
        lo = x0 if x0 > y0 else y0
        hi = min(x0 + xe, y0 + ye)
        if hi <= lo:
            return None
        origin.append(lo)
        extent.append(hi - lo)
    return tuple(origin), tuple(extent)


def _dense_parts(
    origin: tuple[int, ...], extent: tuple[int, ...], shape: tuple[int, ...]
) -> Iterable[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split a box of a row-major ``shape`` into boxes that are each one dense run of the flattening, in
    flat order. A box is dense when every axis after its first axis of extent > 1 is whole."""
    ndim = len(shape)
    first = 0
    while first < ndim and extent[first] == 1:
        first += 1
    if all(extent[d] == shape[d] for d in range(first + 1, ndim)):
        yield origin, extent
        return
    # Not dense: cut into unit slabs along the first non-unit axis, each then checked again.
    for i in range(extent[first]):
        o = (*origin[:first], origin[first] + i, *origin[first + 1 :])
        e = (*extent[:first], 1, *extent[first + 1 :])
        yield from _dense_parts(o, e, shape)

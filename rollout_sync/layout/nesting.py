"""Nesting: a layout map composed with per-shard storage descriptions gives a ``TensorMap`` in global ranks.

Two facts describe where a trainer or an inference engine keeps a logical tensor:

1. the **layout**: which *shard* of the logical tensor each group rank holds (a TP shard of rows, an EP
   rank's experts, a fused sub-parameter's slice). Layout ranks are group ranks (TP rank, EP rank, ...);
   a shard is a tensor of its own shape whose elements are blocks of the logical tensor
   (``Shard``/``ShardBlock``);
2. the **storage** of each shard on global ranks (``Whole`` or ``FlatRuns``): kept whole, as an N-D
   tensor of the shard's shape, on one or several replica ranks (a vLLM parameter view, a ZeRO-0/1/2
   ``param.data``), or cut into flat runs of the shard's row-major flattening (ZeRO-3 ``ds_tensor``
   partitions, padding excluded).

``nest`` composes the two. A flat run of an N-D shard becomes at most ``2·ndim − 1`` boxes per block of the
shard (``flat_run_boxes``), never one piece per row. Holders (replicas) are the global ranks whose
storage holds exactly the same box of the logical tensor; two storages that cut the same replicated
region differently are refused (``UnsupportedLayoutError``), as is a layout that leaves a hole or
overlaps itself.

Address conventions of the produced pieces (the live adapters take exactly these views):

- ``Whole``: the storage is the shard itself, shape ``Shard.shape``, row-major. A block at
  ``shard_origin`` has ``offset = Σ shard_origin[d]·S[d]`` and ``strides = S``, ``S`` the row-major strides
  of the shard shape.
- ``FlatRuns``: the storage of ``FlatRun(rank, start, stop)`` is the 1-D tensor of ``stop − start``
  elements holding elements ``[start, stop)`` of the shard's row-major flattening. Every piece is one dense
  run there: ``offset`` = its first element's flat position minus ``start``, ``strides`` = the row-major
  strides of the piece's own extent. A run of zero length is an empty storage of shape ``(0,)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import prod
from typing import Union

from ..errors import HoleError, LayoutError, OutOfBoundsError, OverlapError, UnsupportedLayoutError
from .box import Box, row_major_strides
from .maps import Piece, RankStorage, TensorMap
from .runs import flat_run_boxes

__all__ = [
    "FlatRun",
    "FlatRuns",
    "Layout",
    "Shard",
    "ShardBlock",
    "ShardStorage",
    "Whole",
    "nest",
]


@dataclass(frozen=True, slots=True)
class ShardBlock:
    """A block of a shard that is a block of the logical tensor:
    ``shard[shard_origin + i] == logical[logical_origin + i]`` for ``0 <= i < extent``."""

    shard_origin: tuple[int, ...]
    logical_origin: tuple[int, ...]
    extent: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Shard:
    """What one layout rank holds of a logical tensor: a tensor of ``shape`` tiled by ``blocks``.

    A plain TP shard is one block (``Shard.of_box``); a fused sub-parameter shard (a rank's q, k and v
    slices stacked in one tensor) or a packed set of experts has several. An empty shard (a vocab shard
    that is all padding) has a shape with a zero and no blocks.
    """

    shape: tuple[int, ...]
    blocks: tuple[ShardBlock, ...]

    @staticmethod
    def of_box(origin: tuple[int, ...], extent: tuple[int, ...]) -> Shard:
        """The shard that is exactly the box ``origin, extent`` of the logical tensor."""
        if prod(extent) == 0:
            return Shard(tuple(extent), ())
        return Shard(tuple(extent), (ShardBlock((0,) * len(extent), tuple(origin), tuple(extent)),))


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the shards of one logical tensor sit: ``shards[layout_rank]``. Layout ranks are group ranks
    (TP or EP ranks); a layout rank that holds nothing of the tensor is absent."""

    name: str
    shape: tuple[int, ...]
    shards: Mapping[int, Shard]


@dataclass(frozen=True, slots=True)
class Whole:
    """The shard is stored whole, as an N-D tensor of the shard's shape (row-major), on each of
    ``ranks`` (global ranks; several ranks are replicas)."""

    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FlatRun:
    """Global ``rank`` stores elements ``[start, stop)`` of the shard's row-major flattening as a 1-D
    storage of ``stop − start`` elements."""

    rank: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class FlatRuns:
    """The shard is stored as flat runs, one per global rank (ZeRO-3 partitions, padding excluded).
    Runs of different ranks may repeat (replicated partitions) but every element of the shard must be in
    some run."""

    runs: tuple[FlatRun, ...]


ShardStorage = Union[Whole, FlatRuns]  # noqa: UP007 (runtime alias; keeps Python 3.10 happy)

# Internal piece record: (logical origin, extent, offset, strides). Plain tuples keep the inner loops cheap.
_Entry = tuple[tuple[int, ...], tuple[int, ...], int, tuple[int, ...]]


def nest(layout: Layout, storages: Mapping[int, ShardStorage], *, dtype: str) -> TensorMap:
    """Compose a layout with the storage of each of its shards into a ``TensorMap`` in global ranks.

    ``storages[layout_rank]`` says how the shard of ``layout.shards[layout_rank]`` is stored. Every global
    rank stores at most one shard (a rank holds one storage per logical tensor). Raises ``LayoutError``
    subclasses naming the tensor, the rank and the box when a block leaves its shard or the logical
    tensor, blocks of a shard overlap or leave a hole, a run leaves its shard, a global rank stores two
    shards, the layout does not cover the tensor exactly once (replicas aside), or replicas of one region
    are cut differently.
    """
    name = layout.name
    shape = tuple(layout.shape)
    if set(storages) != set(layout.shards):
        raise LayoutError(
            "layout ranks and storage descriptions differ",
            tensor=name,
            expected=sorted(layout.shards),
            found=sorted(storages),
        )
    per_rank: dict[int, tuple[tuple[int, ...], list[_Entry]]] = {}
    run_cache: dict[tuple[int, int, int], list[_Entry]] = {}
    checked: set[int] = set()  # a replicated layout repeats one shard object
    for layout_rank, shard in layout.shards.items():
        if id(shard) not in checked:
            _check_shard(name, shape, layout_rank, shard)
            checked.add(id(shard))
        storage = storages[layout_rank]
        if isinstance(storage, Whole):
            entries = _whole_entries(shard)
            for rank in storage.ranks:
                _claim(per_rank, name, rank, layout_rank, shard.shape, entries)
        elif isinstance(storage, FlatRuns):
            numel = prod(shard.shape)
            for run in storage.runs:
                if not 0 <= run.start <= run.stop <= numel:
                    raise OutOfBoundsError(
                        "flat run leaves its shard",
                        tensor=name,
                        rank=run.rank,
                        expected=f"0 <= start <= stop <= {numel} (shard {shard.shape} of layout rank {layout_rank})",
                        found=f"[{run.start}, {run.stop})",
                    )
                key = (id(shard), run.start, run.stop)
                cached = run_cache.get(key)  # replicated shards: the same shard object, the same runs
                if cached is None:
                    cached = run_cache[key] = _run_entries(shard, run.start, run.stop)
                entries = cached
                _claim(per_rank, name, run.rank, layout_rank, (run.stop - run.start,), entries)
        else:
            raise LayoutError(
                "unknown storage description", tensor=name, expected="Whole or FlatRuns", found=type(storage)
            )
    return _assemble(name, shape, dtype, per_rank)


def _check_shard(name: str, shape: tuple[int, ...], layout_rank: int, shard: Shard) -> None:
    ndim = len(shape)
    if len(shard.shape) != ndim:
        raise LayoutError(
            "shard has another number of dimensions than its logical tensor",
            tensor=name,
            expected=shape,
            found=f"shard {shard.shape} of layout rank {layout_rank}",
        )
    total = 0
    for block in shard.blocks:
        if len(block.shard_origin) != ndim or len(block.logical_origin) != ndim or len(block.extent) != ndim:
            raise LayoutError(
                "shard block has another number of dimensions than its logical tensor",
                tensor=name,
                expected=ndim,
                found=block,
            )
        for d in range(ndim):
            e = block.extent[d]
            s = block.shard_origin[d]
            g = block.logical_origin[d]
            if e < 0 or s < 0 or g < 0 or s + e > shard.shape[d] or g + e > shape[d]:
                raise OutOfBoundsError(
                    "shard block leaves its shard or the logical tensor",
                    tensor=name,
                    box=Box(block.logical_origin, block.extent) if min(block.extent) >= 0 else None,
                    expected=f"inside shard {shard.shape} (layout rank {layout_rank}) and tensor {shape}",
                    found=block,
                )
        total += prod(block.extent)
    if total != prod(shard.shape):
        raise HoleError(
            "shard blocks do not tile their shard",
            tensor=name,
            expected=f"{prod(shard.shape)} elements (shard {shard.shape} of layout rank {layout_rank})",
            found=f"{total} elements in {len(shard.blocks)} blocks",
        )
    blocks = shard.blocks
    # Pairwise check for the usual few blocks; past 256 blocks an overlap is left to the TensorMap's own
    # validation (two pieces overlapping in one storage).
    if 1 < len(blocks) <= 256:
        for i in range(len(blocks)):
            a = Box(blocks[i].shard_origin, blocks[i].extent)
            for j in range(i + 1, len(blocks)):
                if a.intersect(Box(blocks[j].shard_origin, blocks[j].extent)) is not None:
                    raise OverlapError(
                        "two blocks of one shard overlap",
                        tensor=name,
                        expected=f"disjoint blocks in shard {shard.shape} of layout rank {layout_rank}",
                        found=(blocks[i], blocks[j]),
                    )


def _claim(
    per_rank: dict[int, tuple[tuple[int, ...], list[_Entry]]],
    name: str,
    rank: int,
    layout_rank: int,
    storage_shape: tuple[int, ...],
    entries: list[_Entry],
) -> None:
    if rank in per_rank:
        raise LayoutError(
            "a global rank stores two shards of one logical tensor",
            tensor=name,
            rank=rank,
            expected="one storage per rank",
            found=f"a second shard (layout rank {layout_rank})",
        )
    per_rank[rank] = (storage_shape, entries)


def _whole_entries(shard: Shard) -> list[_Entry]:
    strides = row_major_strides(shard.shape)
    entries: list[_Entry] = []
    for block in shard.blocks:
        if 0 in block.extent:
            continue
        offset = 0
        for o, s in zip(block.shard_origin, strides, strict=True):
            offset += o * s
        entries.append((block.logical_origin, block.extent, offset, strides))
    entries.sort(key=lambda e: e[2])
    return entries


def _run_entries(shard: Shard, start: int, stop: int) -> list[_Entry]:
    if start == stop:
        return []
    shard_shape = shard.shape
    sboxes = _run_boxes(shard_shape, start, stop)
    blocks = shard.blocks
    entries: list[_Entry] = []
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


_Span = tuple[tuple[int, ...], tuple[int, ...]]


def _run_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[_Span]:
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
        out: list[_Span] = []
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


def _assemble(
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    per_rank: dict[int, tuple[tuple[int, ...], list[_Entry]]],
) -> TensorMap:
    holders: dict[_Span, list[int]] = {}
    for rank, (_, entries) in per_rank.items():
        for entry in entries:
            key = (entry[0], entry[1])
            got = holders.get(key)
            if got is None:
                holders[key] = [rank]
            else:
                got.append(rank)
    numel = prod(shape)
    covered = 0
    for _, extent in holders:
        covered += prod(extent)
    if covered != numel:
        if covered > numel:
            raise UnsupportedLayoutError(
                "pieces of one region overlap without being the same box on every holder (replicas cut "
                "differently, or overlapping shards)",
                tensor=name,
                expected=f"{numel} elements in distinct boxes",
                found=f"{covered} elements",
            )
        raise HoleError(
            "the layout does not cover the logical tensor",
            tensor=name,
            expected=f"{numel} elements of {shape}",
            found=f"{covered} elements covered",
        )
    boxes = {key: (Box(key[0], key[1]), tuple(sorted(ranks))) for key, ranks in holders.items()}
    piece_cache: dict[_Entry, Piece] = {}
    ranks: dict[int, RankStorage] = {}
    for rank in sorted(per_rank):
        storage_shape, entries = per_rank[rank]
        pieces = []
        for entry in entries:
            piece = piece_cache.get(entry)
            if piece is None:
                box, held_by = boxes[(entry[0], entry[1])]
                piece = piece_cache[entry] = Piece(box, entry[2], entry[3], held_by)
            pieces.append(piece)
        ranks[rank] = RankStorage(storage_shape, tuple(pieces))
    return TensorMap(name, shape, dtype, ranks)

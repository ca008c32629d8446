"""Validation of one map, run when a ``TensorMap`` is built, and its normalized form (regions).

What a map must satisfy (each failure is a typed error naming the tensor, the rank and the box):

- every box has the tensor's ndim (``ShapeMismatchError``) and lies inside it (``OutOfBoundsError``);
- addressing (``NotAffineError``): in a storage with the tensor's ndim, every axis of a piece with extent
  > 1 steps along a distinct storage axis by that axis's row-major stride (so a permuted, e.g. transposed,
  storage is legal and the piece is a box of the storage); in a storage of any other ndim (flat, or a 2-D
  storage of a 3-D tensor) the piece must be one dense run (row-major strides of its own extent);
- the pieces of one storage tile it exactly: no two overlap (``OverlapError``), no element is left
  undescribed (``HoleError``), none reaches past its end (``OutOfBoundsError``);
- holders (``CoverageError``): a piece is listed under each of its holders, with the same box and the same
  holders, and under no other rank;
- the distinct boxes of the map are pairwise disjoint in the logical tensor (``OverlapError``): one element
  has one set of holders, so a replica that is cut differently, or a rank holding an element twice, is
  refused.

Cost: ``O(p log p)`` for ``p`` pieces (sorting, hashing and a sweep; never all pairs of pieces).

The normalized form is the tuple of **regions**: one per distinct box, ``(origin, extent, addresses)``
sorted by origin, where ``addresses`` holds ``(rank, offset, strides)`` for each holder in rank order.
Empty pieces (an extent of 0) hold nothing and are left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from operator import add, le
from typing import TYPE_CHECKING

from ..errors import (
    CoverageError,
    HoleError,
    NotAffineError,
    OutOfBoundsError,
    OverlapError,
    ShapeMismatchError,
)
from .box import Box, row_major_strides
from .sweep import first_overlap

if TYPE_CHECKING:
    from .maps import RankStorage

Address = tuple[int, int, tuple[int, ...]]  # (rank, offset, strides)
Region = tuple[tuple[int, ...], tuple[int, ...], tuple[Address, ...]]  # (origin, extent, addresses)

_RM_CACHE: dict[tuple[int, ...], tuple[int, ...]] = {}


def _rm(extent: tuple[int, ...]) -> tuple[int, ...]:
    got = _RM_CACHE.get(extent)
    if got is None:
        got = row_major_strides(extent)
        if len(_RM_CACHE) < 1 << 16:
            _RM_CACHE[extent] = got
    return got


def normalize(name: str, shape: tuple[int, ...], ranks: Mapping[int, RankStorage]) -> tuple[Region, ...]:
    """Validate a map (see the module docstring) and return its regions. ``ranks`` must iterate in rank
    order."""
    ndim = len(shape)
    regions: dict[
        tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], list[Address], list[int]]
    ] = {}
    for rank, storage in ranks.items():
        sshape = storage.shape
        if len(sshape) == ndim:
            _check_nd_storage(name, shape, rank, storage, regions)
        else:
            _check_flat_storage(name, shape, rank, storage, regions)
    _check_holders(name, regions)
    keys = sorted(regions)
    if len(keys) > 1:
        hit = first_overlap(keys)
        if hit is not None:
            (ao, ae), (bo, be) = keys[hit[0]], keys[hit[1]]
            a_holders, b_holders = regions[keys[hit[0]]][0], regions[keys[hit[1]]][0]
            raise OverlapError(
                "two distinct boxes of the map share elements of the logical tensor (one element must have one "
                "set of holders: a replica cut differently, or a rank holding an element twice)",
                tensor=name,
                rank=a_holders[0],
                box=Box(ao, ae),
                expected="disjoint boxes",
                found=f"box {Box(bo, be)} held by ranks {list(b_holders)} (the first by ranks {list(a_holders)})",
            )
    return tuple((o, e, tuple(regions[(o, e)][1])) for o, e in keys)


def _check_box(name: str, shape: tuple[int, ...], rank: int, box: Box) -> int:
    """Check a piece's box against the tensor; return its numel."""
    o = box.origin
    e = box.extent
    if len(e) != len(shape):
        raise ShapeMismatchError(
            "a piece's box has another number of axes than its logical tensor",
            tensor=name,
            rank=rank,
            box=box,
            expected=f"{len(shape)} axes (tensor {shape})",
            found=f"{len(e)} axes",
        )
    if not all(map(le, map(add, o, e), shape)):
        d = next(d for d in range(len(shape)) if o[d] + e[d] > shape[d])
        raise OutOfBoundsError(
            "a piece's box reaches past its logical tensor",
            tensor=name,
            rank=rank,
            box=box,
            expected=f"inside {shape}",
            found=f"axis {d} ends at {o[d] + e[d]}",
        )
    return prod(e)


def _add_region(
    name: str,
    regions: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], list[Address], list[int]]],
    rank: int,
    box: Box,
    holders: tuple[int, ...],
    offset: int,
    strides: tuple[int, ...],
) -> None:
    if rank not in holders:
        raise CoverageError(
            "a piece is listed under a rank that is not among its holders",
            tensor=name,
            rank=rank,
            box=box,
            expected=f"rank {rank} in holders",
            found=f"holders {list(holders)}",
        )
    key = (box.origin, box.extent)
    got = regions.get(key)
    if got is None:
        regions[key] = (holders, [(rank, offset, strides)], [rank])
        return
    if got[0] != holders:
        raise CoverageError(
            "one box is listed with different holders on different ranks",
            tensor=name,
            rank=rank,
            box=box,
            expected=f"holders {list(got[0])} (as listed on rank {got[1][0][0]})",
            found=f"holders {list(holders)}",
        )
    got[1].append((rank, offset, strides))
    got[2].append(rank)


def _check_flat_storage(
    name: str,
    shape: tuple[int, ...],
    rank: int,
    storage: RankStorage,
    regions: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], list[Address], list[int]]],
) -> None:
    """A storage whose ndim differs from the tensor's: every piece is one dense run of its flattening."""
    numel = prod(storage.shape)
    runs: list[tuple[int, int, Box]] = []
    for piece in storage.pieces:
        box = piece.box
        n = _check_box(name, shape, rank, box)
        if n == 0:
            continue
        extent = box.extent
        strides = piece.strides
        dense = _rm(extent)
        if strides != dense and any(extent[d] > 1 and strides[d] != dense[d] for d in range(len(extent))):
            raise NotAffineError(
                "a piece in a storage of another ndim than its tensor (a flat storage) must be one dense run",
                tensor=name,
                rank=rank,
                box=box,
                expected=f"strides {dense} (row-major of the extent) in storage {storage.shape}",
                found=f"strides {strides}",
            )
        start = piece.offset
        if start < 0 or start + n > numel:
            raise OutOfBoundsError(
                "a piece runs past the end of its storage",
                tensor=name,
                rank=rank,
                box=box,
                expected=f"elements inside [0, {numel}) of storage {storage.shape}",
                found=f"[{start}, {start + n})",
            )
        runs.append((start, start + n, box))
        _add_region(name, regions, rank, box, piece.holders, start, strides)
    runs.sort(key=lambda r: r[0])
    pos = 0
    prev: Box | None = None
    for start, stop, box in runs:
        if start < pos:
            raise OverlapError(
                "two pieces of one storage address the same elements",
                tensor=name,
                rank=rank,
                box=box,
                expected=f"a run starting at or after {pos} (end of box {prev})",
                found=f"run [{start}, {stop})",
            )
        if start > pos:
            raise HoleError(
                "a storage holds elements that no piece describes",
                tensor=name,
                rank=rank,
                box=box,
                expected=f"a run starting at {pos} in storage {storage.shape}",
                found=f"run [{start}, {stop}): elements [{pos}, {start}) are described by no piece",
            )
        pos = stop
        prev = box
    if pos != numel:
        raise HoleError(
            "a storage holds elements that no piece describes",
            tensor=name,
            rank=rank,
            box=prev,
            expected=f"pieces covering all {numel} elements of storage {storage.shape}",
            found=f"elements [{pos}, {numel}) are described by no piece",
        )


def _check_nd_storage(
    name: str,
    shape: tuple[int, ...],
    rank: int,
    storage: RankStorage,
    regions: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], list[Address], list[int]]],
) -> None:
    """A storage with the tensor's ndim: every piece is a box of the storage, axes possibly permuted."""
    sshape = storage.shape
    sstrides = _rm(sshape)
    pieces = storage.pieces
    if len(pieces) == 1:
        only = pieces[0]
        if only.offset == 0 and only.box.extent == sshape and only.strides == sstrides:
            # the piece is the whole storage, row-major (a TP shard, a vLLM parameter): nothing else to check
            if _check_box(name, shape, rank, only.box):
                _add_region(name, regions, rank, only.box, only.holders, 0, sstrides)
            return
    ndim = len(sshape)
    numel = prod(sshape)
    axis_of: dict[int, int] = {}
    for a in range(ndim):
        if sshape[a] > 1:
            axis_of[sstrides[a]] = a
    local: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    owners: list[Box] = []
    volume = 0
    for piece in storage.pieces:
        box = piece.box
        n = _check_box(name, shape, rank, box)
        if n == 0:
            continue
        extent = box.extent
        strides = piece.strides
        offset = piece.offset
        if offset < 0 or offset >= numel:
            raise OutOfBoundsError(
                "a piece starts outside its storage",
                tensor=name,
                rank=rank,
                box=box,
                expected=f"an offset inside [0, {numel}) of storage {sshape}",
                found=f"offset {offset}",
            )
        if strides == sstrides and all(map(le, extent, sshape)):
            lext_t = extent  # the storage's own axis order (the common case)
        else:
            lext_t = _permuted_extent(name, rank, box, sshape, sstrides, axis_of, strides)
        lorigin = []
        rest = offset
        for a in range(ndim):
            q, rest = divmod(rest, sstrides[a])
            lorigin.append(q)
        if not all(map(le, map(add, lorigin, lext_t), sshape)):
            a = next(a for a in range(ndim) if lorigin[a] + lext_t[a] > sshape[a])
            raise OutOfBoundsError(
                "a piece runs past the end of its storage",
                tensor=name,
                rank=rank,
                box=box,
                expected=f"inside storage {sshape}",
                found=f"storage axis {a} from {lorigin[a]} to {lorigin[a] + lext_t[a]} (offset {offset}, "
                f"strides {strides})",
            )
        local.append((tuple(lorigin), lext_t))
        owners.append(box)
        volume += n
        _add_region(name, regions, rank, box, piece.holders, offset, strides)
    if volume == numel and len(local) <= 1:
        return  # one box inside the storage with the storage's volume is the whole storage
    if len(local) > 1:
        hit = first_overlap(local)
        if hit is not None:
            raise OverlapError(
                "two pieces of one storage address the same elements",
                tensor=name,
                rank=rank,
                box=owners[hit[1]],
                expected="disjoint storage boxes",
                found=f"storage boxes {_fmt(local[hit[0]])} (box {owners[hit[0]]}) and {_fmt(local[hit[1]])}",
            )
    if volume != numel:
        raise HoleError(
            "a storage holds elements that no piece describes",
            tensor=name,
            rank=rank,
            box=owners[-1] if owners else None,
            expected=f"pieces covering all {numel} elements of storage {sshape}",
            found=f"{volume} elements described",
        )


def _permuted_extent(
    name: str,
    rank: int,
    box: Box,
    sshape: tuple[int, ...],
    sstrides: tuple[int, ...],
    axis_of: dict[int, int],
    strides: tuple[int, ...],
) -> tuple[int, ...]:
    """The extent of a piece along each storage axis, refusing strides that are not a permutation."""
    extent = box.extent
    lext = [1] * len(sshape)
    used = 0
    for d in range(len(extent)):
        if extent[d] > 1:
            a = axis_of.get(strides[d], -1)
            if a < 0 or used & (1 << a):
                raise NotAffineError(
                    "a piece's strides are not a permutation of its storage's axes (not an affine view "
                    "of the storage)",
                    tensor=name,
                    rank=rank,
                    box=box,
                    expected=f"each stride of an axis with extent > 1 from {sstrides} (storage {sshape}), "
                    "each storage axis once",
                    found=f"strides {strides}",
                )
            used |= 1 << a
            lext[a] = extent[d]
    return tuple(lext)


def _fmt(b: tuple[tuple[int, ...], tuple[int, ...]]) -> str:
    return str(Box(b[0], b[1]))


def _check_holders(
    name: str,
    regions: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], list[Address], list[int]]],
) -> None:
    for (o, e), (holders, _, listed) in regions.items():
        if len(listed) == len(holders) and tuple(listed) == holders:
            continue
        if len(set(listed)) != len(listed):
            twice = next(r for r in listed if listed.count(r) > 1)
            raise OverlapError(
                "a rank holds the same box twice in its storage",
                tensor=name,
                rank=twice,
                box=Box(o, e),
                expected="each element once per storage",
                found=f"box listed {listed.count(twice)} times",
            )
        missing = [h for h in holders if h not in listed]
        raise CoverageError(
            "a declared holder does not hold its box",
            tensor=name,
            rank=missing[0] if missing else listed[0],
            box=Box(o, e),
            expected=f"the box listed on every holder {list(holders)}",
            found=f"listed on ranks {listed}",
        )

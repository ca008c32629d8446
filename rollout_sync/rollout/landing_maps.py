"""Target maps from the landings of a loader probe (pure: no vLLM, no torch).

A ``Landing`` (``landings``) says which logical element of a tensor the loader wrote where in one
parameter. This module turns the landings of one tensor on one rank into that rank's part of its target
map and the ``StorageView`` of its storage (``target_map``); ``local_targets`` does so for every tensor.

Rule for the storage of one logical tensor on one rank (the planner wants exactly one storage per tensor
and rank, tiled exactly by its pieces):

- the elements must land in **one** parameter, which must be contiguous;
- they must fill **one contiguous flat range** ``[offset, offset + n)`` of that parameter with no hole (an
  element of the range that the tensor does not write is a hole: another tensor's element or padding).
  The range is the storage, so the executor can receive into it directly and padding is never written;
- inside the range, the correspondence must be a few affine pieces with positive strides
  (``torch.as_strided`` arguments relative to the range), at most ``max_pieces`` of them, that the
  planner can address: boxes of an N-D storage (strides a permutation of its row-major strides, so a
  transposed copy is fine) or dense runs of a flat one (``rollout_sync.layout.validate``).

Anything else (values that are not the probe's coordinates, elements written twice, a landing in two
parameters, a hole, reversed or permuted elements) means the loader transforms what it copies, or scatters it
in a way no single storage view describes; such a tensor is *refused* for in-place writes and goes through
vLLM's full-tensor ``load_weights`` path instead (``local_targets.fallback_map``). The rule covers fused qkv
and gate_up, row- and column-parallel shards, vocab shards without their padding rows, replicated tensors and
MoE experts split by TP or EP: in each the tensor's elements are one run of its parameter. A loader that
interleaves a tensor with another in one parameter (no single run without holes) is refused rather than
described by several storages: the planner does not take several storages per (tensor, rank).

The storage view's shape is the first that makes the pieces addressable of: the parameter's trailing
shape where the range is aligned to it (``q_proj``'s rows of ``qkv_proj.weight`` give ``(rows, hidden)``;
an expert's slab of ``w2_weight`` gives the slab's shape), the first piece's extent in storage-axis order
(a transposed copy in a flat parameter), flat ``(n,)`` (with the storage cut into dense runs instead).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from math import prod

import numpy as np

from ..errors import LayoutError, NotAffineError, OutOfBoundsError, UnsupportedLayoutError
from ..layout.box import Box, row_major_strides
from ..layout.maps import Piece, RankStorage, TensorMap
from .landings import CHUNK, Landing
from .storage_view import StorageView

__all__ = ["DEFAULT_MAX_PIECES", "data_range", "target_map"]

DEFAULT_MAX_PIECES = 64


def _chunks(n: int, size: int = CHUNK) -> Iterator[slice]:
    for lo in range(0, n, size):
        yield slice(lo, min(lo + size, n))


def data_range(landing: Landing) -> tuple[int, int, int] | None:
    """``(first, stop, count)``: window positions of the first and one past the last element that carries
    logical data, and how many do; None when the loader only zero-filled or wrote nothing."""
    linear = landing.linear
    first = last = -1
    count = 0
    for part in _chunks(linear.shape[0]):
        mask = linear[part] >= 0
        k = int(np.count_nonzero(mask))
        if not k:
            continue
        if first < 0:
            first = part.start + int(np.argmax(mask))
        last = part.start + mask.shape[0] - 1 - int(np.argmax(mask[::-1]))
        count += k
    return None if first < 0 else (first, last + 1, count)


def _check_written_once(
    tensor: str, shape: tuple[int, ...], linear: np.ndarray, rank: int, param: str
) -> None:
    """Raise ``NotAffineError`` when one logical element appears twice (a bitmap over the tensor)."""
    seen = np.zeros(max(prod(shape), 1), dtype=bool)
    total = 0
    for part in _chunks(linear.shape[0]):
        seen[linear[part]] = True
        total += part.stop - part.start
    if int(np.count_nonzero(seen)) != total:
        raise NotAffineError(
            "the loader writes one logical element to several places of one parameter",
            tensor=tensor,
            rank=rank,
            expected="each element at most once per rank",
            found=f"parameter {param!r}",
        )


def storage_shape(param_shape: tuple[int, ...], start: int, stop: int) -> tuple[int, ...]:
    """Shape of the view of flat range ``[start, stop)`` of a row-major ``param_shape``: the trailing shape
    ``(rows, *param_shape[k+1:])`` for the largest ``k`` such that the range lies inside one index of the
    axes before ``k`` and is aligned to whole slabs of axis ``k``; ``(stop - start,)`` if there is none."""
    n = stop - start
    if not param_shape:
        return ()
    best: tuple[int, ...] = (n,)
    for k in range(len(param_shape)):
        slab = prod(param_shape[k + 1 :])
        block = slab * param_shape[k]
        if slab == 0 or start % slab or stop % slab:
            continue
        if k and block and start // block != (stop - 1) // block:
            continue
        best = (n // slab, *param_shape[k + 1 :])
    return best


def _box_chunks(extent: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Sub-boxes ``(delta, sub_extent)`` tiling a box of ``extent`` with at most ``CHUNK`` elements each
    (or one row of the innermost axis when that alone is larger), in row-major order."""
    ndim = len(extent)
    if prod(extent) <= CHUNK:
        yield (0,) * ndim, extent
        return
    axis = 0
    while axis < ndim - 1 and prod(extent[axis + 1 :]) > CHUNK:
        axis += 1
    inner = prod(extent[axis + 1 :])
    step = max(CHUNK // max(inner, 1), 1)
    outer = [range(e) for e in extent[:axis]]
    for index in np.ndindex(*[len(r) for r in outer]) if outer else [()]:
        for lo in range(0, extent[axis], step):
            sub = (1,) * axis + (min(step, extent[axis] - lo),) + extent[axis + 1 :]
            yield (*index, lo, *((0,) * (ndim - axis - 1))), sub


def _grid(base: int, steps: Sequence[int], origin: Sequence[int], extent: Sequence[int]) -> np.ndarray:
    """``base + Σ steps[d]·(origin[d] + k_d)`` over the box ``origin + [0, extent)``, flattened row-major."""
    total = np.full((1,) * len(extent), base, dtype=np.int64)
    for d, (o, e) in enumerate(zip(origin, extent, strict=True)):
        view = [1] * len(extent)
        view[d] = e
        total = total + (np.arange(o, o + e, dtype=np.int64) * steps[d]).reshape(view)
    return total.reshape(-1)


def _pieces(
    tensor: str,
    shape: tuple[int, ...],
    linear: np.ndarray,
    rank: int,
    max_pieces: int,
    *,
    dense: bool,
) -> list[tuple[Box, int, tuple[int, ...]]]:
    """Greedy decomposition of a dense storage (``linear[p]``: the logical linear index at storage position
    ``p``; every element written once) into affine boxes.

    A box starts at an unassigned element and grows along the last dimension, then the one before, and so
    on, as long as every element of the grown box is at ``start_position + Σ stride·(coordinate − origin)``,
    unassigned. Only forward lookups (position -> logical index) are needed, so nothing of the size of the
    storage is allocated beyond one ``assigned`` bitmap, and growth gallops (doubling steps), so a box of a
    million rows costs a few dozen checks. Two modes:

    - ``dense=False`` (boxes of an N-D storage, possibly transposed): start at the first unassigned element
      in logical row-major order, strides taken from its neighbours;
    - ``dense=True`` (dense runs of a flat storage): start at the first unassigned storage position,
      strides row-major of the box's own extent.
    """
    ndim = len(shape)
    n = linear.shape[0]
    if ndim == 0:
        return [(Box((), ()), 0, ())]
    logical_strides = row_major_strides(shape)
    assigned = np.zeros(n, dtype=bool)  # indexed by storage position
    top = np.iinfo(linear.dtype).max

    def fits(origin: tuple[int, ...], extent: tuple[int, ...], base: int, strides: Sequence[int]) -> bool:
        for delta, sub in _box_chunks(extent):
            pos = _grid(base, strides, delta, sub)
            if int(pos.min()) < 0 or int(pos.max()) >= n or assigned[pos].any():
                return False
            want = _grid(0, logical_strides, [o + d for o, d in zip(origin, delta, strict=True)], sub)
            if not np.array_equal(linear[pos], want):
                return False
        return True

    def mark(extent: tuple[int, ...], base: int, strides: Sequence[int]) -> None:
        for delta, sub in _box_chunks(extent):
            assigned[_grid(base, strides, delta, sub)] = True

    def first_in_logical_order() -> int | None:
        best, where = top, -1
        for part in _chunks(n):
            masked = np.where(assigned[part], top, linear[part])
            i = int(np.argmin(masked))
            if masked[i] < best:
                best, where = int(masked[i]), part.start + i
        return None if where < 0 else where

    def position_of(target: int, after: int) -> int | None:
        for part in _chunks(n - after - 1):
            lo, hi = after + 1 + part.start, after + 1 + part.stop
            hit = np.flatnonzero((linear[lo:hi] == target) & ~assigned[lo:hi])
            if hit.size:
                return lo + int(hit[0])
        return None

    pieces: list[tuple[Box, int, tuple[int, ...]]] = []
    cursor = 0  # dense mode: boxes are consecutive ranges, every position before the cursor is assigned
    covered = 0
    while covered < n:
        if len(pieces) == max_pieces:
            raise NotAffineError(
                f"the loader scatters this tensor into more than {max_pieces} affine pieces (it permutes "
                "elements)",
                tensor=tensor,
                rank=rank,
                expected=f"at most {max_pieces} pieces",
                found=f"{len(pieces)} pieces covering {covered} of {n} elements",
            )
        if dense:
            base = cursor
        else:
            found = first_in_logical_order()
            if found is None:  # cannot happen: fewer than n elements are covered
                raise LayoutError("internal error: no unassigned element left", tensor=tensor, rank=rank)
            base = found
        start = tuple(int(c) for c in np.unravel_index(int(linear[base]), shape))
        strides = [0] * ndim
        known = [dense] * ndim
        if not dense:
            for d in range(ndim):
                if start[d] + 1 < shape[d]:
                    nb = position_of(int(linear[base]) + logical_strides[d], base)
                    if nb is not None:
                        strides[d] = nb - base
                        known[d] = True
        extent = [1] * ndim
        for d in range(ndim - 1, -1, -1):
            if dense:
                strides[d] = prod(extent[d + 1 :])
            if not known[d]:
                continue
            step = 1
            while start[d] + extent[d] < shape[d]:
                step = min(step, shape[d] - start[d] - extent[d])
                origin_slab = tuple(start[i] + (extent[d] if i == d else 0) for i in range(ndim))
                extent_slab = tuple(step if i == d else extent[i] for i in range(ndim))
                base_slab = base + extent[d] * strides[d]
                if fits(origin_slab, extent_slab, base_slab, strides):
                    extent[d] += step
                    step *= 2
                elif step > 1:
                    step //= 2
                else:
                    break
        for d in range(ndim - 1, -1, -1):  # canonical strides for axes the box does not extend along
            if extent[d] == 1:
                strides[d] = strides[d + 1] * extent[d + 1] if d + 1 < ndim else 1
        box = Box(start, tuple(extent))
        mark(tuple(extent), base, strides)
        covered += box.numel
        if dense:
            cursor += box.numel
        pieces.append((box, base, tuple(strides)))
    pieces.sort(key=lambda p: p[1])
    return pieces


def target_map(
    tensor: str,
    shape: tuple[int, ...],
    dtype: str,
    landings: Sequence[Landing],
    rank: int,
    *,
    max_pieces: int = DEFAULT_MAX_PIECES,
) -> tuple[TensorMap, StorageView] | None:
    """This rank's part of the map of ``tensor`` (holders: this rank) and where its storage lives, or None
    when nothing of the tensor lands on this rank. Raises a ``LayoutError`` subclass naming the tensor, the
    rank and the parameter when the landing breaks the rule of the module docstring."""
    decoded = [(landing, found) for landing in landings if (found := data_range(landing)) is not None]
    if not decoded:
        return None
    if len(decoded) > 1:
        raise UnsupportedLayoutError(
            "the loader writes this tensor into several parameters; one storage per rank is needed",
            tensor=tensor,
            rank=rank,
            expected="one parameter",
            found=sorted(d[0].param for d in decoded),
        )
    landing, (first, last, n) = decoded[0]
    if not landing.param_contiguous:
        raise UnsupportedLayoutError(
            "the parameter is not contiguous; a storage must be a contiguous range of it",
            tensor=tensor,
            rank=rank,
            expected="a contiguous parameter",
            found=f"parameter {landing.param!r}",
        )
    start = landing.start + first
    stop = landing.start + last
    if stop - start != n:
        raise UnsupportedLayoutError(
            "the tensor's elements do not fill one contiguous range of the parameter (another tensor's "
            "elements or padding lie between them)",
            tensor=tensor,
            rank=rank,
            expected=f"{stop - start} elements filling [{start}, {stop}) of parameter {landing.param!r}",
            found=f"{n} elements",
        )
    if stop > prod(landing.param_shape):
        raise OutOfBoundsError(
            "probe observation runs past its parameter",
            tensor=tensor,
            rank=rank,
            expected=f"at most {prod(landing.param_shape)} elements",
            found=stop,
        )
    linear = landing.linear[first:last]
    _check_written_once(tensor, shape, linear, rank, landing.param)
    reasons: list[str] = []

    def cut(dense: bool) -> tuple[Piece, ...]:
        found = _pieces(tensor, shape, linear, rank, max_pieces, dense=dense)
        return tuple(Piece(box, off, strides, (rank,)) for box, off, strides in found)

    attempts: list[tuple[tuple[int, ...], tuple[Piece, ...]]] = []
    pieces: tuple[Piece, ...] = ()
    try:
        pieces = cut(False)
    except NotAffineError as exc:
        reasons.append(f"boxes of an N-D storage: {exc.reason}")
    else:
        attempts += [
            (c, pieces) for c in _storage_shapes(landing.param_shape, start, stop, len(shape), pieces)
        ]
    try:
        runs = cut(True)
    except NotAffineError as exc:
        reasons.append(f"dense runs of a flat storage: {exc.reason}")
    else:
        if runs != pieces:
            attempts.append(((n,), runs))
    for candidate, cut_pieces in attempts:
        try:
            tmap = TensorMap(tensor, tuple(shape), dtype, {rank: RankStorage(candidate, cut_pieces)})
        except LayoutError as exc:  # the pieces are not addressable in a storage of this shape
            reasons.append(f"{candidate}: {exc.reason}")
            continue
        return tmap, StorageView(landing.param, start, candidate)
    raise NotAffineError(
        "no storage shape makes these pieces addressable (pieces must be boxes of an N-D storage or dense "
        "runs of a flat one)",
        tensor=tensor,
        rank=rank,
        expected="one of " + "; ".join(reasons),
        found=f"{len(pieces)} pieces in parameter {landing.param!r}",
    )


def _storage_shapes(
    param_shape: tuple[int, ...], start: int, stop: int, ndim: int, pieces: Sequence[Piece]
) -> list[tuple[int, ...]]:
    """Candidate shapes of the storage view, best first: the parameter's trailing shape (``storage_shape``),
    the first piece's extent in storage-axis order (a transposed copy in a flat parameter), flat."""
    n = stop - start
    out = [storage_shape(param_shape, start, stop)]
    if pieces and ndim > 1:
        first = pieces[0]
        order = sorted(range(ndim), key=lambda d: -first.strides[d])
        inner = prod(first.box.extent[d] for d in order[1:])
        if inner and n % inner == 0:
            out.append((n // inner, *(first.box.extent[d] for d in order[1:])))
    out.append((n,))
    unique = []
    for candidate in out:
        if candidate not in unique:
            unique.append(candidate)
    return unique

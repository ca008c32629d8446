"""Target maps from the observations of a loader probe (pure: no vLLM, no torch).

A *loader probe* (``vllm_plugin.probing``) feeds vLLM's own ``load_weights`` one logical tensor at a time,
filled with its coordinates along one dimension (values ``1..n``, never 0), into parameters whose data were
swapped for ``-1``-filled float32 tensors, and reads back which element of which parameter received which
logical element. That observation is a ``Landing``. This module turns the landings of one rank into that
rank's part of the target map, and says where the storage lives (``StorageView``).

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
parameters, a hole, reversed or permuted elements) means the loader transforms what it copies, or scatters
it in a way no single storage view describes; such a tensor is *refused* for in-place writes and goes
through vLLM's full-tensor ``load_weights`` path instead (``fallback_map``). The rule covers fused qkv and
gate_up, row- and column-parallel shards, vocab shards without their padding rows, replicated tensors and
MoE experts split by TP or EP: in each the tensor's elements are one run of its parameter. A loader that
interleaves a tensor with another in one parameter (no single run without holes) is refused rather than
described by several storages: the planner does not take several storages per (tensor, rank).

The storage view's shape is the first that makes the pieces addressable of: the parameter's trailing
shape where the range is aligned to it (``q_proj``'s rows of ``qkv_proj.weight`` give ``(rows, hidden)``;
an expert's slab of ``w2_weight`` gives the slab's shape), the first piece's extent in storage-axis order
(a transposed copy in a flat parameter), flat ``(n,)`` (with the storage cut into dense runs instead).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from math import prod

import numpy as np

from ..errors import LayoutError, NotAffineError, OutOfBoundsError, UnsupportedLayoutError
from ..layout.box import Box, row_major_strides
from ..layout.maps import Piece, RankStorage, TensorMap

__all__ = [
    "CHUNK",
    "DEFAULT_MAX_PIECES",
    "FILLED",
    "HOLE",
    "Landing",
    "LandingBuilder",
    "LocalTargets",
    "StorageView",
    "TargetsBuilder",
    "data_range",
    "fallback_map",
    "local_targets",
    "target_map",
]

DEFAULT_MAX_PIECES = 64


@dataclass(frozen=True, slots=True)
class StorageView:
    """Where the storage of one logical tensor lives on one rank.

    ``param`` names a parameter of the vLLM model (``model.named_parameters()``); the storage is elements
    ``[offset, offset + numel)`` of that (contiguous) parameter's flattening, viewed with ``shape``:
    ``param.data.view(-1)[offset : offset + numel].view(shape)``. ``param is None`` means a staging buffer
    of the logical tensor's shape (``offset`` 0), filled by the sync and then handed to vLLM's
    ``load_weights`` (the fallback for refused loaders).
    """

    param: str | None
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def to_dict(self) -> dict[str, object]:
        return {"param": self.param, "offset": self.offset, "shape": list(self.shape)}

    @staticmethod
    def from_dict(data: Mapping[str, object]) -> StorageView:
        param = data["param"]
        offset = data["offset"]
        shape = data["shape"]
        if (
            (param is not None and not isinstance(param, str))
            or not isinstance(offset, int)
            or not isinstance(shape, (list, tuple))
        ):
            raise ValueError(f"malformed storage view {dict(data)!r}")
        return StorageView(param, offset, tuple(int(s) for s in shape))


HOLE = -2  # ``Landing.linear``: the loader wrote nothing at this position
FILLED = -1  # ``Landing.linear``: the loader wrote zeros here (padding rows of a vocab shard)
CHUNK = 1 << 21  # elements handled at once when scanning a landing (bounds temporaries to a few dozen MB)
_EMPTY_PROBE = -1.0  # what a probe buffer holds where the loader wrote nothing


@dataclass(frozen=True)
class Landing:
    """What one probe observed: elements of one logical tensor written into one parameter.

    The observation covers the *window* ``[start, start + len(linear))`` of the parameter's row-major
    flattening (``param_shape``), from its first to its last written element: ``linear[i]`` is the
    row-major linear index, in the logical tensor, of the element found at position ``start + i``, or
    ``FILLED`` where the loader wrote zeros (padding), or ``HOLE`` where it wrote nothing. One integer per
    element of the window (int32 when the tensor has under 2**31 elements), built a chunk at a time by
    ``LandingBuilder``: a 77.8M-element vocab shard costs 311 MB, not the gigabytes of per-element
    coordinate arrays.
    """

    param: str
    param_shape: tuple[int, ...]
    param_contiguous: bool
    start: int
    linear: np.ndarray  # (window,) int32 or int64


def linear_dtype(shape: tuple[int, ...]) -> type[np.signedinteger]:
    """The integer type of ``Landing.linear`` for a logical tensor of this shape."""
    return np.int32 if prod(shape) < 2**31 else np.int64


class LandingBuilder:
    """Builds one ``Landing`` from the probe values seen in one parameter's window, one probed dimension
    and one chunk at a time, checking as it goes that the loader only copies (pure: numpy arrays in).

    ``add(dim, offset, values)`` takes the probe values found at window positions ``offset ...`` when
    dimension ``dim`` was probed (``-1`` where nothing was written); dimension 0 first. A value that is not
    a coordinate (1..n along ``dim``), a zero where other probes wrote a coordinate, or an element written
    for one dimension's probe and not another's raises ``NotAffineError``: the loader transforms values or
    places them by value. ``written_outside(dim, count)`` reports elements written outside the window
    (there must be none: the window comes from dimension 0).
    """

    def __init__(
        self,
        tensor: str,
        shape: tuple[int, ...],
        rank: int,
        *,
        param: str,
        param_shape: tuple[int, ...],
        param_contiguous: bool,
        start: int,
        stop: int,
    ) -> None:
        self.tensor = tensor
        self.shape = tuple(shape)
        self.rank = rank
        self.param = param
        self.param_shape = tuple(param_shape)
        self.param_contiguous = param_contiguous
        self.start = start
        self.linear = np.full(stop - start, HOLE, dtype=linear_dtype(self.shape))
        self.strides = row_major_strides(self.shape)
        self.done: list[int] = []  # dimensions fully added, in order

    def _error(self, reason: str, found: str) -> NotAffineError:
        limits = f"integers 1..{list(self.shape)} per dimension" if self.shape else "the value 1"
        return NotAffineError(
            reason, tensor=self.tensor, rank=self.rank, expected=f"probe coordinates: {limits}", found=found
        )

    def add(self, dim: int, offset: int, values: np.ndarray) -> None:
        values = np.asarray(values).reshape(-1)
        cur = self.linear[offset : offset + values.shape[0]]
        if cur.shape[0] != values.shape[0]:
            raise LayoutError(
                "probe values run past the window",
                tensor=self.tensor,
                rank=self.rank,
                expected=f"at most {self.linear.shape[0] - offset} values at offset {offset}",
                found=values.shape[0],
            )
        hole = values == _EMPTY_PROBE
        zero = values == 0
        if dim == 0:
            cur[zero] = FILLED
            data = ~(hole | zero)
        else:
            if not np.array_equal(hole, cur == HOLE):
                i = int(np.argmax(hole != (cur == HOLE)))
                raise self._error(
                    f"probing dimension {dim} wrote other elements than probing dimension 0: the loader's "
                    "placement depends on the values (it transforms them)",
                    f"element {self.start + offset + i} of parameter {self.param!r}",
                )
            if not np.array_equal(zero, cur == FILLED):
                i = int(np.argmax(zero != (cur == FILLED)))
                raise self._error(
                    "the loader zeroes some probes of an element and not others: it transforms values",
                    f"element {self.start + offset + i} of parameter {self.param!r}",
                )
            data = cur >= 0
        got = values[data]
        limit = self.shape[dim] if self.shape else 1
        bad = (got != np.round(got)) | (got < 1) | (got > limit)
        if bad.any():
            i = int(np.flatnonzero(data)[int(np.argmax(bad))])
            raise self._error(
                "the loader transforms values (quantization, scaling, arithmetic): a probe value is not a "
                "coordinate",
                f"{float(values[i])} for dimension {dim} at element {self.start + offset + i} of parameter "
                f"{self.param!r}",
            )
        stride = self.strides[dim] if self.shape else 0
        term = (got.astype(self.linear.dtype) - 1) * self.linear.dtype.type(stride)
        if dim == 0:
            cur[data] = term
        else:
            cur[data] += term

    def dimension_done(self, dim: int) -> None:
        if dim != len(self.done):
            raise LayoutError(
                "probe dimensions out of order",
                tensor=self.tensor,
                rank=self.rank,
                expected=len(self.done),
                found=dim,
            )
        self.done.append(dim)

    def written_outside(self, dim: int, count: int) -> None:
        if count:
            raise self._error(
                f"probing dimension {dim} wrote elements outside the range probing dimension 0 wrote: the "
                "loader's placement depends on the values (it transforms them)",
                f"{count} elements of parameter {self.param!r}",
            )

    def landing(self) -> Landing:
        if len(self.done) != max(len(self.shape), 1):
            raise LayoutError(
                "a landing was finished before every dimension was probed",
                tensor=self.tensor,
                rank=self.rank,
                expected=max(len(self.shape), 1),
                found=len(self.done),
            )
        return Landing(self.param, self.param_shape, self.param_contiguous, self.start, self.linear)


@dataclass(frozen=True)
class LocalTargets:
    """One rank's part of the target maps.

    ``maps[name]`` has the single rank ``rank`` (holders are filled in when the parts are merged);
    ``views[name]`` locates its storage; ``refused[name]`` gives the reason a tensor takes the full-tensor
    path (its map is a staging buffer, ``views[name].param is None``); ``absent`` lists tensors this rank
    does not hold (expert parallelism, or tensors the loaders ignore such as an alias of a tied weight).
    """

    rank: int
    maps: Mapping[str, TensorMap]
    views: Mapping[str, StorageView]
    refused: Mapping[str, str]
    absent: tuple[str, ...]


# ----------------------------------------------------------------------------------------------------------
# One landing -> storage view and pieces
# ----------------------------------------------------------------------------------------------------------


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


def fallback_map(tensor: str, shape: tuple[int, ...], dtype: str, rank: int) -> tuple[TensorMap, StorageView]:
    """The map part of a refused tensor: a staging buffer of the whole logical tensor on this rank."""
    box = Box((0,) * len(shape), tuple(shape))
    storage = RankStorage(tuple(shape), (Piece(box, 0, row_major_strides(tuple(shape)), (rank,)),))
    return TensorMap(tensor, tuple(shape), dtype, {rank: storage}), StorageView(None, 0, tuple(shape))


class TargetsBuilder:
    """One rank's part of every target map, a tensor at a time, so that a tensor's landings can be dropped
    as soon as its map is built (the probe of a whole model never holds more than one tensor's landings).

    ``add(name, shape, dtype, landings, error)``: ``dtype`` is that of the parameter the tensor lands in;
    ``error`` the message of a loader that raised while probing (the tensor is refused). A tensor with no
    landing and no error is absent from this rank.
    """

    def __init__(self, rank: int, *, fallback_dtype: str, max_pieces: int = DEFAULT_MAX_PIECES) -> None:
        self.rank = rank
        self.fallback_dtype = fallback_dtype
        self.max_pieces = max_pieces
        self.maps: dict[str, TensorMap] = {}
        self.views: dict[str, StorageView] = {}
        self.refused: dict[str, str] = {}
        self.absent: list[str] = []

    def add(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: str,
        landings: Sequence[Landing] = (),
        error: str | None = None,
    ) -> None:
        reason = error
        if reason is None:
            try:
                got = target_map(name, shape, dtype, landings, self.rank, max_pieces=self.max_pieces)
            except LayoutError as exc:
                reason = str(exc)
            else:
                if got is None:
                    self.absent.append(name)
                else:
                    self.maps[name], self.views[name] = got
                return
        self.refused[name] = reason
        self.maps[name], self.views[name] = fallback_map(name, shape, self.fallback_dtype, self.rank)

    def build(self) -> LocalTargets:
        return LocalTargets(
            self.rank, dict(self.maps), dict(self.views), dict(self.refused), tuple(self.absent)
        )


def local_targets(
    rank: int,
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    landings: Mapping[str, Sequence[Landing]],
    probe_errors: Mapping[str, str],
    *,
    fallback_dtype: str,
    max_pieces: int = DEFAULT_MAX_PIECES,
) -> LocalTargets:
    """One rank's part of every target map (``TargetsBuilder`` over ``tensors[name] = (shape, dtype)``)."""
    builder = TargetsBuilder(rank, fallback_dtype=fallback_dtype, max_pieces=max_pieces)
    for name, (shape, dtype) in tensors.items():
        builder.add(name, shape, dtype, landings.get(name, ()), probe_errors.get(name))
    return builder.build()

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

import numpy as np

from ..errors import LayoutError, NotAffineError, OutOfBoundsError, UnsupportedLayoutError
from ..layout.box import Box, row_major_strides
from ..layout.maps import Piece, RankStorage, TensorMap

__all__ = [
    "DEFAULT_MAX_PIECES",
    "Landing",
    "LocalTargets",
    "StorageView",
    "decode_landing",
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


@dataclass(frozen=True)
class Landing:
    """What one probe observed: elements of one logical tensor written into one parameter.

    ``positions[i]`` is a row-major flat position in the parameter (of ``param_shape``) and
    ``values[i, d]`` the probe value found there when dimension ``d`` was probed (coordinate + 1; 0 means
    the loader filled the element with zeros, as vocab loaders do for padding rows).
    """

    param: str
    param_shape: tuple[int, ...]
    param_contiguous: bool
    positions: np.ndarray  # (n,) int64
    values: np.ndarray  # (n, ndim) float64


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


def decode_landing(
    tensor: str, shape: tuple[int, ...], landing: Landing, rank: int
) -> tuple[np.ndarray, np.ndarray]:
    """The (positions, coordinates) of the elements that carry logical data, zero-filled elements dropped.

    Raises ``NotAffineError`` when a value is not a coordinate of the probe (the loader transforms values)
    or an element is written twice.
    """
    values = landing.values
    ndim = len(shape)
    if values.ndim != 2 or values.shape[1] != ndim or values.shape[0] != landing.positions.shape[0]:
        raise LayoutError(
            "probe observation has the wrong shape",
            tensor=tensor,
            rank=rank,
            expected=f"({landing.positions.shape[0]}, {ndim}) values",
            found=values.shape,
        )
    zero = values == 0
    filled = zero.all(axis=1) if ndim else np.zeros(values.shape[0], dtype=bool)
    if ndim and (zero.any(axis=1) & ~filled).any():
        raise NotAffineError(
            "the loader zeroes some probes of an element and not others: it transforms values",
            tensor=tensor,
            rank=rank,
            expected="probe coordinates 1..n",
            found=f"parameter {landing.param!r}",
        )
    keep = ~filled
    positions = landing.positions[keep].astype(np.int64)
    values = values[keep]
    if ndim == 0:
        return positions, np.zeros((positions.shape[0], 0), dtype=np.int64)
    limits = np.asarray(shape, dtype=np.float64)
    integral = np.all(values == np.round(values), axis=1)
    inside = np.all((values >= 1) & (values <= limits), axis=1)
    bad = ~(integral & inside)
    if bad.any():
        i = int(np.argmax(bad))
        raise NotAffineError(
            "the loader transforms values (quantization, scaling, arithmetic): a probe value is not a "
            "coordinate",
            tensor=tensor,
            rank=rank,
            expected=f"integers 1..{list(shape)} per dimension",
            found=f"{values[i].tolist()} at element {int(positions[i])} of parameter {landing.param!r}",
        )
    coords = values.astype(np.int64) - 1
    linear = np.ravel_multi_index(tuple(coords.T), shape)
    if np.unique(linear).shape[0] != linear.shape[0]:
        raise NotAffineError(
            "the loader writes one logical element to several places of one parameter",
            tensor=tensor,
            rank=rank,
            expected="each element at most once per rank",
            found=f"parameter {landing.param!r}",
        )
    return positions, coords


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


def _pieces(
    tensor: str,
    shape: tuple[int, ...],
    positions: np.ndarray,
    coords: np.ndarray,
    rank: int,
    max_pieces: int,
    *,
    dense: bool,
) -> list[tuple[Box, int, tuple[int, ...]]]:
    """Greedy decomposition of a dense storage (positions 0..n-1) into affine boxes.

    A box starts at an unassigned element and grows along the last dimension, then the one before, and so
    on, as long as every element of the grown box is present, unassigned and at ``start_position +
    Σ stride·(coordinate − origin)``. Growth gallops (doubling steps), so a box of a million rows costs a
    few dozen checks. Two modes:

    - ``dense=False`` (boxes of an N-D storage, possibly transposed): start at the first unassigned element
      in logical row-major order, strides taken from its neighbours;
    - ``dense=True`` (dense runs of a flat storage): start at the first unassigned storage position,
      strides row-major of the box's own extent.
    """
    ndim = len(shape)
    n = positions.shape[0]
    if ndim == 0:
        return [(Box((), ()), int(positions[0]), ())]
    linear = np.ravel_multi_index(tuple(coords.T), shape)
    order = np.argsort(linear, kind="stable")
    lin_sorted = linear[order]
    pos_sorted = positions[order]
    coords_at = np.empty_like(coords)  # coordinate of the element at each storage position
    coords_at[positions] = coords
    assigned = np.zeros(n, dtype=bool)  # indexed by storage position
    strides_all = row_major_strides(shape)

    def lookup(origin: tuple[int, ...], extent: tuple[int, ...]) -> np.ndarray | None:
        """Storage positions of the box's elements in row-major box order, or None if one is absent."""
        grids = np.ix_(*[np.arange(o, o + e, dtype=np.int64) for o, e in zip(origin, extent, strict=True)])
        lin = np.zeros(extent, dtype=np.int64)
        for d, g in enumerate(grids):
            lin = lin + g * strides_all[d]
        flat = lin.reshape(-1)
        idx = np.searchsorted(lin_sorted, flat)
        idx_clipped = np.minimum(idx, n - 1)
        if idx.max(initial=0) >= n or not np.array_equal(lin_sorted[idx_clipped], flat):
            return None
        return pos_sorted[idx_clipped].reshape(extent)

    def fits(origin: tuple[int, ...], extent: tuple[int, ...], base: int, strides: Sequence[int]) -> bool:
        pos = lookup(origin, extent)
        if pos is None or assigned[pos.reshape(-1)].any():
            return False
        expected = np.full(extent, base, dtype=np.int64)
        for d in range(ndim):
            shape_d = [1] * ndim
            shape_d[d] = extent[d]
            expected = expected + (np.arange(extent[d], dtype=np.int64) * strides[d]).reshape(shape_d)
        return bool(np.array_equal(pos, expected))

    pieces: list[tuple[Box, int, tuple[int, ...]]] = []
    cursor = 0  # next candidate start: index into lin_sorted, or a storage position when dense
    while True:
        if dense:
            while cursor < n and assigned[cursor]:
                cursor += 1
        else:
            while cursor < n and assigned[pos_sorted[cursor]]:
                cursor += 1
        if cursor == n:
            break
        if len(pieces) == max_pieces:
            raise NotAffineError(
                f"the loader scatters this tensor into more than {max_pieces} affine pieces (it permutes "
                "elements)",
                tensor=tensor,
                rank=rank,
                expected=f"at most {max_pieces} pieces",
                found=f"{len(pieces)} pieces covering {int(assigned.sum())} of {n} elements",
            )
        if dense:
            start = tuple(int(c) for c in coords_at[cursor])
            base = cursor
        else:
            start = tuple(int(c) for c in np.unravel_index(int(lin_sorted[cursor]), shape))
            base = int(pos_sorted[cursor])
        strides = [0] * ndim
        known = [dense] * ndim
        if not dense:
            for d in range(ndim):
                if start[d] + 1 < shape[d]:
                    nb = lookup(tuple(s + (1 if i == d else 0) for i, s in enumerate(start)), (1,) * ndim)
                    if nb is not None and not assigned[int(nb.reshape(-1)[0])]:
                        step = int(nb.reshape(-1)[0]) - base
                        if step > 0:
                            strides[d] = step
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
        pos = lookup(start, tuple(extent))
        if pos is None:  # cannot happen: the start element is present
            raise LayoutError(
                "internal error: a grown box lost an element", tensor=tensor, rank=rank, box=box
            )
        assigned[pos.reshape(-1)] = True
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
    decoded = []
    for landing in landings:
        positions, coords = decode_landing(tensor, shape, landing, rank)
        if positions.shape[0]:
            decoded.append((landing, positions, coords))
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
    landing, positions, coords = decoded[0]
    if not landing.param_contiguous:
        raise UnsupportedLayoutError(
            "the parameter is not contiguous; a storage must be a contiguous range of it",
            tensor=tensor,
            rank=rank,
            expected="a contiguous parameter",
            found=f"parameter {landing.param!r}",
        )
    order = np.argsort(positions, kind="stable")
    positions = positions[order]
    coords = coords[order]
    start = int(positions[0])
    stop = int(positions[-1]) + 1
    n = positions.shape[0]
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
    rel = positions - start
    reasons: list[str] = []

    def cut(dense: bool) -> tuple[Piece, ...]:
        found = _pieces(tensor, shape, rel, coords, rank, max_pieces, dense=dense)
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


def local_targets(
    rank: int,
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
    landings: Mapping[str, Sequence[Landing]],
    probe_errors: Mapping[str, str],
    *,
    fallback_dtype: str,
    max_pieces: int = DEFAULT_MAX_PIECES,
) -> LocalTargets:
    """One rank's part of every target map.

    ``tensors[name] = (shape, dtype of the parameter it lands in)``; ``landings[name]`` are the probe's
    observations; ``probe_errors[name]`` the message of a loader that raised while probing (refused). A
    tensor with no landing and no error is absent from this rank.
    """
    maps: dict[str, TensorMap] = {}
    views: dict[str, StorageView] = {}
    refused: dict[str, str] = {}
    absent: list[str] = []
    for name, (shape, dtype) in tensors.items():
        reason = probe_errors.get(name)
        if reason is None:
            try:
                got = target_map(name, shape, dtype, landings.get(name, ()), rank, max_pieces=max_pieces)
            except LayoutError as exc:
                reason = str(exc)
            else:
                if got is None:
                    absent.append(name)
                else:
                    maps[name], views[name] = got
                continue
        refused[name] = reason
        maps[name], views[name] = fallback_map(name, shape, fallback_dtype, rank)
    return LocalTargets(rank, maps, views, refused, tuple(absent))

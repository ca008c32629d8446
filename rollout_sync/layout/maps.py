"""Pieces and maps: where the elements of one logical tensor are stored, on every rank.

Vocabulary (see DESIGN.md):
- a **piece** is a box of a logical tensor together with where it sits in one rank's storage, given
  exactly as ``torch.as_strided(storage, box.extent, strides, storage_offset + offset)`` takes it, and the
  ranks that hold identical data for that box (its replicas, this rank included);
- a **map** (``TensorMap``) is all pieces of one logical tensor on all ranks. Each rank holds the tensor's
  elements in one **storage** (a contiguous view of the rank's real memory, of ``RankStorage.shape``).
  Ranks are global ranks of the sync group.

All three types are frozen and validated when built; a ``TensorMap`` that exists is valid (see
``rollout_sync.layout.validate`` for the rules) and carries its normalized form, ``regions``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from math import prod
from types import MappingProxyType

from ..errors import CoverageError, LayoutError, NotAffineError, ShapeMismatchError, UnsupportedLayoutError
from .box import Box
from .dtypes import ITEMSIZE
from .validate import Region, normalize


@dataclass(frozen=True, slots=True)
class Piece:
    """One box of a logical tensor as one rank stores it.

    ``offset`` and ``strides`` are in elements of the storage (flattened row-major), exactly the
    ``storage_offset`` (relative to the storage view) and ``stride`` arguments of ``torch.as_strided``.
    ``holders`` are the global ranks that hold identical data for this box, sorted; the piece is listed
    under every holder in the map, each time with that holder's own offset and strides.
    """

    box: Box
    offset: int
    strides: tuple[int, ...]
    holders: tuple[int, ...]

    def __post_init__(self) -> None:
        box = self.box
        if not isinstance(box, Box):
            raise ShapeMismatchError("a piece needs a Box", expected="Box", found=type(box).__name__)
        if len(self.strides) != len(box.extent):
            raise ShapeMismatchError(
                "a piece has another number of strides than its box has axes",
                box=box,
                expected=len(box.extent),
                found=self.strides,
            )
        if min(self.strides, default=0) < 0:
            raise NotAffineError(
                "a piece has a negative stride", box=box, expected=">= 0", found=self.strides
            )
        holders = self.holders
        if not holders:
            raise CoverageError(
                "a piece names no holder", box=box, expected="at least one rank", found=holders
            )
        prev = -1
        for h in holders:
            if h <= prev:
                raise CoverageError(
                    "a piece's holders must be distinct non-negative ranks in increasing order",
                    box=box,
                    expected="sorted distinct ranks >= 0",
                    found=holders,
                )
            prev = h


@dataclass(frozen=True, slots=True)
class RankStorage:
    """The storage of one logical tensor on one rank: its shape, and the pieces that tile it exactly."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    # Memo of the last map validated with this storage first in rank order: (logical shape, the map's
    # (rank, storage) items, its regions). A map built again from the very same storage objects (the
    # layers of a model) reuses the regions instead of validating again.
    _memo: tuple[object, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or min(self.shape, default=0) < 0:
            raise ShapeMismatchError(
                "a storage shape is a tuple of sizes >= 0", expected="tuple", found=self.shape
            )
        if not isinstance(self.pieces, tuple):
            raise LayoutError(
                "a storage's pieces are a tuple", expected="tuple", found=type(self.pieces).__name__
            )

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def __reduce__(self) -> tuple[type[RankStorage], tuple[tuple[int, ...], tuple[Piece, ...]]]:
        return (RankStorage, (self.shape, self.pieces))  # without the memo


@dataclass(frozen=True, slots=True)
class TensorMap:
    """All pieces of one logical tensor on all ranks (one side: the sources or the targets).

    ``name`` and ``shape`` are the logical tensor's, as ``save_pretrained`` writes it; ``dtype`` is the
    storage dtype (``str(torch.dtype)`` without the ``torch.`` prefix, e.g. ``"bfloat16"``). ``ranks`` is
    kept as a read-only mapping in rank order.

    Built maps are valid: construction raises a ``LayoutError`` subclass naming the tensor, the rank and
    the box for any violation of the rules in ``rollout_sync.layout.validate``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    ranks: Mapping[int, RankStorage]
    _regions: tuple[Region, ...] = field(default=(), init=False, repr=False, compare=False)
    _shapes: Mapping[int, tuple[int, ...]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name:
            raise LayoutError("a map needs the logical tensor's name", expected="a non-empty str", found=name)
        if not isinstance(self.shape, tuple) or min(self.shape, default=0) < 0:
            raise ShapeMismatchError(
                "a logical shape is a tuple of sizes >= 0", tensor=name, expected="tuple", found=self.shape
            )
        if self.dtype not in ITEMSIZE:
            raise UnsupportedLayoutError(
                "unknown storage dtype", tensor=name, expected=f"one of {sorted(ITEMSIZE)}", found=self.dtype
            )
        ranks = self.ranks
        for rank, storage in ranks.items():
            if type(rank) is not int or rank < 0:
                raise LayoutError("ranks are global ranks (ints >= 0)", tensor=name, found=rank)
            if not isinstance(storage, RankStorage):
                raise LayoutError(
                    "a rank's storage must be a RankStorage",
                    tensor=name,
                    rank=rank,
                    found=type(storage).__name__,
                )
        ordered = dict(sorted(ranks.items()))
        object.__setattr__(self, "ranks", MappingProxyType(ordered))
        memo = _memo(self.shape, ordered)
        if memo is None:
            regions = normalize(name, self.shape, ordered)
            shapes: Mapping[int, tuple[int, ...]] = MappingProxyType({r: s.shape for r, s in ordered.items()})
            if ordered:
                first = next(iter(ordered.values()))
                object.__setattr__(first, "_memo", (self.shape, tuple(ordered.items()), regions, shapes))
        else:
            regions, shapes = memo
        object.__setattr__(self, "_regions", regions)
        object.__setattr__(self, "_shapes", shapes)

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def regions(self) -> tuple[Region, ...]:
        """The normalized map: one ``(origin, extent, addresses)`` per distinct box, sorted by origin, where
        ``addresses`` lists ``(rank, offset, strides)`` for each holder in rank order. Disjoint boxes."""
        return self._regions

    @property
    def storage_shapes(self) -> Mapping[int, tuple[int, ...]]:
        """rank -> storage shape, read-only (shared by maps built from the same storages)."""
        return self._shapes

    @property
    def piece_count(self) -> int:
        """Pieces listed on all ranks (a replicated piece counts once per holder)."""
        return sum(len(s.pieces) for s in self.ranks.values())

    def __reduce__(self) -> tuple[type[TensorMap], tuple[str, tuple[int, ...], str, dict[int, RankStorage]]]:
        return (TensorMap, (self.name, self.shape, self.dtype, dict(self.ranks)))  # validated again on load


def _memo(
    shape: tuple[int, ...], ordered: dict[int, RankStorage]
) -> tuple[tuple[Region, ...], Mapping[int, tuple[int, ...]]] | None:
    """(regions, storage shapes) of an earlier valid map with this shape and these very storage objects.

    Validity depends only on the logical shape and the storages (the name only words the errors, and only
    successful validations are remembered), so reusing the result is exact."""
    if not ordered:
        return None
    memo = next(iter(ordered.values()))._memo
    if memo is None or memo[0] != shape:
        return None
    items = memo[1]
    if not isinstance(items, tuple) or len(items) != len(ordered):
        return None
    for (rank, storage), (mrank, mstorage) in zip(ordered.items(), items, strict=True):
        if rank != mrank or storage is not mstorage:
            return None
    return memo[2], memo[3]  # type: ignore[return-value]

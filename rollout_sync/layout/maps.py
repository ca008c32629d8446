"""Pieces and maps: where the elements of one logical tensor are stored, on every rank.

Vocabulary (see DESIGN.md):
- a **piece** is a box of a logical tensor together with where it sits in one rank's storage, given
  exactly as ``torch.as_strided(storage, box.extent, strides, storage_offset + offset)`` takes it, and the
  ranks that hold identical data for that box (its replicas, this rank included);
- a **map** (``TensorMap``) is all pieces of one logical tensor on all ranks. Each rank holds the tensor's
  elements in one **storage** (a contiguous view of the rank's real memory, of ``RankStorage.shape``).
  Ranks are global ranks of the sync group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod

from .box import Box


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


@dataclass(frozen=True, slots=True)
class RankStorage:
    """The storage of one logical tensor on one rank: its shape, and the pieces that tile it exactly."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True, slots=True)
class TensorMap:
    """All pieces of one logical tensor on all ranks (one side: the sources or the targets).

    ``name`` and ``shape`` are the logical tensor's, as ``save_pretrained`` writes it; ``dtype`` is the
    storage dtype (``str(torch.dtype)`` without the ``torch.`` prefix, e.g. ``"bfloat16"``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    ranks: Mapping[int, RankStorage]

    @property
    def numel(self) -> int:
        return prod(self.shape)

"""One rank's part of every target map, built from the landings of a loader probe a tensor at a time
(``TargetsBuilder``, ``local_targets``), with the staging-buffer map of a refused tensor (``fallback_map``)
(pure: no vLLM, no torch).

A tensor whose landings break the rule of ``landing_maps`` (or whose loader raised while probing) is
*refused*: its map is a staging buffer of the whole logical tensor, filled by the sync and handed to vLLM's
full-tensor ``load_weights``. A tensor that lands nowhere on this rank is *absent* from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import LayoutError
from ..layout.box import Box, row_major_strides
from ..layout.maps import Piece, RankStorage, TensorMap
from .landing_maps import DEFAULT_MAX_PIECES, target_map
from .landings import Landing
from .storage_view import StorageView

__all__ = ["LocalTargets", "TargetsBuilder", "fallback_map", "local_targets"]


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

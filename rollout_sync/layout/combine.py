"""Combining maps that were built in pieces: renumbering ranks and merging per-rank parts.

A vLLM worker describes only its own storage, in engine-local ranks, before it knows its global rank; the
coordinator renumbers each part into global ranks and merges the parts of all workers into one map per
logical tensor. Replicas are found by merging: ranks that hold exactly the same box become its holders.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping

from ..errors import ShapeMismatchError
from .box import Box
from .maps import Piece, RankStorage, TensorMap


def renumber(tmap: TensorMap, table: Mapping[int, int]) -> TensorMap:
    """The same map with every rank (storage owners and holders) replaced by ``table[rank]``."""
    ranks = {
        table[rank]: RankStorage(
            storage.shape,
            tuple(
                Piece(p.box, p.offset, p.strides, tuple(sorted(table[h] for h in p.holders)))
                for p in storage.pieces
            ),
        )
        for rank, storage in tmap.ranks.items()
    }
    return TensorMap(tmap.name, tmap.shape, tmap.dtype, dict(sorted(ranks.items())))


def merge(parts: Iterable[TensorMap]) -> TensorMap:
    """One map from parts that describe disjoint sets of ranks of the same logical tensor.

    The holders of each piece become every rank, across all parts, whose storage holds exactly the same
    box (a part's own holder lists are replaced: a part may not know the other parts' ranks).
    """
    parts = list(parts)
    if not parts:
        raise ValueError("merge needs at least one part")
    first = parts[0]
    ranks: dict[int, RankStorage] = {}
    for part in parts:
        if (part.name, part.shape, part.dtype) != (first.name, first.shape, first.dtype):
            raise ShapeMismatchError(
                "parts of one map disagree about the logical tensor",
                tensor=first.name,
                expected=(first.name, first.shape, first.dtype),
                found=(part.name, part.shape, part.dtype),
            )
        for rank, storage in part.ranks.items():
            if rank in ranks:
                raise ShapeMismatchError("two parts describe the same rank", tensor=first.name, rank=rank)
            ranks[rank] = storage
    holders: dict[Box, list[int]] = defaultdict(list)
    for rank, storage in ranks.items():
        for p in storage.pieces:
            holders[p.box].append(rank)
    merged = {
        rank: RankStorage(
            storage.shape,
            tuple(
                Piece(p.box, p.offset, p.strides, tuple(sorted(set(holders[p.box])))) for p in storage.pieces
            ),
        )
        for rank, storage in sorted(ranks.items())
    }
    return TensorMap(first.name, first.shape, first.dtype, merged)


def alone(tmap: TensorMap, rank: int, new_rank: int | None = None) -> TensorMap:
    """The part of ``tmap`` that describes rank ``rank`` alone, as rank ``new_rank`` (default: ``rank``),
    with itself as the only holder of each piece: what one worker knows before the parts are merged."""
    new_rank = rank if new_rank is None else new_rank
    storage = tmap.ranks[rank]
    pieces = tuple(Piece(p.box, p.offset, p.strides, (new_rank,)) for p in storage.pieces)
    return TensorMap(tmap.name, tmap.shape, tmap.dtype, {new_rank: RankStorage(storage.shape, pieces)})

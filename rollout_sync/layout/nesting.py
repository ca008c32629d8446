"""Nesting: a layout composed with per-shard storage descriptions gives a ``TensorMap`` in global ranks.

``nest`` takes the two facts a trainer or an inference engine states about a logical tensor
(``layout.shards``: which shard each group rank holds, and how each shard is stored on global ranks),
cuts every storage into pieces (``layout.shard_pieces``, where the address conventions are) and finds
their holders. Holders (replicas) are the global ranks whose storage holds exactly the same box of the
logical tensor; two storages that cut the same replicated region differently are refused
(``UnsupportedLayoutError``), as is a layout that leaves a hole or overlaps itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

from ..errors import HoleError, LayoutError, OutOfBoundsError, OverlapError, UnsupportedLayoutError
from .box import Box
from .maps import Piece, RankStorage, TensorMap
from .shard_pieces import Entry, Span, run_entries, whole_entries
from .shards import FlatRuns, Layout, Shard, ShardStorage, Whole

__all__ = ["nest"]


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
    per_rank: dict[int, tuple[tuple[int, ...], list[Entry]]] = {}
    run_cache: dict[tuple[int, int, int], list[Entry]] = {}
    checked: set[int] = set()  # a replicated layout repeats one shard object
    for layout_rank, shard in layout.shards.items():
        if id(shard) not in checked:
            _check_shard(name, shape, layout_rank, shard)
            checked.add(id(shard))
        storage = storages[layout_rank]
        if isinstance(storage, Whole):
            entries = whole_entries(shard)
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
                    cached = run_cache[key] = run_entries(shard, run.start, run.stop)
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
    per_rank: dict[int, tuple[tuple[int, ...], list[Entry]]],
    name: str,
    rank: int,
    layout_rank: int,
    storage_shape: tuple[int, ...],
    entries: list[Entry],
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


def _assemble(
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    per_rank: dict[int, tuple[tuple[int, ...], list[Entry]]],
) -> TensorMap:
    holders: dict[Span, list[int]] = {}
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
    piece_cache: dict[Entry, Piece] = {}
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

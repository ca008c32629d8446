"""What a side says about one logical tensor before nesting (``layout.nesting.nest`` composes the two):

1. the **layout**: which *shard* of the logical tensor each group rank holds (a TP shard of rows, an EP
   rank's experts, a fused sub-parameter's slice). Layout ranks are group ranks (TP rank, EP rank, ...);
   a shard is a tensor of its own shape whose elements are blocks of the logical tensor
   (``Layout``, ``Shard``, ``ShardBlock``);
2. the **storage** of each shard on global ranks (``ShardStorage``: ``Whole`` or ``FlatRuns``): kept whole,
   as an N-D tensor of the shard's shape, on one or several replica ranks (a vLLM parameter view, a
   ZeRO-0/1/2 ``param.data``), or cut into flat runs of the shard's row-major flattening (ZeRO-3
   ``ds_tensor`` partitions, padding excluded).

Plain immutable descriptions; ``nest`` checks them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Union

__all__ = [
    "FlatRun",
    "FlatRuns",
    "Layout",
    "Shard",
    "ShardBlock",
    "ShardStorage",
    "Whole",
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

"""DeepSpeed's affine IR (deepspeed 0.19.8, ``deepspeed.checkpoint.affine``) to and from our maps.

DeepSpeed describes one parameter over one group: ``ParamAffineMap(logical_shape, shard_shapes,
pieces_by_rank)`` in **group ranks**, each ``AffinePiece(shape, source_offset, source_strides, dest_offset,
dest_strides, locations, scale)`` addressing the full logical tensor (``source_*``, row-major) and the
rank's shard (``dest_*``). Ours is a ``TensorMap`` in **global ranks** whose pieces are boxes plus the
storage address. The correspondence:

- group rank ``g`` is global rank ``table[g]`` (``table``: a sequence indexed by group rank, or a mapping);
- ``shard_shapes[g]`` is the storage shape of ``table[g]``;
- a piece's box origin is the coordinate its ``source_offset`` names in the logical tensor, its extent is
  ``shape``; ``dest_offset``/``dest_strides`` are our ``offset``/``strides``; ``locations`` map to sorted
  global holders.

Refused on the way in (typed errors naming the tensor, the rank and the piece): a scale other than 1
(``UnsupportedLayoutError``: we move weights, we do not rescale them), source strides that are not the
logical tensor's row-major strides (not a box), a source offset that names no coordinate, and ranks
missing from the table. Empty pieces are dropped, as DeepSpeed's planner drops them. The resulting map is
then validated like any other (``TensorMap``).

``segments_from_deepspeed`` turns a DeepSpeed ``TransferPlan`` into our segments, for comparing plans and
for executing DeepSpeed's plans with our executor. DeepSpeed is imported inside these functions only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import LayoutError, OutOfBoundsError, ShapeMismatchError, UnsupportedLayoutError
from ..layout.box import Box, row_major_strides
from ..layout.maps import Piece, RankStorage, TensorMap
from ..planning.records import Segment

__all__ = ["from_deepspeed", "segments_from_deepspeed", "to_deepspeed"]

RankTable = Sequence[int] | Mapping[int, int]


def _table(ranks: RankTable, name: str | None) -> dict[int, int]:
    """group rank -> global rank, checked to be one-to-one."""
    table = dict(ranks.items()) if isinstance(ranks, Mapping) else dict(enumerate(ranks))
    for g, r in table.items():
        if type(g) is not int or type(r) is not int or g < 0 or r < 0:
            raise LayoutError(
                "a rank table maps group ranks to global ranks (ints >= 0)", tensor=name, found=(g, r)
            )
    if len(set(table.values())) != len(table):
        raise LayoutError(
            "a rank table must name each global rank once", tensor=name, found=sorted(table.values())
        )
    return table


def to_deepspeed(tmap: TensorMap, ranks: RankTable) -> Any:
    """Our map as a ``deepspeed.checkpoint.affine.ParamAffineMap`` in group ranks; ``ranks[g]`` is the
    global rank of group rank ``g`` and must cover every rank of the map."""
    from deepspeed.checkpoint.affine import AffinePiece, ParamAffineMap

    table = _table(ranks, tmap.name)
    group_of = {r: g for g, r in table.items()}
    full = row_major_strides(tmap.shape)
    shard_shapes: dict[int, tuple[int, ...]] = {}
    pieces_by_rank: dict[int, list[Any]] = {}
    for rank, storage in tmap.ranks.items():
        g = _group(group_of, rank, tmap.name)
        shard_shapes[g] = storage.shape
        pieces = []
        for p in storage.pieces:
            source = sum(o * s for o, s in zip(p.box.origin, full, strict=True))
            locations = [_group(group_of, h, tmap.name) for h in p.holders]
            pieces.append(AffinePiece(p.box.extent, source, full, p.offset, p.strides, locations))
        pieces_by_rank[g] = pieces
    return ParamAffineMap(tmap.shape, shard_shapes, pieces_by_rank)


def _group(group_of: dict[int, int], rank: int, name: str) -> int:
    g = group_of.get(rank)
    if g is None:
        raise LayoutError(
            "a rank of the map is missing from the rank table",
            tensor=name,
            rank=rank,
            expected=f"one of {sorted(group_of)}",
        )
    return g


def from_deepspeed(pmap: Any, ranks: RankTable, *, name: str, dtype: str) -> TensorMap:
    """A ``ParamAffineMap`` (group ranks) as our ``TensorMap`` in global ranks (``ranks[g]`` is the global
    rank of group rank ``g``); validated on construction."""
    table = _table(ranks, name)
    shape = tuple(int(x) for x in pmap.logical_shape)
    full = row_major_strides(shape)
    storages: dict[int, RankStorage] = {}
    for g, sshape in sorted(pmap.shard_shapes.items()):
        rank = _global(table, g, name)
        pieces = []
        for ap in pmap.pieces_by_rank.get(g, []):
            pieces.append(_piece(ap, shape, full, table, name, rank))
        storages[rank] = RankStorage(tuple(int(x) for x in sshape), tuple(p for p in pieces if p is not None))
    for g in pmap.pieces_by_rank:
        if g not in pmap.shard_shapes:
            raise LayoutError(
                "a group rank holds pieces but declares no shard shape",
                tensor=name,
                rank=_global(table, g, name),
            )
    return TensorMap(name, shape, dtype, storages)


def _global(table: dict[int, int], g: int, name: str) -> int:
    r = table.get(int(g))
    if r is None:
        raise LayoutError(
            "a group rank of the DeepSpeed map is missing from the rank table",
            tensor=name,
            expected=f"one of {sorted(table)}",
            found=f"group rank {g}",
        )
    return r


def _piece(
    ap: Any, shape: tuple[int, ...], full: tuple[int, ...], table: dict[int, int], name: str, rank: int
) -> Piece | None:
    extent = tuple(int(x) for x in ap.shape)
    if len(extent) != len(shape):
        raise ShapeMismatchError(
            "a DeepSpeed piece has another number of axes than its parameter",
            tensor=name,
            rank=rank,
            expected=len(shape),
            found=f"piece shape {extent}",
        )
    if float(ap.scale) != 1.0:
        raise UnsupportedLayoutError(
            "a DeepSpeed piece with a scale other than 1 (the shard holds the block scaled; a weight sync "
            "moves the values unchanged)",
            tensor=name,
            rank=rank,
            expected="scale 1",
            found=f"scale {ap.scale} on piece of shape {extent} at source offset {ap.source_offset}",
        )
    if any(x == 0 for x in extent):
        return None
    strides = tuple(int(x) for x in ap.source_strides)
    if len(strides) != len(shape) or any(
        e > 1 and s != f for e, s, f in zip(extent, strides, full, strict=True)
    ):
        raise UnsupportedLayoutError(
            "a DeepSpeed piece whose source strides are not the parameter's row-major strides is not a box",
            tensor=name,
            rank=rank,
            expected=f"source strides {full} on axes with extent > 1",
            found=f"{strides} (piece shape {extent})",
        )
    origin = []
    rest = int(ap.source_offset)
    for size, stride in zip(shape, full, strict=True):
        coordinate, rest = divmod(rest, stride) if stride else (0, rest)
        origin.append(coordinate)
        if coordinate >= size:
            rest = -1
            break
    if rest != 0 or len(origin) != len(shape):
        raise OutOfBoundsError(
            "a DeepSpeed piece's source offset names no coordinate of its parameter",
            tensor=name,
            rank=rank,
            expected=f"a coordinate of {shape}",
            found=f"source offset {ap.source_offset}",
        )
    box = Box(tuple(origin), extent)
    holders = tuple(sorted(_global(table, int(loc), name) for loc in ap.locations))
    return Piece(box, int(ap.dest_offset), tuple(int(x) for x in ap.dest_strides), holders)


def segments_from_deepspeed(
    plan: Any, source_ranks: RankTable, target_ranks: RankTable, *, tensor: int = 0
) -> list[Segment]:
    """A DeepSpeed ``TransferPlan`` (source and target group ranks) as our segments in global ranks."""
    src = _table(source_ranks, None)
    tgt = _table(target_ranks, None)
    out = []
    for s in plan.segments:
        out.append(
            Segment(
                tensor,
                _global(src, s.source_rank, f"tensor {tensor}"),
                int(s.source_offset),
                tuple(int(x) for x in s.source_strides),
                _global(tgt, s.target_rank, f"tensor {tensor}"),
                int(s.target_offset),
                tuple(int(x) for x in s.target_strides),
                tuple(int(x) for x in s.shape),
            )
        )
    return out

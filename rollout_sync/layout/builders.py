"""Pure map builders: a ``TensorMap`` from layout facts alone (shapes, group sizes, rank tables, partition
sizes, alignment, padding). No process group, no torch, no vLLM or DeepSpeed import.

The live adapters read the same facts from a live engine and take exactly the storage views documented
here; the dry-run simulator and the plan benchmark call these builders directly.

Layout builders (``*_layout``) return a ``Layout`` in group ranks; storage builders return the
``ShardStorage`` of one shard; map builders (``*_map``) compose them with ``nest`` into a ``TensorMap`` in
global ranks. Rank numbering conventions (which global rank is which TP/DP/EP rank) are the callers'
(``rollout_sync.geometry.model_maps`` documents the trainer's and vLLM's).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import LayoutError
from .maps import TensorMap
from .nesting import nest
from .shards import Layout, Shard, ShardBlock, Whole

__all__ = [
    "even_sizes",
    "replicated_layout",
    "replicated_map",
    "split_layout",
    "split_map",
    "sub_param_layout",
]


# ----------------------------------------------------------------------------------------------------------
# Sizes
# ----------------------------------------------------------------------------------------------------------


def even_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Near-even split of ``total`` into ``parts`` contiguous sizes; the first ``total % parts`` get one more."""
    if parts <= 0 or total < 0:
        raise LayoutError("cannot split", expected="parts > 0 and total >= 0", found=(total, parts))
    base, rem = divmod(total, parts)
    return tuple(base + (1 if i < rem else 0) for i in range(parts))


# ----------------------------------------------------------------------------------------------------------
# Layouts (group ranks) and storages
# ----------------------------------------------------------------------------------------------------------


def replicated_layout(name: str, shape: Sequence[int], n: int) -> Layout:
    """Layout ranks ``0..n-1`` each hold the whole tensor."""
    shape = tuple(shape)
    whole = Shard.of_box((0,) * len(shape), shape)
    return Layout(name, shape, dict.fromkeys(range(n), whole))


def split_layout(name: str, shape: Sequence[int], dim: int, sizes: Sequence[int]) -> Layout:
    """Layout rank ``i`` holds the contiguous range of ``sizes[i]`` indices along ``dim`` that follows
    rank ``i-1``'s (uneven and zero sizes allowed; a zero size is an empty shard)."""
    shape = tuple(shape)
    if not 0 <= dim < len(shape):
        raise LayoutError(
            "split dim outside the tensor", tensor=name, expected=f"0 <= dim < {len(shape)}", found=dim
        )
    if sum(sizes) != shape[dim] or any(s < 0 for s in sizes):
        raise LayoutError(
            "split sizes do not tile the split dim",
            tensor=name,
            expected=f"non-negative sizes summing to {shape[dim]}",
            found=tuple(sizes),
        )
    shards = {}
    start = 0
    for i, size in enumerate(sizes):
        origin = tuple(start if d == dim else 0 for d in range(len(shape)))
        extent = tuple(size if d == dim else s for d, s in enumerate(shape))
        shards[i] = Shard.of_box(origin, extent)
        start += size
    return Layout(name, shape, shards)


def sub_param_layout(
    name: str, shape: Sequence[int], dim: int, sub_sizes: Sequence[int], widths: Sequence[Sequence[int]]
) -> Layout:
    """A fused parameter made of sub-parameters stacked along ``dim`` (sizes ``sub_sizes``, e.g. q|k|v or
    gate|up), each split over the ranks: layout rank ``r`` holds, in order, the slice of width
    ``widths[i][r]`` of every sub-parameter ``i`` that follows rank ``r-1``'s (DeepSpeed's
    ``sub_param_map``). Rank ``r``'s shard stacks those slices along ``dim``."""
    shape = tuple(shape)
    ndim = len(shape)
    if not 0 <= dim < ndim or sum(sub_sizes) != shape[dim] or len(widths) != len(sub_sizes):
        raise LayoutError(
            "sub-parameter sizes do not tile the fused dim",
            tensor=name,
            expected=f"{len(sub_sizes)} sub-parameters summing to dim {dim} of {shape}",
            found=(tuple(sub_sizes), len(widths)),
        )
    ranks = len(widths[0]) if widths else 0
    for i, w in enumerate(widths):
        if len(w) != ranks or sum(w) != sub_sizes[i] or min(w, default=0) < 0:
            raise LayoutError(
                "sub-parameter widths do not tile their sub-parameter",
                tensor=name,
                expected=f"{ranks} widths summing to {sub_sizes[i]}",
                found=tuple(w),
            )
    shards = {}
    for r in range(ranks):
        blocks = []
        at = 0
        base = 0
        for i, size in enumerate(sub_sizes):
            width = widths[i][r]
            if width:
                start = base + sum(widths[i][:r])
                blocks.append(
                    ShardBlock(
                        tuple(at if d == dim else 0 for d in range(ndim)),
                        tuple(start if d == dim else 0 for d in range(ndim)),
                        tuple(width if d == dim else shape[d] for d in range(ndim)),
                    )
                )
            at += width
            base += size
        shards[r] = Shard(tuple(at if d == dim else shape[d] for d in range(ndim)), tuple(blocks))
    return Layout(name, shape, shards)


# ----------------------------------------------------------------------------------------------------------
# Generic maps in global ranks
# ----------------------------------------------------------------------------------------------------------


def replicated_map(name: str, shape: Sequence[int], dtype: str, ranks: Sequence[int]) -> TensorMap:
    """Every rank of ``ranks`` holds the whole tensor (storage = the tensor itself, row-major); all are
    holders."""
    shape = tuple(shape)
    layout = Layout(name, shape, {0: Shard.of_box((0,) * len(shape), shape)})
    return nest(layout, {0: Whole(tuple(ranks))}, dtype=dtype)


def split_map(
    name: str, shape: Sequence[int], dtype: str, dim: int, sizes: Sequence[int], ranks: Sequence[int]
) -> TensorMap:
    """``ranks[i]`` holds ``sizes[i]`` contiguous indices along ``dim`` (uneven allowed), as an N-D storage
    of its shard's shape."""
    if len(sizes) != len(ranks):
        raise LayoutError("one size per rank", tensor=name, expected=len(ranks), found=len(sizes))
    layout = split_layout(name, shape, dim, sizes)
    return nest(layout, {i: Whole((r,)) for i, r in enumerate(ranks)}, dtype=dtype)

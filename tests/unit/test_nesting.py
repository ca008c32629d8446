"""Nesting a layout with per-shard storage: checked element by element against numpy storages built
independently of the maps (``arange`` logical tensors, shards cut with numpy slicing, ZeRO partitions cut
from the flattened shard)."""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync.errors import HoleError, LayoutError, OutOfBoundsError, OverlapError, UnsupportedLayoutError
from rollout_sync.layout import Box, TensorMap, flat_run_boxes
from rollout_sync.layout.nesting import nest
from rollout_sync.layout.shard_pieces import _run_boxes
from rollout_sync.layout.shards import FlatRun, FlatRuns, Layout, Shard, ShardBlock, Whole

# --------------------------------------------------------------------------------------------------------
# Oracle (imported by test_builders.py and test_models.py)
# --------------------------------------------------------------------------------------------------------


def check_tiling(tmap: TensorMap) -> None:
    """Every storage is tiled exactly by its pieces (no hole, no overlap, nothing past its end); every
    element of the logical tensor is in exactly one distinct box; holders are exactly the ranks listing
    that box. Element by element (use small shapes)."""
    boxes: dict[Box, set[int]] = {}
    for rank, storage in tmap.ranks.items():
        count = np.zeros(prod(storage.shape), dtype=np.int64)
        for p in storage.pieces:
            assert len(p.strides) == len(p.box.extent) == len(tmap.shape)
            idx = np.full(p.box.extent, p.offset, dtype=np.int64)
            for d, s in enumerate(p.strides):
                shape = [1] * len(p.box.extent)
                shape[d] = p.box.extent[d]
                idx = idx + (np.arange(p.box.extent[d]) * s).reshape(shape)
            assert idx.size == 0 or (idx.min() >= 0 and idx.max() < count.size), (rank, p)
            np.add.at(count, idx.ravel(), 1)
            boxes.setdefault(p.box, set()).add(rank)
            assert tuple(sorted(p.holders)) == p.holders
            assert all(e >= 1 for e in p.box.extent)
            if len(storage.shape) == 1 and len(p.box.extent) > 1:
                # flat storage: the piece is one dense run
                assert p.strides == tuple(prod(p.box.extent[d + 1 :]) for d in range(len(p.box.extent))), (
                    rank,
                    p,
                )
        assert (count == 1).all(), f"rank {rank}: storage {storage.shape} not tiled exactly: {count}"
    cover = np.zeros(tmap.shape, dtype=np.int64)
    for box in boxes:
        cover[tuple(slice(o, o + e) for o, e in zip(box.origin, box.extent, strict=True))] += 1
    assert (cover == 1).all(), f"{tmap.name}: logical tensor not covered exactly once: {cover}"
    for rank, storage in tmap.ranks.items():
        for p in storage.pieces:
            assert set(p.holders) == boxes[p.box], (rank, p, boxes[p.box])


def check_storages(tmap: TensorMap, logical: np.ndarray, storages: Mapping[int, np.ndarray]) -> None:
    """``check_tiling`` plus: every piece's strided view of the independently built storage equals the
    logical tensor's box, on every rank of the map (and the map lists exactly those ranks)."""
    check_tiling(tmap)
    assert set(tmap.ranks) == set(storages), (sorted(tmap.ranks), sorted(storages))
    for rank, storage in tmap.ranks.items():
        real = np.ascontiguousarray(storages[rank])
        assert tuple(real.shape) == storage.shape, (rank, real.shape, storage.shape)
        flat = real.reshape(-1)
        for p in storage.pieces:
            view = np.lib.stride_tricks.as_strided(
                flat[p.offset :],
                shape=p.box.extent,
                strides=tuple(s * flat.itemsize for s in p.strides),
            )
            want = logical[tuple(slice(o, o + e) for o, e in zip(p.box.origin, p.box.extent, strict=True))]
            np.testing.assert_array_equal(view, want, err_msg=f"{tmap.name} rank {rank} piece {p}")


def zero3_parts(flat: np.ndarray, dp: int, alignment: int = 1) -> list[np.ndarray]:
    """What ZeRO-3's ``ds_tensor`` of each DP rank holds of a flattened tensor, padding cut off."""
    p = -(-flat.size // dp)
    p = -(-p // alignment) * alignment
    return [flat[k * p : min((k + 1) * p, flat.size)] for k in range(dp)]


def arange(shape: tuple[int, ...]) -> np.ndarray:
    return np.arange(prod(shape), dtype=np.int64).reshape(shape)


# --------------------------------------------------------------------------------------------------------
# Flat runs
# --------------------------------------------------------------------------------------------------------


def test_a_flat_run_inside_one_row_is_one_box() -> None:
    assert _run_boxes((4, 7), 9, 12) == [((1, 2), (1, 3))]


def test_a_flat_run_across_rows_is_a_head_a_block_and_a_tail() -> None:
    assert _run_boxes((5, 7), 5, 30) == [((0, 5), (1, 2)), ((1, 0), (3, 7)), ((4, 0), (1, 2))]


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple),
    data=st.data(),
)
def test_tuple_runs_are_the_boxes_of_flat_run_boxes(shape: tuple[int, ...], data: st.DataObject) -> None:
    n = prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    expected = [(b.origin, b.extent) for b in flat_run_boxes(shape, start, stop)]
    assert _run_boxes(shape, start, stop) == (expected if stop > start else [])


# --------------------------------------------------------------------------------------------------------
# nest
# --------------------------------------------------------------------------------------------------------


def _zero3(shard_numel: int, ranks: tuple[int, ...]) -> FlatRuns:
    p = -(-shard_numel // len(ranks))
    return FlatRuns(
        tuple(FlatRun(r, min(k * p, shard_numel), min((k + 1) * p, shard_numel)) for k, r in enumerate(ranks))
    )


def test_a_zero3_partition_starts_mid_row() -> None:
    shape = (5, 7)
    layout = Layout("w", shape, {0: Shard.of_box((0, 0), shape)})
    tmap = nest(layout, {0: _zero3(35, (0, 1, 2, 3))}, dtype="bfloat16")
    logical = arange(shape)
    check_storages(tmap, logical, dict(enumerate(zero3_parts(logical.ravel(), 4))))
    first = tmap.ranks[1].pieces[0]
    assert (first.box.origin, first.box.extent, first.offset) == ((1, 2), (1, 5), 0)
    assert tmap.ranks[3].shape == (8,)  # 9 per partition, the last one has one padding element


def test_a_run_of_zero_length_is_an_empty_storage() -> None:
    layout = Layout("w", (5,), {0: Shard.of_box((0,), (5,))})
    tmap = nest(layout, {0: _zero3(5, (0, 1, 2, 3))}, dtype="float32")  # partitions 2, 2, 1, 0
    assert tmap.ranks[3].shape == (0,)
    assert tmap.ranks[3].pieces == ()
    check_tiling(tmap)


def test_whole_replicas_are_holders_of_each_other() -> None:
    shape = (4, 6)
    layout = Layout("w", shape, {0: Shard.of_box((0, 0), (2, 6)), 1: Shard.of_box((2, 0), (2, 6))})
    tmap = nest(layout, {0: Whole((0, 2)), 1: Whole((1, 3))}, dtype="bfloat16")
    logical = arange(shape)
    check_storages(tmap, logical, {0: logical[:2], 2: logical[:2], 1: logical[2:], 3: logical[2:]})
    assert tmap.ranks[2].pieces[0].holders == (0, 2)
    assert tmap.ranks[0].pieces[0] is tmap.ranks[2].pieces[0]


def test_a_replicated_layout_partitioned_alike_on_two_groups_gives_holders_across_groups() -> None:
    shape = (3, 5)
    whole = Shard.of_box((0, 0), shape)
    layout = Layout("norm", shape, {0: whole, 1: whole})
    tmap = nest(layout, {0: _zero3(15, (0, 2)), 1: _zero3(15, (1, 3))}, dtype="bfloat16")
    logical = arange(shape)
    parts = zero3_parts(logical.ravel(), 2)
    check_storages(tmap, logical, {0: parts[0], 2: parts[1], 1: parts[0], 3: parts[1]})
    assert {p.holders for p in tmap.ranks[0].pieces} == {(0, 1)}
    assert {p.holders for p in tmap.ranks[3].pieces} == {(2, 3)}


def _fused_rows_shard(sizes: list[tuple[int, int]], cols: int) -> Shard:
    """A shard stacking row ranges ``(logical_start, rows)`` of a logical tensor on top of each other."""
    blocks = []
    at = 0
    for start, rows in sizes:
        blocks.append(ShardBlock((at, 0), (start, 0), (rows, cols)))
        at += rows
    return Shard((at, cols), tuple(blocks))


def test_a_fused_shard_stored_flat_is_cut_at_its_block_borders() -> None:
    # Logical [q(8); k(4); v(4)] x 6 columns; TP rank 1 of 2 holds q[4:8], k[2:4], v[2:4] stacked, ZeRO-3 over 3.
    shape = (16, 6)
    shard = _fused_rows_shard([(4, 4), (10, 2), (14, 2)], 6)
    layout = Layout("qkv", shape, {1: shard, 0: _fused_rows_shard([(0, 4), (8, 2), (12, 2)], 6)})
    tmap = nest(layout, {1: _zero3(48, (1, 3, 5)), 0: _zero3(48, (0, 2, 4))}, dtype="bfloat16")
    logical = arange(shape)
    real1 = np.concatenate([logical[4:8], logical[10:12], logical[14:16]])
    real0 = np.concatenate([logical[0:4], logical[8:10], logical[12:14]])
    parts1 = zero3_parts(real1.ravel(), 3)
    parts0 = zero3_parts(real0.ravel(), 3)
    check_storages(
        tmap, logical, {1: parts1[0], 3: parts1[1], 5: parts1[2], 0: parts0[0], 2: parts0[1], 4: parts0[2]}
    )


def test_blocks_side_by_side_stored_flat_become_dense_runs() -> None:
    # A shard whose two blocks sit side by side along columns: a flat run crossing both is cut per row.
    shape = (3, 8)
    shard = Shard((3, 4), (ShardBlock((0, 0), (0, 0), (3, 2)), ShardBlock((0, 2), (0, 6), (3, 2))))
    rest = Shard((3, 4), (ShardBlock((0, 0), (0, 2), (3, 4)),))
    layout = Layout("w", shape, {0: shard, 1: rest})
    tmap = nest(layout, {0: FlatRuns((FlatRun(0, 0, 12),)), 1: Whole((1,))}, dtype="float32")
    logical = arange(shape)
    real0 = np.concatenate([logical[:, 0:2], logical[:, 6:8]], axis=1)
    check_storages(tmap, logical, {0: real0.ravel(), 1: logical[:, 2:6]})


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_tp_splits_under_zero3_match_numpy(data: st.DataObject) -> None:
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    dim = data.draw(st.integers(0, ndim - 1))
    tp = data.draw(st.integers(1, 3))
    cuts = sorted(data.draw(st.lists(st.integers(0, shape[dim]), min_size=tp - 1, max_size=tp - 1)))
    bounds = [0, *cuts, shape[dim]]
    dp = data.draw(st.integers(1, 4))
    logical = arange(shape)
    shards = {}
    storages = {}
    real = {}
    for t in range(tp):
        lo, hi = bounds[t], bounds[t + 1]
        origin = tuple(lo if d == dim else 0 for d in range(ndim))
        extent = tuple(hi - lo if d == dim else s for d, s in enumerate(shape))
        shards[t] = Shard.of_box(origin, extent)
        ranks = tuple(d * tp + t for d in range(dp))
        storages[t] = _zero3(prod(extent), ranks)
        piece = logical[tuple(slice(o, o + e) for o, e in zip(origin, extent, strict=True))]
        for k, part in enumerate(zero3_parts(piece.ravel(), dp)):
            real[ranks[k]] = part
    tmap = nest(Layout("w", shape, shards), storages, dtype="bfloat16")
    check_storages(tmap, logical, real)
    for t in range(tp):
        for d in range(dp):
            assert len(tmap.ranks[d * tp + t].pieces) <= max(1, 2 * ndim - 1)


def test_overlapping_blocks_of_one_shard_are_refused() -> None:
    shard = Shard((4, 2), (ShardBlock((0, 0), (0, 0), (3, 2)), ShardBlock((2, 0), (2, 0), (2, 2))))
    with pytest.raises((OverlapError, HoleError)):
        nest(Layout("w", (4, 2), {0: shard}), {0: Whole((0,))}, dtype="float32")


def test_a_layout_with_a_hole_is_refused() -> None:
    layout = Layout("w", (4, 2), {0: Shard.of_box((0, 0), (3, 2))})
    with pytest.raises(HoleError) as info:
        nest(layout, {0: Whole((0,))}, dtype="float32")
    assert info.value.tensor == "w"


def test_a_rank_that_stores_two_shards_is_refused() -> None:
    layout = Layout("w", (4, 2), {0: Shard.of_box((0, 0), (2, 2)), 1: Shard.of_box((2, 0), (2, 2))})
    with pytest.raises(LayoutError) as info:
        nest(layout, {0: Whole((0,)), 1: Whole((0,))}, dtype="float32")
    assert info.value.rank == 0


def test_a_run_past_its_shard_is_refused() -> None:
    layout = Layout("w", (4, 2), {0: Shard.of_box((0, 0), (4, 2))})
    with pytest.raises(OutOfBoundsError):
        nest(layout, {0: FlatRuns((FlatRun(0, 0, 9),))}, dtype="float32")


def test_a_block_past_the_logical_tensor_is_refused() -> None:
    layout = Layout("w", (4, 2), {0: Shard.of_box((2, 0), (4, 2))})
    with pytest.raises(OutOfBoundsError):
        nest(layout, {0: Whole((0,))}, dtype="float32")


def test_replicas_cut_differently_are_refused() -> None:
    whole = Shard.of_box((0, 0), (4, 4))
    layout = Layout("w", (4, 4), {0: whole, 1: whole})
    with pytest.raises(UnsupportedLayoutError):
        nest(layout, {0: _zero3(16, (0, 2)), 1: _zero3(16, (1, 3, 5))}, dtype="float32")


def test_layout_and_storages_must_name_the_same_layout_ranks() -> None:
    layout = Layout("w", (4,), {0: Shard.of_box((0,), (4,))})
    with pytest.raises(LayoutError):
        nest(layout, {1: Whole((0,))}, dtype="float32")


@pytest.mark.parametrize("dp", [1, 2, 3, 5])
def test_packed_experts_placed_round_robin_and_partitioned_match_numpy(dp: int) -> None:
    # Logical [E=4, 3, 5]; EP rank 0 packs experts 0 and 2, EP rank 1 packs 1 and 3; ZeRO-3 over dp ranks each.
    shape = (4, 3, 5)
    logical = arange(shape)
    shards = {
        k: Shard(
            (2, 3, 5), tuple(ShardBlock((i, 0, 0), (e, 0, 0), (1, 3, 5)) for i, e in enumerate((k, k + 2)))
        )
        for k in (0, 1)
    }
    storages = {k: _zero3(30, tuple(d * 2 + k for d in range(dp))) for k in (0, 1)}
    tmap = nest(Layout("experts", shape, shards), storages, dtype="bfloat16")
    real = {}
    for k in (0, 1):
        packed = np.stack([logical[k], logical[k + 2]])
        for d, part in enumerate(zero3_parts(packed.ravel(), dp)):
            real[d * 2 + k] = part
    check_storages(tmap, logical, real)

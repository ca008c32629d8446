"""DeepSpeed 0.19.8's affine IR: conversion both ways, and the peer check against its own planner
(``plan_transfer``): on layouts it accepts, our plan moves every element to the same place."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from planner_layouts import ANY, DEEPSPEED, element_routes, layout_pairs, shapes, tensor_maps

from rollout_sync.errors import LayoutError, OutOfBoundsError, UnsupportedLayoutError
from rollout_sync.interop.deepspeed_ir import from_deepspeed, segments_from_deepspeed, to_deepspeed
from rollout_sync.layout.box import row_major_strides
from rollout_sync.layout.maps import TensorMap
from rollout_sync.planning.planner import plan_tensor

os.environ.setdefault("DS_ACCELERATOR", "cpu")
affine = pytest.importorskip("deepspeed.checkpoint.affine")
transfer = pytest.importorskip("deepspeed.checkpoint.affine_transfer")

BUDGET = transfer.PlanBudget(
    max_pieces_per_map=1 << 16,
    max_pair_checks=1 << 24,
    max_segments=1 << 20,
    max_plan_bytes=1 << 28,
    max_merge_checks=1 << 24,
)


def table(m: TensorMap) -> list[int]:
    """Group rank g is the g-th smallest global rank of the map."""
    return sorted(m.ranks)


def deepspeed_routes(source: TensorMap, target: TensorMap):
    plan = transfer.plan_transfer(
        to_deepspeed(target, table(target)), to_deepspeed(source, table(source)), BUDGET
    )
    return element_routes(segments_from_deepspeed(plan, table(source), table(target)))


# ------------------------------------------------------------------------------------------- conversion


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes().flatmap(lambda s: tensor_maps(s, 3, ANY)))
def test_any_map_converts_to_deepspeed_and_back_unchanged(m):
    ds = to_deepspeed(m, table(m))
    ds.validate()
    assert from_deepspeed(ds, table(m), name=m.name, dtype=m.dtype) == m


def test_deepspeed_builders_convert_into_valid_maps():
    fused = affine.sub_param_map((48, 8), [32, 8, 8], [[16, 16], [4, 4], [4, 4]], 0)  # qkv over TP 2
    m = from_deepspeed(fused, [10, 11], name="qkv", dtype="bfloat16")
    assert sorted(m.ranks) == [10, 11]
    assert sum(e[0] * e[1] for _, e, _ in m.regions) == 48 * 8
    rep = from_deepspeed(affine.replicated_map((4, 4), 3), {0: 7, 1: 5, 2: 9}, name="norm", dtype="float32")
    assert rep.regions[0][2] == ((5, 0, (4, 1)), (7, 0, (4, 1)), (9, 0, (4, 1)))


def test_a_scale_other_than_1_is_refused():
    with pytest.raises(UnsupportedLayoutError) as err:
        from_deepspeed(affine.replicated_map((4,), 2, scale=0.5), [0, 1], name="bias", dtype="float32")
    assert err.value.tensor == "bias" and err.value.rank == 0


def test_source_strides_that_are_not_a_box_are_refused():
    piece = affine.AffinePiece((2, 2), 0, (1, 2), 0, (2, 1), [0])  # a transposed read of the logical tensor
    bad = affine.ParamAffineMap((2, 2), {0: (2, 2)}, {0: [piece]})
    with pytest.raises(UnsupportedLayoutError):
        from_deepspeed(bad, [0], name="w", dtype="float32")


def test_a_source_offset_that_names_no_coordinate_is_refused():
    piece = affine.AffinePiece((1,), 9, (1,), 0, (1,), [0])
    with pytest.raises(OutOfBoundsError):
        from_deepspeed(affine.ParamAffineMap((4,), {0: (1,)}, {0: [piece]}), [0], name="w", dtype="float32")


def test_ranks_missing_from_the_table_are_refused():
    with pytest.raises(LayoutError):
        from_deepspeed(affine.replicated_map((4,), 3), [0, 1], name="w", dtype="float32")
    m = from_deepspeed(affine.replicated_map((4,), 2), [0, 1], name="w", dtype="float32")
    with pytest.raises(LayoutError):
        to_deepspeed(m, [0, 2])
    with pytest.raises(LayoutError):
        to_deepspeed(m, [0, 0])


# ------------------------------------------------------------------------------------------- peer check


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs(DEEPSPEED, DEEPSPEED))
def test_on_layouts_deepspeed_accepts_our_plan_moves_every_element_like_deepspeeds(pair):
    source, target = pair
    ours = element_routes(plan_tensor(source, target, "lowest"))
    assert ours == deepspeed_routes(source, target)


def outside_deepspeed(m: TensorMap) -> bool:
    """A storage of another ndim than its tensor, or one read with permuted strides: what 0.19.8 refuses."""
    for st_ in m.ranks.values():
        if len(st_.shape) != len(m.shape):
            return True
        rm = row_major_strides(st_.shape)
        for p in st_.pieces:
            if any(e > 1 and s != r for e, s, r in zip(p.box.extent, p.strides, rm, strict=True)):
                return True
            if any(e > n for e, n in zip(p.box.extent, st_.shape, strict=True)):
                return True  # row-major strides, but only as a permutation of the storage axes
    return False


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs(ANY, ANY))
def test_on_random_layouts_deepspeed_agrees_or_refuses_only_what_it_does_not_express(pair):
    source, target = pair
    ours = element_routes(plan_tensor(source, target))
    try:
        theirs = deepspeed_routes(source, target)
    except transfer.AffineTransferError:
        assert outside_deepspeed(source) or outside_deepspeed(target)
        return
    assert ours == theirs


def test_deepspeeds_own_tp_maps_plan_the_same_row_to_column_reshard():
    src = from_deepspeed(affine.contiguous_split_map((8, 6), [4, 4], 0), [0, 1], name="w", dtype="float32")
    tgt = from_deepspeed(
        affine.contiguous_split_map((8, 6), [2, 2, 2], 1), [2, 3, 4], name="w", dtype="float32"
    )
    assert element_routes(plan_tensor(src, tgt)) == deepspeed_routes(src, tgt)

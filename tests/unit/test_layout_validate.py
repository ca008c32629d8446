"""Maps are validated when built: every refusal names the tensor, the rank and the box."""

from __future__ import annotations

import pytest

from rollout_sync.errors import (
    CoverageError,
    HoleError,
    LayoutError,
    NotAffineError,
    OutOfBoundsError,
    OverlapError,
    ShapeMismatchError,
    UnsupportedLayoutError,
)
from rollout_sync.layout.box import Box, row_major_strides
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap


def piece(origin, extent, offset, strides=None, holders=(0,)):
    return Piece(
        Box(tuple(origin), tuple(extent)), offset, tuple(strides or row_major_strides(tuple(extent))), holders
    )


def one_rank(shape, storage_shape, pieces, rank=0, dtype="float32"):
    return TensorMap("w", tuple(shape), dtype, {rank: RankStorage(tuple(storage_shape), tuple(pieces))})


def refused(cls, build):
    with pytest.raises(cls) as err:
        build()
    assert err.value.tensor == "w"
    return err.value


# ------------------------------------------------------------------------------------------- accepted


def test_a_flat_run_cut_inside_rows_is_three_dense_pieces():
    # elements [3, 17) of a [4, 5] tensor: row 0 cols 3-4, rows 1-2, row 3 cols 0-1
    m = one_rank(
        (4, 5),
        (14,),
        [piece((0, 3), (1, 2), 0), piece((1, 0), (2, 5), 2), piece((3, 0), (1, 2), 12)],
    )
    assert [(r[0], r[1]) for r in m.regions] == [((0, 3), (1, 2)), ((1, 0), (2, 5)), ((3, 0), (1, 2))]
    assert m.regions[1][2] == ((0, 2, (5, 1)),)


def test_a_transposed_storage_is_an_affine_view():
    m = one_rank((3, 5), (5, 3), [piece((0, 0), (3, 5), 0, (1, 3))])
    assert m.regions == (((0, 0), (3, 5), ((0, 0, (1, 3)),)),)


def test_a_permuted_4d_storage_with_several_pieces_is_accepted():
    # logical [2, 3, 4, 5] stored with axes (2, 0, 3, 1): storage shape [4, 2, 5, 3]
    sshape = (4, 2, 5, 3)
    ss = row_major_strides(sshape)
    strides = (ss[1], ss[3], ss[0], ss[2])
    pieces = [
        piece((0, 0, 0, 0), (2, 3, 2, 5), 0, strides),
        piece((0, 0, 2, 0), (2, 3, 2, 5), 2 * ss[0], strides),
    ]
    m = one_rank((2, 3, 4, 5), sshape, pieces)
    assert len(m.regions) == 2


def test_a_dense_run_in_a_2d_storage_of_a_3d_tensor_is_accepted():
    # a 3-D tensor stored as [2, 12]: the piece [1, 2, 4] at offset 4 is one dense run of 8 elements
    m = one_rank(
        (2, 3, 4),
        (2, 12),
        [piece((0, 0, 0), (1, 1, 4), 0), piece((0, 1, 0), (1, 2, 4), 4), piece((1, 0, 0), (1, 3, 4), 12)],
    )
    assert len(m.regions) == 3


def test_one_map_mixes_flat_and_nd_storages_across_ranks():
    m = TensorMap(
        "w",
        (4, 3),
        "bfloat16",
        {
            0: RankStorage((2, 3), (piece((0, 0), (2, 3), 0),)),
            1: RankStorage((6,), (piece((2, 0), (2, 3), 0, holders=(1,)),)),
        },
    )
    assert [a[0][0] for *_, a in m.regions] == [0, 1]


def test_replicas_list_all_holders_and_each_holder_its_own_address():
    # ranks 3 and 7 both hold the whole [2, 2] tensor; rank 7 keeps it after 2 elements of another box
    shared = (3, 7)
    m = TensorMap(
        "w",
        (3, 2),
        "float32",
        {
            3: RankStorage((2, 2), (piece((0, 0), (2, 2), 0, holders=shared),)),
            7: RankStorage(
                (6,), (piece((2, 0), (1, 2), 0, holders=(7,)), piece((0, 0), (2, 2), 2, holders=shared))
            ),
        },
    )
    assert m.regions == (
        ((0, 0), (2, 2), ((3, 0, (2, 1)), (7, 2, (2, 1)))),
        ((2, 0), (1, 2), ((7, 0, (2, 1)),)),
    )


def test_empty_storages_and_empty_pieces_hold_nothing():
    m = TensorMap(
        "w",
        (4,),
        "float32",
        {
            0: RankStorage((4,), (piece((0,), (4,), 0),)),
            1: RankStorage((0,), ()),
            2: RankStorage((0,), (piece((4,), (0,), 0, holders=(2,)),)),
        },
    )
    assert len(m.regions) == 1


def test_a_map_rebuilt_from_the_same_storages_reuses_its_validation_but_not_for_another_shape():
    storage = RankStorage((4, 2), (piece((0, 0), (4, 2), 0),))
    first = TensorMap("a", (4, 2), "float32", {0: storage})
    second = TensorMap("b", (4, 2), "float32", {0: storage})
    assert second.regions is first.regions
    with pytest.raises(OutOfBoundsError):
        TensorMap("c", (3, 2), "float32", {0: storage})
    with pytest.raises(HoleError):
        TensorMap("d", (4, 2), "float32", {0: storage, 1: RankStorage((2,), ())})


# ------------------------------------------------------------------------------------------- refused


def test_overlapping_runs_in_one_flat_storage_are_refused():
    err = refused(
        OverlapError, lambda: one_rank((4, 4), (16,), [piece((0, 0), (2, 4), 0), piece((2, 0), (2, 4), 6)])
    )
    assert err.rank == 0 and err.box == Box((2, 0), (2, 4))


def test_overlapping_boxes_in_one_nd_storage_are_refused():
    refused(
        OverlapError,
        lambda: one_rank(
            (4, 4), (4, 4), [piece((0, 0), (3, 4), 0, (4, 1)), piece((3, 0), (1, 4), 8, (4, 1))]
        ),
    )


def test_a_hole_in_a_flat_storage_is_refused():
    err = refused(
        HoleError, lambda: one_rank((4, 4), (17,), [piece((0, 0), (1, 4), 0), piece((1, 0), (3, 4), 5)])
    )
    assert "[4, 5)" in str(err)


def test_a_hole_at_the_end_of_a_storage_is_refused():
    refused(HoleError, lambda: one_rank((4, 4), (17,), [piece((0, 0), (4, 4), 0)]))
    refused(HoleError, lambda: one_rank((2, 4), (4, 4), [piece((0, 0), (2, 4), 0)]))
    refused(HoleError, lambda: one_rank((2, 4), (4, 4), []))


def test_a_run_past_the_end_of_a_storage_is_refused():
    err = refused(
        OutOfBoundsError,
        lambda: one_rank((4, 4), (16,), [piece((0, 0), (1, 4), 0), piece((1, 0), (3, 4), 8)]),
    )
    assert err.rank == 0 and err.box == Box((1, 0), (3, 4))
    refused(OutOfBoundsError, lambda: one_rank((4, 4), (3, 4), [piece((0, 0), (4, 4), 0, (4, 1))]))
    refused(OutOfBoundsError, lambda: one_rank((4, 4), (4, 4), [piece((0, 0), (4, 4), 16, (4, 1))]))


def test_a_box_past_the_logical_tensor_is_refused():
    refused(OutOfBoundsError, lambda: one_rank((4, 4), (20,), [piece((0, 0), (5, 4), 0)]))


def test_a_1d_piece_describing_a_matrix_is_refused():
    err = refused(ShapeMismatchError, lambda: one_rank((4, 4), (16,), [piece((0,), (16,), 0)]))
    assert err.rank == 0 and err.box == Box((0,), (16,))


def test_a_2d_storage_of_a_3d_tensor_is_refused_where_the_piece_is_not_dense():
    # the box [2, 2, 4] of a [2, 3, 4] tensor with the tensor's own strides skips row 2: not one run
    err = refused(
        NotAffineError, lambda: one_rank((2, 3, 4), (2, 8), [piece((0, 0, 0), (2, 2, 4), 0, (12, 4, 1))])
    )
    assert err.box == Box((0, 0, 0), (2, 2, 4))


def test_an_nd_piece_in_flat_storage_is_refused_where_not_dense():
    # a column block of a [4, 6] tensor in a flat storage with the tensor's row stride
    refused(
        NotAffineError,
        lambda: one_rank((4, 6), (24,), [piece((0, 0), (4, 3), 0, (6, 1)), piece((0, 3), (4, 3), 12)]),
    )


def test_strides_that_are_not_a_permutation_of_storage_axes_are_refused():
    refused(NotAffineError, lambda: one_rank((4, 4), (4, 4), [piece((0, 0), (4, 4), 0, (4, 2))]))
    refused(
        NotAffineError, lambda: one_rank((4, 4), (4, 4), [piece((0, 0), (4, 4), 0, (4, 4))])
    )  # one axis twice
    refused(NotAffineError, lambda: one_rank((2, 2), (2, 2), [piece((0, 0), (2, 2), 0, (3, 1))]))


def test_a_piece_listed_under_a_rank_that_is_not_a_holder_is_refused():
    err = refused(CoverageError, lambda: one_rank((4,), (4,), [piece((0,), (4,), 0, holders=(1,))]))
    assert err.rank == 0


def test_a_declared_holder_that_does_not_hold_the_box_is_refused():
    err = refused(
        CoverageError,
        lambda: TensorMap(
            "w",
            (4,),
            "float32",
            {0: RankStorage((4,), (piece((0,), (4,), 0, holders=(0, 2)),)), 2: RankStorage((0,), ())},
        ),
    )
    assert err.rank == 2 and err.box == Box((0,), (4,))


def test_one_box_with_different_holders_on_two_ranks_is_refused():
    refused(
        CoverageError,
        lambda: TensorMap(
            "w",
            (4,),
            "float32",
            {
                0: RankStorage((4,), (piece((0,), (4,), 0, holders=(0, 1)),)),
                1: RankStorage((4,), (piece((0,), (4,), 0, holders=(1,)),)),
            },
        ),
    )


def test_replicas_cut_differently_are_refused():
    # rank 0 holds rows 0-2, rank 1 rows 2-3: row 2 is held twice but declared with single holders
    err = refused(
        OverlapError,
        lambda: TensorMap(
            "w",
            (4, 2),
            "float32",
            {
                0: RankStorage((3, 2), (piece((0, 0), (3, 2), 0),)),
                1: RankStorage((2, 2), (piece((2, 0), (2, 2), 0, holders=(1,)),)),
            },
        ),
    )
    assert err.box in (Box((0, 0), (3, 2)), Box((2, 0), (2, 2)))


def test_a_rank_holding_one_box_twice_is_refused():
    refused(OverlapError, lambda: one_rank((4,), (8,), [piece((0,), (4,), 0), piece((0,), (4,), 4)]))


def test_one_rank_holding_overlapping_boxes_is_refused():
    refused(
        OverlapError, lambda: one_rank((4, 4), (24,), [piece((0, 0), (4, 4), 0), piece((1, 0), (2, 4), 16)])
    )


def test_bad_piece_and_map_fields_are_refused():
    with pytest.raises(ShapeMismatchError):
        Piece(Box((0, 0), (2, 2)), 0, (2,), (0,))
    with pytest.raises(NotAffineError):
        Piece(Box((0, 0), (2, 2)), 0, (2, -1), (0,))
    with pytest.raises(CoverageError):
        Piece(Box((0,), (2,)), 0, (1,), ())
    with pytest.raises(CoverageError):
        Piece(Box((0,), (2,)), 0, (1,), (3, 1))
    with pytest.raises(UnsupportedLayoutError):
        one_rank((4,), (4,), [piece((0,), (4,), 0)], dtype="float13")
    with pytest.raises(LayoutError):
        TensorMap("w", (4,), "float32", {-1: RankStorage((4,), (piece((0,), (4,), 0),))})
    with pytest.raises(OutOfBoundsError):
        one_rank((4,), (4,), [piece((0,), (4,), -1)])


def test_validating_a_large_map_does_not_compare_all_pairs_of_pieces():
    # 20,000 flat runs of one row each over 100 ranks: pairwise checks would be 2·10⁸ comparisons
    shape = (20000, 3)
    storages = {}
    for r in range(100):
        pieces = tuple(Piece(Box((r * 200 + i, 0), (1, 3)), 3 * i, (3, 1), (r,)) for i in range(200))
        storages[r] = RankStorage((600,), pieces)
    m = TensorMap("w", shape, "float32", storages)
    assert len(m.regions) == 20000

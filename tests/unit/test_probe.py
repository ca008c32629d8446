"""Target maps from loader-probe observations (``rollout_sync.rollout.landings``, ``landing_maps``,
``local_targets``), pure.

A *simulated loader* (numpy) plays vLLM's loaders here: it copies a logical tensor into a parameter the way
a real loader would (a row range of a fused parameter, a column shard, a transposed copy, ...). The probe
protocol is then run exactly as ``vllm_plugin.probing`` runs it (one probe per dimension, values
``coordinate + 1``, parameters reset to -1) and the resulting map is checked element by element against
the simulated loader.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync.errors import NotAffineError, UnsupportedLayoutError
from rollout_sync.layout.box import Box
from rollout_sync.rollout.codec import local_targets_from_dict, local_targets_to_dict
from rollout_sync.rollout.landing_maps import storage_shape, target_map
from rollout_sync.rollout.landings import FILLED, Landing, LandingBuilder
from rollout_sync.rollout.local_targets import fallback_map, local_targets
from rollout_sync.rollout.storage_view import StorageView

Loader = Callable[[dict[str, np.ndarray], np.ndarray], None]


def probe(
    shape: tuple[int, ...],
    params: dict[str, tuple[int, ...]],
    loader: Loader,
    *,
    chunk: int = 5,
    tensor: str = "t",
    rank: int = 0,
) -> list[Landing]:
    """Run the probe protocol against a simulated loader, feeding ``LandingBuilder`` a few elements at a
    time as ``vllm_plugin.probing`` feeds it chunks; the landings it would observe."""
    per_dim = []
    for dim in range(max(len(shape), 1)):
        bufs = {n: np.full(s, -1.0) for n, s in params.items()}
        if shape:
            view = [1] * len(shape)
            view[dim] = shape[dim]
            value = np.broadcast_to(np.arange(1, shape[dim] + 1, dtype=np.float64).reshape(view), shape)
        else:
            value = np.ones(())
        loader(bufs, value)
        per_dim.append({n: b.reshape(-1) for n, b in bufs.items()})
    landings = []
    for name, pshape in params.items():
        written = np.flatnonzero(per_dim[0][name] != -1)
        if not written.size:
            assert all(not (d[name] != -1).any() for d in per_dim)
            continue
        lo, hi = int(written[0]), int(written[-1]) + 1
        builder = LandingBuilder(
            tensor, shape, rank, param=name, param_shape=pshape, param_contiguous=True, start=lo, stop=hi
        )
        for dim, seen in enumerate(per_dim):
            flat = seen[name]
            for at in range(lo, hi, chunk):
                builder.add(dim, at - lo, flat[at : min(at + chunk, hi)])
            builder.written_outside(dim, int((flat[:lo] != -1).sum() + (flat[hi:] != -1).sum()))
            builder.dimension_done(dim)
        landings.append(builder.landing())
    return landings


def check_against_loader(
    shape: tuple[int, ...], params: dict[str, tuple[int, ...]], loader: Loader, rank: int = 0
) -> tuple[StorageView, list]:
    """Build the map and check that every piece addresses exactly what the loader wrote."""
    got = target_map("t", shape, "bfloat16", probe(shape, params, loader), rank)
    assert got is not None
    tmap, view = got
    # What the loader does with a tensor whose elements are their own linear index + 1.
    bufs = {n: np.full(s, -1.0) for n, s in params.items()}
    loader(bufs, np.arange(1, prod(shape) + 1, dtype=np.float64).reshape(shape))
    assert view.param is not None
    flat = bufs[view.param].reshape(-1)[view.offset : view.offset + view.numel]
    seen = np.zeros(view.numel, dtype=bool)
    storage = tmap.ranks[rank]
    assert prod(storage.shape) == view.numel
    for piece in storage.pieces:
        idx = np.full(piece.box.extent, piece.offset, dtype=np.int64)
        for d, (e, s) in enumerate(zip(piece.box.extent, piece.strides, strict=True)):
            shp = [1] * len(shape)
            shp[d] = e
            idx = idx + (np.arange(e) * s).reshape(shp)
        grids = np.ix_(
            *[np.arange(o, o + e) for o, e in zip(piece.box.origin, piece.box.extent, strict=True)]
        )
        logical = np.ravel_multi_index(grids, shape) + 1 if shape else np.array(1)
        assert np.array_equal(flat[idx], logical), piece
        assert not seen[idx.reshape(-1)].any(), "two pieces address one element"
        seen[idx.reshape(-1)] = True
    assert seen.all(), "the storage has elements no piece describes"
    return view, list(storage.pieces)


# ---------------------------------------------------------------------------------------------- layouts


def test_k_rows_of_a_fused_qkv_at_tp2_rank1_are_one_piece_in_a_row_range_of_the_parameter():
    # q 128 rows, k 64, v 64 logical; TP 2 -> qkv_proj [64 + 32 + 32, 16]; rank 1 holds k rows 32:64.
    def loader(p, w):
        p["qkv"][64:96] = w[32:64]

    view, pieces = check_against_loader((64, 16), {"qkv": (128, 16)}, loader, rank=1)
    assert view == StorageView("qkv", 64 * 16, (32, 16))
    assert [(p.box, p.offset, p.strides, p.holders) for p in pieces] == [
        (Box((32, 0), (32, 16)), 0, (16, 1), (1,))
    ]


def test_a_vocab_shard_excludes_the_zero_filled_padding_rows():
    # vocab 1000, padded to 1024, TP 2: rank 1 holds rows 512:1000 in param rows 0:488, rows 488:512 zeroed.
    def loader(p, w):
        p["embed"][:488] = w[512:]
        p["embed"][488:] = 0

    view, pieces = check_against_loader((1000, 8), {"embed": (512, 8)}, loader, rank=1)
    assert view == StorageView("embed", 0, (488, 8))
    assert [p.box for p in pieces] == [Box((512, 0), (488, 8))]


def test_a_row_parallel_shard_is_one_piece_of_a_column_block():
    def loader(p, w):
        p["o"][:] = w[:, 64:]

    view, pieces = check_against_loader((32, 128), {"o": (32, 64)}, loader, rank=1)
    assert view == StorageView("o", 0, (32, 64))
    assert [(p.box, p.offset, p.strides) for p in pieces] == [(Box((0, 64), (32, 64)), 0, (64, 1))]


def test_an_expert_slab_of_w13_gets_the_slab_shape():
    # w13 [E=4, 2*I=8, H=16]; expert 2's up_proj [8 rows] at TP 2 rank 0 -> w13[2, 4:8].
    def loader(p, w):
        p["w13"][2, 4:8] = w[0:4]

    view, pieces = check_against_loader((8, 16), {"w13": (4, 8, 16)}, loader)
    assert view == StorageView("w13", 2 * 8 * 16 + 4 * 16, (4, 16))
    assert [p.box for p in pieces] == [Box((0, 0), (4, 16))]


def test_a_transposed_storage_is_one_piece_with_permuted_strides():
    def loader(p, w):
        p["wt"][:] = w.T

    view, pieces = check_against_loader((6, 10), {"wt": (10, 6)}, loader)
    assert view == StorageView("wt", 0, (10, 6))
    assert [(p.box, p.strides) for p in pieces] == [(Box((0, 0), (6, 10)), (1, 6))]


def test_a_fused_logical_qkv_at_tp2_is_three_pieces_in_one_storage():
    # Logical [q0 q1 k0 k1 v0 v1] rows (each 4): rank 0 stores q0 k0 v0.
    def loader(p, w):
        p["qkv"][:] = np.concatenate([w[0:4], w[8:12], w[16:20]])

    view, pieces = check_against_loader((24, 3), {"qkv": (12, 3)}, loader)
    assert view == StorageView("qkv", 0, (12, 3))
    assert [p.box for p in pieces] == [Box((0, 0), (4, 3)), Box((8, 0), (4, 3)), Box((16, 0), (4, 3))]


def test_column_halves_interleaved_in_storage_are_two_pieces():
    # Logical [8, 2*6] = [gate | up] columns; TP 2 rank 1 stores gate[:, 3:6] | up[:, 3:6] per row.
    def loader(p, w):
        p["gu"][:] = np.concatenate([w[:, 3:6], w[:, 9:12]], axis=1)

    _, pieces = check_against_loader((8, 12), {"gu": (8, 6)}, loader, rank=1)
    assert [(p.box, p.offset, p.strides) for p in pieces] == [
        (Box((0, 3), (8, 3)), 0, (6, 1)),
        (Box((0, 9), (8, 3)), 3, (6, 1)),
    ]


def test_a_replicated_1d_tensor_and_a_scalar_are_one_piece_each():
    def vec(p, w):
        p["norm"][:] = w

    view, pieces = check_against_loader((32,), {"norm": (32,)}, vec)
    assert (view, [p.box for p in pieces]) == (StorageView("norm", 0, (32,)), [Box((0,), (32,))])

    def scalar(p, w):
        p["scale"][...] = w

    got = target_map("s", (), "float32", probe((), {"scale": ()}, scalar), 0)
    assert got is not None
    assert got[1] == StorageView("scale", 0, ())
    assert [p.box for p in got[0].ranks[0].pieces] == [Box((), ())]


def test_a_small_row_reversal_is_described_row_by_row_and_a_large_permutation_is_refused():
    def reverse(p, w):
        p["r"][:] = w[::-1]

    _, pieces = check_against_loader((4, 5), {"r": (4, 5)}, reverse)
    assert len(pieces) == 4
    perm = np.random.default_rng(0).permutation(200)

    def shuffle(p, w):
        p["r"][:] = w[perm]

    with pytest.raises(NotAffineError, match="more than 64 affine pieces"):
        target_map("t", (200, 3), "bfloat16", probe((200, 3), {"r": (200, 3)}, shuffle), 0)


# ---------------------------------------------------------------------------------------------- refusals


def test_a_loader_that_scales_values_is_refused_as_transforming():
    def loader(p, w):
        p["w"][:] = w * 2

    with pytest.raises(NotAffineError, match="transforms values") as err:
        probe((16, 4), {"w": (16, 4)}, loader, tensor="model.norm.weight", rank=3)
    assert err.value.tensor == "model.norm.weight" and err.value.rank == 3


def test_a_tensor_written_into_two_parameters_is_refused():
    def loader(p, w):
        p["a"][:] = w
        p["b"][:] = w

    with pytest.raises(UnsupportedLayoutError, match="several parameters"):
        target_map("t", (4, 4), "bfloat16", probe((4, 4), {"a": (4, 4), "b": (4, 4)}, loader), 0)


def test_a_tensor_with_a_hole_in_its_parameter_range_is_refused():
    def loader(p, w):
        p["w"][0:4] = w[0:4]
        p["w"][6:10] = w[4:8]

    with pytest.raises(UnsupportedLayoutError, match="one contiguous range"):
        target_map("t", (8, 2), "bfloat16", probe((8, 2), {"w": (10, 2)}, loader), 0)


def test_an_element_written_twice_is_refused():
    def loader(p, w):
        p["w"][0:4] = w
        p["w"][4:8] = w

    with pytest.raises(NotAffineError, match="several places"):
        target_map("t", (4, 2), "bfloat16", probe((4, 2), {"w": (8, 2)}, loader), 0)


def test_local_targets_stage_a_refused_tensor_whole_and_report_it_by_name():
    def good(p, w):
        p["norm"][:] = w

    def bad(p, w):
        p["w"][:] = w
        p["w2"][:] = w

    landings = {
        "model.norm.weight": probe((8,), {"norm": (8,)}, good),
        "model.embed.weight": probe((4, 2), {"w": (4, 2), "w2": (4, 2)}, bad),
    }
    tensors = {
        "model.norm.weight": ((8,), "bfloat16"),
        "model.embed.weight": ((4, 2), "bfloat16"),
        "x": ((3,), "bfloat16"),
    }
    out = local_targets(5, tensors, landings, {"x": "ValueError: loader raised"}, fallback_dtype="bfloat16")
    assert set(out.refused) == {"model.embed.weight", "x"}
    assert "several parameters" in out.refused["model.embed.weight"]
    assert out.views["model.embed.weight"] == StorageView(None, 0, (4, 2))
    assert out.maps["model.embed.weight"] == fallback_map("model.embed.weight", (4, 2), "bfloat16", 5)[0]
    assert out.views["model.norm.weight"] == StorageView("norm", 0, (8,))
    assert out.absent == ()
    assert local_targets_from_dict(local_targets_to_dict(out)) == out


def test_a_tensor_that_lands_nowhere_is_absent_from_the_rank():
    def nothing(p, w):
        pass

    out = local_targets(
        0,
        {"e": ((4, 4), "bfloat16")},
        {"e": probe((4, 4), {"w": (4, 4)}, nothing)},
        {},
        fallback_dtype="bfloat16",
    )
    assert out.absent == ("e",) and not out.maps and not out.refused


@pytest.mark.parametrize(
    ("param_shape", "start", "stop", "expected"),
    [
        ((128, 16), 0, 1024, (64, 16)),
        ((4, 8, 16), 2 * 128, 3 * 128, (8, 16)),
        ((4, 8, 16), 2 * 128 + 64, 3 * 128, (4, 16)),
        ((4, 8, 16), 0, 2 * 128, (2, 8, 16)),
        ((10, 7), 3, 12, (9,)),
        ((32,), 0, 32, (32,)),
    ],
)
def test_the_storage_shape_is_the_parameters_trailing_shape_where_the_range_aligns(
    param_shape, start, stop, expected
):
    assert storage_shape(param_shape, start, stop) == expected


# ---------------------------------------------------------------------------------------------- property


@st.composite
def layouts(draw, transpose: bool):
    """A logical tensor cut into random boxes (guillotine cuts), each copied (maybe transposed) into a
    consecutive range of one flat parameter, in random order, with padding after."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    boxes = [((0,) * ndim, shape)]
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(boxes) - 1))
        origin, extent = boxes[i]
        d = draw(st.integers(0, ndim - 1))
        if extent[d] < 2:
            continue
        cut = draw(st.integers(1, extent[d] - 1))
        a = (origin, tuple(cut if k == d else e for k, e in enumerate(extent)))
        b = (
            tuple(o + cut if k == d else o for k, o in enumerate(origin)),
            tuple(e - cut if k == d else e for k, e in enumerate(extent)),
        )
        boxes[i : i + 1] = [a, b]
    order = draw(st.permutations(range(len(boxes))))
    axes = [tuple(draw(st.permutations(range(ndim)))) if transpose else tuple(range(ndim)) for _ in boxes]
    lead = draw(st.integers(0, 3))
    pad = draw(st.integers(0, 3))
    return shape, [boxes[i] for i in order], [axes[i] for i in order], lead, pad


def _box_loader(boxes, axes, lead):
    def loader(p, w):
        flat = p["p"]
        pos = lead
        for (origin, extent), perm in zip(boxes, axes, strict=True):
            block = w[tuple(slice(o, o + e) for o, e in zip(origin, extent, strict=True))]
            data = np.transpose(block, perm).reshape(-1)
            flat[pos : pos + data.size] = data
            pos += data.size

    return loader


@settings(max_examples=150, deadline=None)
@given(layouts(transpose=False))
def test_any_row_major_box_layout_in_a_flat_parameter_gives_a_map_that_matches_the_loader(layout):
    shape, boxes, axes, lead, pad = layout
    _, pieces = check_against_loader(
        shape, {"p": (lead + prod(shape) + pad,)}, _box_loader(boxes, axes, lead)
    )
    if len(boxes) == 1:
        assert len(pieces) == 1


@settings(max_examples=150, deadline=None)
@given(layouts(transpose=True))
def test_a_layout_with_transposed_boxes_gives_a_matching_map_or_a_clear_refusal(layout):
    shape, boxes, axes, lead, pad = layout
    params = {"p": (lead + prod(shape) + pad,)}
    loader = _box_loader(boxes, axes, lead)
    if len(boxes) == 1:
        check_against_loader(shape, params, loader)  # one transposed box is always addressable
        return
    try:
        check_against_loader(shape, params, loader)
    except NotAffineError as exc:
        assert exc.tensor == "t" and "storage shape" in exc.reason


# ---------------------------------------------------------------------------------------------- scale


def test_a_vocab_shard_of_millions_of_rows_is_decoded_in_bounded_memory():
    # A padded vocab shard: logical [2 * rows, 64], rank 1 stores rows rows:2*rows in a [rows + 8, 64]
    # parameter, the last 8 rows zero-filled. The window is 4 bytes an element; the decode must not
    # allocate per-element coordinate arrays (8-16 bytes an element, per dimension), only bitmaps
    # (a byte per element of the tensor and of the window) and chunk-sized temporaries.
    import tracemalloc

    rows, cols = 2**18, 64  # 16.8M elements in the shard, eight CHUNKs
    shape = (2 * rows, cols)
    linear = np.empty((rows + 8) * cols, dtype=np.int32)
    linear[: rows * cols] = np.arange(rows * cols, 2 * rows * cols, dtype=np.int32)
    linear[rows * cols :] = FILLED
    landing = Landing("embed", (rows + 8, cols), True, 0, linear)
    tracemalloc.start()
    try:
        got = target_map("model.embed_tokens.weight", shape, "bfloat16", [landing], 1)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got is not None
    tmap, view = got
    assert view == StorageView("embed", 0, (rows, cols))
    assert [p.box for p in tmap.ranks[1].pieces] == [Box((rows, 0), (rows, cols))]
    assert peak < 1.5 * linear.nbytes, f"peak {peak} bytes for a {linear.nbytes}-byte window"


def test_a_loader_that_places_by_value_is_caught_between_probed_dimensions():
    # Writes the probe into row 0 or row 1 depending on its first value: dimension 0 and 1 disagree.
    def loader(p, w):
        row = 0 if w.reshape(-1)[1] == 1 else 1
        p["w"][row] = w[0]

    with pytest.raises(NotAffineError, match="placement depends on the values"):
        probe((1, 4), {"w": (2, 4)}, loader)


def test_a_transformed_value_in_a_later_chunk_is_named_by_its_position():
    def loader(p, w):
        p["w"][:] = w
        p["w"][3, 1] = 0.5

    with pytest.raises(NotAffineError, match="transforms values") as err:
        probe((4, 4), {"w": (4, 4)}, loader, chunk=3)
    assert "element 13" in str(err.value)

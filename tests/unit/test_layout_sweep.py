"""The box-overlap sweep against brute force, on random boxes in 1 to 4 dimensions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_sync.layout.sweep import boxes_overlap, first_overlap, overlapping_pairs

Box = tuple[tuple[int, ...], tuple[int, ...]]


@st.composite
def boxes(draw, ndim: int, size: int = 9) -> Box:
    origin = tuple(draw(st.integers(0, size - 1)) for _ in range(ndim))
    extent = tuple(draw(st.integers(1, size - o)) for o in origin)
    return origin, extent


@st.composite
def partition(draw, ndim: int, size: int = 9, max_boxes: int = 50) -> list[Box]:
    """Disjoint boxes: a random guillotine partition of [0, size)^ndim, with some parts dropped."""
    todo = [((0,) * ndim, (size,) * ndim)]
    done: list[Box] = []
    while todo:
        o, e = todo.pop()
        axes = [d for d in range(ndim) if e[d] > 1]
        if not axes or len(done) + len(todo) >= max_boxes or not draw(st.integers(0, 4)):
            done.append((o, e))
            continue
        d = draw(st.sampled_from(axes))
        cut = draw(st.integers(1, e[d] - 1))
        todo.append((o, (*e[:d], cut, *e[d + 1 :])))
        todo.append(((*o[:d], o[d] + cut, *o[d + 1 :]), (*e[:d], e[d] - cut, *e[d + 1 :])))
    keep = draw(st.lists(st.booleans(), min_size=len(done), max_size=len(done)))
    return [b for b, k in zip(done, keep, strict=True) if k or not any(keep)]


def brute_pairs(a: list[Box], b: list[Box]) -> set[tuple[int, int]]:
    return {(i, j) for i, x in enumerate(a) for j, y in enumerate(b) if boxes_overlap(*x, *y)}


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.tuples(partition(n), partition(n))))
def test_overlapping_pairs_of_two_partitions_are_exactly_the_intersecting_ones(sets):
    a, b = sets
    got = overlapping_pairs(a, b)
    assert len(got) == len(set(got))
    assert set(got) == brute_pairs(a, b)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.lists(boxes(n), max_size=60)))
def test_first_overlap_finds_a_real_overlap_exactly_when_one_exists(bs):
    hit = first_overlap(bs)
    exists = any(boxes_overlap(*bs[i], *bs[j]) for i in range(len(bs)) for j in range(i + 1, len(bs)))
    assert (hit is not None) == exists
    if hit is not None:
        i, j = hit
        assert i < j and boxes_overlap(*bs[i], *bs[j])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4).flatmap(partition))
def test_a_partition_has_no_overlap(bs):
    assert first_overlap(bs) is None


def test_column_blocks_against_row_blocks_meet_pairwise():
    cols = [((0, 16 * c), (256, 16)) for c in range(16)]
    rows = [((16 * r, 0), (16, 256)) for r in range(16)]
    assert len(overlapping_pairs(rows, cols)) == 256
    assert first_overlap(cols + rows[:1]) is not None

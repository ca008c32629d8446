"""The planner, checked element by element (pure Python oracle) on random layouts, plus its refusals,
replica policies, merging and determinism. The torch ``as_strided`` oracle is in ``test_planner_oracle``."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_layouts import (
    ANY,
    ONLY_FLAT,
    ONLY_ND,
    check_plan_fills_targets,
    flat_runs,
    layout_pairs,
    policies,
    rows,
    shapes,
    tensor_maps,
    whole,
)

from rollout_sync.errors import (
    CoverageError,
    LayoutError,
    ReplicaPolicyError,
    ShapeMismatchError,
)
from rollout_sync.layout.box import Box
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.planning.planner import plan_model, plan_tensor
from rollout_sync.planning.policy import Balanced, ReplicaRequest
from rollout_sync.planning.records import Segment

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------- oracle


def check(source: TensorMap, target: TensorMap, policy) -> None:
    plan = plan_model([source], [target], policy)
    check_plan_fills_targets(plan.iter_segments(), [source], [target], lambda i: plan.tensors[i].name)


@SETTINGS
@given(layout_pairs(), policies())
def test_random_layouts_move_every_target_element_from_its_logical_source(pair, policy):
    check(*pair, policy)


@SETTINGS
@given(layout_pairs(ONLY_FLAT, ONLY_ND, min_ndim=2), policies())
def test_flat_storage_on_the_source_side_fills_nd_targets(pair, policy):
    check(*pair, policy)


@SETTINGS
@given(layout_pairs(ONLY_ND, ONLY_FLAT, min_ndim=2), policies())
def test_flat_storage_on_the_target_side_is_written_run_by_run(pair, policy):
    check(*pair, policy)


@SETTINGS
@given(layout_pairs(ONLY_FLAT, ONLY_FLAT, min_ndim=2), policies())
def test_flat_storage_on_both_sides_with_partitions_that_start_mid_row(pair, policy):
    check(*pair, policy)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_whole_model_plan_fills_every_tensor(data):
    sources, targets = [], []
    for k in range(data.draw(st.integers(1, 4))):
        shape = data.draw(shapes(1, 3, max_numel=120))
        sources.append(data.draw(tensor_maps(shape, 0, ANY, name=f"t{k}")))
        targets.append(data.draw(tensor_maps(shape, 20, ANY, name=f"t{k}")))
    policy = data.draw(policies())
    plan = plan_model(sources, targets, policy)
    check_plan_fills_targets(plan.iter_segments(), sources, targets, lambda i: plan.tensors[i].name)


# ------------------------------------------------------------------------------------------- examples


def test_row_blocks_into_flat_runs_cut_inside_rows():
    source = rows("w", (4, 6), [0, 1])
    target = flat_runs("w", (4, 6), [0, 10, 24], [2, 3])
    segs = plan_tensor(source, target)
    check_plan_fills_targets(segs, [source], [target], lambda i: "w")
    # rank 2 holds row 0 and 4 elements of row 1; rank 3 the rest of row 1 and rows 2-3 (from rank 1)
    assert [(s.source_rank, s.target_rank, s.extent) for s in segs] == [
        (0, 2, (1, 6)),
        (0, 2, (1, 4)),
        (0, 3, (1, 2)),
        (1, 3, (2, 6)),
    ]


def test_a_flat_run_copied_whole_is_one_segment():
    # the same flat partitions on both sides: head, body and tail boxes of each run merge back into one copy
    source = flat_runs("w", (6, 10), [0, 13, 47, 60], [0, 1, 2])
    target = flat_runs("w", (6, 10), [0, 13, 47, 60], [5, 6, 7])
    segs = plan_tensor(source, target)
    check_plan_fills_targets(segs, [source], [target], lambda i: "w")
    assert len(segs) <= 3 * 3  # at most one per box, never one per row
    assert sum(s.numel for s in segs) == 60


def test_row_blocks_into_the_same_rows_elsewhere_merge_into_one_segment_per_rank_pair():
    source = TensorMap(
        "w",
        (8, 4),
        "float32",
        {
            0: RankStorage(
                (8, 4), tuple(Piece(Box((2 * i, 0), (2, 4)), 8 * i, (4, 1), (0,)) for i in range(4))
            )
        },
    )
    target = rows("w", (8, 4), [1])
    segs = plan_tensor(source, target)
    assert segs == [Segment(0, 0, 0, (4, 1), 1, 0, (4, 1), (8, 4))]


def test_transposed_source_storage_is_read_with_its_own_strides():
    # rank 0 stores the [3, 5] tensor transposed: storage [5, 3], element (i, j) at j * 3 + i
    source = TensorMap(
        "w", (3, 5), "float32", {0: RankStorage((5, 3), (Piece(Box((0, 0), (3, 5)), 0, (1, 3), (0,)),))}
    )
    target = rows("w", (3, 5), [1])
    segs = plan_tensor(source, target)
    assert segs == [Segment(0, 0, 0, (1, 3), 1, 0, (5, 1), (3, 5))]
    check_plan_fills_targets(segs, [source], [target], lambda i: "w")


def test_extra_source_tensors_are_ignored_and_tensors_are_planned_in_name_order():
    a, b, c = whole("b", (4,), [0]), whole("a", (4,), [0]), whole("unused", (4,), [0])
    plan = plan_model([a, b, c], [whole("b", (4,), [1]), whole("a", (4,), [1])])
    assert [t.name for t in plan.tensors] == ["a", "b"]
    assert len(plan) == 2


# ------------------------------------------------------------------------------------------- refusals


def test_a_target_tensor_without_a_source_map_is_refused_naming_it():
    with pytest.raises(CoverageError) as err:
        plan_model([whole("a", (4,), [0])], [whole("a", (4,), [1]), whole("b", (4,), [1])])
    assert err.value.tensor == "b"


def test_maps_of_different_logical_shapes_are_refused():
    with pytest.raises(ShapeMismatchError) as err:
        plan_model([whole("a", (4, 2), [0])], [whole("a", (2, 4), [1])])
    assert err.value.tensor == "a"
    with pytest.raises(ShapeMismatchError):
        plan_tensor(whole("a", (4,), [0]), whole("a", (5,), [1]))


def test_every_tensor_of_mismatching_shape_is_named_the_first_ten_and_a_count():
    names = [f"t{i:02d}" for i in range(12)]
    sources = [whole(n, (5, 2), [0]) for n in names] + [whole("ok", (3,), [0])]
    targets = [whole(n, (4, 2), [1]) for n in names] + [whole("ok", (3,), [1])]
    with pytest.raises(ShapeMismatchError) as err:
        plan_model(sources, targets)
    text = str(err.value)
    assert err.value.tensor == "t00" and "for 12 tensors" in text
    assert all(f"'{n}': target (4, 2), source (5, 2)" in text for n in names[:10])
    assert "'t10'" not in text and "and 2 more" in text and "'ok'" not in text


def test_target_elements_no_source_holds_are_refused_naming_tensor_rank_and_box():
    # the source holds rows 0..1 of a [4, 3] tensor only; rank 9 needs all of it
    source = TensorMap(
        "w", (4, 3), "float32", {0: RankStorage((2, 3), (Piece(Box((0, 0), (2, 3)), 0, (3, 1), (0,)),))}
    )
    target = rows("w", (4, 3), [8, 9])
    with pytest.raises(CoverageError) as err:
        plan_model([source], [target])
    assert err.value.tensor == "w"
    assert err.value.rank == 9
    assert err.value.box == Box((2, 0), (2, 3))
    assert "[2:4, 0:3]" in str(err.value)


def test_a_coverage_refusal_comes_before_any_replica_choice():
    calls = []

    def policy(request: ReplicaRequest) -> int:
        calls.append(request)
        return request.candidates[0]

    source = TensorMap(
        "w",
        (4, 3),
        "float32",
        {r: RankStorage((2, 3), (Piece(Box((0, 0), (2, 3)), 0, (3, 1), (0, 1)),)) for r in (0, 1)},
    )
    with pytest.raises(CoverageError):
        plan_model([source], [rows("w", (4, 3), [8, 9])], policy)
    assert calls == []


def test_duplicate_map_names_on_one_side_are_refused():
    with pytest.raises(LayoutError):
        plan_model([whole("a", (4,), [0]), whole("a", (4,), [1])], [whole("a", (4,), [2])])
    with pytest.raises(LayoutError):
        plan_model([whole("a", (4,), [0])], [whole("a", (4,), [1]), whole("a", (4,), [2])])


def test_an_unknown_policy_name_is_refused():
    with pytest.raises(LayoutError):
        plan_model([whole("a", (4,), [0, 1])], [whole("a", (4,), [2])], "fastest")  # type: ignore[arg-type]


@pytest.mark.parametrize("answer", [7, True, "0", None, 0.0])
def test_a_policy_returning_a_non_holder_is_refused(answer):
    source = whole("w", (4,), [0, 1])
    with pytest.raises(ReplicaPolicyError) as err:
        plan_model([source], [whole("w", (4,), [5])], lambda request: answer)
    assert err.value.tensor == "w"
    assert err.value.rank == 5
    assert err.value.box == Box((0,), (4,))


# ------------------------------------------------------------------------------------------- policies


def test_lowest_reads_every_replicated_box_from_its_lowest_holder():
    plan = plan_model([whole("w", (4, 4), [3, 1, 2])], [rows("w", (4, 4), [4, 5])])
    assert {s.source_rank for s in plan.segments} == {1}


def test_balanced_copies_locally_when_the_target_rank_holds_the_box():
    plan = plan_model([whole("w", (4, 4), [0, 1, 2, 3])], [rows("w", (4, 4), [2, 3])], "balanced")
    assert {(s.source_rank, s.target_rank) for s in plan.segments} == {(2, 2), (3, 3)}
    assert plan.half(2).local and not plan.half(2).receives


def test_balanced_spreads_bytes_over_the_holders():
    plan = plan_model([whole("w", (8, 4), [0, 1, 2, 3])], [rows("w", (8, 4), [4, 5, 6, 7])], "balanced")
    assert plan.bytes_by_source_rank() == {0: 32, 1: 32, 2: 32, 3: 32}
    lowest = plan_model([whole("w", (8, 4), [0, 1, 2, 3])], [rows("w", (8, 4), [4, 5, 6, 7])])
    assert lowest.bytes_by_source_rank() == {0: 128}


def test_balanced_counts_load_across_the_whole_model():
    # tensor "a" can only come from rank 0; "b" is replicated on 0 and 1, so balanced serves it from 1
    a = whole("a", (16,), [0])
    b = whole("b", (4,), [0, 1])
    plan = plan_model([a, b], [whole("a", (16,), [5]), whole("b", (4,), [5])], "balanced")
    assert [s.source_rank for s in plan.segments] == [0, 1]


def test_balanced_with_places_serves_each_target_from_a_holder_in_its_own_process_then_its_host():
    # TRL's colocate mode: trainer rank r and vLLM worker 2 + r share a process; ranks 4, 5 are on host b
    places = {
        0: ("a", 10),
        1: ("a", 11),
        2: ("a", 10),
        3: ("a", 11),
        4: ("b", 20),
        5: ("b", 21),
        6: ("b", 22),
    }
    sources = [whole("w", (8, 4), [0, 1, 4])]
    targets = [rows("w", (8, 4), [2, 3, 5, 6])]
    plan = plan_model(sources, targets, Balanced(places))
    pairs = {(s.source_rank, s.target_rank) for s in plan.segments}
    assert pairs == {(0, 2), (1, 3), (4, 5), (4, 6)}
    # without places the same plan spreads the load over every holder
    spread = plan_model(sources, targets, "balanced")
    assert {s.source_rank for s in spread.segments} == {0, 1, 4}


def test_a_callable_policy_sees_the_tensor_the_target_rank_the_box_and_the_holders():
    seen = []

    def last(request: ReplicaRequest) -> int:
        seen.append(request)
        return request.candidates[-1]

    plan = plan_model([whole("w", (4, 2), [1, 3])], [rows("w", (4, 2), [7, 8])], last)
    assert {s.source_rank for s in plan.segments} == {3}
    assert sorted((r.target_rank, r.box, r.candidates, r.nbytes) for r in seen) == [
        (7, Box((0, 0), (2, 2)), (1, 3), 16),
        (8, Box((2, 0), (2, 2)), (1, 3), 16),
    ]


def test_a_policy_with_record_sees_every_assignment():
    policy = Balanced()
    plan_model(
        [whole("a", (16,), [0]), whole("b", (4,), [0, 1])],
        [whole("a", (16,), [5]), whole("b", (4,), [5])],
        policy,
    )
    assert policy.assigned == {0: 64, 1: 16}


# ------------------------------------------------------------------------------------------- determinism


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs(), st.randoms(use_true_random=False))
def test_the_same_maps_give_the_same_plan_whatever_the_input_order(pair, rnd):
    source, target = pair
    other = whole("other", (3,), [0])
    first = plan_model([source, other], [target, whole("other", (3,), [40])], "balanced")
    # rebuild both maps with their ranks in another order, and pass the tensors in another order
    items = list(target.ranks.items())
    rnd.shuffle(items)
    target2 = TensorMap(target.name, target.shape, target.dtype, dict(items))
    second = plan_model([other, source], [whole("other", (3,), [40]), target2], "balanced")
    assert first.digest == second.digest
    assert first == second


def test_plans_of_layers_with_identical_layouts_share_records_and_differ_only_by_name():
    sources = [rows(f"layer{i}.w", (8, 4), [0, 1]) for i in range(3)]
    targets = [flat_runs(f"layer{i}.w", (8, 4), [0, 5, 19, 32], [2, 3, 4]) for i in range(3)]
    plan = plan_model(sources, targets)
    assert plan.records(0) is plan.records(1) is plan.records(2)
    one = plan_model(sources[:1], targets[:1])
    assert plan.tensor_segments(2) == tuple(
        Segment(2, *(getattr(s, f) for f in Segment.__slots__[1:])) for s in one.segments
    )


def test_many_row_blocks_into_many_column_blocks_are_planned_without_all_pairs():
    # 64 row blocks against 64 column-block × run pieces: every target box meets 8 sources
    source = rows("w", (256, 256), list(range(64)))
    target_storages = {}
    rank = 100
    for c in range(8):
        for r in range(8):
            box = Box((32 * r, 32 * c), (32, 32))
            target_storages[rank] = RankStorage((32, 32), (Piece(box, 0, (32, 1), (rank,)),))
            rank += 1
    target = TensorMap("w", (256, 256), "float32", target_storages)
    plan = plan_model([source], [target])
    assert len(plan) == 64 * 8
    check_plan_fills_targets(plan.iter_segments(), [source], [target], lambda i: "w")


def test_a_random_callable_policy_is_called_only_for_replicated_boxes():
    calls = []
    rng = random.Random(3)

    def pick(request: ReplicaRequest) -> int:
        calls.append(request.candidates)
        return rng.choice(request.candidates)

    source = TensorMap(
        "w",
        (4, 2),
        "float32",
        {
            0: RankStorage((2, 2), (Piece(Box((0, 0), (2, 2)), 0, (2, 1), (0,)),)),
            1: RankStorage((2, 2), (Piece(Box((2, 0), (2, 2)), 0, (2, 1), (1, 2)),)),
            2: RankStorage((2, 2), (Piece(Box((2, 0), (2, 2)), 0, (2, 1), (1, 2)),)),
        },
    )
    plan = plan_model([source], [whole("w", (4, 2), [5])], pick)
    assert calls == [(1, 2)]
    check_plan_fills_targets(plan.iter_segments(), [source], [whole("w", (4, 2), [5])], lambda i: "w")


def test_the_plan_is_byte_for_byte_the_same_in_processes_with_other_hash_seeds():
    import os
    import subprocess
    import sys

    script = (
        "from planner_layouts import rows, flat_runs, whole\n"
        "from rollout_sync.planning.planner import plan_model\n"
        "s = [rows('a', (8, 6), [0, 1]), whole('b', (5, 3), [0, 1, 2]), rows('c', (4, 4), [3, 4])]\n"
        "t = [flat_runs('a', (8, 6), [0, 7, 30, 48], [5, 6, 7]), whole('b', (5, 3), [5, 6]),"
        " flat_runs('c', (4, 4), [0, 9, 16], [1, 2])]\n"
        "print(plan_model(s, t, 'balanced').digest)\n"
    )
    here = os.path.dirname(__file__)
    root = os.path.dirname(os.path.dirname(here))
    digests = set()
    for seed in ("0", "1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join([root, here])}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1 and len(digests.pop()) == 64

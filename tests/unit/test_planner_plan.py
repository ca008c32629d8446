"""The Plan type: validated construction, columnar storage, halves, statistics."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from planner_layouts import flat_runs, layout_pairs, rows, whole

from rollout_sync.errors import OutOfBoundsError, PlanMismatchError, ShapeMismatchError
from rollout_sync.planning.plan import Plan
from rollout_sync.planning.planner import plan_model
from rollout_sync.planning.records import PlannedTensor, Segment


def table(name="w", shape=(4, 4), src=None, tgt=None):
    return PlannedTensor(name, shape, "bfloat16", "float32", src or {0: (4, 4)}, tgt or {1: (16,)})


def test_a_plan_built_from_segments_sorts_them_and_validates_each():
    t = table()
    a = Segment(0, 0, 8, (4, 1), 1, 8, (4, 1), (2, 4))
    b = Segment(0, 0, 0, (4, 1), 1, 0, (4, 1), (2, 4))
    plan = Plan([t], [a, b])
    assert plan.segments == (b, a)
    assert plan.bytes_by_source_rank() == {0: 32}
    assert plan.bytes_by_target_rank() == {1: 64}
    with pytest.raises(OutOfBoundsError) as err:
        Plan([t], [Segment(0, 0, 8, (4, 1), 1, 9, (4, 1), (2, 4))])
    assert err.value.rank == 1 and err.value.tensor == "w"
    with pytest.raises(PlanMismatchError):
        Plan([t], [Segment(0, 5, 0, (4, 1), 1, 0, (4, 1), (2, 4))])
    with pytest.raises(PlanMismatchError):
        Plan([t], [Segment(1, 0, 0, (4, 1), 1, 0, (4, 1), (2, 4))])
    with pytest.raises(ShapeMismatchError):
        Plan([t], [Segment(0, 0, 0, (1,), 1, 0, (1,), (4,))])


def test_segments_refuse_bad_fields():
    with pytest.raises(ShapeMismatchError):
        Segment(0, 0, 0, (1,), 1, 0, (4, 1), (2, 4))
    with pytest.raises(ValueError):
        Segment(0, 0, 0, (4, 1), 1, 0, (4, 1), (0, 4))
    with pytest.raises(ValueError):
        Segment(0, 0, -1, (4, 1), 1, 0, (4, 1), (2, 4))


def test_records_are_columnar_and_refused_when_ragged():
    plan = plan_model([rows("w", (4, 6), [0, 1])], [flat_runs("w", (4, 6), [0, 10, 24], [2, 3])])
    rec = plan.records(0)
    assert isinstance(rec, array) and len(rec) == len(plan) * (4 + 3 * 2)
    assert Plan.from_records(plan.tensors, [rec]) == plan
    with pytest.raises(PlanMismatchError):
        Plan.from_records(plan.tensors, [rec[:-1]])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout_pairs())
def test_halves_split_the_plan_into_sends_receives_and_local_copies(pair):
    source, target = pair
    plan = plan_model([source], [target], "balanced")
    ranks = set(source.ranks) | set(target.ranks)
    sends, receives, local = [], [], []
    for r in sorted(ranks):
        half = plan.half(r)
        assert half.digest == plan.digest and half.tensors is plan.tensors
        assert all(s.source_rank == r != s.target_rank for s in half.sends)
        assert all(s.target_rank == r != s.source_rank for s in half.receives)
        assert all(s.source_rank == r == s.target_rank for s in half.local)
        sends += half.sends
        receives += half.receives
        local += half.local
    remote = [s for s in plan.segments if s.source_rank != s.target_rank]
    assert sorted(sends, key=repr) == sorted(remote, key=repr) == sorted(receives, key=repr)
    assert sorted(local, key=repr) == sorted(
        (s for s in plan.segments if s.source_rank == s.target_rank), key=repr
    )
    moved = sum(s.numel for s in plan.segments) * 4
    assert sum(plan.bytes_by_target_rank().values()) == moved
    assert plan.local_bytes() == sum(s.numel for s in local) * 4


def test_a_rank_with_nothing_to_do_gets_an_empty_half():
    plan = plan_model([whole("w", (4,), [0])], [whole("w", (4,), [1])])
    half = plan.half(42)
    assert half.sends == half.receives == half.local == ()
    assert plan.ranks() == ((0,), (1,))


def test_maps_and_plans_survive_pickling_for_spawned_test_processes():
    import pickle

    source, target = rows("w", (4, 6), [0, 1]), flat_runs("w", (4, 6), [0, 10, 24], [2, 3])
    plan = plan_model([source], [target])
    assert pickle.loads(pickle.dumps(source)) == source
    back = pickle.loads(pickle.dumps(plan))
    assert back == plan and back.digest == plan.digest and back.half(2) == plan.half(2)

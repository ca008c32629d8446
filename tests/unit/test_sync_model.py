"""The sync time model's pure parts (``scale.sync_model``): the shared medium's progressive filling, the
interpolation of measured stream rates, and one sync's modeled time from ranks' work. Its agreement with
real syncs is what ``python -m benchmarks model`` measures."""

from __future__ import annotations

import pytest

from rollout_sync.scale.sync_model import LinkFigures, RankWork, modeled_sync, wire_seconds

LINKS = LinkFigures(message_s=1e-4, stream_gbps={1: 1.0, 2: 1.6, 4: 2.0}, copy_gbps=4.0, agree_s=2e-3)


def test_aggregate_rates_are_interpolated_and_held_flat_outside():
    assert LINKS.aggregate(1) == pytest.approx(1e9)
    assert LINKS.aggregate(3) == pytest.approx(1.8e9)
    assert LINKS.aggregate(8) == pytest.approx(2e9)


def test_streams_share_the_medium_and_a_finished_one_leaves_its_share():
    # two streams of 0.8 GB and 1.6 GB: both at 0.8 GB/s until the first ends at 1 s, then 1 GB/s alone
    done = wire_seconds({(0, 2): 800_000_000, (1, 3): 1_600_000_000}, LINKS)
    assert done[(0, 2)] == pytest.approx(1.0)
    assert done[(1, 3)] == pytest.approx(1.8)
    assert wire_seconds({(0, 2): 0}, LINKS) == {(0, 2): 0.0}


def test_a_sync_takes_its_slowest_rank_with_every_phase_added():
    works = [
        RankWork(0, {2: 1_000_000_000}, {}, 400_000_000, 0, 0, 10, 1),
        RankWork(2, {}, {0: 1_000_000_000}, 0, 0, 0, 10, 1),
    ]
    modeled = modeled_sync(works, LINKS)
    assert modeled.slowest == 0
    parts = modeled.parts[0]
    assert parts == pytest.approx({"agree": 2e-3, "copy": 0.1, "messages": 1e-3, "wire": 1.0})
    assert modeled.seconds == pytest.approx(1.103)
    assert modeled.parts[2]["copy"] == 0.0

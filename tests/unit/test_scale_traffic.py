"""The traffic of a plan, the time model and its lower bound, and the executor figures derived from them."""

from __future__ import annotations

from math import prod
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scale_planning import KIMI, QWEN3, QWEN3_MOE, models, whole_model

from rollout_sync.errors import DryRunSpecError
from rollout_sync.layout.dtypes import ITEMSIZE
from rollout_sync.planning.by_layout import plan_model_by_layout
from rollout_sync.planning.planner import plan_model
from rollout_sync.planning.policy import Spread
from rollout_sync.planning.records import record_width
from rollout_sync.scale.traffic import (
    Bandwidth,
    Topology,
    lower_bound,
    modeled_seconds,
    needed_bytes,
    node_link_seconds,
    plan_traffic,
)

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def topology_for(sources, targets, gpus_per_node: int = 8, shared: bool = False) -> Topology:
    trainer = max(r for m in sources for r in m.ranks) + 1
    top = max(r for m in (*sources, *targets) for r in m.ranks) + 1
    return Topology(trainer, max(top - trainer, 1), gpus_per_node, gpus_per_node, shared)


def by_segments(plan, topology: Topology) -> dict[str, Any]:
    """The traffic counted the plain way: one segment at a time."""
    out: dict[str, Any] = {
        k: {}
        for k in (
            "sent_intra",
            "sent_inter",
            "recv_intra",
            "recv_inter",
            "local",
            "half_bytes",
            "half_segments",
        )
    }
    count = 0
    for s in plan.iter_segments():
        count += 1
        t = plan.tensors[s.tensor]
        nbytes = prod(s.extent) * ITEMSIZE[t.source_dtype]
        words = 8 * (record_width(len(t.shape)) + 1)
        ends = {s.source_rank, s.target_rank}
        for r in ends:
            out["half_segments"][r] = out["half_segments"].get(r, 0) + 1
            out["half_bytes"][r] = out["half_bytes"].get(r, 0) + words
        if len(ends) == 1:
            out["local"][s.source_rank] = out["local"].get(s.source_rank, 0) + nbytes
            continue
        link = "intra" if topology.node(s.source_rank) == topology.node(s.target_rank) else "inter"
        out[f"sent_{link}"][s.source_rank] = out[f"sent_{link}"].get(s.source_rank, 0) + nbytes
        out[f"recv_{link}"][s.target_rank] = out[f"recv_{link}"].get(s.target_rank, 0) + nbytes
    out["segments"] = count
    return out


def check_totals(plan, topology: Topology) -> None:
    traffic = plan_traffic(plan, topology)
    expected = by_segments(plan, topology)
    assert traffic.segments == expected["segments"] == len(plan)
    for key in (
        "sent_intra",
        "sent_inter",
        "recv_intra",
        "recv_inter",
        "local",
        "half_bytes",
        "half_segments",
    ):
        assert getattr(traffic, key) == expected[key], key
    sent_by_planner = plan.bytes_by_source_rank(include_local=False)
    assert {r: traffic.sent(r) for r in sent_by_planner} == sent_by_planner


@SETTINGS
@given(models(), st.sampled_from(["lowest", "spread"]), st.integers(1, 4), st.booleans())
def test_traffic_totals_equal_the_sum_over_segments_on_random_layouts(model, policy, per_node, shared):
    sources, targets = model
    plan = plan_model(sources, targets, Spread() if policy == "spread" else policy)
    check_totals(plan, topology_for(sources, targets, per_node, shared))


@pytest.mark.parametrize(
    "case",
    [(QWEN3, 3, 2, 2, 1, 1, 4, 1), (QWEN3_MOE, 1, 4, 1, 2, 2, 2, 2), (KIMI, 3, 8, 1, 2, 2, 2, 1)],
    ids=["qwen3-zero3", "moe-zero1-ep2", "kimi-zero3-ep2"],
)
def test_traffic_totals_equal_the_sum_over_segments_of_plans_that_share_records_between_layers(case):
    sources, targets = whole_model(*case)
    plan = plan_model_by_layout(sources, targets, "lowest")
    assert len({id(plan.records(i)) for i in range(len(plan.tensors))}) < len(plan.tensors)
    check_totals(plan, topology_for(sources, targets, 4))


@SETTINGS
@given(
    models(),
    st.sampled_from(["lowest", "spread"]),
    st.integers(1, 4),
    st.booleans(),
    st.floats(0.5, 1000.0),
    st.floats(0.5, 1000.0),
)
def test_the_lower_bound_is_never_above_the_modeled_time(model, policy, per_node, shared, intra, inter):
    sources, targets = model
    plan = plan_model(sources, targets, Spread() if policy == "spread" else policy)
    topology = topology_for(sources, targets, per_node, shared)
    bandwidth = Bandwidth(intra * 1e9, inter * 1e9)
    traffic = plan_traffic(plan, topology)
    modeled, _ = modeled_seconds(traffic, bandwidth)
    bound = lower_bound(needed_bytes(sources, targets), traffic, topology, bandwidth)
    assert bound.seconds <= modeled


def test_separate_nodes_put_every_byte_on_the_nic_and_the_bound_is_the_busiest_receiver():
    sources, targets = whole_model(QWEN3, 3, 2, 2, 1, 1, 4, 1)
    plan = plan_model(sources, targets)
    topology = Topology(4, 4)
    bandwidth = Bandwidth(350e9, 50e9)
    traffic = plan_traffic(plan, topology)
    assert not traffic.sent_intra and not traffic.recv_intra
    busiest = max(max(traffic.sent_inter.values()), max(traffic.recv_inter.values()))
    modeled, _ = modeled_seconds(traffic, bandwidth)
    assert modeled == busiest / 50e9
    needed = needed_bytes(sources, targets)
    assert needed == {r: traffic.received(r) for r in range(4, 8)}
    bound = lower_bound(needed, traffic, topology, bandwidth)
    assert bound.seconds == max(needed.values()) / 50e9
    assert bound.rank in needed and bound.needed_bytes == needed[bound.rank]


def test_shared_nodes_send_over_nvlink_within_a_node_and_raise_the_ingress_bound():
    sources, targets = whole_model(QWEN3, 3, 2, 2, 1, 1, 4, 1)
    plan = plan_model(sources, targets)
    traffic = plan_traffic(plan, Topology(4, 4, 4, 4, shared_nodes=True))
    # trainer ranks 0..3 and rollout ranks 4..7 all sit on node 0
    assert not traffic.sent_inter and not traffic.recv_inter
    assert sum(traffic.recv_intra.values()) == sum(traffic.sent_intra.values()) > 0
    bandwidth = Bandwidth(300e9, 50e9)
    bound = lower_bound(needed_bytes(sources, targets), traffic, Topology(4, 4, 4, 4, True), bandwidth)
    assert bound.seconds == bound.needed_bytes / 350e9


def test_topology_places_rollout_gpus_after_the_trainers_nodes_unless_nodes_are_shared():
    separate = Topology(256, 128, 8, 8)
    assert [separate.node(r) for r in (0, 7, 8, 255, 256, 263, 264, 383)] == [0, 0, 1, 31, 32, 32, 33, 47]
    shared = Topology(256, 128, 8, 8, shared_nodes=True)
    assert [shared.node(r) for r in (0, 255, 256, 263, 264, 383)] == [0, 31, 0, 0, 1, 15]
    with pytest.raises(DryRunSpecError, match="outside the sync group"):
        separate.node(384)
    with pytest.raises(DryRunSpecError, match="same GPUs per node"):
        Topology(8, 8, 8, 4, shared_nodes=True)


def test_message_offers_are_the_executors_and_the_default_cap_is_the_executors():
    from rollout_sync.scale.dry_run import DEFAULT_STAGING_CAP_BYTES
    from rollout_sync.scale.rounds import message_offers, rank_rounds
    from rollout_sync.transport.core.schedule import build_schedule, wanted_message_bytes
    from rollout_sync.transport.core.stats import DEFAULT_STAGING_CAP_BYTES as EXECUTOR_DEFAULT

    assert DEFAULT_STAGING_CAP_BYTES == EXECUTOR_DEFAULT
    sources, targets = whole_model(QWEN3_MOE, 1, 4, 1, 2, 2, 2, 2)
    plan = plan_model(sources, targets, Spread())
    traffic = plan_traffic(plan, topology_for(sources, targets))
    cap = 1 << 16
    offers = message_offers(traffic, cap)
    for rank in sorted(offers):
        half = plan.half(rank)
        assert offers[rank] == wanted_message_bytes(half, cap, 2), rank
        got = rank_rounds(half, offers)
        peers = {s.target_rank for s in half.sends} | {s.source_rank for s in half.receives}
        sizes = {p: min(offers[rank], offers[p]) for p in peers}
        assert got.refused is None
        assert got.rounds == build_schedule(half, sizes).rounds > 0


def test_a_staging_cap_too_small_for_the_peers_is_reported_as_the_executors_refusal():
    from rollout_sync.scale.rounds import message_offers, rank_rounds

    sources, targets = whole_model(QWEN3, 3, 4, 1, 1, 2, 2, 1)
    plan = plan_model(sources, targets)
    traffic = plan_traffic(plan, topology_for(sources, targets))
    got = rank_rounds(plan.half(4), message_offers(traffic, 256))
    assert got.refused is not None and "bytes per message" in got.refused and got.rounds == 0


def test_one_link_per_node_carries_every_byte_into_or_out_of_that_node():
    """Two trainer ranks on node 0 send a TP-2 engine on node 1: node 1's link carries both workers' bytes,
    so its time is their sum over the rate (not the busiest worker's share, as with a NIC per GPU)."""
    sources, targets = whole_model(QWEN3, 3, 2, 1, 1, 1, 2, 1)
    topology = Topology(2, 2, 2, 2)
    traffic = plan_traffic(plan_model(sources, targets), topology)
    into = traffic.recv_inter[2] + traffic.recv_inter[3]
    assert into == sum(needed_bytes(sources, targets).values())
    seconds, node = node_link_seconds(traffic, topology, 1e8)
    assert node in (0, 1) and seconds == pytest.approx(into / 1e8)  # out of node 0 = into node 1
    assert node_link_seconds(
        plan_traffic(plan_model(sources, targets), Topology(2, 2, 4, 4, True)),
        Topology(2, 2, 4, 4, True),
        1e8,
    ) == (0.0, None)
    with pytest.raises(DryRunSpecError):
        node_link_seconds(traffic, topology, 0)

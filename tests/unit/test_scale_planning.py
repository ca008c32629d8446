"""Planning at scale: one rank planning only its own half, the whole plan planned once per layout, and the
local balanced policy (``Spread``). Every result is compared with the planner's own whole plan."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_layouts import ANY, shapes, tensor_maps

from rollout_sync.errors import ReplicaPolicyError
from rollout_sync.geometry import trainer_maps, vllm_target_maps
from rollout_sync.layout.box import Box
from rollout_sync.layout.maps import TensorMap
from rollout_sync.planning.by_layout import plan_model_by_layout
from rollout_sync.planning.planner import plan_model
from rollout_sync.planning.policy import Balanced, ReplicaRequest, Spread
from rollout_sync.planning.rank_half import plan_rank_half
from rollout_sync.scale.traffic import Topology, plan_traffic
from rollout_sync.shapes import model_tensors

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

QWEN3 = {
    "model_type": "qwen3",
    "num_hidden_layers": 3,
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 200,
    "tie_word_embeddings": False,
}
QWEN3_MOE = {
    **QWEN3,
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
}
KIMI = {
    "model_type": "kimi_k2",
    "num_hidden_layers": 3,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "topk_method": "noaux_tc",
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "vocab_size": 200,
}

# (config, zero stage, dp, tp, ep; engines, engine tp, engine ep)
WHOLE_MODELS = [
    pytest.param(QWEN3, 1, 4, 2, 1, 2, 4, 1, id="qwen3-zero1-tp2-dp4-to-2xtp4"),
    pytest.param(QWEN3, 3, 2, 2, 1, 1, 8, 1, id="qwen3-zero3-tp2-dp2-to-tp8"),
    pytest.param(QWEN3, 2, 6, 1, 1, 3, 2, 1, id="qwen3-zero2-dp6-to-3xtp2"),
    pytest.param(QWEN3_MOE, 1, 4, 1, 2, 2, 2, 2, id="moe-zero1-ep2-to-2xtp2ep2"),
    pytest.param(QWEN3_MOE, 3, 4, 1, 4, 1, 4, 1, id="moe-zero3-ep4-to-tp4"),
    pytest.param(KIMI, 1, 8, 1, 4, 2, 4, 4, id="kimi-zero1-ep4-edp2-to-2xtp4ep4"),
    pytest.param(KIMI, 3, 8, 1, 2, 2, 2, 1, id="kimi-zero3-ep2-to-2xtp2"),
]


def whole_model(
    config: dict[str, Any], zero: int, dp: int, tp: int, ep: int, engines: int, etp: int, eep: int
):
    model = model_tensors(config)
    sources = trainer_maps(model, zero, dp, tp, ep)
    targets = vllm_target_maps(model, engines, etp, eep, dp * tp)
    return sources, targets


@st.composite
def models(draw: Any) -> tuple[list[TensorMap], list[TensorMap]]:
    """One to three random tensors; with some luck a tensor shares its storages with another (as the layers
    of a model do), replicas included, so that sharing by layout meets name-dependent choices."""
    colocated = draw(st.booleans())
    sources: list[TensorMap] = []
    targets: list[TensorMap] = []
    for k in range(draw(st.integers(1, 3))):
        shape = draw(shapes(1, 3))
        source = draw(tensor_maps(shape, 0, ANY, name=f"t{k}"))
        first = 0 if colocated else 16
        target = draw(tensor_maps(shape, first, ANY, name=f"t{k}"))
        sources.append(source)
        targets.append(target)
        if draw(st.booleans()):  # a second tensor of the very same layout
            sources.append(TensorMap(f"t{k}.copy", shape, source.dtype, source.ranks))
            targets.append(TensorMap(f"t{k}.copy", shape, target.dtype, target.ranks))
    return sources, targets


def all_ranks(sources: list[TensorMap], targets: list[TensorMap]) -> list[int]:
    return sorted({r for m in (*sources, *targets) for r in m.ranks})


def check_halves(sources, targets, policy) -> None:
    plan = plan_model(sources, targets, policy)
    for rank in all_ranks(sources, targets):
        alone = plan_rank_half(sources, targets, rank, policy)
        assert alone.with_digest(plan.digest) == plan.half(rank), f"rank {rank}"


@SETTINGS
@given(models(), st.sampled_from(["lowest", "spread"]))
def test_a_rank_planning_alone_gets_exactly_its_half_of_the_whole_plan(model, policy):
    sources, targets = model
    check_halves(sources, targets, Spread() if policy == "spread" else policy)


@SETTINGS
@given(models(), st.sampled_from(["lowest", "spread"]))
def test_planning_each_layout_once_gives_the_planners_plan_record_for_record(model, policy):
    sources, targets = model
    pol = Spread() if policy == "spread" else policy
    assert plan_model_by_layout(sources, targets, pol) == plan_model(sources, targets, pol)


@pytest.mark.parametrize(("config", "zero", "dp", "tp", "ep", "engines", "etp", "eep"), WHOLE_MODELS)
@pytest.mark.parametrize("policy", ["lowest", "spread"])
def test_every_rank_of_a_whole_model_plans_its_own_half_as_the_whole_plan_does(
    config, zero, dp, tp, ep, engines, etp, eep, policy
):
    sources, targets = whole_model(config, zero, dp, tp, ep, engines, etp, eep)
    pol = Spread() if policy == "spread" else policy
    plan = plan_model(sources, targets, pol)
    assert plan_model_by_layout(sources, targets, pol) == plan
    for rank in all_ranks(sources, targets):
        alone = plan_rank_half(sources, targets, rank, pol)
        assert alone.with_digest(plan.digest) == plan.half(rank), f"rank {rank}"


def test_a_whole_model_shares_record_arrays_between_layers_even_with_the_spread_policy():
    sources, targets = whole_model(KIMI, 3, 8, 1, 2, 2, 2, 1)
    plan = plan_model_by_layout(sources, targets, Spread())
    distinct = {id(plan.records(i)) for i in range(len(plan.tensors))}
    assert len(distinct) < len(plan.tensors) / 2


@pytest.mark.parametrize("policy", ["balanced", Balanced(), lambda request: request.candidates[-1]])
def test_a_policy_that_is_not_local_is_refused_for_a_rank_planning_alone(policy):
    sources, targets = whole_model(QWEN3, 1, 2, 1, 1, 1, 2, 1)
    with pytest.raises(ReplicaPolicyError, match="depends on the whole plan"):
        plan_rank_half(sources, targets, 0, policy)
    with pytest.raises(ReplicaPolicyError, match="depends on the whole plan"):
        plan_model_by_layout(sources, targets, policy)


def _request(target: int, candidates: tuple[int, ...], tensor: str = "w") -> ReplicaRequest:
    return ReplicaRequest(tensor, target, Box((0,), (1,)), candidates, 2)


def test_spread_gives_the_tp_ranks_of_an_engine_distinct_holders():
    holders = tuple(range(4))
    for first in (8, 64, 256):
        chosen = {Spread()(_request(first + w, holders)) for w in range(4)}
        assert chosen == set(holders)


def test_spread_gives_the_same_tp_rank_of_consecutive_engines_distinct_holders():
    # 4 holders (an expert-data-parallel group), one target per engine of 16 workers (expert owner 3).
    holders = (3, 67, 131, 195)
    chosen = [Spread()(_request(256 + 16 * k + 3, holders)) for k in range(8)]
    assert sorted(chosen) == sorted(holders * 2)


def test_spread_copies_locally_when_the_target_holds_the_box():
    assert Spread()(_request(5, (1, 5, 9))) == 5


def test_spread_rotates_from_tensor_to_tensor():
    holders = tuple(range(8))
    starts = {Spread()(_request(64, holders, f"model.layers.{i}.w")) for i in range(40)}
    assert len(starts) == len(holders)


def _send_bytes(sources, targets, policy) -> list[int]:
    plan = plan_model_by_layout(sources, targets, policy)
    dp = len({r for m in sources for r in m.ranks})
    traffic = plan_traffic(plan, Topology(dp, len({r for m in targets for r in m.ranks})))
    return [traffic.sent(r) for r in range(dp)]


def test_spread_balances_zero1_replicas_where_lowest_sends_everything_from_one_rank():
    sources, targets = whole_model(QWEN3, 1, 8, 1, 1, 2, 4, 1)
    lowest = _send_bytes(sources, targets, "lowest")
    spread = _send_bytes(sources, targets, Spread())
    assert sum(lowest) == sum(spread)
    assert lowest[0] == sum(lowest)  # every replicated box from rank 0
    mean = sum(spread) / len(spread)
    assert max(spread) <= 1.3 * mean, spread
    assert min(spread) >= 0.7 * mean, spread


def test_spread_balances_expert_replicas_over_their_expert_data_parallel_group():
    sources, targets = whole_model(KIMI, 1, 8, 1, 4, 2, 4, 4)
    spread = _send_bytes(sources, targets, Spread())
    lowest = _send_bytes(sources, targets, "lowest")
    assert max(spread) < max(lowest)
    assert max(spread) <= 1.5 * (sum(spread) / len(spread)), spread

"""Several vLLM engines (data-parallel replicas, TP 2 each) are targets of one plan: tiny Qwen3 with tied
embeddings on real vLLM CPU engines.

Global ranks: trainer rank 0 holds every logical tensor of checkpoint B whole (a stand-in source read from
the checkpoint: no trainer is needed to check the rollout side); engine X (started from checkpoint A) is
ranks 1-2, engine Y (started from B) ranks 3-4. One plan fills every worker of both engines; each worker
applies the segments of its own half. Afterwards X equals Y as Y started (tokens, every parameter bit for
bit) and Y is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollout_sync.layout.box import Box, row_major_strides
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.planning.plan import Plan
from rollout_sync.planning.planner import plan_model
from rollout_sync.rollout.checkpoint import logical_tensors
from rollout_sync.rollout.fleet_maps import RolloutTargets
from tests.harness.vllm_engines import shared_spec
from tests.vllm.rollout_checks import Snapshot, builder_differences, differing_params, snapshot
from vllm_plugin.driver import setup_engines

pytestmark = pytest.mark.vllm

TRAINER_RANK = 0


def whole_source_maps(checkpoint: Path) -> list[TensorMap]:
    """Rank 0 holds every tensor of ``checkpoint`` whole, row-major."""
    maps = []
    for name, (shape, dtype) in logical_tensors(checkpoint).items():
        piece = Piece(Box((0,) * len(shape), shape), 0, row_major_strides(shape), (TRAINER_RANK,))
        maps.append(TensorMap(name, shape, dtype, {TRAINER_RANK: RankStorage(shape, (piece,))}))
    return maps


def receive_rows(plan: Plan, rank: int) -> list[list[Any]]:
    half = plan.half(rank)
    assert half.sends == () and half.local == ()
    return [
        [
            half.tensors[s.tensor].name,
            s.source_offset,
            list(s.source_strides),
            s.target_offset,
            list(s.target_strides),
            list(s.extent),
        ]
        for s in half.receives
    ]


@dataclass
class Fleet:
    a: Path
    b: Path
    fresh_x: Snapshot
    fresh_y: Snapshot
    targets: RolloutTargets
    plan: Plan
    reports: list[list[dict[str, Any]]]
    tied_head: list[dict[str, Any]]  # engine X's workers after the update, then after a forward as a linear
    after_x: Snapshot
    after_y: Snapshot


@pytest.fixture(scope="module")
def fleet(tiny_model: Any, vllm_pool: Any) -> Iterator[Fleet]:
    a, b = tiny_model("dense-tied", 0), tiny_model("dense-tied", 1)
    if vllm_pool.capacity < 2:
        raise ValueError(
            f"this test needs two engines at once: engine pool capacity >= 2, found {vllm_pool.capacity}"
        )
    x = vllm_pool.get(shared_spec(a, 2))
    y = vllm_pool.get(shared_spec(b, 2))  # the pool holds two engines at once
    try:
        fresh_x, fresh_y = snapshot(x), snapshot(y)
        targets = setup_engines([x.llm, y.llm], first_rank=TRAINER_RANK + 1)
        plan = plan_model(whole_source_maps(b), targets.map_list())
        reports = []
        for engine, ranks in zip((x, y), targets.engines, strict=True):
            receives = {str(r): receive_rows(plan, r) for r in ranks}
            reports.append(engine.collective_rpc("rs_rollout_test_apply_segments", args=(str(b), receives)))
            engine.llm.reset_prefix_cache()
        after_x, after_y = snapshot(x), snapshot(y)
        tied_head = x.collective_rpc("rs_rollout_test_tied_head")
        yield Fleet(a, b, fresh_x, fresh_y, targets, plan, reports, tied_head, after_x, after_y)
    finally:
        vllm_pool.restore(x)
        vllm_pool.restore(y)


def test_one_plan_brings_every_engine_to_the_sources_weights_bit_for_bit(fleet: Fleet):
    assert fleet.fresh_x.tokens != fleet.fresh_y.tokens
    assert fleet.after_x.tokens == fleet.fresh_y.tokens
    assert differing_params(fleet.after_x, fleet.fresh_y) == []
    assert fleet.after_y == fleet.fresh_y


def test_engines_are_numbered_after_the_trainer_in_tp_rank_order(fleet: Fleet):
    assert fleet.targets.engines == ((1, 2), (3, 4))
    assert [[r["rank"] for r in engine] for engine in fleet.reports] == [[1, 2], [3, 4]]


def test_each_worker_receives_exactly_the_elements_of_its_storages(fleet: Fleet):
    for engine in fleet.reports:
        for report in engine:
            rank = report["rank"]
            held = sum(m.ranks[rank].numel for m in fleet.targets.maps.values() if rank in m.ranks)
            assert report["elements"] == held
            assert report["written"] == len(fleet.targets.views[rank])


def test_tied_embeddings_are_one_storage_and_the_alias_is_no_target(fleet: Fleet):
    maps = fleet.targets.maps
    assert "lm_head.weight" not in maps
    assert set(maps) == set(logical_tensors(fleet.b))
    for rank in (1, 2, 3, 4):
        assert fleet.targets.views[rank]["model.embed_tokens.weight"].param == "model.embed_tokens.weight"
    # Vocab-parallel rows: the second TP rank of each engine holds rows 512-999 (24 padding rows excluded).
    embed = maps["model.embed_tokens.weight"]
    assert [p.box for p in embed.ranks[4].pieces] == [Box((512, 0), (488, 128))]
    assert embed.ranks[4].pieces[0].holders == (2, 4)


def test_a_tied_embeddings_gemm_handle_is_rebuilt_at_its_first_use_and_the_heads_at_the_update(fleet: Fleet):
    """Where vLLM keeps a GEMM handle per module (oneDNN/sgl on AVX-512/AMX CPUs), it builds one for the
    input embedding too, which computes no logits (the head does): an update rebuilds the head's and
    releases the embedding's until it is used as a linear layer, when it is rebuilt from the current
    weight and computes what the head computes. Without such handles (AVX2) neither is a derived copy."""
    for worker in fleet.tied_head:
        assert worker["tied"] is True
        gemm = sorted(d for d in worker["derived"] if d.startswith("CPU GEMM prepack"))
        if not gemm:  # no handles on this CPU: plain GEMMs over the live weight
            assert worker["embed_waits"] is False
        else:
            assert gemm == [
                "CPU GEMM prepack of lm_head",
                "CPU GEMM prepack of model.embed_tokens (rebuilt on first use)",
            ]
            assert worker["embed_waits"] is True and worker["embed_waits_after_use"] is False
        assert worker["embed_equals_head"] is True


def test_replicated_norms_are_held_by_every_worker_of_every_engine(fleet: Fleet):
    norm = fleet.targets.maps["model.norm.weight"]
    assert {p.holders for s in norm.ranks.values() for p in s.pieces} == {(1, 2, 3, 4)}


def test_the_probed_fleet_maps_equal_the_pure_builders(fleet: Fleet):
    assert builder_differences(fleet.targets.maps, fleet.a, 2, 2, TRAINER_RANK + 1) == []

"""vLLM's own weight-transfer API drives the ``rollout_sync`` backend, on a real vLLM CPU engine running the
tiny Qwen3-MoE with expert parallelism (TP 2, experts split by EP rank).

The engine starts from checkpoint B with ``weight_transfer_config={"backend": "rollout_sync"}`` (the backend
comes from this package's ``vllm.general_plugins`` entry point) and records its fresh state. Through
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` it
then receives checkpoint A (tokens must change) and B again: tokens and every parameter must equal the fresh
state bit for bit (experts compared after vLLM's own CPU prepack on both sides).

Expert parallelism on CPU needs a test-only workaround for a vLLM CPU bug (``tests/vllm/ep_workaround.py``:
the CPU MoE kernel ignores ``expert_map`` and segfaults); the workers load it through their extension.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollout_sync.rollout.fleet_maps import RolloutTargets
from tests.vllm.ep_workaround import ep_spec
from tests.vllm.rollout_checks import Snapshot, builder_differences, differing_params, snapshot
from vllm_plugin.driver import setup_engines
from vllm_plugin.registration import BACKEND

pytestmark = pytest.mark.vllm


@dataclass
class Run:
    a: Path
    b: Path
    fresh: Snapshot
    targets: RolloutTargets
    after_a: Snapshot
    after_b: Snapshot
    versions: list[str]


def _update(llm: Any, checkpoint: Path, version: str) -> None:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"checkpoint": str(checkpoint)}})
    llm.finish_weight_update(weight_version=version)
    llm.reset_prefix_cache()


@pytest.fixture(scope="module")
def run(tiny_model: Any, vllm_pool: Any) -> Iterator[Run]:
    a, b = tiny_model("moe", 0), tiny_model("moe", 1)
    engine = vllm_pool.get(ep_spec(b))  # weight_transfer_config backend rollout_sync
    try:
        llm = engine.llm
        fresh = snapshot(engine)
        targets = setup_engines([llm])  # the extension's view of the same worker (for the map checks)
        llm.init_weight_transfer_engine({"init_info": {"first_rank": 0, "maps": "verify"}})
        versions = []
        _update(llm, a, "a")
        versions.append(llm.get_weight_version())
        after_a = snapshot(engine)
        _update(llm, b, "b")
        versions.append(llm.get_weight_version())
        after_b = snapshot(engine)
        yield Run(a, b, fresh, targets, after_a, after_b, versions)
    finally:
        vllm_pool.restore(engine)


def test_the_backend_is_declared_as_a_vllm_general_plugin():
    points = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert [p.value for p in points if p.name == "rollout_sync"] == ["vllm_plugin.registration:register"]


def test_registering_the_backend_twice_is_harmless():
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from vllm_plugin.registration import register

    register()
    register()
    assert WeightTransferEngineFactory._registry[BACKEND]().__name__ == "RolloutSyncWeightTransferEngine"


def test_an_update_through_vllms_api_changes_the_tokens_and_a_second_restores_them_bit_for_bit(run: Run):
    assert run.after_a.tokens != run.fresh.tokens
    assert run.after_b.tokens == run.fresh.tokens
    assert differing_params(run.after_b, run.fresh) == []
    assert run.versions == ["a", "b"]


def test_expert_parallel_workers_hold_whole_experts_of_their_own(run: Run):
    maps = run.targets.maps
    for e in range(8):
        for kind in ("gate_proj", "up_proj", "down_proj"):
            m = maps[f"model.layers.1.mlp.experts.{e}.{kind}.weight"]
            assert list(m.ranks) == [e // 4]  # linear placement: experts 0-3 on rank 0, 4-7 on rank 1
            assert [p.box.extent for p in m.ranks[e // 4].pieces] == [m.shape]
    view = run.targets.views[1]["model.layers.1.mlp.experts.6.up_proj.weight"]
    assert view.param == "model.layers.1.mlp.experts.routed_experts.w13_weight"
    assert view.offset == (2 * 128 + 64) * 128  # local expert 2, rows 64:128 of [4, 2·64, 128]


def test_the_probed_expert_parallel_maps_equal_the_pure_builders(run: Run):
    # ep == tp selects vLLM's enable_expert_parallel layout in the builder.
    import json

    from rollout_sync.geometry.model_maps import vllm_target_maps
    from rollout_sync.shapes.tensors import model_tensors

    config = json.loads((run.b / "config.json").read_text())
    built = {m.name for m in vllm_target_maps(model_tensors(config), 1, 2, ep=2)}
    assert built == set(run.targets.maps)
    assert builder_differences(run.targets.maps, run.b, 1, 2, 0, ep=2) == []

"""The dry run's vLLM target maps, built from shapes alone (``rollout-sync plan``'s path: layout string ->
``scale.dry_run.build_maps``, engines numbered after the trainer's ranks), equal the maps the live vLLM
adapter learns by probing real vLLM CPU engines' loaders, and plans into either move the same bytes between
the same ranks. Tiny Qwen3 with tied embeddings at TP 2, tiny Qwen3-MoE at TP 2 with expert parallelism."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollout_sync.planning.by_layout import plan_model_by_layout
from rollout_sync.planning.policy import Spread
from rollout_sync.scale.dry_run import build_maps
from rollout_sync.scale.spec import parse_rollout, parse_trainer
from rollout_sync.scale.traffic import Topology, plan_traffic
from rollout_sync.shapes import model_tensors
from tests.harness.vllm_engines import VllmEngineSpec, shared_spec
from tests.vllm.ep_workaround import ep_spec
from tests.vllm.rollout_checks import canonical
from vllm_plugin.driver import setup_engines

pytestmark = pytest.mark.vllm


def _compare(pool: Any, spec: VllmEngineSpec, trainer: str, rollout: str) -> None:
    layout = parse_rollout(rollout)
    if spec.tensor_parallel_size != layout.tp:
        raise ValueError(f"engine TP {spec.tensor_parallel_size} and layout {rollout!r} differ")
    model_dir = Path(spec.model)
    live = pool.get(spec)
    world = parse_trainer(trainer).world
    probed = setup_engines([live.llm], first_rank=world)
    assert probed.engines == (tuple(range(world, world + layout.tp)),)
    assert not probed.refused, probed.refused

    config = json.loads((model_dir / "config.json").read_text())
    sources, dry = build_maps(model_tensors(config), parse_trainer(trainer), layout, "bfloat16")
    dry_by_name = {m.name: m for m in dry}
    assert set(probed.maps) == set(dry_by_name)
    differ = [
        name
        for name, m in sorted(probed.maps.items())
        if (m.shape, m.dtype) != (dry_by_name[name].shape, dry_by_name[name].dtype)
        or canonical(m) != canonical(dry_by_name[name])
    ]
    assert differ == [], f"{len(differ)} maps differ, e.g. {differ[:5]}"

    topology = Topology(world, layout.tp)
    from_live = plan_traffic(plan_model_by_layout(sources, probed.map_list(), Spread()), topology)
    from_dry = plan_traffic(plan_model_by_layout(sources, dry, Spread()), topology)
    assert from_live.segments == from_dry.segments > 0
    for key in ("sent_inter", "recv_inter", "local", "half_segments"):
        assert getattr(from_live, key) == getattr(from_dry, key), key


def test_dry_run_targets_equal_a_live_tp2_moe_engine_with_expert_parallelism(vllm_pool, tiny_model):
    # The EP engine of test_rollout_backend.py (probing runs no forward pass; the workaround extension is
    # for the forwards of that module, tests/vllm/ep_workaround.py).
    _compare(vllm_pool, ep_spec(tiny_model("moe", 1)), "zero=1,ep=2,world=4", "engines=1,tp=2,ep=2")


def test_dry_run_targets_equal_a_live_tp2_engine_with_tied_embeddings(vllm_pool, tiny_model):
    _compare(vllm_pool, shared_spec(tiny_model("dense-tied"), 2), "zero=3,world=4", "engines=1,tp=2")

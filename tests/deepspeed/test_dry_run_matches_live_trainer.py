"""The dry run's trainer maps, built from shapes alone (``rollout-sync plan``'s path: layout string ->
``scale.dry_run.build_maps``), equal the maps the live DeepSpeed adapter reads from real engines on CPU
ranks, on every rank, for ZeRO-1/2/3, AutoTP and AutoEP (with its expert-data-parallel groups)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from rollout_sync.scale.dry_run import build_maps
from rollout_sync.scale.spec import parse_rollout, parse_trainer
from rollout_sync.shapes import model_tensors
from rollout_sync.trainer import trainer_storage
from tests.harness import timings
from tests.harness.deepspeed_engines import DeepSpeedRank, DeepSpeedSpec, run_deepspeed

pytestmark = pytest.mark.deepspeed

# ZeRO-3 parameters under DeepSpeed's persistence threshold stay gathered between steps (a derived copy the
# adapter refuses to describe); every parameter of a tiny model is under the default threshold.
_NO_PERSISTENCE = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _compare(ctx: DeepSpeedRank) -> dict[str, Any]:
    spec = ctx.spec
    started = time.perf_counter()
    live = trainer_storage(ctx.engine).maps
    live_s = time.perf_counter() - started
    config = json.loads((ctx.model_path / "config.json").read_text())
    trainer = parse_trainer(
        f"zero={spec.zero_stage},tp={spec.autotp_size},ep={spec.autoep_size},world={ctx.world_size}"
    )
    started = time.perf_counter()
    dry, _ = build_maps(
        model_tensors(config), trainer, parse_rollout("engines=1,tp=2"), spec.torch_dtype_name
    )
    dry_s = time.perf_counter() - started
    live_by_name = {m.name: m for m in live}
    dry_by_name = {m.name: m for m in dry}
    differ = []
    for name in sorted(set(live_by_name) | set(dry_by_name)):
        a, b = live_by_name.get(name), dry_by_name.get(name)
        if a is None or b is None:
            differ.append(f"{name}: only in the {'dry run' if a is None else 'live maps'}")
        elif a != b:
            ranks = sorted(r for r in set(a.ranks) | set(b.ranks) if a.ranks.get(r) != b.ranks.get(r))
            differ.append(f"{name}: ranks {ranks[:4]} differ; live {a.ranks.get(ranks[0]) if ranks else a}")
    return {
        "differ": differ,
        "maps": len(live),
        "ranks": sorted({r for m in live for r in m.ranks}),
        "replicated": sum(1 for m in live if any(len(reg[2]) > 1 for reg in m.regions)),
        "live_s": live_s,
        "dry_s": dry_s,
    }


CASES = [
    pytest.param(
        DeepSpeedSpec("dense", 3, autotp_size=2, extra_config=_NO_PERSISTENCE), 4, id="zero3-tp2-dp2"
    ),
    pytest.param(DeepSpeedSpec("moe", 1, autoep_size=2, dtype="fp32"), 4, id="zero1-ep2-edp2-fp32"),
    pytest.param(
        DeepSpeedSpec("moe", 3, autoep_size=2, zero_init=True, extra_config=_NO_PERSISTENCE),
        4,
        id="zero3-ep2-edp2-zero_init",
    ),
    pytest.param(DeepSpeedSpec("dense-tied", 1, autotp_size=2), 2, id="zero1-tp2-tied"),
]


@pytest.mark.parametrize(("spec", "world"), CASES)
def test_maps_built_from_shapes_alone_equal_the_live_deepspeed_adapters_on_every_rank(
    tiny_model, spec, world
):
    started = time.perf_counter()
    results = run_deepspeed(spec, tiny_model(spec.kind), _compare, world, timeout=600)
    timings.record(
        f"dry run vs live DeepSpeed maps, {spec.kind} zero{spec.zero_stage} w{world}",
        time.perf_counter() - started,
    )
    for rank, r in enumerate(results):
        assert r["differ"] == [], f"rank {rank}: " + "\n".join(r["differ"][:10])
        assert r["maps"] > 0 and r["ranks"] == list(range(world))
    if spec.zero_stage < 3 or spec.autotp_size > 1:
        assert results[0]["replicated"] > 0  # the comparison covered replicated boxes (holders) too

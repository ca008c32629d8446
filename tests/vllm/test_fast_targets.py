"""Setup's fast path on real vLLM CPU engines: target maps from shapes, confirmed by the loader trace, equal
the element probe's on the same engine (``maps="verify"`` compares them on every worker and raises on any
difference), and a wrong shape-table map is refused with a typed error naming the tensor and the first
wrong position. Dense (untied and tied) at TP 1 and 2, MoE at TP 2 with and without expert parallelism."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from rollout_sync.errors import CoverageError, HoleError
from rollout_sync.layout.box import Box
from rollout_sync.layout.combine import renumber
from rollout_sync.layout.maps import Piece, RankStorage
from rollout_sync.rollout.codec import local_targets_from_dict
from rollout_sync.rollout.fleet_maps import assemble
from rollout_sync.rollout.local_targets import LocalTargets
from tests.harness.vllm_engines import shared_spec
from tests.vllm.ep_workaround import ep_spec
from vllm_plugin.calls import call
from vllm_plugin.driver import setup_engines

pytestmark = pytest.mark.vllm


def _verify(pool: Any, spec: Any) -> list[dict[str, Any]]:
    live = pool.get(spec)
    reports: list[list[dict[str, Any]]] = []
    targets = setup_engines([live.llm], first_rank=3, maps="verify", reports=reports)
    assert not targets.refused
    summaries = reports[0]
    for s in summaries:
        setup = s["setup"]
        assert setup["maps"] == "verify"
        assert setup["why_probed"] is None, setup["why_probed"]
        assert setup["probed"] == 0 and setup["from_shapes"] > 0, setup
    return summaries


@pytest.mark.parametrize(("kind", "tp"), [("dense", 1), ("dense-tied", 2), ("dense", 2)])
def test_fast_targets_equal_the_element_probe_on_dense_engines(vllm_pool, tiny_model, kind, tp):
    _verify(vllm_pool, shared_spec(tiny_model(kind), tp))


def test_fast_targets_equal_the_element_probe_on_moe_engines(vllm_pool, tiny_model):
    _verify(vllm_pool, shared_spec(tiny_model("moe"), 2))
    _verify(vllm_pool, ep_spec(tiny_model("moe", 1)))


def test_fast_setup_probes_nothing_and_reports_its_time(vllm_pool, tiny_model):
    live = vllm_pool.get(shared_spec(tiny_model("dense"), 2))
    reports: list[list[dict[str, Any]]] = []
    setup_engines([live.llm], first_rank=0, maps="fast", reports=reports)
    for s in reports[0]:
        assert s["setup"]["maps"] == "fast" and s["setup"]["probed"] == 0
        assert s["probe_seconds"] < s["maps_seconds"] or s["probe_seconds"] == 0.0
        assert s["setup"]["trace_seconds"] > 0


def test_a_wrong_shape_table_is_refused_naming_the_tensor_and_position(vllm_pool, tiny_model):
    """Shape tables that pad the vocab to 96 rows instead of vLLM's 64 move the TP 2 shard boundary of
    the embedding (1000 rows: vLLM's rank 0 holds rows [0, 512), the skewed table says [0, 528)): the trace
    check refuses it on every worker, naming the tensor and the first wrong position."""
    live = vllm_pool.get(shared_spec(tiny_model("dense"), 2))
    errors = live.llm.collective_rpc("rs_rollout_test_skewed_setup", args=(0, 96))
    assert len(errors) == 2
    for error in errors:
        assert error is not None and error.startswith("TargetMismatchError"), error
        assert "first wrong position" in error, error
        assert "'model.embed_tokens.weight'" in error or "'lm_head.weight'" in error, error
    assert errors[0] != errors[1]  # each worker names its own wrong position


def _drop(targets: LocalTargets, name: str) -> LocalTargets:
    maps = {n: m for n, m in targets.maps.items() if n != name}
    views = {n: v for n, v in targets.views.items() if n != name}
    return replace(targets, maps=maps, views=views, absent=(*targets.absent, name))


def test_real_engines_targets_with_a_hole_are_refused_before_any_plan(vllm_pool, tiny_model):
    """The real workers' targets, then one worker's part of a tensor removed (a missing TP rank for that
    tensor), a vocab shard cut to half its rows, a routed expert removed from its only owner in one of two
    engines: each is refused when the parts are merged, naming the engine, the tensor and the first
    uncovered position (or that the engine holds none of it)."""
    dense = vllm_pool.get(shared_spec(tiny_model("dense"), 2)).llm
    setup_engines([dense], first_rank=2, maps="fast")
    workers = [local_targets_from_dict(d) for d in call(dense, "local_targets", name="0")]
    engines = [(2, 3)]
    assert assemble(workers, engines).ignored == ()  # complete as set up: every tensor held
    embed = "model.embed_tokens.weight"
    with pytest.raises(
        HoleError, match=r"engine 0 does not hold every element: first uncovered position \[512, 0\]"
    ):
        assemble([workers[0], _drop(workers[1], embed)], engines)
    # half of rank 3's vocab shard (rows [512, 1000) of 1000)
    view = workers[1].views[embed]
    storage = workers[1].maps[embed].ranks[3]
    (piece,) = storage.pieces
    rows = piece.box.extent[0] // 2
    half = Piece(Box(piece.box.origin, (rows, *piece.box.extent[1:])), 0, piece.strides, (3,))
    cut = replace(workers[1].maps[embed], ranks={3: RankStorage((rows, *storage.shape[1:]), (half,))})
    shrunk = replace(
        workers[1],
        maps={**workers[1].maps, embed: cut},
        views={**workers[1].views, embed: replace(view, shape=(rows, *view.shape[1:]))},
    )
    with pytest.raises(HoleError, match=rf"first uncovered position \[{512 + rows}, 0\]") as err:
        assemble([workers[0], shrunk], engines)
    assert err.value.tensor == embed

    # Two engines with expert parallelism (the real engine's workers, and the same again as engine 1 at
    # ranks 4, 5); engine 1's owner of one routed expert lost it: engine 1 would keep it stale.
    moe = vllm_pool.get(ep_spec(tiny_model("moe", 1))).llm
    setup_engines([moe], first_rank=2, maps="fast")
    first = [local_targets_from_dict(d) for d in call(moe, "local_targets", name="0")]
    second = [_renumbered(w, {2: 4, 3: 5}) for w in first]
    fleet = [(2, 3), (4, 5)]
    assemble(first + second, fleet)
    owner, name = next((i, n) for i, w in enumerate(second) for n in w.maps if ".experts." in n)
    lost = [_drop(w, name) if i == owner else w for i, w in enumerate(second)]
    with pytest.raises(CoverageError, match="engine 1 holds none of this tensor") as err:
        assemble(first + lost, fleet)
    assert err.value.tensor == name


def _renumbered(targets: LocalTargets, table: dict[int, int]) -> LocalTargets:
    maps = {n: renumber(m, table) for n, m in targets.maps.items()}
    return replace(targets, rank=table[targets.rank], maps=maps)

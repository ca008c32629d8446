"""Target maps learned from vLLM's own loaders, and weights written in place through them, on real vLLM CPU
engines: tiny Qwen3 dense at TP 1 and tiny Qwen3-MoE at TP 2 (the tied model and several engines are in
``test_rollout_engines.py``).

Per configuration two engines run, one after the other: X started from checkpoint A (seed 0) and Y from
checkpoint B (seed 1). Each receives the other checkpoint through its maps (one process per worker, no
trainer) and must then equal the other engine as it started: greedy tokens, and every parameter bit for
bit (MoE experts are compared after vLLM's own CPU prepack on both sides, i.e. through the same repacking).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_sync.rollout.checkpoint import logical_tensors, read_tensors
from tests.harness.vllm_engines import shared_spec
from tests.vllm.rollout_checks import (
    RoundTrip,
    Snapshot,
    builder_differences,
    differing_params,
    round_trip,
    snapshot,
)
from vllm_plugin.driver import apply_checkpoint, setup_engines
from vllm_plugin.worker_state import param_digest

pytestmark = pytest.mark.vllm

SENTINEL = 7.0


@dataclass
class Config:
    kind: str
    tp: int
    a: Path
    b: Path
    x: RoundTrip  # started from a, received b
    y: RoundTrip  # started from b, received a
    padding_values: list[list[float]]  # after a sentinel fill and a write, per worker
    padding_filled: list[int]
    refused: list[dict[str, Any]]  # summaries after a transforming loader was installed on model.norm.weight
    refused_snapshot: Snapshot


def _run(pool: Any, tiny_model: Any, kind: str, tp: int) -> Config:
    a, b = tiny_model(kind, 0), tiny_model(kind, 1)
    x = pool.get(shared_spec(a, tp))
    try:
        rt_x = round_trip(x, b)
        # Padding: a sentinel in every element no storage covers survives a write of every tensor.
        filled = x.collective_rpc("rs_rollout_test_fill_uncovered", args=(SENTINEL,))
        apply_checkpoint([x.llm], str(a))
        padding_values = x.collective_rpc("rs_rollout_test_uncovered_values")
        x.collective_rpc("rs_rollout_test_fill_uncovered", args=(0.0,))
        # A loader that transforms values is refused for in-place writes and goes through load_weights.
        x.collective_rpc("rs_rollout_test_scale_loader", args=("model.norm.weight", 2.0))
        refused = x.collective_rpc("rollout_sync_setup")  # each worker's own report
        setup_engines([x.llm])
        apply_checkpoint([x.llm], str(b))
        refused_snapshot = snapshot(x)
    finally:
        pool.restore(x)
    y = pool.get(shared_spec(b, tp))
    try:
        rt_y = round_trip(y, a)
    finally:
        pool.restore(y)
    return Config(kind, tp, a, b, rt_x, rt_y, padding_values, filled, refused, refused_snapshot)


@pytest.fixture(scope="module", params=[("moe", 2), ("dense", 1)], ids=["moe-tp2", "dense-tp1"])
def config(request: pytest.FixtureRequest, vllm_pool: Any, tiny_model: Any) -> Config:
    kind, tp = request.param
    return _run(vllm_pool, tiny_model, kind, tp)


def test_writing_the_other_checkpoint_through_the_maps_gives_the_fresh_engines_tokens(config: Config):
    assert config.x.written.tokens == config.y.fresh.tokens
    assert config.y.written.tokens == config.x.fresh.tokens
    assert config.x.fresh.tokens != config.y.fresh.tokens  # the two checkpoints really differ


def test_every_parameter_equals_the_fresh_engines_bit_for_bit(config: Config):
    assert differing_params(config.x.written, config.y.fresh) == []
    assert differing_params(config.y.written, config.x.fresh) == []
    assert differing_params(config.x.fresh, config.y.fresh) != []


def test_every_element_of_every_logical_tensor_is_covered_once_with_nothing_refused(config: Config):
    targets = config.x.targets
    assert set(targets.maps) == set(logical_tensors(config.a))
    assert targets.refused == {}
    assert targets.engines == (tuple(range(config.tp)),)
    for name, tmap in targets.maps.items():
        covered = sum(p.box.numel for p in {p for s in tmap.ranks.values() for p in s.pieces})
        assert covered == tmap.numel, name
        for view in (targets.views[r][name] for r in tmap.ranks):
            assert view.param is not None, name


def test_the_probed_maps_equal_the_pure_builders(config: Config):
    assert builder_differences(config.x.targets.maps, config.a, 1, config.tp, 0) == []


def test_fused_and_sharded_storages_sit_where_vllm_keeps_them(config: Config):
    views = config.x.targets.views
    tp = config.tp
    q_rows, kv_rows = 128 // tp, 64 // tp
    last = views[tp - 1]
    assert last["model.layers.0.self_attn.q_proj.weight"].param == "model.layers.0.self_attn.qkv_proj.weight"
    assert last["model.layers.0.self_attn.k_proj.weight"].offset == q_rows * 128
    assert last["model.layers.0.self_attn.v_proj.weight"].offset == (q_rows + kv_rows) * 128
    # The vocab shard of the last rank excludes its padding rows: vocab 1000, 1024 // tp rows per rank.
    rows = 1000 - (tp - 1) * (1024 // tp)
    assert last["lm_head.weight"].shape == (rows, 128)
    if config.kind == "moe":
        w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
        inter = 64 // tp
        assert last["model.layers.1.mlp.experts.5.gate_proj.weight"].param == w13
        assert last["model.layers.1.mlp.experts.5.up_proj.weight"].offset == (5 * 2 + 1) * inter * 128
        assert last["model.layers.1.mlp.experts.5.down_proj.weight"].shape == (128, inter)
        assert config.x.reports[0]["refreshed"]  # the CPU MoE prepack was rebuilt
    else:
        assert last["model.layers.0.mlp.up_proj.weight"].offset == (256 // tp) * 128


def test_padding_rows_are_never_written(config: Config):
    tp = config.tp
    rows = 1024 // tp
    real = [min(rows, 1000 - r * rows) for r in range(tp)]
    for rank, uncovered in enumerate(config.x.uncovered):
        vocab = ("model.embed_tokens.weight", "lm_head.weight")
        expected = {name: [[real[rank] * 128, rows * 128]] for name in vocab} if real[rank] < rows else {}
        assert {n: r for n, r in uncovered.items() if r} == expected
    assert config.padding_filled == [2 * (rows - n) * 128 for n in real]
    assert config.padding_values == [[SENTINEL] if n < rows else [] for n in real]


def test_a_transforming_loader_is_refused_by_name_and_loaded_through_load_weights(config: Config):
    for summary in config.refused:
        assert set(summary["refused"]) == {"model.norm.weight"}
        reason = summary["refused"]["model.norm.weight"]
        assert "transforms values" in reason and "model.norm.weight" in reason
    expected = dict(read_tensors(config.b, ["model.norm.weight"]))["model.norm.weight"] * 2
    fresh_b = config.y.fresh
    for rank, digests in enumerate(config.refused_snapshot.digests):
        assert digests["model.norm.weight"] == param_digest(expected.to(torch.bfloat16))
        others = {n: d for n, d in digests.items() if n != "model.norm.weight"}
        assert others == {n: d for n, d in fresh_b.digests[rank].items() if n != "model.norm.weight"}

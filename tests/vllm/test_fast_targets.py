"""Setup's fast path on real vLLM CPU engines: target maps from shapes, confirmed by the loader trace, equal
the element probe's on the same engine (``maps="verify"`` compares them on every worker and raises on any
difference), and a wrong shape-table map is refused with a typed error naming the tensor and the first
wrong position. Dense (untied and tied) at TP 1 and 2, MoE at TP 2 with and without expert parallelism."""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness.vllm_engines import shared_spec
from tests.vllm.ep_workaround import ep_spec
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
        assert "model.embed_tokens.weight" in error and "first wrong position" in error, error
    assert errors[0] != errors[1]  # each worker names its own wrong position

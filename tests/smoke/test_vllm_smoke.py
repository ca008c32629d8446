"""A real vLLM CPU engine at TP 2 serves the tiny model: deterministic greedy tokens, two workers, padded
vocabulary shards."""

from __future__ import annotations

import pytest

from tests.harness.vllm_engines import DEFAULT_PROMPTS, VllmEngine, omp_threads_bind, shared_spec

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(vllm_pool, tiny_model) -> VllmEngine:
    return vllm_pool.get(shared_spec(tiny_model("dense"), 2))


def test_greedy_generation_at_tp2_gives_the_same_tokens_twice(engine):
    first = engine.generate_greedy(DEFAULT_PROMPTS, max_tokens=12)
    second = engine.generate_greedy(DEFAULT_PROMPTS, max_tokens=12)
    assert first == second
    assert [len(tokens) for tokens in first] == [12, 12]
    assert all(0 <= t < 1000 for tokens in first for t in tokens)
    assert all(len(set(tokens)) >= 6 for tokens in first), first


def test_the_tp2_engine_runs_one_worker_per_tp_rank_with_the_extension_loaded(engine):
    ranks = engine.collective_rpc("rs_harness_ranks")
    assert [(r["tp_rank"], r["tp_size"]) for r in ranks] == [(0, 2), (1, 2)]
    assert len({r["pid"] for r in ranks}) == 2
    assert {r["pid"] for r in ranks} <= set(engine.pids)


def test_each_tp2_worker_holds_half_of_the_padded_vocabulary(engine):
    for shapes in engine.collective_rpc("rs_harness_param_shapes"):
        # vocab 1000 padded to 1024 rows, 512 per TP rank; q 128 + k 64 + v 64 rows, halved.
        assert shapes["model.embed_tokens.weight"] == [512, 128]
        assert shapes["lm_head.weight"] == [512, 128]
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == [128, 128]


def test_cores_are_split_between_tp_workers_without_overlap():
    assert omp_threads_bind(2, [0, 1]) == "0|1"
    assert omp_threads_bind(2, [0, 1, 2, 3, 4]) == "0,1,2|3,4"
    assert omp_threads_bind(1, [3, 5]) == "3,5"
    with pytest.raises(ValueError, match="needs at least 4 cores"):
        omp_threads_bind(4, [0, 1])

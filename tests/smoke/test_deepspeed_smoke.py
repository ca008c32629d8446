"""A real DeepSpeed ZeRO-3 engine on two CPU ranks starts from the tiny Qwen3 checkpoint, bit for bit, by
both build paths (partitioned at ``deepspeed.initialize``, or built inside ``zero.Init``), and trains one
step. One launch of two ranks serves every test of this module."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest

from tests.harness import timings
from tests.harness.deepspeed_engines import (
    DeepSpeedRank,
    DeepSpeedSpec,
    build_engine,
    checkpoint_mismatches,
    full_parameters,
    run_deepspeed,
    train_step,
)

pytestmark = pytest.mark.deepspeed

_WATCHED = "model.layers.0.mlp.down_proj.weight"


def _zero3_rank(ctx: DeepSpeedRank) -> dict[str, Any]:
    engine = ctx.engine
    param = dict(engine.module.named_parameters())[_WATCHED]
    result: dict[str, Any] = {
        "startup_s": ctx.startup_s,
        "optimizer": type(engine.optimizer).__name__,
        "local_numel": int(param.ds_tensor.numel()),
        "full_numel": int(param.ds_numel),
        "mismatches_at_start": checkpoint_mismatches(engine, ctx.model_path),
    }
    before = full_parameters(engine)[_WATCHED]
    started = time.perf_counter()
    result["loss"] = train_step(engine, seed=0)
    result["step_s"] = time.perf_counter() - started
    after = full_parameters(engine)[_WATCHED]
    result["changed"] = int((before != after).sum())
    result["after"] = after.float().tolist()

    started = time.perf_counter()
    zero_init_engine = build_engine(
        DeepSpeedSpec(kind=ctx.spec.kind, zero_stage=3, dtype=ctx.spec.dtype, zero_init=True), ctx.model_path
    )
    result["zero_init_startup_s"] = time.perf_counter() - started
    result["zero_init_mismatches"] = checkpoint_mismatches(zero_init_engine, ctx.model_path)
    result["zero_init_loss"] = train_step(zero_init_engine, seed=0)
    return result


@pytest.fixture(scope="module")
def zero3_ranks(tiny_model) -> list[dict[str, Any]]:
    spec = DeepSpeedSpec(kind="dense", zero_stage=3, dtype="bf16")
    with timings.timed("deepspeed ZeRO-3 smoke: 2 ranks, two engines, two steps (wall)"):
        results = run_deepspeed(spec, tiny_model("dense"), _zero3_rank, 2, timeout=600)
    timings.record("deepspeed ZeRO-3 engine startup in rank (spawn to engine)", results[0]["startup_s"])
    timings.record("deepspeed ZeRO-3 zero.Init engine build in rank", results[0]["zero_init_startup_s"])
    timings.record("deepspeed ZeRO-3 one training step", results[0]["step_s"])
    return results


def test_each_zero3_rank_stores_half_of_a_parameter(zero3_ranks):
    for r in zero3_ranks:
        assert r["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
        assert r["local_numel"] * 2 == r["full_numel"] == 128 * 256


def test_a_zero3_engine_starts_from_the_checkpoint_bit_for_bit(zero3_ranks):
    assert [r["mismatches_at_start"] for r in zero3_ranks] == [[], []]


def test_a_zero3_engine_built_inside_zero_init_starts_from_the_checkpoint_bit_for_bit(zero3_ranks):
    assert [r["zero_init_mismatches"] for r in zero3_ranks] == [[], []]
    # Same weights, same batch: the first loss of both build paths is the same number.
    assert [r["zero_init_loss"] for r in zero3_ranks] == [r["loss"] for r in zero3_ranks]


def test_one_zero3_step_on_two_ranks_changes_the_weights_identically_on_both(zero3_ranks):
    r0, r1 = zero3_ranks
    assert math.isfinite(r0["loss"]) and r0["loss"] == r1["loss"]
    assert r0["changed"] > r0["full_numel"] // 2
    assert r0["after"] == r1["after"]

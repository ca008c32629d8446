"""End to end on CPU: real DeepSpeed trainer ranks and a real vLLM engine (TP 2), joined by the ZeroMQ
handshake into one gloo group, synced by the trainer hook after each of three optimizer steps. After each
sync vLLM holds exactly the trainer's weights (a write of the trainer's own checkpoint changes no bit), and
after the last its greedy tokens and every parameter equal a fresh engine loaded from that checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testbed.deepspeed import DeepSpeedSpec
from tests.e2e.e2e_steps import check_steps, fresh_engine_snapshot, run_sync_steps
from tests.harness.vllm_engines import shared_spec
from tests.vllm.rollout_checks import differing_params

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]


def _check_against_fresh(vllm_pool: Any, run: Any, tp: int = 2) -> None:
    last = run.steps[-1]
    fresh = fresh_engine_snapshot(vllm_pool, last.checkpoint, tp)
    assert last.synced.tokens == fresh.tokens
    assert differing_params(last.synced, fresh) == []


def test_zero2_replicas_sync_with_the_balanced_policy_spreading_sends_over_both_trainer_ranks(
    tiny_model: Any, vllm_pool: Any, tmp_path: Path
):
    model = tiny_model("dense")
    engine = vllm_pool.get(shared_spec(model, 2))
    try:
        run = run_sync_steps(engine, DeepSpeedSpec("dense", 2), model, tmp_path, policy="balanced")
    finally:
        vllm_pool.restore(engine)
    check_steps(run)
    # sent as messages, or handed to a worker that maps this rank's storages (same host)
    stats = [t["sync"]["stats"] for t in run.steps[-1].trainer]
    sent = [sum(s["bytes_sent"].values()) + sum(s["bytes_mapped"].values()) for s in stats]
    assert min(sent) > 0.3 * max(sent), (
        f"balanced policy left a replica idle: bytes sent per trainer rank {sent}"
    )


def test_zero3_on_two_ranks_syncs_into_a_tp2_engine_after_every_step(
    tiny_model: Any, vllm_pool: Any, tmp_path: Path
):
    model = tiny_model("dense")
    engine = vllm_pool.get(shared_spec(model, 2))
    try:
        run = run_sync_steps(engine, DeepSpeedSpec("dense", 3), model, tmp_path)
    finally:
        vllm_pool.restore(engine)
    assert run.ranks == [0, 1]
    check_steps(run)
    _check_against_fresh(vllm_pool, run)


def test_autoep2_experts_sync_into_a_tp2_moe_engine_after_every_step(
    tiny_model: Any, vllm_pool: Any, tmp_path: Path
):
    model = tiny_model("moe")
    engine = vllm_pool.get(shared_spec(model, 2))
    try:
        run = run_sync_steps(engine, DeepSpeedSpec("moe", 3, autoep_size=2), model, tmp_path)
    finally:
        vllm_pool.restore(engine)
    check_steps(run)
    _check_against_fresh(vllm_pool, run)

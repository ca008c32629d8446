"""Every offline call to an engine gets its own answer, on a real TP-2 vLLM engine, after failures that
used to leave vLLM's other worker one answer behind (``vllm_plugin.calls``).

A trainer of one rank (this process, ``TrainerSync.connect``) holds every tensor whole. First a worker-side
exception in ``receive`` (no link yet), then a handshake refused because the trainer's model has another
vocabulary (every mismatching tensor named, with both shapes, on the engine's side too); after each, a
``status`` gets the status of every worker, and finally a second handshake with the right model and a sync
that leaves the engine holding that model bit for bit.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from rollout_sync.errors import PeerFailedError, ShapeMismatchError
from rollout_sync.trainer.hook import TrainerSync
from testbed.rank_pool import free_port
from tests.harness.vllm_engines import shared_spec
from tests.harness.whole_trainer import VOCAB_TENSORS, connect_whole_trainer
from tests.vllm.rollout_checks import snapshot
from vllm_plugin.driver import apply_checkpoint, connect_engine, engine_status, receive_sync, setup_engines

pytestmark = pytest.mark.vllm

TOKEN = "calls-token"


def handshake(engine: Any, checkpoint: Path, grow: int = 0) -> tuple[Any, Any]:
    """(the trainer's outcome, the engine's outcome): each a TrainerSync / worker statuses or an error."""
    address = f"tcp://127.0.0.1:{free_port()}"
    with ThreadPoolExecutor(2) as pool:
        trainer = pool.submit(
            connect_whole_trainer, checkpoint, address, engines=1, token=TOKEN, timeout=60, grow=grow
        )
        rollout = pool.submit(connect_engine, engine, address, 0, token=TOKEN, timeout=60)
        outcomes = []
        for f in (trainer, rollout):
            try:
                outcomes.append(f.result(120))
            except Exception as exc:
                outcomes.append(exc)
    return outcomes[0], outcomes[1]


def test_after_a_failed_receive_and_a_refused_handshake_every_call_gets_its_own_answer(
    tiny_model: Any, vllm_pool: Any, tmp_path: Path
):
    a, b = tiny_model("dense", 0), tiny_model("dense", 1)
    engine = vllm_pool.get(shared_spec(a, 2))
    try:
        setup_engines([engine], first_rank=1)
        # 1. A worker-side exception in receive (no link yet): both workers' errors, as answers.
        with pytest.raises(PeerFailedError) as failed:
            receive_sync([engine])
        assert "engine 0 worker 0: receive failed: IncompleteUpdateError" in str(failed.value)
        assert "engine 0 worker 1: receive failed: IncompleteUpdateError" in str(failed.value)
        assert engine_status(engine) == [{"connected": False}, {"connected": False}]

        # 2. A handshake refused for mismatching maps: every mismatching tensor named, both shapes.
        trainer, rollout = handshake(engine, b, grow=4)
        assert isinstance(trainer, ShapeMismatchError), trainer
        for text in (str(trainer), str(rollout)):
            assert "different logical shapes for 2 tensors" in text, text
            for name in VOCAB_TENSORS:
                assert f"'{name}': target (1000, 128), source (1004, 128)" in text, text
        assert isinstance(rollout, PeerFailedError) and "engine 0 worker 1" in str(rollout), rollout
        statuses = engine_status(engine)
        assert [s["connected"] for s in statuses] == [False, False], statuses
        assert engine.collective_rpc("rs_harness_ranks")[1]["tp_rank"] == 1  # a direct call: its own too

        # 3. A second handshake with the right model on the same engine, then a sync: bit for bit.
        trainer, rollout = handshake(engine, b)
        assert isinstance(trainer, TrainerSync), trainer
        assert [s["rank"] for s in rollout] == [1, 2], rollout
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(trainer.sync, 5)
            reports = receive_sync([engine])[0]
            assert sent.result(60).version == 5
        assert [r["version"] for r in reports] == [5, 5]
        synced = snapshot(engine)
        apply_checkpoint([engine], str(b))  # b written through the maps: changes no bit
        assert snapshot(engine) == synced
        assert [s["version"] for s in engine_status(engine)] == [5, 5]
        trainer.detach()
    finally:
        vllm_pool.restore(engine)

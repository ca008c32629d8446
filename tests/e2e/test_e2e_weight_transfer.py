"""The vLLM way: the same ZeRO-3 trainer syncs into an engine through vLLM's own weight-transfer API
(``weight_transfer_config={"backend": "rollout_sync"}``: ``init_weight_transfer_engine`` joins the sync
group, ``start_weight_update`` / ``update_weights`` / ``finish_weight_update(weight_version=...)`` receive
each step), and the engine then holds exactly the trainer's weights and reports the trainer's version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testbed.deepspeed import DeepSpeedSpec
from testbed.rank_pool import RankPool, free_port
from testbed.trainer_ranks import attach, setup, train_step
from tests.e2e.e2e_steps import TOKEN, TRAINER_ENV, save_checkpoint
from tests.harness.vllm_engines import shared_spec
from vllm_plugin.driver import apply_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]


def test_vllms_weight_transfer_api_receives_each_sync_and_sets_the_weight_version(
    tiny_model: Any, vllm_pool: Any, tmp_path: Path
):
    model = tiny_model("dense")
    engine = vllm_pool.get(shared_spec(model, 2))  # started with weight_transfer_config rollout_sync
    llm = engine.llm
    try:
        with RankPool(2, env=TRAINER_ENV, timeout=600) as pool:
            pool.call(setup, DeepSpeedSpec("dense", 3), str(model))
            address = f"tcp://127.0.0.1:{free_port()}"
            pending = pool.submit(attach, address, TOKEN, 1, 1, "balanced", 90.0)
            init_info = {
                "first_rank": 2,
                "address": address,
                "engine": 0,
                "token": TOKEN,
                "timeout": 90.0,
                "maps": "verify",
            }
            llm.init_weight_transfer_engine({"init_info": init_info})
            assert pending.result(240) == [0, 1]
            for step in (1, 2):
                pending = pool.submit(train_step, step)
                llm.start_weight_update()
                llm.update_weights({"update_info": {}})
                version = pending.result(240)[0]["sync"]["version"]
                llm.finish_weight_update(weight_version=str(version))
                llm.reset_prefix_cache()
                assert llm.get_weight_version() == str(version)
                before = engine.collective_rpc("rollout_sync_param_digests")
                pool.call(save_checkpoint, str(tmp_path / f"step{step}"), str(model))
        engine.collective_rpc("rollout_sync_setup", kwargs={"first_rank": 0})
        apply_checkpoint([llm], str(tmp_path / "step2"))
        after = engine.collective_rpc("rollout_sync_param_digests")
        assert before == after, "the engine did not hold exactly the trainer's weights after the last sync"
    finally:
        vllm_pool.restore(engine)

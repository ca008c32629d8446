"""vLLM's trainer-side weight-transfer API with the ``rollout_sync`` backend: the driver code vLLM documents for
its NCCL backend (``WeightTransferTrainerFactory.trainer_init(init_info=..., client=HTTPVLLMWeightSyncClient(url),
source=ModuleSource(model))``, then ``send_weights()`` per sync), with ``NCCLTrainerInitInfo`` replaced by
``RolloutSyncTrainerInitInfo`` and the server started with ``--weight-transfer-config '{"backend":
"rollout_sync"}'``. A 2-rank ZeRO-3 DeepSpeed trainer, a real ``vllm serve`` at TP 2: after every sync the
server reports the trainer's version and holds its weights bit for bit. A source that is not a DeepSpeed
engine is refused on every rank before anything moves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testbed.deepspeed import DeepSpeedSpec
from testbed.rank_pool import RankContext, RankPool, free_port
from testbed.trainer_ranks import setup
from tests.e2e.e2e_steps import TRAINER_ENV, save_checkpoint
from tests.serve.servers import WEIGHT_TRANSFER, Server, launch, wait_all
from vllm_plugin.driver import apply_checkpoint

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]


def trainer_init(ctx: RankContext, url: str, port: int, plain: bool = False) -> str:
    """As vLLM's docs write it for NCCL, with rollout-sync's init info."""
    import torch
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from vllm_plugin.trainer_engine import RolloutSyncTrainerInitInfo

    model = torch.nn.Linear(4, 4) if plain else ctx.state["engine"]
    try:
        ctx.state["transfer"] = WeightTransferTrainerFactory.trainer_init(
            init_info=RolloutSyncTrainerInitInfo(
                master_address="127.0.0.1", master_port=port, world_size=4, rank=ctx.rank
            ),
            client=HTTPVLLMWeightSyncClient(url),
            source=ModuleSource(model),
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ready"


def step_and_send(ctx: RankContext, seed: int) -> int:
    from testbed.deepspeed import train_step

    train_step(ctx.state["engine"], seed=seed)
    ctx.state["transfer"].send_weights()
    return int(ctx.state["transfer"].sync.last.version)


@pytest.fixture(scope="module")
def served(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    model = tiny_model("dense")
    server = launch(model, tmp_path_factory.mktemp("trainer-api"), "trainer-api", tp=2, extra=WEIGHT_TRANSFER)
    try:
        wait_all([server], timeout=400)
        yield server, model
    finally:
        server.stop()


def test_a_driver_of_vllms_trainer_api_switches_to_rollout_sync_by_its_init_info(served, tmp_path: Path):
    server, model = served
    with RankPool(2, env=TRAINER_ENV, timeout=600) as pool:
        pool.call(setup, DeepSpeedSpec("dense", 3), str(model))
        assert pool.call(trainer_init, server.engine.url, free_port()) == ["ready", "ready"]
        for step in (1, 2):
            versions = pool.call(step_and_send, step)
            assert versions[0] == versions[1] and server.engine.weight_version() == str(versions[0])
        pool.call(save_checkpoint, str(tmp_path / "last"), str(model))
    digests = server.engine.call("param_digests")
    server.engine.call("setup", {"first_rank": 0})
    apply_checkpoint([server.engine], str(tmp_path / "last"))
    assert server.engine.call("param_digests") == digests, "the server did not hold the trainer's weights"


def test_a_source_that_is_not_a_deepspeed_engine_is_refused_on_every_rank(tiny_model: Any):
    with RankPool(2, env=TRAINER_ENV, timeout=600) as pool:
        pool.call(setup, DeepSpeedSpec("dense", 3), str(tiny_model("dense")))
        errors = pool.call(trainer_init, "http://127.0.0.1:9", free_port(), True)
    for error in errors:
        assert error.startswith("UnsupportedLayoutError") and "ModuleSource(deepspeed_engine)" in error, error
        assert "Linear" in error, error

"""Stale storage views on real DeepSpeed engines (2 CPU ranks, ZeRO-2 and ZeRO-3), synced into a plain
receiver process (one rank that holds every logical tensor whole; no vLLM).

DeepSpeed 0.19.8's ``load_checkpoint`` copies into the low-precision and fp32 buffers in place but replaces
the Adam states (``torch.optim.Optimizer.load_state_dict``): views of ``exp_avg`` cut before the load would
send the pre-load state. The trainer hook notices the replaced buffer before the sync, re-derives the views
(same maps) and sends the loaded state. A buffer replaced so that the engine can no longer be described
under the plan's maps is refused on every rank, with a typed error on the rank that found it.

References come from DeepSpeed's own gathers (``GatheredParameters``, ``safe_get_full_optimizer_state``),
compared bit for bit with what the receiver got.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from testbed.deepspeed import DeepSpeedSpec
from testbed.rank_pool import RankContext, RankPool, free_port
from testbed.trainer_ranks import setup

pytestmark = pytest.mark.deepspeed

TOKEN = "stale-views"
STATES = ("param", "exp_avg")
TIMEOUT = 60.0
INT_VIEW = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


# ---------------------------------------------------------------------------------- trainer rank commands
def step(ctx: RankContext, seed: int) -> float:
    from testbed.deepspeed import train_step

    return train_step(ctx.state["engine"], seed=seed)


def release(ctx: RankContext) -> None:
    """Every rank releases ZeRO-3's persistent gathered parameters (a first description refuses them)."""
    ctx.state["engine"].empty_partition_cache()


def describe(ctx: RankContext, state: str) -> list[tuple[str, tuple[int, ...], str]]:
    from rollout_sync.trainer.storage import trainer_storage

    return [(m.name, m.shape, m.dtype) for m in trainer_storage(ctx.state["engine"], state).maps]


def attach(ctx: RankContext, address: str, state: str) -> int:
    from rollout_sync.trainer.hook import TrainerSync

    sync = TrainerSync.attach(
        ctx.state["engine"], address=address, engines=1, token=TOKEN, every=None, state=state, timeout=TIMEOUT
    )
    ctx.state.setdefault("syncs", {})[state] = sync
    return sync.endpoint.rank


def sync(ctx: RankContext, state: str, version: int) -> dict[str, Any]:
    s = ctx.state["syncs"][state]
    try:
        result = s.sync(version)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "tensor": getattr(exc, "tensor", None)}
    return {"version": result.version, "rederived": s.views.rederived, "check_s": s.views.check_seconds}


def reference(ctx: RankContext, state: str) -> dict[str, torch.Tensor] | None:
    """Every logical tensor of ``state`` from DeepSpeed's own gathers (collective); rank 0 returns them."""
    from tests.deepspeed.trainer_helpers import full_tensors

    full = full_tensors(ctx.state["engine"], state)
    return full if ctx.rank == 0 else None


def save(ctx: RankContext, path: str) -> None:
    ctx.state["engine"].save_checkpoint(path, tag="t")


def load(ctx: RankContext, path: str) -> None:
    ctx.state["engine"].load_checkpoint(path, tag="t")


def replace_a_parameter(ctx: RankContext, name: str, rank: int) -> None:
    """On ``rank`` only, give parameter ``name`` new memory (it no longer aliases ZeRO's flat buffer)."""
    if ctx.rank != rank:
        return
    p = dict(ctx.state["engine"].module.named_parameters())[name]
    if hasattr(p, "ds_tensor"):
        p.ds_tensor = p.ds_tensor.clone()
    else:
        p.data = p.data.clone()


# ---------------------------------------------------------------------------------- receiver commands
def connect(
    ctx: RankContext, address: str, state: str, tensors: list[tuple[str, tuple[int, ...], str]]
) -> int:
    from rollout_sync.layout.builders import replicated_map
    from rollout_sync.rollout.group_link import RolloutLink

    maps = [replicated_map(name, shape, dtype, [0]) for name, shape, dtype in tensors]
    link = RolloutLink.connect(
        address, engine=0, local_rank=0, local_size=1, maps=maps, token=TOKEN, timeout=TIMEOUT
    )
    targets = {
        name: torch.full(shape, float("nan"), dtype=getattr(torch, dtype)) for name, shape, dtype in tensors
    }
    ctx.state.setdefault("links", {})[state] = (link, targets)
    return link.rank


def receive(ctx: RankContext, state: str) -> dict[str, Any]:
    link, targets = ctx.state["links"][state]
    try:
        result = link.receive(targets)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "status": link.status()}
    return {"version": result.version, "tensors": {n: t.clone() for n, t in targets.items()}}


# ---------------------------------------------------------------------------------- checks
def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    v = INT_VIEW[a.dtype]
    return bool(torch.equal(a.contiguous().view(v), b.contiguous().view(v)))


def differing(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n in ref if n not in got or not same_bits(got[n], ref[n])) + sorted(
        set(got) - set(ref)
    )


def sync_all(
    trainer: RankPool, receiver: RankPool, state: str, version: int
) -> tuple[list[Any], dict[str, Any]]:
    pending = trainer.submit(sync, state, version)
    got = receiver.call(receive, state, timeout=TIMEOUT * 2)[0]
    return pending.result(TIMEOUT * 2), got


@pytest.mark.parametrize("stage", [2, 3])
def test_a_sync_after_load_checkpoint_sends_exactly_the_loaded_weights_and_adam_states(
    stage: int, tiny_model: Any, tmp_path: Path
):
    model = tiny_model("dense")
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    with RankPool(2, env=env, timeout=600) as trainer, RankPool(1, env=env, timeout=600) as receiver:
        trainer.call(setup, DeepSpeedSpec("dense", stage), str(model))
        trainer.call(step, 1)  # Adam states exist only after a step
        trainer.call(release)
        for state in STATES:
            tensors = trainer.call(describe, state)[0]
            address = f"tcp://127.0.0.1:{free_port()}"
            pending = trainer.submit(attach, address, state)
            receiver.call(connect, address, state, tensors, timeout=TIMEOUT * 2)
            assert pending.result(TIMEOUT * 2) == [0, 1]

        saved = {s: trainer.call(reference, s)[0] for s in STATES}
        for state in STATES:
            ranks, got = sync_all(trainer, receiver, state, 1)
            assert [r["version"] for r in ranks] == [1, 1] and got["version"] == 1, (ranks, got)
            assert differing(got["tensors"], saved[state]) == [], f"{state} after step 1"
        trainer.call(save, str(tmp_path / "ckpt"))

        trainer.call(step, 2)
        stepped = {s: trainer.call(reference, s)[0] for s in STATES}
        for state in STATES:
            assert differing(stepped[state], saved[state]), (
                f"step 2 changed no {state}: the test proves nothing"
            )
            ranks, got = sync_all(trainer, receiver, state, 2)
            assert differing(got["tensors"], stepped[state]) == [], f"{state} after step 2"
            assert [r["rederived"] for r in ranks] == [0, 0]

        trainer.call(load, str(tmp_path / "ckpt"))
        loaded = {s: trainer.call(reference, s)[0] for s in STATES}
        for state in STATES:
            assert differing(loaded[state], saved[state]) == [], f"load_checkpoint did not restore {state}"
            ranks, got = sync_all(trainer, receiver, state, 3)
            assert all("error" not in r for r in ranks) and "error" not in got, (ranks, got)
            assert got["version"] == 3
            assert differing(got["tensors"], loaded[state]) == [], f"{state} after load_checkpoint"
            # DeepSpeed 0.19.8 copies the weights into their buffers in place and replaces the Adam states.
            expected = 1 if state == "exp_avg" else 0
            assert [r["rederived"] for r in ranks] == [expected, expected], (state, ranks)

        # Unchanged buffers: the next sync only checks them (figures in the report: check_s).
        ranks, got = sync_all(trainer, receiver, "param", 4)
        assert [r["rederived"] for r in ranks] == [0, 0] and got["version"] == 4
        print(f"ZeRO-{stage}: check before a sync {max(r['check_s'] for r in ranks) * 1e6:.0f} us (param)")

        # One rank's parameter gets new memory: ZeRO's flat buffer no longer holds it, so the engine cannot be
        # described under the plan's maps. Every rank refuses the sync; nothing moves; no rank hangs.
        name = "model.layers.0.mlp.up_proj.weight"
        trainer.call(replace_a_parameter, name, 1)
        ranks, got = sync_all(trainer, receiver, "param", 5)
        assert ranks[1]["error"] == "StaleStorageError" and ranks[1]["tensor"] == name, ranks
        assert "rank 1" in ranks[1]["message"] and "re-attach" in ranks[1]["message"]
        assert ranks[0]["error"] == "PlanMismatchError" and "rank 1" in ranks[0]["message"], ranks
        assert got["error"] == "PlanMismatchError" and got["status"]["version"] == 4, got
        assert got["status"]["incomplete"]

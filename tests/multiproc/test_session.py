"""The whole sync session between processes, without engines: trainer ranks (ZeRO-3 storage built from
shapes) and rollout workers (a TP-2 engine's storage) meet through the real ZeroMQ handshake, build one
gloo group, and sync; the rollout storages then hold every element of every logical tensor."""

from __future__ import annotations

import time

import pytest
import torch

from rollout_sync.errors import PeerFailedError, SyncTimeoutError
from rollout_sync.geometry.model_maps import trainer_maps, vllm_target_maps
from rollout_sync.shapes import model_tensors
from testbed.expected_storage import extract, local_part
from testbed.rank_pool import RankError, RankPool, free_port
from tests.harness.session_model import CONFIG, TRAINERS, WORKERS, full_tensors

TOKEN = "session-test"


def side_maps():
    model = model_tensors(CONFIG)
    return trainer_maps(model, 3, TRAINERS), vllm_target_maps(model, 1, WORKERS, first_rank=TRAINERS)


def join(ctx, address: str, timeout: float, worker_device: str | None = None, drop: str | None = None):
    from rollout_sync.rollout.group_link import RolloutLink
    from rollout_sync.trainer.hook import TrainerSync

    sources, targets = side_maps()
    if ctx.rank < TRAINERS:
        full = full_tensors(seed=1)
        views = {m.name: extract(full[m.name], m, ctx.rank) for m in sources if ctx.rank in m.ranks}
        ctx.state["side"] = TrainerSync.connect(
            sources,
            views,
            rank=ctx.rank,
            world_size=TRAINERS,
            address=address,
            engines=1,
            token=TOKEN,
            timeout=timeout,
        )
        ctx.state["full"] = full
    else:
        local = ctx.rank - TRAINERS
        mine = [local_part(m, ctx.rank, local) for m in targets if ctx.rank in m.ranks and m.name != drop]
        link = RolloutLink.connect(
            address,
            engine=0,
            local_rank=local,
            local_size=WORKERS,
            maps=mine,
            token=TOKEN,
            timeout=timeout,
            device=worker_device,
        )
        ctx.state["side"] = link
        ctx.state["targets"] = {
            m.name: torch.full(m.ranks[ctx.rank].shape, float("nan"), dtype=torch.bfloat16)
            for m in targets
            if ctx.rank in m.ranks
        }
    return ctx.state["side"].endpoint.rank


def sync(ctx, version: int, seed: int):
    side = ctx.state["side"]
    if ctx.rank < TRAINERS:
        full = full_tensors(seed)
        for name, view in side.sources.items():  # new weights, written in place like an optimizer step
            m = next(m for m in side_maps()[0] if m.name == name)
            view.copy_(extract(full[name], m, ctx.rank))
        return side.sync(version).version
    return side.receive(ctx.state["targets"]).version


def coordinator_reused_its_plan(ctx):
    side = ctx.state["side"]
    return side.coordinated.reused_plan if ctx.rank == 0 else None


def check(ctx, seed: int):
    if ctx.rank < TRAINERS:
        return None
    full = full_tensors(seed)
    _, targets = side_maps()
    bad = []
    for m in targets:
        if ctx.rank in m.ranks and not torch.equal(
            ctx.state["targets"][m.name], extract(full[m.name], m, ctx.rank)
        ):
            bad.append(m.name)
    return bad


def status(ctx):
    side = ctx.state["side"]
    return side.status() if ctx.rank >= TRAINERS else None


def die(ctx):
    import os

    os._exit(3)


@pytest.fixture
def pool():
    with RankPool(TRAINERS + WORKERS, env={"OMP_NUM_THREADS": "1"}, timeout=120) as p:
        yield p


def test_trainer_and_rollout_ranks_sync_every_element_and_agree_on_the_version(pool):
    address = f"tcp://127.0.0.1:{free_port()}"
    assert pool.call(join, address, 60) == [0, 1, 2, 3]
    assert pool.call(sync, 7, 1) == [7, 7, 7, 7]
    assert pool.call(check, 1)[TRAINERS:] == [[], []]
    assert pool.call(sync, 8, 2) == [8, 8, 8, 8]
    assert pool.call(check, 2)[TRAINERS:] == [[], []]
    assert [s["version"] for s in pool.call(status)[TRAINERS:]] == [8, 8]
    # A new handshake with the same layout (a reconnect) reuses the plan, and the new group syncs.
    assert pool.call(join, f"tcp://127.0.0.1:{free_port()}", 60) == [0, 1, 2, 3]
    assert pool.call(coordinator_reused_its_plan)[0] is True
    assert pool.call(sync, 9, 3) == [9, 9, 9, 9]
    assert pool.call(check, 3)[TRAINERS:] == [[], []]


def join_refused(ctx, address: str, worker_device: str):
    start = time.monotonic()
    try:
        join(ctx, address, 30, worker_device if ctx.rank == TRAINERS + 1 else None)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return ("joined",)


def test_a_backend_that_cannot_carry_a_worker_s_device_is_refused_at_the_handshake_on_every_rank(pool):
    """gloo handed CUDA tensors would send raw device pointers: the coordinator refuses before any group
    is built, naming the worker, its device and the backend that would carry it."""
    results = pool.call(join_refused, f"tcp://127.0.0.1:{free_port()}", "cuda")
    assert results[0][0] == "BackendDeviceError", results[0]
    for kind, message, elapsed in results:
        assert kind in ("BackendDeviceError", "HandshakeError"), (kind, message)
        assert "engine 0 worker 1 holds cuda storages" in message and "'nccl'" in message, message
        assert elapsed < 20, elapsed


def join_with_a_hole(ctx, address: str, tensor: str):
    start = time.monotonic()
    try:
        join(ctx, address, 30, drop=tensor if ctx.rank == TRAINERS + 1 else None)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return ("joined",)


def test_an_engine_that_leaves_elements_of_a_tensor_uncovered_is_refused_on_every_rank(pool):
    """Worker 1 describes no storage for the embedding (a missing TP rank): its rows [512, 1000) would stay
    stale. The coordinator refuses before any group is built, naming the engine, the tensor and the first
    uncovered position, and every rank hears why."""
    results = pool.call(join_with_a_hole, f"tcp://127.0.0.1:{free_port()}", "model.embed_tokens.weight")
    assert results[0][0] == "HoleError", results[0]
    for kind, message, elapsed in results:
        assert kind in ("HoleError", "HandshakeError"), (kind, message)
        assert "engine 0 does not hold every element: first uncovered position [512, 0]" in message, message
        assert "'model.embed_tokens.weight'" in message, message
        assert elapsed < 20, elapsed


def only_rollout_receives(ctx, timeout_expected: float):
    """Rollout ranks start receiving; trainer rank 1 dies instead of sending."""
    if ctx.rank == 1:
        import os

        os._exit(3)
    if ctx.rank == 0:
        return "trainer 0 idle"
    start = time.monotonic()
    try:
        ctx.state["side"].receive(ctx.state["targets"])
    except (PeerFailedError, SyncTimeoutError) as exc:
        return ("raised", type(exc).__name__, time.monotonic() - start, ctx.state["side"].status())
    return ("no error",)


def gloo_event_loops(ctx) -> int:
    """Threads of this process running a gloo device's event loop (one per live gloo group here)."""
    import os

    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue  # the thread ended meanwhile
    return sum(name.startswith("gloo_tcp") for name in names)


def sync_while_trainer_1_dies(ctx):
    """Trainer rank 1 dies instead of sending; every other rank syncs, fails, and reports its error and
    how many gloo event loops it still runs."""
    if ctx.rank == 1:
        die(ctx)
    try:
        sync(ctx, 2, 2)
    except (PeerFailedError, SyncTimeoutError) as exc:
        return type(exc).__name__, gloo_event_loops(ctx)
    return "no error", gloo_event_loops(ctx)


def test_a_failed_sync_destroys_the_sync_group_on_every_surviving_rank(pool):
    """After a failed sync no rank keeps the group's connections: gloo's ``shutdown`` alone leaves them
    open, and a late message for a receive nobody waits for any more then spins gloo's event loop on a
    core for as long as the group lives (seen in a vLLM worker, starving the engine's next call)."""
    assert pool.call(gloo_event_loops) == [0, 0, 0, 0]
    pool.call(join, f"tcp://127.0.0.1:{free_port()}", 8)
    assert pool.call(gloo_event_loops) == [1, 1, 1, 1]  # the sync group's
    pool.call(sync, 1, 1)
    pending = pool.submit(sync_while_trainer_1_dies)
    with pytest.raises(RankError, match="rank 1 died"):
        pending.result(timeout=60)
    for r in (0, 2, 3):
        error, loops = pending._results[r]
        assert error in ("PeerFailedError", "SyncTimeoutError"), pending._results[r]
        assert loops == 0, f"rank {r} still runs {loops} gloo event loop(s) after the failed sync"


def test_a_trainer_rank_dying_mid_sync_makes_every_worker_raise_in_time_without_claiming_the_version(pool):
    address = f"tcp://127.0.0.1:{free_port()}"
    pool.call(join, address, 8)
    pool.call(sync, 1, 1)
    pending = pool.submit(only_rollout_receives, 8)
    with pytest.raises(RankError, match="rank 1 died"):
        pending.result(timeout=60)
    outcomes = pending._results
    for r in (2, 3):
        kind, error, seconds, state = outcomes[r]
        assert kind == "raised" and error in ("PeerFailedError", "SyncTimeoutError"), outcomes[r]
        assert seconds < 30
        assert state["version"] == 1 and state["incomplete"] is True

"""Ranks that share a process (TRL's colocate mode): four ranks run as four threads of this process over
gloo, ranks 0 and 2 share one mailbox, ranks 1 and 3 another. Segments between ranks of one process are
handoffs (copied straight from the peer's source storage, no message, no staging); the others still go over
gloo. Random planner plans are checked bit for bit, and a receiver that fails fails its in-process senders at once, not at the timeout."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_executor_layouts import (
    bitwise_equal,
    expected_buffers,
    random_scenario,
    source_storages,
    target_buffers,
)

from rollout_sync.errors import PeerFailedError
from rollout_sync.transport import ExecuteOptions, Executor
from rollout_sync.transport.core.groups import connect_store, new_group
from rollout_sync.transport.core.in_process import InProcess

WORLD = 4
PROCESS_OF = {0: "a", 1: "b", 2: "a", 3: "b"}


def _on_threads(fn: Callable[[int, Executor], Any], timeout: float = 120) -> list[Any]:
    """``fn(rank, executor)`` on ``WORLD`` threads, one gloo group each; ranks with the same
    ``PROCESS_OF`` share a mailbox. Returns the results in rank order; re-raises the first failure."""
    master = connect_store("127.0.0.1", 0, WORLD, is_master=True, timeout=30)
    group_id = secrets.token_hex(8)
    results: list[Any] = [None] * WORLD
    errors: list[BaseException | None] = [None] * WORLD

    def run(rank: int) -> None:
        try:
            # one store client per thread: a client blocks while it waits for a key
            store = connect_store("127.0.0.1", master.port, WORLD, is_master=False, timeout=30)
            group = new_group(store, rank, WORLD, timeout=30, prefix="handoff")
            peers = frozenset(r for r in range(WORLD) if r != rank and PROCESS_OF[r] == PROCESS_OF[rank])
            local = InProcess(group_id, rank, peers)
            results[rank] = fn(
                rank, Executor(group, ExecuteOptions(staging_cap_bytes=4096, timeout=20), local)
            )
        except BaseException as e:  # handed to the test thread
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    results.append(errors)
    return results


@pytest.mark.parametrize("seed", [11, 12, 13, 14, 15])
def test_random_plans_are_exact_and_pairs_in_one_process_exchange_no_message(seed: int) -> None:
    sc = random_scenario(seed, WORLD)
    plan = sc.plan()

    def sync(rank: int, executor: Executor) -> dict[str, Any]:
        half = plan.half(rank)
        sources = source_storages(sc, rank)
        out = {}
        for _ in range(2):  # the second sync reuses the schedule
            buffers, targets = target_buffers(sc, rank)
            stats = executor.execute(half, sources, targets)
            expected = expected_buffers(sc, rank)
            out["wrong"] = sorted(n for n in expected if not bitwise_equal(expected[n], buffers[n]))
        out["peers"] = {*stats.bytes_sent, *stats.bytes_received}
        out["handed"] = sum(s.numel for s in half.receives if PROCESS_OF[s.source_rank] == PROCESS_OF[rank])
        out["local_elements"] = sum(s.numel for s in half.local)
        out["local_bytes"] = stats.local_bytes
        return out

    *results, errors = _on_threads(sync)
    assert errors == [None] * WORLD, errors
    for rank, r in enumerate(results):
        assert r["wrong"] == [], f"rank {rank}: wrong target elements in {r['wrong']}"
        assert all(PROCESS_OF[p] != PROCESS_OF[rank] for p in r["peers"]), (rank, r["peers"])
        if r["handed"]:
            assert r["local_bytes"] > 0


def test_a_receiver_that_fails_fails_its_in_process_senders_at_once() -> None:
    sc = random_scenario(21, WORLD)
    plan = sc.plan()
    handed = {
        (s.source_rank, s.target_rank)
        for r in range(WORLD)
        for s in plan.half(r).receives
        if PROCESS_OF[s.source_rank] == PROCESS_OF[s.target_rank]
    }
    assert handed, "the scenario has no pair in one process"
    receiver = min(t for _, t in handed)

    class Broken(dict):
        def __getitem__(self, key: str) -> torch.Tensor:
            raise KeyError(f"no storage {key!r} here")

    def sync(rank: int, executor: Executor) -> None:
        sources = source_storages(sc, rank)
        _, targets = target_buffers(sc, rank)
        if rank == receiver:  # a target mapping that passes the check, then fails while copying
            targets = Broken(targets)
            executor._check = lambda *a, **k: (None, torch.device("cpu"), 4096)  # type: ignore[method-assign]
        executor.execute(plan.half(rank), sources, targets)

    started = time.monotonic()
    *_, errors = _on_threads(sync)
    assert time.monotonic() - started < 15, "a sender waited for the timeout (20 s)"
    assert errors[receiver] is not None
    for source, target in handed:
        if target == receiver:
            assert isinstance(errors[source], PeerFailedError), errors[source]
            assert f"rank {receiver} failed" in str(errors[source]), errors[source]
            assert "no storage" in str(errors[source])

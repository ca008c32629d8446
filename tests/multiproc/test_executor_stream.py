"""Streamed targets over gloo: every target given to the executor as a meta placeholder and made by a
``TargetStream`` when its first part arrives (what a rollout worker does for a layer vLLM keeps in another
form). Random planner plans on 2 and 4 ranks, under several staging caps: every target is opened once and
closed once, and holds all of its elements (bit for bit against the oracle) when it is closed. A meta
placeholder without a stream is refused at the agreement."""

from __future__ import annotations

import pytest
import torch
from test_executor_layouts import (
    bitwise_equal,
    expected_buffers,
    random_scenario,
    source_storages,
    target_buffers,
)

from rollout_sync.errors import PlanMismatchError
from rollout_sync.transport import ExecuteOptions, Executor
from tests.harness.ranks import run_on_ranks

OPTIONS = (
    ExecuteOptions(timeout=30),
    ExecuteOptions(staging_cap_bytes=4096, timeout=30),
    ExecuteOptions(staging_cap_bytes=1024, timeout=30, overlap=False),
)


class _Recorder:
    """Hands out the poisoned target storages on ``open``; checks each against the oracle on ``close``."""

    def __init__(self, storages, buffers, expected) -> None:
        self.storages, self.buffers, self.expected = storages, buffers, expected
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.incomplete: list[str] = []

    def open(self, name: str) -> torch.Tensor:
        self.opened.append(name)
        return self.storages[name]

    def close(self, name: str) -> None:
        self.closed.append(name)
        if not bitwise_equal(self.expected[name], self.buffers[name]):
            self.incomplete.append(name)


def _streamed(rank: int, world: int, group, seeds: list[int]) -> list[dict]:
    out = []
    for seed in seeds:
        sc = random_scenario(seed, world)
        half = sc.plan().half(rank)
        sources = source_storages(sc, rank)
        for options in OPTIONS:
            executor = Executor(group, options)
            for _ in range(2):  # the program is cached: the second sync streams the same way
                buffers, storages = target_buffers(sc, rank)
                expected = expected_buffers(sc, rank)
                stream = _Recorder(storages, buffers, expected)
                placeholders = {
                    n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in storages.items()
                }
                executor.execute(half, sources, placeholders, stream=stream)
                wrong = sorted(n for n in expected if not bitwise_equal(expected[n], buffers[n]))
                received = sorted({half.tensors[s.tensor].name for s in (*half.receives, *half.local)})
                out.append(
                    {
                        "wrong": wrong,
                        "opened": sorted(stream.opened),
                        "closed": sorted(stream.closed),
                        "received": received,
                        "incomplete": stream.incomplete,
                    }
                )
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_streamed_targets_are_made_at_their_first_part_and_closed_complete_after_their_last(world: int):
    results = run_on_ranks(_streamed, world, [world * 10 + k for k in range(3)], timeout=300)
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            assert r["wrong"] == [], f"rank {rank}"
            assert r["opened"] == r["received"] == r["closed"], f"rank {rank}: each once, every received one"
            assert r["incomplete"] == [], f"rank {rank}: closed before every element landed"


def _placeholder_without_stream(rank: int, world: int, group) -> str:
    sc = random_scenario(3, world)
    half = sc.plan().half(rank)
    _, storages = target_buffers(sc, rank)
    targets = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in storages.items()}
    try:
        Executor(group, ExecuteOptions(timeout=30)).execute(half, source_storages(sc, rank), targets)
    except PlanMismatchError as e:
        return str(e)
    return "no error"


def test_a_placeholder_target_without_a_stream_is_refused_on_every_rank_before_any_byte_moves():
    for message in run_on_ranks(_placeholder_without_stream, 2, timeout=120):
        assert "placeholder and no stream makes it" in message

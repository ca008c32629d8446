"""Streamed targets over gloo: every target given to the executor as a meta placeholder and made by a
``TargetStream`` when its first part arrives (what a rollout worker does for a layer vLLM keeps in another
form). Random planner plans on 2 and 4 ranks, under several staging caps: every target is opened once and
closed once, and holds all of its elements (bit for bit against the oracle) when it is closed. Targets
reached by direct messages never hold more than the staging cap at once (or one target, when one is larger).
The staging arena of a rank with streamed targets leaves room in the cap for one of them open and for what
closing it may allocate. Where two senders each send half of the same targets in a round (ZeRO-3 partitions,
balanced replicas), the receiver closes each before it opens the next. A meta placeholder without a stream is
refused at the agreement."""

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
from rollout_sync.layout.box import Box
from rollout_sync.layout.maps import Piece, RankStorage, TensorMap
from rollout_sync.planning.planner import plan_model
from rollout_sync.transport import ExecuteOptions, Executor
from tests.harness.ranks import run_on_ranks

OPTIONS = (
    ExecuteOptions(timeout=30),
    ExecuteOptions(staging_cap_bytes=4096, timeout=30),
    ExecuteOptions(staging_cap_bytes=1024, timeout=30, overlap=False),
)


class _Recorder:
    """Hands out the poisoned target storages on ``open``; checks each against the oracle on ``close``."""

    def __init__(self, storages, buffers, expected, reserve: int = 0, watch: bool = False) -> None:
        self.storages, self.buffers, self.expected = storages, buffers, expected
        self.reserve = reserve
        self.watch = watch  # given targets: told when their last part landed
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.incomplete: list[str] = []
        self.held: dict[str, int] = {}
        self.peak_held = 0

    def open(self, name: str) -> torch.Tensor:
        self.opened.append(name)
        t = self.storages[name]
        self.held[name] = t.numel() * t.element_size()
        self.peak_held = max(self.peak_held, sum(self.held.values()))
        return t

    def held_bytes(self) -> int:
        return sum(self.held.values())

    def reserve_bytes(self) -> int:
        return self.reserve

    def room_bytes(self) -> int:  # one target made (at most ``reserve``) and what closing it allocates
        return 2 * self.reserve

    def adds_bytes(self, name: str) -> int:
        t = self.storages[name]
        return 0 if name in self.held else t.numel() * t.element_size()

    def watches(self, name: str) -> bool:
        return self.watch

    def close(self, name: str) -> None:
        self.closed.append(name)
        self.held.pop(name, None)
        if not bitwise_equal(self.expected[name], self.buffers[name]):
            self.incomplete.append(name)


def _streamed(rank: int, world: int, group, seeds: list[int], watched: bool = False) -> list[dict]:
    """Each sync's targets are given as placeholders that the stream makes, or (``watched``) as the storages
    themselves, which the stream watches: either way it must close each after its last part."""
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
                stream = _Recorder(storages, buffers, expected, watch=watched)
                if watched:
                    given = dict(storages)
                    stream.opened = sorted(given)  # given: never made by the stream
                else:
                    given = {
                        n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in storages.items()
                    }
                executor.execute(half, sources, given, stream=stream)
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
@pytest.mark.parametrize("watched", [False, True], ids=["streamed", "watched"])
def test_streamed_targets_are_made_at_their_first_part_and_closed_complete_after_their_last(
    world: int, watched: bool
):
    results = run_on_ranks(_streamed, world, [world * 10 + k for k in range(3)], watched, timeout=300)
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


def _whole(name: str, n: int, rank: int) -> TensorMap:
    return TensorMap(
        name, (n,), "float32", {rank: RankStorage((n,), (Piece(Box((0,), (n,)), 0, (1,), (rank,)),))}
    )


def _bounded(rank: int, world: int, group, cap: int) -> dict:
    """Rank 0 sends 24 tensors of 256 KiB, each one direct message, to rank 1, which streams them."""
    n = 1 << 16
    names = [f"t{i:02d}" for i in range(24)]
    plan = plan_model([_whole(x, n, 0) for x in names], [_whole(x, n, 1) for x in names])
    half = plan.half(rank)
    executor = Executor(group, ExecuteOptions(staging_cap_bytes=cap, timeout=30))
    if rank == 0:
        sources = {x: torch.full((n,), float(i)) for i, x in enumerate(names)}
        executor.execute(half, sources, {})
        return {}
    storages = {x: torch.full((n,), float("nan")) for x in names}
    expected = {x: torch.full((n,), float(i)) for i, x in enumerate(names)}
    stream = _Recorder(storages, storages, expected)
    executor.execute(half, {}, {x: torch.empty((n,), device="meta") for x in names}, stream=stream)
    return {"peak": stream.peak_held, "incomplete": stream.incomplete, "closed": len(stream.closed)}


@pytest.mark.parametrize("tensors_in_cap", [1, 3])
def test_streamed_direct_messages_hold_at_most_the_cap_or_one_target(tensors_in_cap: int):
    size = (1 << 16) * 4
    _, got = run_on_ranks(_bounded, 2, tensors_in_cap * size, timeout=120)
    assert got["incomplete"] == [] and got["closed"] == 24
    assert got["peak"] == tensors_in_cap * size, got  # never more, and the window is used


def _transposed(rank: int, world: int, group, cap: int, reserve: int) -> dict:
    """Rank 0 sends 32 tensors [128, 128] float32 (2 MiB); rank 1 stores each transposed (packed messages through its
    staging arena) and streams them, with ``reserve`` bytes asked for closing one."""
    n = 128
    names = [f"t{i}" for i in range(32)]

    def whole(name: str, r: int, strides: tuple[int, int]) -> TensorMap:
        piece = Piece(Box((0, 0), (n, n)), 0, strides, (r,))
        return TensorMap(name, (n, n), "float32", {r: RankStorage((n, n), (piece,))})

    plan = plan_model([whole(x, 0, (n, 1)) for x in names], [whole(x, 1, (1, n)) for x in names])
    half = plan.half(rank)
    executor = Executor(group, ExecuteOptions(staging_cap_bytes=cap, timeout=30))
    full = {x: torch.arange(n * n, dtype=torch.float32).view(n, n) + i for i, x in enumerate(names)}
    if rank == 0:
        stats = executor.execute(half, full, {})
        return {"arena": stats.peak_staging_bytes}
    storages = {x: torch.full((n, n), float("nan")) for x in names}
    expected = {x: full[x].t().contiguous() for x in names}
    stream = _Recorder(storages, storages, expected, reserve)
    placeholders = {x: torch.empty((n, n), device="meta") for x in names}
    stats = executor.execute(half, {}, placeholders, stream=stream)
    wrong = [x for x in names if not torch.equal(storages[x], expected[x])]
    return {"arena": stats.peak_staging_bytes, "wrong": wrong, "incomplete": stream.incomplete}


def test_the_staging_arena_of_a_streaming_rank_leaves_room_for_one_target_and_its_closing():
    cap, target = 1 << 20, 128 * 128 * 4
    for reserve in (0, target):
        sender, receiver = run_on_ranks(_transposed, 2, cap, reserve, timeout=120)
        assert receiver["wrong"] == [] and receiver["incomplete"] == [], receiver
        assert 0 < receiver["arena"] <= cap - 2 * reserve, (reserve, receiver)
        assert sender["arena"] > 0
    # a reserve that leaves the slots too little: they take the whole cap, the stream comes on top
    _, receiver = run_on_ranks(_transposed, 2, cap, cap, timeout=120)
    assert receiver["wrong"] == [] and 0 < receiver["arena"] <= cap, receiver


class _OpenCounter(_Recorder):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peak_open = 0

    def open(self, name: str) -> torch.Tensor:
        t = super().open(name)
        self.peak_open = max(self.peak_open, len(self.held))
        return t


def _halves(rank: int, world: int, group, cap: int) -> dict:
    """Ranks 0 and 1 each hold half the rows of 16 tensors [128, 128] float32 (as ZeRO-3 partitions or
    balanced replicas split them); rank 2 stores each transposed (packed messages from both) and streams
    them."""
    n, half_rows = 128, 64
    names = [f"t{i:02d}" for i in range(16)]

    def sources(name: str) -> TensorMap:
        storages = {
            r: RankStorage((half_rows, n), (Piece(Box((r * half_rows, 0), (half_rows, n)), 0, (n, 1), (r,)),))
            for r in (0, 1)
        }
        return TensorMap(name, (n, n), "float32", storages)

    def target(name: str) -> TensorMap:
        piece = Piece(Box((0, 0), (n, n)), 0, (1, n), (2,))
        return TensorMap(name, (n, n), "float32", {2: RankStorage((n, n), (piece,))})

    plan = plan_model([sources(x) for x in names], [target(x) for x in names])
    half = plan.half(rank)
    executor = Executor(group, ExecuteOptions(staging_cap_bytes=cap, timeout=30))
    full = {x: torch.arange(n * n, dtype=torch.float32).view(n, n) + i for i, x in enumerate(names)}
    if rank < 2:
        rows = slice(rank * half_rows, (rank + 1) * half_rows)
        executor.execute(half, {x: full[x][rows].contiguous() for x in names}, {})
        return {}
    storages = {x: torch.full((n, n), float("nan")) for x in names}
    expected = {x: full[x].t().contiguous() for x in names}
    stream = _OpenCounter(storages, storages, expected)
    placeholders = {x: torch.empty((n, n), device="meta") for x in names}
    stats = executor.execute(half, {}, placeholders, stream=stream)
    wrong = [x for x in names if not torch.equal(storages[x], expected[x])]
    return {
        "wrong": wrong,
        "incomplete": stream.incomplete,
        "peak_open": stream.peak_open,
        "rounds": stats.rounds,
    }


def test_a_round_from_peers_holding_halves_of_the_same_targets_closes_each_before_opening_the_next():
    # 1 MiB of staging: each round's message from each sender carries the halves of several tensors
    _, _, receiver = run_on_ranks(_halves, 3, 1 << 20, timeout=120)
    assert receiver["wrong"] == [] and receiver["incomplete"] == [], receiver
    assert receiver["rounds"] >= 2, receiver
    assert receiver["peak_open"] == 1, receiver  # unpacked message by message, it would open all of them

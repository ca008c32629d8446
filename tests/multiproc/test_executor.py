"""The executor over gloo on 2–6 CPU ranks (one process each): random planner plans into NaN-poisoned
targets checked bit for bit against an oracle, disjoint senders and receivers, a rank that sends, receives
and copies within itself, caps smaller than a segment, flat runs of millions of elements, dtype casts, and
failures (another plan, a wrong storage, a killed rank, a rank that never joins) that every rank reports
within the timeout."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from math import ceil, prod

import pytest
import torch
from test_executor_layouts import (
    bitwise_equal,
    expected_buffers,
    random_scenario,
    side_map,
    source_storages,
    target_buffers,
)

from rollout_sync.errors import PeerFailedError, PlanMismatchError, SyncTimeoutError
from rollout_sync.planning.planner import plan_model
from rollout_sync.transport import ExecuteOptions, Executor, SyncStats
from tests.harness.ranks import run_on_ranks


def _check_scenario(rank: int, group, seed: int, world: int, options: ExecuteOptions, syncs: int = 2) -> dict:
    """Run one random scenario ``syncs`` times with one executor; return what the parent asserts on."""
    sc = random_scenario(seed, world)
    half = sc.plan().half(rank)
    sources = source_storages(sc, rank)
    before = {k: v.clone() for k, v in sources.items()}
    executor = Executor(group, options)
    stats: list[SyncStats] = []
    for _ in range(syncs):
        buffers, targets = target_buffers(sc, rank)  # fresh poison every sync
        stats.append(executor.execute(half, sources, targets))
        expected = expected_buffers(sc, rank)
        wrong = sorted(name for name in expected if not bitwise_equal(expected[name], buffers[name]))
        assert not wrong, f"seed {seed} rank {rank}: wrong target elements in {wrong}"
    assert all(bitwise_equal(before[k], sources[k]) for k in sources), "a source storage changed"
    return {
        "peak": max(s.peak_staging_bytes for s in stats),
        "cap": options.staging_cap_bytes,
        "allocations": executor.arena.allocations,
        "sent": stats[-1].bytes_sent,
        "received": stats[-1].bytes_received,
        "local": stats[-1].local_bytes,
        "rounds": stats[-1].rounds,
    }


OPTION_SETS = (
    ExecuteOptions(timeout=30),
    ExecuteOptions(staging_cap_bytes=2048, timeout=30, zero_copy=False),
    ExecuteOptions(staging_cap_bytes=1024, timeout=30, overlap=False),
)


def _random_plans(rank: int, world: int, group, seeds: list[int]) -> list[dict]:
    out = []
    for seed in seeds:
        for options in OPTION_SETS:
            out.append(_check_scenario(rank, group, seed, world, options))
    return out


@pytest.mark.parametrize("world", [2, 4, 6])
def test_random_planner_plans_fill_every_target_with_its_oracle_and_change_nothing_else(world: int) -> None:
    seeds = [world * 100 + k for k in range(4)]
    results = run_on_ranks(_random_plans, world, seeds, timeout=400)
    for per_rank in results:
        for r in per_rank:
            assert r["peak"] <= r["cap"]
            assert r["allocations"] <= 1  # one arena, reused by the second sync
    # Every byte a rank sends to a peer is a byte that peer receives from it.
    for k in range(len(results[0])):
        for rank in range(world):
            for peer, n in results[rank][k]["sent"].items():
                assert results[peer][k]["received"][rank] == n


# -- disjoint senders and receivers: trainer ZeRO-3 over 2 ranks -> vLLM TP-2 over 2 other ranks ---------


def _tiny_qwen3_maps():
    from rollout_sync.geometry import trainer_maps, vllm_target_maps
    from rollout_sync.shapes import model_tensors

    config = {
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "vocab_size": 500,
        "tie_word_embeddings": False,
        "attention_bias": False,
    }
    model = model_tensors(config)
    sources = trainer_maps(model, zero_stage=3, dp=2, dtype="float32")
    targets = vllm_target_maps(model, engines=1, tp=2, first_rank=2, dtype="bfloat16")
    return sources, targets


def _zero3_to_tp2(rank: int, world: int, group) -> dict:
    sources_maps, target_maps = _tiny_qwen3_maps()
    plan = plan_model(sources_maps, target_maps)
    values = {}
    g = torch.Generator().manual_seed(7)
    for m in sources_maps:
        values[m.name] = torch.randn(m.shape, generator=g, dtype=torch.float64)
    sources, targets, expected = {}, {}, {}
    for m in sources_maps:
        if rank in m.ranks:
            st = torch.empty(m.ranks[rank].shape, dtype=getattr(torch, m.dtype))
            for p in m.ranks[rank].pieces:
                box = tuple(slice(o, o + e) for o, e in zip(p.box.origin, p.box.extent, strict=True))
                torch.as_strided(st, p.box.extent, p.strides, p.offset).copy_(values[m.name][box])
            sources[m.name] = st
    src_dtype = {m.name: getattr(torch, m.dtype) for m in sources_maps}
    for m in target_maps:
        if rank in m.ranks:
            targets[m.name] = torch.full(m.ranks[rank].shape, float("nan"), dtype=getattr(torch, m.dtype))
            exp = torch.full(m.ranks[rank].shape, float("nan"), dtype=getattr(torch, m.dtype))
            for p in m.ranks[rank].pieces:
                box = tuple(slice(o, o + e) for o, e in zip(p.box.origin, p.box.extent, strict=True))
                v = values[m.name][box].to(src_dtype[m.name]).to(exp.dtype)
                torch.as_strided(exp, p.box.extent, p.strides, p.offset).copy_(v)
            expected[m.name] = exp
    stats = Executor(group, ExecuteOptions(staging_cap_bytes=64 << 10, timeout=30)).execute(
        plan.half(rank), sources, targets
    )
    wrong = sorted(n for n in expected if not bitwise_equal(expected[n], targets[n]))
    assert not wrong, f"rank {rank}: wrong {wrong}"
    return {"sent": stats.bytes_sent, "received": stats.bytes_received, "local": stats.local_bytes}


def test_trainer_ranks_only_send_and_rollout_ranks_only_receive_when_the_sets_are_disjoint() -> None:
    results = run_on_ranks(_zero3_to_tp2, 4, timeout=300)
    for rank in (0, 1):
        assert results[rank]["received"] == {} and results[rank]["local"] == 0
        assert set(results[rank]["sent"]) == {2, 3}
    for rank in (2, 3):
        assert results[rank]["sent"] == {} and results[rank]["local"] == 0
        assert set(results[rank]["received"]) == {0, 1}


# -- one rank sends, receives and copies within itself -------------------------------------------------


def test_a_rank_that_is_source_and_target_sends_receives_and_copies_within_itself() -> None:
    def scenario_uses_middle_rank() -> None:
        sc = random_scenario(11, 3, tensors=5, source_ranks=[0, 1], target_ranks=[1, 2])
        half = sc.plan().half(1)
        assert half.sends and half.receives and half.local

    scenario_uses_middle_rank()
    results = run_on_ranks(_check_middle, 3, timeout=200)
    middle = results[1]
    assert middle["sent"] and middle["received"] and middle["local"] > 0


def _check_middle(rank: int, world: int, group) -> dict:
    # The scenario of test_a_rank_that_is_source_and_target...: seed 11, sources on 0-1, targets on 1-2.
    from test_executor_layouts import random_scenario as scenario

    sc = scenario(11, world, tensors=5, source_ranks=[0, 1], target_ranks=[1, 2])
    half = sc.plan().half(rank)
    sources = source_storages(sc, rank)
    buffers, targets = target_buffers(sc, rank)
    stats = Executor(group, ExecuteOptions(staging_cap_bytes=4096, timeout=30)).execute(
        half, sources, targets
    )
    expected = expected_buffers(sc, rank)
    assert all(bitwise_equal(expected[n], buffers[n]) for n in expected)
    return {"sent": stats.bytes_sent, "received": stats.bytes_received, "local": stats.local_bytes}


# -- caps smaller than a segment, and flat runs of millions of elements ---------------------------------


def _one_tensor(
    rank: int,
    world: int,
    group,
    shape: tuple[int, ...],
    src_family: str,
    tgt_family: str,
    dtypes: tuple[str, str],
    options,
) -> dict:
    import random as _random

    rng = _random.Random(5)
    name = "big.weight"
    src = side_map(name, shape, dtypes[0], src_family, [0], rng)
    tgt = side_map(name, shape, dtypes[1], tgt_family, [1], rng)
    plan = plan_model([src], [tgt])
    g = torch.Generator().manual_seed(3)
    full = torch.randn(shape, generator=g, dtype=torch.float64)
    sources, targets = {}, {}
    if rank == 0:
        st = torch.empty(src.ranks[0].shape, dtype=getattr(torch, dtypes[0]))
        for p in src.ranks[0].pieces:
            box = tuple(slice(o, o + e) for o, e in zip(p.box.origin, p.box.extent, strict=True))
            torch.as_strided(st, p.box.extent, p.strides, p.offset).copy_(full[box])
        sources[name] = st
    else:
        targets[name] = torch.full(tgt.ranks[1].shape, float("nan"), dtype=getattr(torch, dtypes[1]))
    stats = Executor(group, options).execute(plan.half(rank), sources, targets)
    if rank == 1:
        (p,) = tgt.ranks[1].pieces
        got = torch.as_strided(targets[name], p.box.extent, p.strides, p.offset)
        want = full.to(getattr(torch, dtypes[0])).to(getattr(torch, dtypes[1]))
        assert bitwise_equal(got.contiguous(), want)
    return {"rounds": stats.rounds, "peak": stats.peak_staging_bytes, "bytes": sum(stats.bytes_sent.values())}


def test_a_segment_larger_than_the_cap_is_split_by_bytes_into_bounded_rounds() -> None:
    # 40 x 24 float32 stored transposed on the target: one strided segment of 3,840 bytes; a 256-byte cap
    # leaves 128-byte messages (one peer, two slots).
    opts = ExecuteOptions(staging_cap_bytes=256, timeout=30)
    results = run_on_ranks(
        _one_tensor, 2, (40, 24), "rows", "transposed", ("float32", "float32"), opts, timeout=200
    )
    assert results[0]["peak"] <= 256 and results[1]["peak"] <= 256
    assert results[0]["bytes"] == 40 * 24 * 4
    assert ceil(3840 / 128) <= results[0]["rounds"] <= ceil(3840 / 128) + 2


def _flat_runs(rank: int, world: int, group) -> list[dict]:
    out = []
    n = 2_000_000
    cap = 1 << 20
    for zero_copy, families in (
        (False, ("flat", "rows")),
        (True, ("flat", "rows")),
        (False, ("flat", "flat")),
    ):
        opts = ExecuteOptions(staging_cap_bytes=cap, timeout=60, zero_copy=zero_copy)
        out.append(_one_tensor(rank, world, group, (n,), *families, ("bfloat16", "bfloat16"), opts))
    # a 2-D tensor of 2M elements split by columns: strided on the target side, packed through staging
    opts = ExecuteOptions(staging_cap_bytes=cap, timeout=60)
    out.append(_one_tensor(rank, world, group, (1000, 2000), "flat", "cols", ("bfloat16", "bfloat16"), opts))
    return out


def test_a_flat_run_of_millions_of_elements_takes_rounds_in_proportion_to_its_bytes_not_its_elements() -> (
    None
):
    results = run_on_ranks(_flat_runs, 2, timeout=300)
    message = (1 << 20) // 2  # one peer, two slots
    for sender, receiver in zip(results[0], results[1], strict=True):
        assert sender["bytes"] == 4_000_000
        assert sender["rounds"] == receiver["rounds"] <= ceil(4_000_000 / message) + 1
        assert sender["peak"] <= 1 << 20 and receiver["peak"] <= 1 << 20


# -- dtype casts ---------------------------------------------------------------------------------------


def _casts(rank: int, world: int, group) -> list[str]:
    """fp32 -> bf16, bf16 -> fp32, fp32 -> fp16, fp16 -> bf16 with values across the whole range (large,
    tiny, subnormal, signed zeros, infinities)."""
    import random as _random

    failures = []
    g = torch.Generator().manual_seed(1)
    for src_dt, tgt_dt in (
        ("float32", "bfloat16"),
        ("bfloat16", "float32"),
        ("float32", "float16"),
        ("float16", "bfloat16"),
    ):
        shape = (64, 33)
        rng = _random.Random(2)
        src = side_map("w", shape, src_dt, "rows", [0], rng)
        tgt = side_map("w", shape, tgt_dt, "cols", [1], rng)
        plan = plan_model([src], [tgt])
        values = torch.randn(shape, generator=g, dtype=torch.float64) * torch.pow(
            10.0, torch.randint(-45, 39, shape, generator=g).double()
        )
        values.view(-1)[:4] = torch.tensor([0.0, -0.0, float("inf"), float("-inf")], dtype=torch.float64)
        source_values = values.to(getattr(torch, src_dt))
        sources = {"w": source_values.clone()} if rank == 0 else {}
        targets = {} if rank == 0 else {"w": torch.full(shape, float("nan"), dtype=getattr(torch, tgt_dt))}
        Executor(group, ExecuteOptions(timeout=30)).execute(plan.half(rank), sources, targets)
        if rank == 1 and not bitwise_equal(targets["w"], source_values.to(getattr(torch, tgt_dt))):
            failures.append(f"{src_dt} -> {tgt_dt}")
    return failures


def test_mixed_dtypes_are_cast_exactly_as_tensor_to_casts() -> None:
    results = run_on_ranks(_casts, 2, timeout=200)
    assert results == [[], []]


# -- refusals: another plan, a wrong storage: every rank raises the same error, nothing moves -----------


def _refusals(rank: int, world: int, group) -> dict:
    out: dict[str, object] = {}
    options = ExecuteOptions(timeout=30)
    sc = random_scenario(21, world, source_ranks=[0, 1], target_ranks=[1, 2])
    other = random_scenario(22, world, source_ranks=[0, 1], target_ranks=[1, 2])
    executor = Executor(group, options)

    def attempt(label: str, half, sources, targets, buffers) -> None:
        try:
            executor.execute(half, sources, targets)
            out[label] = "no error"
        except PlanMismatchError as e:
            out[label] = str(e)
        out[label + " untouched"] = all(bool(torch.isnan(b).all()) for b in buffers.values())

    # rank 2 holds another plan
    plan = (other if rank == 2 else sc).plan()
    buffers, targets = target_buffers(other if rank == 2 else sc, rank)
    attempt(
        "other plan", plan.half(rank), source_storages(other if rank == 2 else sc, rank), targets, buffers
    )

    half = sc.plan().half(rank)
    sources = source_storages(sc, rank)
    # rank 1 passes a target of the wrong dtype
    buffers, targets = target_buffers(sc, rank)
    if rank == 1:
        name = next(iter(targets))
        targets = dict(targets, **{name: targets[name].to(torch.float16)})
    attempt("wrong dtype", half, sources, targets, buffers)
    # rank 2 passes a target of the wrong shape
    buffers, targets = target_buffers(sc, rank)
    if rank == 2:
        name = next(iter(targets))
        targets = dict(targets, **{name: torch.full((prod(targets[name].shape) + 1,), float("nan"))})
    attempt("wrong shape", half, sources, targets, buffers)
    # rank 0 is handed rank 1's half
    buffers, targets = target_buffers(sc, rank)
    attempt("wrong half", sc.plan().half(1) if rank == 0 else half, sources, targets, buffers)
    # after refusals the group is still usable: the right storages sync
    buffers, targets = target_buffers(sc, rank)
    executor.execute(half, sources, targets)
    expected = expected_buffers(sc, rank)
    out["then ok"] = all(bitwise_equal(expected[n], buffers[n]) for n in expected)
    return out


def test_a_different_plan_or_a_wrong_storage_on_one_rank_makes_every_rank_raise_the_same_error() -> None:
    results = run_on_ranks(_refusals, 3, timeout=300)
    for label, must_name in (
        ("other plan", "rank 2 holds plan digest"),
        ("wrong dtype", "rank 1: target storage of tensor"),
        ("wrong shape", "rank 2: target storage of tensor"),
        ("wrong half", "rank 0: rank 0 of the group was given the half of rank 1"),
    ):
        messages = {r[label] for r in results}
        assert len(messages) == 1, (label, messages)
        (message,) = messages
        assert must_name in message, (label, message)
        assert all(r[label + " untouched"] for r in results), label
    assert (
        "expected dtype bfloat16" in results[0]["wrong dtype"]
        or "expected dtype float32" in results[0]["wrong dtype"]
    )
    assert all(r["then ok"] for r in results)


# -- failures of peers: a killed rank, a rank that never joins -----------------------------------------


class _DiesOnAccess(Mapping):
    """Target storages that kill this process on the ``after``-th lookup (the executor looks targets up
    while it unpacks, so the rank dies mid-run)."""

    def __init__(self, storages: dict[str, torch.Tensor], after: int) -> None:
        self._storages = storages
        self._left = after

    def __getitem__(self, key: str) -> torch.Tensor:
        self._left -= 1
        if self._left < 0:
            os._exit(3)
        return self._storages[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._storages)

    def __len__(self) -> int:
        return len(self._storages)


def killed_mid_run(rank: int, world: int, executor: Executor, after: int = 40) -> tuple[str, float, str]:
    """Every rank holds rows of a 300 x 200 float32 tensor and receives columns: every rank sends to and
    receives from every other rank, in many small rounds; the last rank dies while unpacking (at its
    ``after``-th target lookup)."""
    import random as _random

    rng = _random.Random(0)
    shape = (300, 200)
    src = side_map("w", shape, "float32", "rows", list(range(world)), rng)
    tgt = side_map("w", shape, "float32", "cols", list(range(world)), rng)
    plan = plan_model([src], [tgt])
    sources = {"w": torch.ones(src.ranks[rank].shape)}
    targets: Mapping[str, torch.Tensor] = {"w": torch.full(tgt.ranks[rank].shape, float("nan"))}
    if rank == world - 1:
        targets = _DiesOnAccess(dict(targets), after=after)
    start = time.monotonic()
    try:
        executor.execute(plan.half(rank), sources, targets)
        return ("finished", time.monotonic() - start, "")
    except (PeerFailedError, SyncTimeoutError) as e:
        return (type(e).__name__, time.monotonic() - start, str(e))


def _killed(rank: int, world: int, group, timeout: float) -> tuple[str, float, str]:
    return killed_mid_run(
        rank, world, Executor(group, ExecuteOptions(staging_cap_bytes=4096, timeout=timeout))
    )


def test_a_rank_killed_mid_run_makes_every_other_rank_raise_within_the_timeout() -> None:
    timeout = 10.0
    world = 3
    results = run_on_ranks(_killed, world, timeout, timeout=200, may_die={world - 1})
    assert results[world - 1] is None  # it died
    for rank in range(world - 1):
        kind, elapsed, message = results[rank]
        assert kind in ("PeerFailedError", "SyncTimeoutError"), results[rank]
        assert elapsed < timeout + 5, results[rank]
        assert f"rank {rank}:" in message
    assert any(f"rank {world - 1}" in r[2] for r in results[: world - 1])


def _never_joins(rank: int, world: int, group, timeout: float) -> tuple[str, float]:
    sc = random_scenario(4, world)
    half = sc.plan().half(rank)
    if rank == world - 1:
        time.sleep(timeout + 3)
        return ("slept", 0.0)
    sources = source_storages(sc, rank)
    _, targets = target_buffers(sc, rank)
    start = time.monotonic()
    try:
        Executor(group, ExecuteOptions(timeout=timeout)).execute(half, sources, targets)
        return ("finished", time.monotonic() - start)
    except (SyncTimeoutError, PeerFailedError) as e:
        return (type(e).__name__, time.monotonic() - start)


def test_a_rank_that_never_joins_makes_the_others_raise_within_the_timeout() -> None:
    timeout = 4.0
    results = run_on_ranks(_never_joins, 3, timeout, timeout=120)
    for kind, elapsed in results[:2]:
        assert kind == "SyncTimeoutError"
        assert timeout - 0.5 <= elapsed < timeout + 4


# -- the default world group ---------------------------------------------------------------------------


def _world_group(rank: int, world: int, group, path: str) -> bool:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    try:
        sc = random_scenario(31, world)
        sources = source_storages(sc, rank)
        buffers, targets = target_buffers(sc, rank)
        Executor(dist.group.WORLD, ExecuteOptions(timeout=30)).execute(sc.plan().half(rank), sources, targets)
        expected = expected_buffers(sc, rank)
        return all(bitwise_equal(expected[n], buffers[n]) for n in expected)
    finally:
        dist.destroy_process_group()


def test_the_default_world_group_of_torch_distributed_works_too(tmp_path) -> None:
    assert run_on_ranks(_world_group, 3, str(tmp_path / "rendezvous"), timeout=200) == [True, True, True]

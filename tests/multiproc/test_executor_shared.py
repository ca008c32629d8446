"""Ranks on one host in different processes: by default each receiver maps its senders' storages and copies
its segments straight from them (``mapped``: no messages); with ``map_sources=False`` staged messages' bytes go
through shared slots in /dev/shm (only 8-byte signals cross gloo) and dense segments are pulled. Random
planner plans are exact either way, staging (arena plus the shared slots a rank made) stays under the cap,
nothing is left in /dev/shm while syncs run or after a rank was killed; a sender's storages moved into shared
memory stay the storages its views (and the trainer's) write to."""

from __future__ import annotations

import dataclasses
import os
import secrets
import time

import pytest
import torch
from test_executor import OPTION_SETS, killed_mid_run
from test_executor_layouts import (
    bitwise_equal,
    expected_buffers,
    random_scenario,
    side_map,
    source_storages,
    target_buffers,
)

from rollout_sync.errors import PeerFailedError, SyncTimeoutError
from rollout_sync.planning.planner import plan_model
from rollout_sync.transport import ExecuteOptions, Executor
from rollout_sync.transport.same_host.shared_memory import SHM_PREFIX, SameHost, shm_dir
from tests.harness.ranks import run_on_ranks


def _same_host(group, rank: int, world: int, group_id: str) -> SameHost:
    """Every other rank (all run on this host), with its pid, learnt over the group."""
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    group.allgather([pids], [torch.tensor([os.getpid()])]).wait()
    return SameHost(group_id, rank, {r: int(p) for r, p in enumerate(pids) if r != rank})


def _ours(group_id: str) -> list[str]:
    return sorted(p.name for p in shm_dir().glob(f"{SHM_PREFIX}*-{group_id}-*"))


def _torch_files(pid: int) -> list[str]:
    """Files in /dev/shm that torch's shared memory of process ``pid`` left by name."""
    return sorted(p.name for p in shm_dir().glob(f"torch_{pid}_*"))


def _random(rank: int, world: int, group, seeds: list[int], group_id: str, map_sources: bool) -> list[dict]:
    same_host = _same_host(group, rank, world, group_id)
    out = []
    for seed in seeds:
        sc = random_scenario(seed, world)
        half = sc.plan().half(rank)
        sources = source_storages(sc, rank)
        for options in OPTION_SETS:
            options = dataclasses.replace(options, map_sources=map_sources)
            executor = Executor(group, options, same_host=same_host)
            for _ in range(2):
                buffers, targets = target_buffers(sc, rank)
                stats = executor.execute(half, sources, targets)
                expected = expected_buffers(sc, rank)
                wrong = sorted(n for n in expected if not bitwise_equal(expected[n], buffers[n]))
                assert not wrong, f"seed {seed} rank {rank}: wrong target elements in {wrong}"
            group.barrier().wait()  # every receiver has opened (and unlinked) what its senders made
            out.append(
                {
                    "peak": stats.peak_staging_bytes,
                    "cap": options.staging_cap_bytes,
                    "shared": executor.shared_bytes,
                    "sent": stats.bytes_sent,
                    "received": stats.bytes_received,
                    "left": _ours(group_id) + _torch_files(os.getpid()),
                    "mapped": sorted(executor.pairs.maps_from | executor.pairs.mapped_by),
                    "handed": stats.bytes_mapped,
                }
            )
            executor.close()
    return out


@pytest.mark.parametrize("map_sources", [False, True], ids=["shared-slots", "mapped"])
@pytest.mark.parametrize("world", [2, 4])
def test_random_plans_between_processes_on_one_host_are_exact_and_leave_nothing_in_dev_shm(
    world: int, map_sources: bool
) -> None:
    group_id = secrets.token_hex(6)
    results = run_on_ranks(
        _random, world, [world * 10 + 1, world * 10 + 2], group_id, map_sources, timeout=400
    )
    for per_rank in results:
        for r in per_rank:
            assert r["peak"] <= r["cap"], r
            assert r["left"] == [], r
    if map_sources:  # every pair with bytes to move maps: no message, no shared slot; senders hand over
        for rank, per_rank in enumerate(results):
            for r in per_rank:
                assert set(r["mapped"]) <= set(range(world)) - {rank}, r
                assert r["shared"] == 0 and not r["sent"] and not r["received"], r
        assert any(r["handed"] for per_rank in results for r in per_rank)
        assert any(r["mapped"] for per_rank in results for r in per_rank)
    else:
        assert any(r["shared"] > 0 for per_rank in results for r in per_rank)
        assert all(r["mapped"] == [] for per_rank in results for r in per_rank)
    for k in range(len(results[0])):
        for rank in range(world):
            for peer, n in results[rank][k]["sent"].items():
                assert results[peer][k]["received"][rank] == n
    assert _ours(group_id) == []


def _killed(
    rank: int, world: int, group, timeout: float, group_id: str, map_sources: bool
) -> tuple[str, float, str]:
    same_host = _same_host(group, rank, world, group_id)
    options = ExecuteOptions(staging_cap_bytes=4096, timeout=timeout, map_sources=map_sources)
    executor = Executor(group, options, same_host=same_host)
    try:  # mapped pairs look targets up once per segment (no rounds): the rank dies at its second copy
        return killed_mid_run(rank, world, executor, after=3 if map_sources else 40)
    finally:
        executor.close()


@pytest.mark.parametrize("map_sources", [False, True], ids=["shared-slots", "mapped"])
def test_a_rank_killed_mid_run_fails_the_others_in_time_and_leaves_nothing_in_dev_shm(
    map_sources: bool,
) -> None:
    timeout = 10.0
    world = 3
    group_id = secrets.token_hex(6)
    results = run_on_ranks(_killed, world, timeout, group_id, map_sources, timeout=200, may_die={world - 1})
    assert results[world - 1] is None
    for rank in range(world - 1):
        kind, elapsed, message = results[rank]
        assert kind in ("PeerFailedError", "SyncTimeoutError"), results[rank]
        assert elapsed < timeout + 5, results[rank]
        assert f"rank {rank}:" in message
    assert _ours(group_id) == []


def _pulled(rank: int, world: int, group, group_id: str, can_pull: bool) -> dict:
    """Dense same-dtype segments (rows of one rank into whole tensors elsewhere): pulled by the receiver
    straight from the sender's storage where the probe says it can read it, else packed into shared
    slots; exact either way."""
    from rollout_sync.transport.same_host import cross_memory

    if not can_pull:  # as where a seccomp filter or Yama forbids reading another process

        def refused(pid: int, runs: object) -> None:
            raise PermissionError(1, "Operation not permitted")

        cross_memory.pull = refused  # type: ignore[assignment]
    same_host = _same_host(group, rank, world, group_id)
    shape = (512, 256)
    full = torch.arange(512 * 256, dtype=torch.float32).reshape(shape) * 1.5
    src = side_map("w", shape, "float32", "rows", [0, 1], __import__("random").Random(3))
    tgt = side_map("w", shape, "float32", "replicated", [0, 1], __import__("random").Random(3))
    plan = plan_model([src], [tgt])
    rows = src.ranks[rank]
    sources = {"w": torch.empty(rows.shape)}
    for piece in rows.pieces:
        box = tuple(slice(o, o + e) for o, e in zip(piece.box.origin, piece.box.extent, strict=True))
        torch.as_strided(sources["w"], piece.box.extent, piece.strides, piece.offset).copy_(full[box])
    options = ExecuteOptions(staging_cap_bytes=1 << 16, timeout=30, map_sources=False)
    executor = Executor(group, options, same_host=same_host)
    try:
        for _ in range(2):
            targets = {"w": torch.full(shape, float("nan"))}
            stats = executor.execute(plan.half(rank), sources, targets)
            assert torch.equal(targets["w"], full), f"rank {rank}: wrong elements"
        pulled = sum(stats.bytes_pulled.values())
        return {"from": sorted(executor.pulls_from), "by": sorted(executor.pulled_by), "pulled": pulled > 0}
    finally:
        executor.close()


@pytest.mark.parametrize("can_pull", [True, False])
def test_dense_segments_are_pulled_from_the_sender_s_memory_where_the_probe_allows_it(can_pull: bool) -> None:
    group_id = secrets.token_hex(6)
    results = run_on_ranks(_pulled, 2, group_id, can_pull, timeout=200)
    if can_pull:
        want = [{"from": [1], "by": [1], "pulled": True}, {"from": [0], "by": [0], "pulled": True}]
    else:
        want = [{"from": [], "by": [], "pulled": False}] * 2
    assert results == want, results
    assert _ours(group_id) == []


def _rows_plan(rank: int, target_dtype: str):
    """Each of two ranks holds rows of a 256 x 128 float32 ``w``; every rank receives the whole tensor in
    ``target_dtype``: the plan and this rank's map."""
    import random as _random

    shape = (256, 128)
    src = side_map("w", shape, "float32", "rows", [0, 1], _random.Random(5))
    tgt = side_map("w", shape, target_dtype, "replicated", [0, 1], _random.Random(5))
    return plan_model([src], [tgt]), src.ranks[rank]


def _rows_setup(rank: int, target_dtype: str):
    """``_rows_plan``, the whole tensor's values (the same on both ranks) and this rank's source storage."""
    plan, rows = _rows_plan(rank, target_dtype)
    full = torch.randn((256, 128), generator=torch.Generator().manual_seed(7))
    sources = {"w": torch.empty(rows.shape)}
    _fill_rows(sources["w"], rows, full)
    return plan, rows, full, sources


def _fill_rows(storage: torch.Tensor, rows, full: torch.Tensor) -> None:
    """Write this rank's rows of ``full`` into its storage."""
    for piece in rows.pieces:
        box = tuple(slice(o, o + e) for o, e in zip(piece.box.origin, piece.box.extent, strict=True))
        torch.as_strided(storage, piece.box.extent, piece.strides, piece.offset).copy_(full[box])


def _moved(rank: int, world: int, group, group_id: str) -> dict:
    """Each rank holds rows of ``w`` (float32; the targets are bfloat16: the receiver casts while it copies)
    and receives the whole tensor. The first sync moves each sender's storage into shared memory in place:
    a view taken before it still writes the storage the peer maps (an optimizer step through DeepSpeed's
    own views); a storage replaced between syncs is mapped anew and the old mapping dropped."""
    same_host = _same_host(group, rank, world, group_id)
    plan, rows, full, sources = _rows_setup(rank, "bfloat16")
    shape = full.shape
    before = sources["w"].view(-1)[:]  # a view made before the storage moves
    executor = Executor(group, ExecuteOptions(timeout=30), same_host=same_host)
    out: dict = {"exact": []}
    try:

        def sync() -> None:
            targets = {"w": torch.full(shape, float("nan"), dtype=torch.bfloat16)}
            executor.execute(plan.half(rank), sources, targets)
            out["exact"].append(torch.equal(targets["w"], full.to(torch.bfloat16)))

        sync()
        out["shared"] = sources["w"].untyped_storage().is_shared()
        out["same_storage"] = before.untyped_storage().data_ptr() == sources["w"].untyped_storage().data_ptr()
        full = full * 2  # the step, written through the old view
        _fill_rows(before.view(rows.shape), rows, full)
        group.barrier().wait()
        sync()
        full = full + 1  # a new storage for the same tensor
        sources = {"w": torch.empty(rows.shape)}
        _fill_rows(sources["w"], rows, full)
        group.barrier().wait()
        sync()
        out["mapped"] = sorted(executor.pairs.maps_from | executor.pairs.mapped_by)
        out["mappings"] = len(executor.pairs.mapped.maps)
    finally:
        executor.close()
    group.barrier().wait()
    out["left"] = _ours(group_id) + _torch_files(os.getpid())
    return out


def test_a_sender_s_storage_is_moved_into_shared_memory_in_place_and_remapped_when_replaced() -> None:
    group_id = secrets.token_hex(6)
    results = run_on_ranks(_moved, 2, group_id, timeout=200)
    for rank, r in enumerate(results):
        assert r == {
            "exact": [True, True, True],
            "shared": True,
            "same_storage": True,
            "mapped": [1 - rank],
            "mappings": 1,
            "left": [],
        }, (rank, r)


def _mapped_inodes() -> set[int]:
    """Inodes of the files this process has mapped (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        return {int(line.split()[4]) for line in f if len(line.split()) > 4}


def _dead_peer(rank: int, world: int, group, group_id: str) -> dict:
    """Both ranks hold rows of ``w`` and receive all of it, each mapping the other's storages. After one
    sync rank 0 is killed (SIGKILL): rank 1's next sync fails within the timeout, and then no mapping of
    rank 0's memory is left in rank 1 (it would keep the dead rank's memory alive)."""
    import gc
    import signal

    same_host = _same_host(group, rank, world, group_id)
    plan, _, full, sources = _rows_setup(rank, "float32")
    executor = Executor(group, ExecuteOptions(timeout=10), same_host=same_host)
    peer_pid = same_host.peers[1 - rank]

    def sync() -> bool:
        targets = {"w": torch.full(full.shape, float("nan"))}
        executor.execute(plan.half(rank), sources, targets)
        return torch.equal(targets["w"], full)

    out: dict = {"exact": sync()}
    peer_inodes = {key[1] for key in executor.pairs.mapped.maps._maps if key[0] == peer_pid}
    out["mapped_before"] = bool(peer_inodes) and peer_inodes <= _mapped_inodes()
    group.barrier().wait()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        sync()
        out["failed"] = "finished"
    except (PeerFailedError, SyncTimeoutError) as e:
        out["failed"] = type(e).__name__
    out["elapsed"] = time.monotonic() - start
    gc.collect()
    out["mapped_after"] = sorted(peer_inodes & _mapped_inodes())
    out["mappings_after"] = len(executor.pairs.mapped.maps)
    executor.close()
    return out


def test_a_receiver_lets_go_of_a_killed_sender_s_memory_when_its_sync_fails() -> None:
    results = run_on_ranks(_dead_peer, 2, secrets.token_hex(6), timeout=200, may_die={0})
    assert results[0] is None
    r = results[1]
    assert r["exact"] and r["mapped_before"], r
    assert r["failed"] in ("PeerFailedError", "SyncTimeoutError") and r["elapsed"] < 15, r
    assert r["mapped_after"] == [] and r["mappings_after"] == 0, r


def _unshareable(rank: int, world: int, group, group_id: str) -> dict:
    """Rank 0 cannot share its storages (as a process out of file descriptors or of /dev/shm): at the probe
    it offers no mapping, so its sends go through pulls and shared slots while rank 1's are still mapped;
    exact both ways."""
    from rollout_sync.transport.core import mapped

    if rank == 0:

        def refused(tensor: torch.Tensor) -> tuple[int, int, int]:
            raise RuntimeError("unable to write to file </torch_0_0>: No space left on device (28)")

        mapped.share = refused  # type: ignore[assignment]
    same_host = _same_host(group, rank, world, group_id)
    plan, _, full, sources = _rows_setup(rank, "float32")
    shape = full.shape
    executor = Executor(group, ExecuteOptions(timeout=30), same_host=same_host)
    exact = []
    try:
        for _ in range(2):
            targets = {"w": torch.full(shape, float("nan"))}
            stats = executor.execute(plan.half(rank), sources, targets)
            exact.append(torch.equal(targets["w"], full))
        return {
            "exact": exact,
            "maps_from": sorted(executor.pairs.maps_from),
            "mapped_by": sorted(executor.pairs.mapped_by),
            "sent": sorted(int(p) for p in stats.bytes_sent),
            "handed": sorted(int(p) for p in stats.bytes_mapped),
        }
    finally:
        executor.close()


def test_a_sender_that_cannot_share_its_storages_is_not_mapped_and_its_bytes_still_arrive() -> None:
    group_id = secrets.token_hex(6)
    results = run_on_ranks(_unshareable, 2, group_id, timeout=200)
    assert results == [
        {"exact": [True, True], "maps_from": [1], "mapped_by": [], "sent": [1], "handed": []},
        {"exact": [True, True], "maps_from": [], "mapped_by": [0], "sent": [], "handed": [0]},
    ], results
    assert _ours(group_id) == []

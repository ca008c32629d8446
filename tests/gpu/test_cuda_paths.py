"""What runs on a GPU and nowhere else (marker ``gpu``: deselected by default, skipped without CUDA; run by
``scripts/gpu_check.sh``): the delta codec's torch path on the device writes the bytes the NumPy path writes
on the CPU and reads them back; the device comparison finds exactly the changed elements; CUDA IPC handles
export and the mapped-handoff executor moves a small plan between four processes on one GPU, bit for bit,
every pair mapped, nothing left in ``/dev/shm``; a sender killed with SIGKILL fails the other ranks within
the timeout, and its allocation is released (no receiver keeps it mapped)."""

from __future__ import annotations

import json

import pytest
import torch

from rollout_sync.transport.delta.change_codec import (
    bits_dtype,
    changed_positions,
    decode_positions,
    decode_values,
    encode,
    max_encoded_bytes,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("itemsize", [2, 4])
def test_the_device_coding_writes_the_cpu_bytes_and_reads_them_back(itemsize: int) -> None:
    bits = bits_dtype(itemsize)
    g = torch.Generator().manual_seed(itemsize)
    old = torch.randint(-(2**14), 2**14, (200_000,), generator=g).to(bits)
    new = old.clone()
    at = torch.randperm(old.numel(), generator=g)[:2_000].sort().values
    new[at] += torch.randint(-300, 300, (at.numel(),), generator=g).to(bits)
    new[at[new[at] == old[at]]] += 1
    cpu_out = torch.zeros(max_encoded_bytes(at.numel(), itemsize), dtype=torch.uint8)
    nbytes = encode(new, old, at, cpu_out)
    dev_new, dev_old = new.cuda(), old.cuda()
    count, positions = changed_positions(dev_new, dev_old, old.numel())
    assert count == at.numel() and positions is not None
    assert torch.equal(positions.cpu(), at)
    dev_out = torch.zeros_like(cpu_out, device="cuda")
    assert encode(dev_new, dev_old, positions, dev_out) == nbytes
    assert torch.equal(dev_out.cpu(), cpu_out)
    assert torch.equal(decode_positions(dev_out[:nbytes]).cpu(), at)
    assert torch.equal(decode_values(dev_out[:nbytes], dev_old[positions]).cpu(), new[at])


def test_a_cuda_ipc_handle_names_the_storages_block_and_offset() -> None:
    from rollout_sync.transport.core import cuda_ipc

    block = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    words, offset, nbytes = cuda_ipc.export(block[4096:])
    assert len(words) == cuda_ipc.HANDLE_WORDS and any(words)
    assert nbytes == block.untyped_storage().nbytes() and offset >= 0


def test_bench_ipc_on_the_gpu_maps_every_pair_and_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import ipc

    status = ipc.main(["--device", "cuda", "--layers", "1", "--vocab", "2048", "--syncs", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status == 0 and out["verified"] and out["mapped"] and out["shm_left"] == []


BLOCK_BYTES = 4 << 30
"""The killed sender's sources live in one allocation of this size (the block its IPC handle exports)."""


def _killed_sender(rank: int, world: int, group, group_id: str, device_type: str = "cuda") -> dict | None:
    """Bench ipc's four ranks (ZeRO-3 ranks 0-1 to TP-2 ranks 2-3) with one layer, on GPU 0; rank 0's
    sources live in a 4 GiB allocation. After a verified sync rank 0 is killed (SIGKILL); every other rank's
    next sync fails within the timeout; each receiver then holds no mapping, and the dead rank's allocation
    is released (the device's free memory grows by at least the allocation). ``device_type="cpu"`` runs the
    same steps through memory files (a 64 MiB allocation, no memory check), to check this test without a GPU."""
    import gc
    import os
    import signal
    import time

    from benchmarks.execute import _carve, _logical, _maps, _pieces_copy
    from rollout_sync.errors import PeerFailedError, SyncTimeoutError
    from rollout_sync.planning.planner import plan_model
    from rollout_sync.transport import ExecuteOptions, Executor
    from rollout_sync.transport.same_host.shared_memory import SameHost

    cuda = device_type == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    block_bytes = BLOCK_BYTES if cuda else 64 << 20
    if cuda:
        torch.cuda.set_device(device)
    pids = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    group.allgather([pids], [torch.tensor([os.getpid()])]).wait()
    same_host = SameHost(group_id, rank, {r: int(p) for r, p in enumerate(pids) if r != rank})
    source_maps, target_maps = _maps(1, 2048)
    plan = plan_model(source_maps, target_maps)
    shapes = {m.name: m.ranks[rank].shape for m in source_maps if rank in m.ranks}
    flat, sources = _carve(shapes, torch.bfloat16, 0.0, device)
    for i, m in enumerate(source_maps):
        if rank in m.ranks:
            _pieces_copy(sources[m.name], m.ranks[rank], _logical(i, m.shape, device), True)
    if rank == 0 and sources:
        inside = torch.empty(block_bytes, dtype=torch.uint8, device=device)[: flat.numel() * 2].view(
            flat.dtype
        )
        inside.copy_(flat)
        sources = {
            n: inside[v.storage_offset() : v.storage_offset() + v.numel()].view(v.shape)
            for n, v in sources.items()
        }
    shapes = {m.name: m.ranks[rank].shape for m in target_maps if rank in m.ranks}
    _, targets = _carve(shapes, torch.bfloat16, float("nan"), device)
    executor = Executor(group, ExecuteOptions(timeout=20, shared_memory=True), same_host=same_host)
    executor.execute(plan.half(rank), sources, targets)
    out: dict = {"mapped_before": len(executor.pairs.mapped.maps)}
    free_before = torch.cuda.mem_get_info(device)[0] if cuda else 0
    group.barrier().wait()
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        executor.execute(plan.half(rank), sources, targets)
        out["failed"] = "finished"
    except (PeerFailedError, SyncTimeoutError) as e:
        out["failed"] = type(e).__name__
    out["elapsed"] = time.monotonic() - start
    gc.collect()
    out["mappings_after"] = len(executor.pairs.mapped.maps)
    deadline = time.monotonic() + 20
    while cuda:  # the driver frees a dead process's memory shortly after it exits
        out["freed"] = torch.cuda.mem_get_info(device)[0] - free_before
        if out["freed"] >= BLOCK_BYTES * 0.9 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    executor.close()
    return out


def test_a_killed_sender_fails_the_others_in_time_and_its_allocation_is_released() -> None:
    import secrets

    from tests.harness.ranks import run_on_ranks

    results = run_on_ranks(
        _killed_sender, 4, secrets.token_hex(6), timeout=240, may_die={0}, group_timeout=30
    )
    assert results[0] is None
    for rank in (1, 2, 3):
        r = results[rank]
        assert r["failed"] in ("PeerFailedError", "SyncTimeoutError") and r["elapsed"] < 25, (rank, r)
        assert r["mappings_after"] == 0, (rank, r)
    for rank in (2, 3):
        assert results[rank]["mapped_before"] > 0, (rank, results[rank])
        assert results[rank]["freed"] >= BLOCK_BYTES * 0.9, (rank, results[rank])

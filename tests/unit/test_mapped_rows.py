"""Mapped handoffs' tables (``transport.mapped``) and the refusal of device storages over gloo, in one
process on CPU: a row names a storage's memory file (or a CUDA IPC handle) and the tensor's offset, a
receiver's views from a table read the sender's elements, a storage that cannot be shared and a CUDA row on
a CPU receiver fail with the storage named, and an executor over gloo refuses CUDA storages for every pair
that does not map them, naming the ranks (the CUDA path itself runs in ``scripts/gpu_check.sh``)."""

from __future__ import annotations

import os
import struct
from typing import Any

import pytest
import torch

from benchmarks.execute import qwen3_like
from rollout_sync.errors import BackendDeviceError
from rollout_sync.geometry import trainer_maps, vllm_target_maps
from rollout_sync.planning.planner import plan_model
from rollout_sync.shapes import model_tensors
from rollout_sync.transport import ExecuteOptions, Executor
from rollout_sync.transport.core import cuda_ipc
from rollout_sync.transport.core.mapped import (
    CUDA_IPC,
    MEMORY_FILE,
    ROW,
    UNSHARED,
    MappedStorages,
    table_of,
    views_of,
)


def test_a_table_names_each_storage_and_its_views_read_the_senders_elements() -> None:
    flat = torch.arange(64, dtype=torch.float32)
    sources = {"a": flat[8:24], "b": torch.arange(5, dtype=torch.int64)}
    table, error = table_of(["a", "b"], sources)
    assert error is None and tuple(table.shape) == (2, ROW)
    rows = table.tolist()
    assert [r[0] for r in rows] == [MEMORY_FILE, MEMORY_FILE]
    assert rows[0][3] == 64 * 4 and rows[0][4] == 8  # the storage's bytes, the view's element offset
    maps = MappedStorages()
    views = views_of(table, ["a", "b"], [torch.float32, torch.int64], os.getpid(), maps)
    got = torch.as_strided(views["a"], (16,), (1,), views["a"].storage_offset())
    assert torch.equal(got, flat[8:24])
    assert torch.equal(torch.as_strided(views["b"], (5,), (1,), 0), sources["b"])
    assert len(maps) == 2
    maps.keep_only(os.getpid(), rows[:1])  # a later table that no longer names "b"
    assert len(maps) == 1
    maps.clear()
    assert len(maps) == 0


def test_a_storage_that_cannot_be_shared_is_named_and_its_row_refused() -> None:
    sources = {"w": torch.empty(4, device="meta")}
    table, error = table_of(["w"], sources)
    assert error is not None and "'w'" in error and "meta" in error
    assert int(table[0, 0]) == UNSHARED
    with pytest.raises(OSError, match="'w'"):
        views_of(table, ["w"], [torch.float32], os.getpid(), MappedStorages())


def test_a_cuda_row_is_refused_by_a_receiver_whose_storages_are_on_the_cpu() -> None:
    row = [CUDA_IPC, 0, 512, 1024, 0, *range(cuda_ipc.HANDLE_WORDS)]
    with pytest.raises(OSError, match="cannot open the CUDA storage of pid 7"):
        MappedStorages(torch.device("cpu")).storage(7, row)


def test_an_ipc_handle_travels_as_signed_words_zero_bytes_included_and_cpu_tensors_have_none() -> None:
    raw = bytes([0, 7, 0, 0, 255, 128, 0, 1] * 8)  # zero bytes inside, high bytes: negative int64 words
    words = list(struct.unpack(f"<{cuda_ipc.HANDLE_WORDS}q", raw))
    handle = cuda_ipc.handle_of(torch.tensor(words).tolist())  # through a table row and back
    assert bytes(handle.reserved) == raw
    assert cuda_ipc.handle_words(handle) == words
    with pytest.raises(RuntimeError, match="cpu storage has no CUDA IPC handle"):
        cuda_ipc.export(torch.zeros(2))


class _Group:
    """Enough of a group object for an executor's construction (nothing is sent)."""

    def __init__(self, rank: int, size: int, backend: str) -> None:
        self._rank, self._size, self._backend = rank, size, backend

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def _get_backend_name(self) -> str:
        return self._backend


def _half(rank: int) -> Any:
    """Rank ``rank``'s half of bench execute's layout (ZeRO-3 on ranks 0-1 to TP 2 on ranks 2-3), one layer."""
    model = model_tensors(qwen3_like(1, 256))
    sources = trainer_maps(model, zero_stage=3, dp=2, dtype="bfloat16")
    targets = vllm_target_maps(model, engines=1, tp=2, first_rank=2, dtype="bfloat16")
    return plan_model(sources, targets).half(rank)


def test_cuda_storages_over_gloo_are_refused_for_every_pair_that_does_not_map_them() -> None:
    half = _half(0)  # trainer rank 0 sends to rollout ranks 2 and 3
    executor = Executor(_Group(0, 4, "gloo"), ExecuteOptions(shared_memory=True))
    cuda = torch.device("cuda", 0)
    with pytest.raises(BackendDeviceError, match=r"ranks \[2, 3\]") as raised:
        executor.pairs.refuse_unmapped(half, cuda, "gloo", 0)
    assert "rank 0" in str(raised.value) and "'gloo'" in str(raised.value)
    executor.pairs.mapped_by = frozenset({2})
    with pytest.raises(BackendDeviceError, match=r"ranks \[3\]"):
        executor.pairs.refuse_unmapped(half, cuda, "gloo", 0)
    executor.pairs.mapped_by = frozenset({2, 3})
    executor.pairs.refuse_unmapped(half, cuda, "gloo", 0)  # every pair maps: nothing crosses gloo
    with pytest.raises(BackendDeviceError, match=r"a delta sync .* ranks \[2, 3\]"):
        executor.pairs.refuse_unmapped(half, cuda, "gloo", 0, delta=True)  # its pairs exchange messages
    executor.pairs.refuse_unmapped(half, torch.device("cpu"), "gloo", 0)
    Executor(_Group(0, 4, "nccl")).pairs.refuse_unmapped(half, cuda, "nccl", 0)


def test_a_receiver_checks_its_senders_maps_not_the_ones_it_is_mapped_by() -> None:
    half = _half(2)  # rollout rank 2 receives from trainer ranks 0 and 1
    executor = Executor(_Group(2, 4, "gloo"), ExecuteOptions(shared_memory=True))
    executor.pairs.mapped_by = frozenset({0, 1})  # the wrong direction for a receiver
    with pytest.raises(BackendDeviceError, match=r"ranks \[0, 1\]"):
        executor.pairs.refuse_unmapped(half, torch.device("cuda", 0), "gloo", 2)
    executor.pairs.maps_from = frozenset({0, 1})
    executor.pairs.refuse_unmapped(half, torch.device("cuda", 0), "gloo", 2)


def test_gloo_takes_cuda_storages_only_where_every_rank_may_map_every_other_through_cuda_ipc() -> None:
    from rollout_sync.sync.fleet_plan import check_backend

    all_cuda = {"trainer rank 0": "cuda", "engine 0 worker 0": "cuda"}
    check_backend("gloo", all_cuda, ipc=True)  # one host, shared memory, no delta: CUDA IPC
    with pytest.raises(BackendDeviceError, match=r"trainer rank 0 holds cuda storages.*'nccl'"):
        check_backend("gloo", all_cuda)  # other hosts, or shared_memory=False, or delta
    mixed = {"trainer rank 0": "cpu", "engine 0 worker 0": "cuda"}
    with pytest.raises(BackendDeviceError, match="engine 0 worker 0 holds cuda storages"):
        check_backend("gloo", mixed, ipc=True)  # a CPU rank and a CUDA rank cannot map each other
    with pytest.raises(BackendDeviceError, match="holds cpu storages"):
        check_backend("nccl", {"trainer rank 0": "cpu"}, ipc=True)

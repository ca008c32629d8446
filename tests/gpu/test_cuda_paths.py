"""What runs on a GPU and nowhere else (marker ``gpu``: deselected by default, skipped without CUDA; run by
``scripts/gpu_check.sh``): the delta codec's torch path on the device writes the bytes the NumPy path writes
on the CPU and reads them back; the device comparison finds exactly the changed elements; CUDA IPC handles
export and the mapped-handoff executor moves a small plan between four processes on one GPU, bit for bit,
every pair mapped, nothing left in ``/dev/shm``."""

from __future__ import annotations

import json

import pytest
import torch

from rollout_sync.transport.delta_codec import (
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
    from rollout_sync.transport import cuda_ipc

    block = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    words, offset, nbytes = cuda_ipc.export(block[4096:])
    assert len(words) == cuda_ipc.HANDLE_WORDS and any(words)
    assert nbytes == block.untyped_storage().nbytes() and offset >= 0


def test_bench_ipc_on_the_gpu_maps_every_pair_and_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    from rollout_sync.bench import ipc

    status = ipc.main(["--device", "cuda", "--layers", "1", "--vocab", "2048", "--syncs", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status == 0 and out["verified"] and out["mapped"] and out["shm_left"] == []

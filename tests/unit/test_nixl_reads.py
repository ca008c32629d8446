"""The read list of a group-free sync (``transport.nixl_reads``), executed with plain copies in one process
(the reads as NIXL would do them: bytes from a source storage's address to a local one): every element of
every target lands, bit for bit, in place or through staging within the cap, with and without a change of
dtype."""

from __future__ import annotations

import pytest
import torch

from rollout_sync.geometry.model_maps import trainer_maps, vllm_target_maps
from rollout_sync.planning.planner import plan_model
from rollout_sync.shapes import model_tensors
from rollout_sync.transport.core.program import torch_dtype, view
from rollout_sync.transport.nixl.reads import read_plan
from testbed.expected_storage import extract, local_part
from tests.harness.session_model import CONFIG, TRAINERS, WORKERS, full_tensors


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _read_into(
    sources: dict[int, dict[str, torch.Tensor]], targets: dict[str, torch.Tensor], half, in_place, cap: int
) -> int:
    """Execute ``read_plan`` with copies of bytes; returns the largest staging used at once."""
    plan = read_plan(half, in_place, cap)
    for r in plan.in_place:
        src, dst = _flat_bytes(sources[r.source][r.name]), _flat_bytes(targets[r.name])
        for s, d, n in r.runs:
            dst[d * r.itemsize : (d + n) * r.itemsize] = src[s * r.itemsize : (s + n) * r.itemsize]
    peak = 0
    for batch in plan.batches:
        staging = torch.empty(plan.staging_bytes, dtype=torch.uint8)
        used = sum(p.count * p.itemsize for p in batch)
        assert used <= cap or (len(batch) == 1 and batch[0].count == 1)
        peak = max(peak, used)
        for p in batch:
            src = _flat_bytes(sources[p.source][p.name])
            for s, at, n in p.runs:
                staging[p.offset + at * p.itemsize : p.offset + (at + n) * p.itemsize] = src[
                    s * p.itemsize : (s + n) * p.itemsize
                ]
        for p in batch:
            typed = staging[p.offset : p.offset + p.count * p.itemsize].view(torch_dtype(p.source_dtype))
            for c in p.copies:
                n = 1
                for e in c.extent:
                    n *= e
                view(targets[p.name], c).copy_(typed[c.buffer_offset : c.buffer_offset + n].view(c.extent))
    return peak


@pytest.mark.parametrize(
    ("in_place", "cap", "target_dtype"),
    [
        ("all", 1 << 20, "bfloat16"),
        ("none", 1 << 20, "bfloat16"),
        ("half", 3000, "bfloat16"),
        ("none", 512, "float32"),
    ],
)
def test_every_worker_s_reads_land_every_element_bit_for_bit(in_place: str, cap: int, target_dtype: str):
    model = model_tensors(CONFIG)
    sources_maps = trainer_maps(model, 3, TRAINERS)
    targets_maps = vllm_target_maps(model, 1, WORKERS, first_rank=TRAINERS, dtype=target_dtype)
    plan = plan_model(sources_maps, targets_maps)
    full = full_tensors(7)
    sources = {
        r: {m.name: extract(full[m.name], m, r) for m in sources_maps if r in m.ranks}
        for r in range(TRAINERS)
    }
    for w in range(WORKERS):
        rank = TRAINERS + w
        half = plan.half(rank)
        mine = [local_part(m, rank, w) for m in targets_maps if rank in m.ranks]
        targets = {
            m.name: torch.full(m.ranks[w].shape, float("nan"), dtype=torch_dtype(target_dtype)) for m in mine
        }
        names = sorted(targets)
        chosen = {"all": names, "none": [], "half": names[::2]}[in_place]
        peak = _read_into(sources, targets, half, set(chosen), cap)
        assert peak <= cap
        for m in targets_maps:
            if rank in m.ranks:
                expected = extract(full[m.name].to(torch_dtype(target_dtype)), m, rank)
                assert torch.equal(targets[m.name], expected), (w, m.name)


def test_in_place_reads_need_the_source_dtype_and_the_rest_is_staged_in_batches_within_the_cap():
    model = model_tensors(CONFIG)
    sources_maps = trainer_maps(model, 3, TRAINERS)
    targets_maps = vllm_target_maps(model, 1, WORKERS, first_rank=TRAINERS)
    half = plan_model(sources_maps, targets_maps).half(TRAINERS)
    names = {half.tensors[s.tensor].name for s in half.receives}
    direct = read_plan(half, names, 4096)
    assert direct.batches == () and {r.name for r in direct.in_place} == names
    staged = read_plan(half, set(), 4096)
    assert staged.in_place == () and len(staged.batches) > 1 and staged.staging_bytes <= 4096
    assert staged.bytes_from() == direct.bytes_from()
    assert sum(staged.bytes_from().values()) == sum(
        s.extent[0] * (s.extent[1] if len(s.extent) > 1 else 1) * 2 for s in half.receives
    )

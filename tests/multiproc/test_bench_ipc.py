"""The GPU check's benchmark (``python -m benchmarks ipc``, run by ``scripts/gpu_check.sh``) run on
the CPU: the same four processes, plan, executor and mapped handoffs (memory files instead of CUDA IPC
handles) on a small model, every pair mapped, verified bit for bit, nothing left in ``/dev/shm``, and its
JSON keys."""

from __future__ import annotations

import json

import pytest

from benchmarks import ipc


def test_bench_ipc_on_cpu_maps_every_pair_and_verifies(capsys: pytest.CaptureFixture[str]) -> None:
    status = ipc.main(["--device", "cpu", "--layers", "1", "--vocab", "2048", "--syncs", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["verified"] is True and out["mapped"] is True and out["shm_left"] == [], out
    assert status == 0
    assert out["device"] == "cpu" and out["bytes"] > 0
    for key in (
        "ours_ipc_s",
        "copy_bound_s",
        "ours_gbps",
        "copy_gbps",
        "fraction_of_copy",
        "ours_copy_phase_s",
    ):
        assert out[key] > 0, key

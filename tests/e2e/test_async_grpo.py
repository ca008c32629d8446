"""``examples/async_grpo.py``: GRPO with generation running all the time in an ``AsyncLLM`` (TP 2), the trainer
(DeepSpeed ZeRO-3, 2 ranks) stepping and syncing while requests are in flight (keep mode). Every step syncs
and the engine takes the version; the samples trained on carry their per-token weight versions, from
which the example reports staleness: with generation never stopping, some step trains on samples an
earlier version produced."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.examples import example_env

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]

ROOT = Path(__file__).resolve().parents[2]


def test_async_grpo_syncs_every_step_into_running_generation_and_reports_staleness(tmp_path: Path):
    env = example_env()  # run as a user runs it: from its install, outside the checkout
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "async_grpo.py"),
        "--steps",
        "4",
        "--workdir",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    steps = summary["steps"]
    assert summary["ok"] and [s["version"] for s in steps] == [1, 2, 3, 4], steps
    assert all(s["engine_weight_version"] == str(s["version"]) for s in steps), steps
    assert all(0 <= s["staleness_mean"] <= s["staleness_max"] for s in steps), steps
    assert max(s["staleness_max"] for s in steps) >= 1, "every sample came from the latest weights"
    assert all(s["stall_s"] >= s["sync_s"] > 0 for s in steps), steps

"""Offline mode in two programs on one machine: ``examples/two_programs/trainer.py`` (2 DeepSpeed ZeRO-3
ranks under ``torch.distributed.run``) and ``examples/two_programs/rollout.py`` (an ``LLM(...)`` at TP 1),
started as separate processes that meet only through the coordinator address and the shared token. Two
steps; after each sync the rollout program writes the trainer's own checkpoint (DeepSpeed's gathers) into
vLLM and no bit may change."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from testbed.rank_pool import free_port
from tests.harness.examples import example_env

pytestmark = [pytest.mark.vllm, pytest.mark.deepspeed]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "two_programs"
# Both programs start real engines (vLLM 40-120 s, DeepSpeed 10-60 s on 2 loaded cores; one CI run under load
# 8 had vLLM's engine not yet up after 170 s), so the bound is generous, yet a hang still fails in bounded time.
DEADLINE_S = 480.0
PROGRAM_TIMEOUT_S = "420"  # every wait inside either program (handshake, sync)


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start an example as a user would: from outside the checkout (``log``'s folder), the package from its
    install."""
    with log.open("wb") as out:
        return subprocess.Popen(
            cmd, cwd=log.parent, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill the program and everything it started (its own session), if it still runs."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _last_json(log: Path) -> dict[str, Any]:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise AssertionError(f"no JSON summary in {log}:\n{log.read_text(errors='replace')[-3000:]}")


def test_a_trainer_program_and_a_rollout_program_sync_twice_bit_for_bit(tiny_model: Any, tmp_path: Path):
    model = str(tiny_model("dense"))
    address = f"tcp://127.0.0.1:{free_port()}"
    env = example_env(ROLLOUT_SYNC_TOKEN="two-programs-test", OMP_NUM_THREADS="1")
    verify = tmp_path / "verify"
    common = ["--model", model, "--address", address, "--steps", "2", "--verify-dir", str(verify)]
    trainer_cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    trainer_cmd += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    trainer_cmd += [str(EXAMPLE / "trainer.py"), *common, "--timeout", PROGRAM_TIMEOUT_S]
    rollout_cmd = [sys.executable, str(EXAMPLE / "rollout.py"), *common, "--trainer-ranks", "2"]
    # TP 1: one worker process less to start and stop
    rollout_cmd += ["--tp", "1", "--timeout", PROGRAM_TIMEOUT_S]
    started = time.monotonic()
    rollout = _start(rollout_cmd, tmp_path / "rollout.log", env)
    trainer = _start(trainer_cmd, tmp_path / "trainer.log", env)
    try:
        for proc in (rollout, trainer):
            left = DEADLINE_S - (time.monotonic() - started)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(left, 1.0))
    finally:
        for proc in (rollout, trainer):
            _stop(proc)
    elapsed = time.monotonic() - started
    logs = {
        name: (tmp_path / f"{name}.log").read_text(errors="replace")[-4000:]
        for name in ("rollout", "trainer")
    }
    assert rollout.returncode == 0 and trainer.returncode == 0, (rollout.returncode, trainer.returncode, logs)
    summary = _last_json(tmp_path / "rollout.log")
    trained = _last_json(tmp_path / "trainer.log")["trainer"]
    rows = summary["rollout"]
    assert [r["version"] for r in rows] == [t["version"] for t in trained] == [1, 2], (rows, trained)
    assert all(r["verified"] and r["params_differing"] == 0 for r in rows), rows
    assert all(r["weight_version"] == str(r["version"]) and r["bytes_received"] > 0 for r in rows), rows
    digests = [summary["initial_weights_digest"], *(r["weights_digest"] for r in rows)]
    assert len(set(digests)) == 3, f"the weights did not change at every sync: {digests}"
    assert summary["ok"]
    print(f"two programs, 2 syncs verified bit for bit, {elapsed:.0f} s end to end")

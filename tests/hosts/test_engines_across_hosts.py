"""Real DeepSpeed and vLLM across emulated hosts (``testbed.hosts``), through the two-programs example
(``examples/two_programs``): the trainer program (2 ranks under ``torch.distributed.run``) on host a, each
rollout program (vLLM at TP 2) on its own host, meeting only at the coordinator's address on host a. After
every sync the rollout program writes the trainer's own checkpoint (DeepSpeed's gathers) into vLLM and no
bit may change. The rows also say how each engine's bytes arrived: over the sync group, or (only on the
trainer's host) straight from the trainer's storages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from testbed.hosts import Hosts

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.deepspeed,
]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "two_programs"
DEADLINE_S = 600.0  # vLLM engines starting on 2 loaded cores; a hang still fails in bounded time
PROGRAM_TIMEOUT_S = "480"
PORT = 29700


def _last_json(log: Path) -> dict[str, Any]:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise AssertionError(f"no JSON summary in {log}:\n{log.read_text(errors='replace')[-3000:]}")


def run_programs(
    hosts: Hosts, model: Path, tmp: Path, *, zero: int, engines: list[str], next_pid: int | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The trainer program on host a, rollout program k (engine k, TP 2) on host ``engines[k]``; both
    programs' summaries (trainer rank 0's steps, each rollout program's rows)."""
    env = {
        **os.environ,
        "ROLLOUT_SYNC_TOKEN": "across-hosts-test",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    address = f"tcp://{hosts.name_of('a')}:{PORT}"
    common = [
        "--model",
        str(model),
        "--address",
        address,
        "--steps",
        "2",
        "--verify-dir",
        str(tmp / "verify"),
    ]
    common += ["--timeout", PROGRAM_TIMEOUT_S]
    trainer_cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    trainer_cmd += ["--master-addr", "127.0.0.1", "--master-port", "29500", str(EXAMPLE / "trainer.py")]
    trainer_cmd += [*common, "--zero", str(zero), "--engines", str(len(engines))]
    logs = {
        "trainer": tmp / "trainer.log",
        **{f"engine{k}": tmp / f"engine{k}.log" for k in range(len(engines))},
    }
    procs = {"trainer": hosts.run("a", trainer_cmd, env=env, stdout=logs["trainer"].open("wb"), stderr=subprocess.STDOUT, next_pid=next_pid)}  # fmt: skip
    for k, host in enumerate(engines):
        cmd = [sys.executable, str(EXAMPLE / "rollout.py"), *common, "--trainer-ranks", "2", "--tp", "2"]
        cmd += ["--engine", str(k)]
        procs[f"engine{k}"] = hosts.run(host, cmd, env=env, stdout=logs[f"engine{k}"].open("wb"), stderr=subprocess.STDOUT, next_pid=next_pid)  # fmt: skip
    started = time.monotonic()
    try:
        for proc in procs.values():
            proc.wait(max(DEADLINE_S - (time.monotonic() - started), 1.0))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc in procs.values():
            Hosts.stop(proc)
    tails = {name: log.read_text(errors="replace")[-3000:] for name, log in logs.items()}
    assert all(p.returncode == 0 for p in procs.values()), (
        {n: p.returncode for n, p in procs.items()},
        tails,
    )
    trained = _last_json(logs["trainer"])["trainer"]
    rows = [_last_json(logs[f"engine{k}"]) for k in range(len(engines))]
    return trained, rows


def check_verified(trained: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> None:
    assert [t["version"] for t in trained] == [1, 2], trained
    for summary in summaries:
        rows = summary["rollout"]
        assert [r["version"] for r in rows] == [1, 2], rows
        assert all(r["verified"] and r["params_differing"] == 0 for r in rows), rows
        assert all(r["weight_version"] == str(r["version"]) for r in rows), rows
        assert summary["ok"]


def test_zero3_trainer_on_one_host_syncs_two_tp2_engines_on_two_others_over_the_group(
    tiny_model: Any, tmp_path: Path
):
    """Hosts a and b share one hostname, and the programs on them start at the same pid: they still sync
    over the group, never through shared memory."""
    model = tiny_model("dense")
    with Hosts(["a", "b", "c"], hostnames={"a": "node", "b": "node", "c": "other"}) as hosts:
        before = {h: hosts.bytes_into(h) for h in ("b", "c")}
        trained, summaries = run_programs(hosts, model, tmp_path, zero=3, engines=["b", "c"], next_pid=300)
        crossed = {h: hosts.bytes_into(h) - before[h] for h in ("b", "c")}
    check_verified(trained, summaries)
    for host, summary in zip(("b", "c"), summaries, strict=True):
        rows = summary["rollout"]
        assert all(r["bytes_over_group"] > 0 and r["bytes_same_host"] == 0 for r in rows), rows
        payload = sum(r["bytes_over_group"] for r in rows)
        assert crossed[host] > payload, (host, crossed[host], payload)  # every byte crossed the link


def test_zero2_trainer_syncs_an_engine_on_its_own_host_through_shared_memory_and_one_elsewhere_over_the_group(
    tiny_model: Any, tmp_path: Path
):
    model = tiny_model("dense")
    with Hosts(["a", "c"]) as hosts:
        trained, summaries = run_programs(hosts, model, tmp_path, zero=2, engines=["a", "c"])
    check_verified(trained, summaries)
    local, remote = (s["rollout"] for s in summaries)
    assert all(r["bytes_same_host"] > 0 and r["bytes_over_group"] == 0 for r in local), local
    assert all(r["bytes_over_group"] > 0 and r["bytes_same_host"] == 0 for r in remote), remote

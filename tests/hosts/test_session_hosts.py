"""A sync session across emulated hosts (``testbed.hosts``), without engines: trainer ranks and rollout
workers each run ``tests/hosts/session_rank.py`` on their host and meet only through the coordinator's
address. These pin down what crossing a host changes (the transport chosen, the address each rank binds)
and what a fault on the link does; the same with real DeepSpeed and vLLM is ``test_engines_across_hosts``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from testbed.hosts import Hosts, available

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "hosts" / "session_rank.py"
PORT = 29700
pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


@dataclass
class Rank:
    role: str  # "trainer" or "worker"
    rank: int  # trainer rank, or the worker's rank in its engine
    host: str
    args: list[str] = field(default_factory=list)
    next_pid: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    lines: list[dict[str, Any]] = field(default_factory=list)
    err: bytes = b""

    @property
    def name(self) -> str:
        return f"{self.role} {self.rank} on {self.host} {self.args}"


def start(hosts: Hosts, ranks: list[Rank], address: str, timeout: float = 30) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for r in ranks:
        argv = [
            sys.executable,
            str(PROGRAM),
            r.role,
            str(r.rank),
            "--address",
            address,
            "--timeout",
            str(timeout),
        ]
        r.proc = hosts.run(
            r.host,
            [*argv, *r.args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            next_pid=r.next_pid,
        )

        def read(r: Rank = r) -> None:
            assert r.proc is not None and r.proc.stdout is not None
            for line in r.proc.stdout:
                if line.startswith(b"{"):
                    r.lines.append(json.loads(line))

        threading.Thread(target=read, daemon=True).start()


def finish(ranks: list[Rank], deadline_s: float = 180) -> None:
    """Wait for every rank to exit (each must say done); a rank still running at the deadline fails."""
    end = time.monotonic() + deadline_s
    for r in ranks:
        assert r.proc is not None
        try:
            r.proc.wait(max(end - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            Hosts.stop(r.proc)
            raise AssertionError(f"{r.name} still ran after {deadline_s} s: {r.lines}") from None
        r.err = r.proc.stderr.read() if r.proc.stderr else b""
        time.sleep(0.05)  # the reader thread's last lines
        assert r.proc.returncode == 0 and r.lines and r.lines[-1].get("done"), (
            r.name,
            r.lines,
            r.err[-3000:],
        )


def syncs(r: Rank) -> dict[int, dict[str, Any]]:
    return {line["version"]: line for line in r.lines if "version" in line}


def until(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.05)


def trainers(host: str, *args: str) -> list[Rank]:
    return [Rank("trainer", r, host, list(args)) for r in (0, 1)]


def engine(index: int, host: str, *args: str) -> list[Rank]:
    return [Rank("worker", w, host, ["--engine", str(index), *args]) for w in (0, 1)]


def test_two_hosts_with_one_hostname_and_the_same_pids_sync_over_the_group_not_through_shared_memory():
    with Hosts(["a", "b"], hostnames={"a": "node", "b": "node"}) as hosts:
        ranks = [*trainers("a"), *engine(0, "b")]
        for r, pid in zip(ranks, (1000, 2000, 1000, 2000), strict=True):
            r.next_pid = pid  # trainer rank 0 and worker 0 share pid 1000, the others 2000
        start(hosts, ranks, f"tcp://{hosts.address('a')}:{PORT}")
        finish(ranks)
    assert {(r.lines[0]["host"], r.lines[0]["pid"]) for r in ranks} == {("node", 1000), ("node", 2000)}
    for r in ranks[2:]:
        for version, line in syncs(r).items():
            assert line["wrong"] == [] and line["received"] > 0, (version, line)
            assert line["mapped_from"] == line["pulled"] == line["handed"] == 0, line


def test_an_engine_on_the_trainer_s_host_uses_shared_memory_and_one_on_another_host_the_group():
    with Hosts(["a", "c"]) as hosts:
        ranks = [*trainers("a", "--engines", "1:2"), *engine(0, "a"), *engine(1, "c")]
        start(hosts, ranks, f"tcp://{hosts.name_of('a')}:{PORT}")
        finish(ranks)
    for r in ranks[2:]:
        for line in syncs(r).values():
            assert line["wrong"] == [], line
            if r.host == "a":  # the trainer's storages, mapped: no payload over the group
                assert line["mapped_from"] > 0 and line["received"] == 0, line
            else:
                assert line["received"] > 0 and line["mapped_from"] == line["pulled"] == 0, line


def test_a_coordinator_reached_over_loopback_while_peers_are_on_other_hosts_is_refused_on_every_rank():
    """The trainer names its own address 0.0.0.0 (its route to that is loopback), the engine names the host
    by its address: the trainer's group connections would listen on loopback, which the engine cannot
    reach. Refused at the handshake, naming the trainer rank, its host and the loopback address."""
    with Hosts(["a", "b"]) as hosts:
        ranks = [*trainers("a", "--syncs", "1"), *engine(0, "b", "--syncs", "1")]
        start(hosts, ranks[:2], f"tcp://0.0.0.0:{PORT}", timeout=20)
        start(hosts, ranks[2:], f"tcp://{hosts.address('a')}:{PORT}", timeout=20)
        for r in ranks:
            assert r.proc is not None
            r.proc.wait(60)
            r.err = r.proc.stderr.read() if r.proc.stderr else b""
    for r in ranks:
        assert r.proc is not None and r.proc.returncode != 0, r.name
        text = r.err.decode(errors="replace")
        assert "HandshakeError" in text and "over loopback (127.0.0.1)" in text, text[-2000:]
        assert "name the coordinator by an address every host reaches" in text, text[-2000:]

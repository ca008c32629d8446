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

from testbed.hosts import Hosts

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "tests" / "hosts" / "session_rank.py"
PORT = 29700


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


def lines_for(ranks: list[Rank], version: int) -> list[dict[str, Any] | None]:
    return [syncs(r).get(version) for r in ranks]


def go(control: Path, version: int) -> None:
    (control / f"go-{version}").touch()


TIMEOUT_S = 10.0  # every wait of every rank in the fault tests


def test_a_link_cut_during_a_sync_fails_every_rank_in_time_naming_the_peers_and_the_next_sync_succeeds(
    tmp_path: Path,
):
    """Sync 2 crosses a 2 Mbit/s link (about 1.5 s for the engine's bytes); 0.5 s in, the link is cut. Every
    rank fails within its timeout (plus the 1 s it spends telling its peers), naming the peers across the
    cut; the workers
    do not claim version 2. Once the link is back, both sides join a new handshake, in the same processes,
    and sync 3 lands every element."""
    with Hosts(["a", "b"]) as hosts:
        ranks = [
            *trainers("a", "--syncs", "1,2,3", "--control", str(tmp_path)),
            *engine(0, "b", "--syncs", "1,2,3"),
        ]
        start(hosts, ranks, f"tcp://{hosts.name_of('a')}:{PORT}", timeout=TIMEOUT_S)
        go(tmp_path, 1)
        until(lambda: all(lines_for(ranks, 1)), 120, "sync 1")
        hosts.shape("b", rate_bps=2 * 10**6)
        go(tmp_path, 2)
        time.sleep(0.5)
        hosts.cut("b")
        cut_at = time.monotonic()
        until(lambda: all(lines_for(ranks, 2)), 4 * TIMEOUT_S, "a failure of sync 2 on every rank")
        failed_within = time.monotonic() - cut_at
        hosts.restore("b")
        hosts.shape("b")
        go(tmp_path, 3)
        finish(ranks)
    first = lines_for(ranks, 1)
    assert all(line is not None and "error" not in line for line in first), first
    second = lines_for(ranks, 2)
    for r, line in zip(ranks, second, strict=True):
        assert line is not None and "error" in line, (r.name, line)
        assert line["seconds"] < TIMEOUT_S + 5, (r.name, line)  # the wait that timed out, then a 1 s notice
        assert "failed peer(s)" in line["error"] or "peers of this sync" in line["error"], (r.name, line)
    for line in second[:2]:  # the trainers name the engine across the cut, with its host's address
        assert "engine 0" in line["error"] and hosts.address("b") in line["error"], line
    for line in second[2:]:  # the workers name the trainer ranks across the cut
        assert "trainer rank" in line["error"] and hosts.address("a") in line["error"], line
        assert line["status"]["version"] == 1 and line["status"]["incomplete"] is True, line
    assert failed_within < TIMEOUT_S + 5, failed_within
    third = lines_for(ranks, 3)
    assert all(line is not None and "error" not in line for line in third), third
    assert all(line["wrong"] == [] for line in third[2:]), third


def test_a_sync_over_a_link_that_loses_5_percent_of_its_packets_lands_bit_for_bit():
    with Hosts(["a", "b"]) as hosts:
        hosts.shape("b", loss_pct=5)
        ranks = [*trainers("a", "--syncs", "1,2"), *engine(0, "b", "--syncs", "1,2")]
        start(hosts, ranks, f"tcp://{hosts.name_of('a')}:{PORT}", timeout=60)
        finish(ranks)
    for r in ranks[2:]:
        assert [(v, line["wrong"]) for v, line in syncs(r).items()] == [(1, []), (2, [])], r.lines


def test_a_host_killed_mid_sync_is_named_by_the_survivors_in_time_and_the_trainer_goes_on_with_the_others(
    tmp_path: Path,
):
    """Engines on hosts b and c; during sync 2 (c's link slowed to 2 Mbit/s) every process of host c is
    SIGKILLed. The trainer ranks and engine 0 fail in time, naming engine 1; then the trainer joins a new
    handshake with one engine, engine 0 rejoins, and sync 3 lands every element on it."""
    with Hosts(["a", "b", "c"]) as hosts:
        ctl = ["--control", str(tmp_path)]
        ranks = [
            *trainers("a", "--syncs", "1,2,3", "--engines", "1:2,3:1", *ctl),
            *engine(0, "b", "--syncs", "1,2,3"),
            *engine(1, "c", "--syncs", "1,2,3"),
        ]
        start(hosts, ranks, f"tcp://{hosts.name_of('a')}:{PORT}", timeout=TIMEOUT_S)
        go(tmp_path, 1)
        until(lambda: all(lines_for(ranks, 1)), 120, "sync 1")
        hosts.shape("c", rate_bps=2 * 10**6)
        go(tmp_path, 2)
        time.sleep(0.5)
        hosts.kill("c")
        killed_at = time.monotonic()
        survivors = ranks[:4]
        until(lambda: all(lines_for(survivors, 2)), 4 * TIMEOUT_S, "a failure of sync 2 on every survivor")
        failed_within = time.monotonic() - killed_at
        go(tmp_path, 3)
        finish(survivors)
    assert failed_within < 2 * TIMEOUT_S + 5, failed_within
    for r, line in zip(survivors, lines_for(survivors, 2), strict=True):
        assert line is not None and "error" in line, (r.name, line)
        assert "engine 1" in line["error"] and hosts.address("c") in line["error"], (r.name, line)
    third = lines_for(survivors, 3)
    assert all(line is not None and "error" not in line for line in third), third
    assert all(line["wrong"] == [] for line in third[2:]), third


def test_an_engine_host_that_starts_late_is_admitted_at_the_next_handshake(tmp_path: Path):
    """The trainer syncs engine 0 (host b); engine 1 starts on host c after sync 1 and waits; before sync 2
    the trainer joins a new handshake for two engines, engine 0 rejoins it, and sync 2 lands every element on
    both engines, over the group."""
    with Hosts(["a", "b", "c"]) as hosts:
        ranks = [
            *trainers("a", "--syncs", "1,2", "--engines", "1:1,2:2", "--control", str(tmp_path)),
            *engine(0, "b", "--syncs", "1,2", "--rejoin", "2"),
        ]
        late = engine(1, "c", "--syncs", "2")
        address = f"tcp://{hosts.name_of('a')}:{PORT}"
        start(hosts, ranks, address, timeout=TIMEOUT_S)
        go(tmp_path, 1)
        until(lambda: all(lines_for(ranks, 1)), 120, "sync 1")
        start(hosts, late, address, timeout=TIMEOUT_S)
        waiting = lambda: all(any("joining" in line for line in r.lines) for r in late)  # noqa: E731
        until(waiting, 120, "the late engine's workers joining")  # started (slow on a busy machine)
        go(tmp_path, 2)
        finish([*ranks, *late])
    for r in [*ranks[2:], *late]:
        for line in syncs(r).values():
            assert "error" not in line and line["wrong"] == [] and line["received"] > 0, (r.name, line)
    assert [sorted(syncs(r)) for r in late] == [[2], [2]]

"""Group-free syncs (backend ``nixl``) across emulated hosts: each rollout worker reads its half straight from
the trainer ranks' registered storages through NIXL (UCX over TCP on the link), no process group between
them. Same programs as ``test_session_hosts`` (``session_rank.py``), with ``--backend nixl`` on the trainer."""

from __future__ import annotations

import time
from pathlib import Path

from testbed.hosts import Hosts
from tests.hosts import test_session_hosts as session

NIXL = ("--backend", "nixl")


def test_workers_on_another_host_with_the_same_hostname_and_pids_read_every_element_from_the_trainer_ranks():
    """Trainer ranks (ZeRO-3 partitions) on host a, a TP-2 engine on host b with the same hostname and the
    same pids: every worker reads its half over the link (UCX over TCP, not a same-host read of whatever
    process has that pid), bit for bit, three syncs in a row; what crossed into host b is at least what the
    workers read, and nothing went over a group."""
    with Hosts(["a", "b"], hostnames={"a": "node", "b": "node"}) as hosts:
        ranks = [
            *session.trainers("a", *NIXL, "--syncs", "1,2,3"),
            *session.engine(0, "b", "--syncs", "1,2,3"),
        ]
        for r, pid in zip(ranks, (1000, 2000, 1000, 2000), strict=True):
            r.next_pid = pid
        before = hosts.bytes_into("b")
        session.start(hosts, ranks, f"tcp://{hosts.address('a')}:{session.PORT}")
        session.finish(ranks)
        crossed = hosts.bytes_into("b") - before
    assert {(r.lines[0]["host"], r.lines[0]["pid"]) for r in ranks} == {("node", 1000), ("node", 2000)}
    read = 0
    for r in ranks[2:]:
        lines = session.syncs(r)
        assert sorted(lines) == [1, 2, 3], r.lines
        for line in lines.values():
            assert line["wrong"] == [] and line["received"] > 0, line
            assert line["sent"] == line["mapped_from"] == line["pulled"] == line["handed"] == 0, line
        read += sum(line["received"] for line in lines.values())
    for r in ranks[:2]:
        assert all(line["sent"] > 0 and "error" not in line for line in session.syncs(r).values()), r.lines
    assert crossed >= read, (crossed, read)


def test_delta_syncs_read_only_what_changed_from_each_trainer_rank_s_export_bit_for_bit():
    """Delta syncs over NIXL (``transport.nixl_delta``), trainer ranks on host a, a TP-2 engine on host b:
    sync 1 is full (no base yet); in syncs 2 to 4 about 1% of every tensor's elements changed, and each
    worker reads only its coded region of each trainer rank's export, applies it on the version it holds,
    and every element equals the trainer's bit for bit."""
    with Hosts(["a", "b"]) as hosts:
        delta = ("--syncs", "1,2,3,4", "--delta", "0.01")
        ranks = [*session.trainers("a", *NIXL, *delta), *session.engine(0, "b", *delta)]
        session.start(hosts, ranks, f"tcp://{hosts.address('a')}:{session.PORT}")
        session.finish(ranks)
    for r in ranks[2:]:
        lines = session.syncs(r)
        assert sorted(lines) == [1, 2, 3, 4] and all(line["wrong"] == [] for line in lines.values()), r.lines
        assert lines[1]["delta_base"] is None, lines[1]
        for v in (2, 3, 4):
            assert lines[v]["delta_base"] == v - 1, lines[v]
            assert 0 < lines[v]["received"] < 0.1 * lines[1]["received"], (lines[1], lines[v])
    for r in ranks[:2]:
        lines = session.syncs(r)
        assert all("error" not in line and line["dropped"] == [] for line in lines.values()), r.lines
        assert all(lines[v]["sent"] < 0.1 * lines[1]["sent"] for v in (2, 3, 4)), r.lines


def test_targets_made_while_written_as_vllm_s_loaded_forms_are_made_once_filled_and_closed_once_per_sync():
    """Workers whose targets are placeholders that a stream makes at their first part and closes after their
    last (what vLLM's packed layers do on AVX-512 and AMX CPUs): every target made once per sync, staged
    within a 4 KiB cap, closed once, bit for bit."""
    with Hosts(["a", "b"]) as hosts:
        ranks = [
            *session.trainers("a", *NIXL, "--syncs", "1,2"),
            *session.engine(0, "b", "--syncs", "1,2", "--stream", "--cap", "4096"),
        ]
        session.start(hosts, ranks, f"tcp://{hosts.address('a')}:{session.PORT}")
        session.finish(ranks)
    for r in ranks[2:]:
        lines = session.syncs(r)
        assert sorted(lines) == [1, 2] and all(line["wrong"] == [] for line in lines.values()), r.lines


def attached(r: session.Rank) -> list[int]:
    return [line["attached"] for line in r.lines if "attached" in line]


def test_a_link_cut_during_a_group_free_sync_fails_in_time_naming_the_peers_and_the_workers_rejoin_alone(
    tmp_path: Path,
):
    """Sync 2 crosses a 1 Mbit/s link; 0.5 s in, the link is cut. The workers' reads fail within the timeout
    naming the trainer ranks across the cut (with their address), and they do not claim version 2; each
    trainer rank's sync 2 reached no worker and says so, naming the engine's workers and their address. Once
    the link is back, the workers join again through the admission desk; the trainer ranks never join a new
    handshake, and sync 3 lands every element."""
    timeout = session.TIMEOUT_S
    with Hosts(["a", "b"]) as hosts:
        ranks = [
            *session.trainers("a", *NIXL, "--syncs", "1,2,3", "--control", str(tmp_path)),
            *session.engine(0, "b", "--syncs", "1,2,3"),
        ]
        session.start(hosts, ranks, f"tcp://{hosts.name_of('a')}:{session.PORT}", timeout=timeout)
        session.go(tmp_path, 1)
        session.until(lambda: all(session.lines_for(ranks, 1)), 120, "sync 1")
        hosts.shape("b", rate_bps=10**6, burst_bytes=96 * 1024)  # both workers' reads take over 2 s
        session.go(tmp_path, 2)
        time.sleep(0.5)
        hosts.cut("b")
        cut_at = time.monotonic()
        session.until(
            lambda: all(session.lines_for(ranks, 2)), 4 * timeout, "a failure of sync 2 on every rank"
        )
        failed_within = time.monotonic() - cut_at
        hosts.restore("b")
        hosts.shape("b")
        rejoined = lambda: all(any(line.get("joined") == 3 for line in r.lines) for r in ranks[2:])  # noqa: E731
        try:
            session.until(rejoined, 4 * timeout, "the workers joining again")
        except AssertionError as exc:
            for r in ranks:
                assert r.proc is not None
                Hosts.stop(r.proc)
            errs = [(r.proc.stderr.read() if r.proc and r.proc.stderr else b"")[-3000:] for r in ranks]
            raise AssertionError(f"{exc}: {[r.lines for r in ranks]} {errs}") from None
        session.go(tmp_path, 3)
        session.finish(ranks)
    first = session.lines_for(ranks, 1)
    assert all(line is not None and "error" not in line for line in first), first
    second = session.lines_for(ranks, 2)
    for r, line in zip(ranks, second, strict=True):
        assert line is not None and "error" in line, (r.name, line)
        assert line["seconds"] < timeout + 5, (r.name, line)
    for line in second[:2]:  # the trainer ranks name the engine's workers across the cut, with their address
        assert "reached no worker" in line["error"] and "engine 0 worker" in line["error"], line
        assert hosts.address("b") in line["error"], line
    for line in second[2:]:  # the workers name the trainer ranks across the cut
        assert "trainer rank" in line["error"] and hosts.address("a") in line["error"], line
        assert line["status"]["version"] == 1 and line["status"]["incomplete"] is True, line
    assert failed_within < timeout + 5, failed_within
    third = session.lines_for(ranks, 3)
    assert all(line is not None and "error" not in line for line in third), third
    assert all(line["wrong"] == [] for line in third[2:]), third
    assert [attached(r) for r in ranks[:2]] == [[1], [1]], [r.lines for r in ranks[:2]]


def test_a_host_killed_mid_sync_is_dropped_by_name_and_the_other_engine_s_sync_completes_without_a_new_handshake(
    tmp_path: Path,
):
    """Engines on hosts b and c; during sync 2 (c's link slowed to 2 Mbit/s) every process of host c is
    SIGKILLed. Engine 0's workers complete sync 2 bit for bit; the trainer ranks' sync 2 completes for them
    within one timeout and names engine 1 (and its address) as dropped; sync 3 goes on with engine 0 alone,
    with no new handshake on any side."""
    timeout = session.TIMEOUT_S
    with Hosts(["a", "b", "c"]) as hosts:
        ctl = ["--control", str(tmp_path)]
        ranks = [
            *session.trainers("a", *NIXL, "--syncs", "1,2,3", "--engines", "1:2", *ctl),
            *session.engine(0, "b", "--syncs", "1,2,3"),
            *session.engine(1, "c", "--syncs", "1,2,3"),
        ]
        address = f"tcp://{hosts.name_of('a')}:{session.PORT}"
        session.start(hosts, ranks[:2], address, timeout=timeout)
        # engine 0 waits for sync 3 while the trainer's sync 2 waits a whole timeout for engine 1
        session.start(hosts, ranks[2:], address, timeout=3 * timeout)
        session.go(tmp_path, 1)
        session.until(lambda: all(session.lines_for(ranks, 1)), 120, "sync 1")
        hosts.shape("c", rate_bps=2 * 10**6)
        session.go(tmp_path, 2)
        time.sleep(0.5)
        hosts.kill("c")
        survivors = ranks[:4]
        session.until(lambda: all(session.lines_for(survivors, 2)), 4 * timeout, "sync 2 on every survivor")
        session.go(tmp_path, 3)
        session.finish(survivors)
    for r in survivors:
        lines = session.syncs(r)
        assert sorted(lines) == [1, 2, 3] and all("error" not in line for line in lines.values()), [
            str(x) for x in r.lines
        ]
    for r in ranks[:2]:
        second = session.syncs(r)[2]
        assert second["seconds"] < timeout + 5, second
        assert [d for d in second["dropped"] if "engine 1 worker" in d and hosts.address("c") in d], second
        assert len(second["dropped"]) == 2 and session.syncs(r)[3]["dropped"] == [], r.lines
        assert attached(r) == [1], r.lines
    for r in ranks[2:4]:
        assert all(line["wrong"] == [] for line in session.syncs(r).values()), r.lines
        assert [line["joined"] for line in r.lines if "joined" in line] == [1], r.lines


def test_an_engine_that_starts_late_joins_at_the_next_sync_boundary_and_the_others_do_nothing(tmp_path: Path):
    """The trainer ranks sync engine 0 (host b); engine 1 starts on host c after sync 1, joins through the
    admission desk, and sync 2 reaches both engines bit for bit. Neither the trainer ranks nor engine 0 join
    a new handshake."""
    with Hosts(["a", "b", "c"]) as hosts:
        ctl = ["--control", str(tmp_path)]
        early = [
            *session.trainers("a", *NIXL, "--syncs", "1,2,3", *ctl),
            *session.engine(0, "b", "--syncs", "1,2,3"),
        ]
        late = session.engine(1, "c", "--syncs", "2,3")
        address = f"tcp://{hosts.name_of('a')}:{session.PORT}"
        session.start(hosts, early, address, timeout=60)
        session.go(tmp_path, 1)
        session.until(lambda: all(session.lines_for(early, 1)), 120, "sync 1")
        session.start(hosts, late, address, timeout=60)
        joined = lambda: all(any("joined" in line for line in r.lines) for r in late)  # noqa: E731
        session.until(joined, 120, "the late engine's workers joining")
        session.go(tmp_path, 2)
        session.go(tmp_path, 3)
        session.finish([*early, *late])
    for r in early[:2]:
        lines = session.syncs(r)
        assert all("error" not in line and line["dropped"] == [] for line in lines.values()), r.lines
        assert lines[2]["sent"] > lines[1]["sent"], r.lines  # sync 2 reached both engines
        assert attached(r) == [1], r.lines
    for r in [*early[2:], *late]:
        lines = session.syncs(r)
        assert all(line["wrong"] == [] for line in lines.values()), r.lines
        assert len([line for line in r.lines if "joined" in line]) == 1, r.lines
    assert sorted(session.syncs(late[0])) == [2, 3]


def test_a_trainer_rank_killed_mid_read_fails_every_worker_in_time_naming_it_and_no_rank_hangs(
    tmp_path: Path,
):
    """Trainer rank 0 on host a, trainer rank 1 on host c, an engine on host b. During sync 2 (c's link slowed to
    200 kbit/s), every process of host c is SIGKILLed while the workers read from it. Every worker still reading
    fails sync 2 within its timeout, naming trainer rank 1 and its address, and claims nothing (one whose reads
    were all in holds version 2 bit for bit); trainer rank 0 learns of it from the workers and its sync 2 fails
    too, naming them; no process hangs."""
    timeout = session.TIMEOUT_S
    with Hosts(["a", "b", "c"]) as hosts:
        ctl = ["--control", str(tmp_path)]
        ranks = [
            session.Rank("trainer", 0, "a", [*NIXL, "--syncs", "1,2", *ctl]),
            session.Rank("trainer", 1, "c", [*NIXL, "--syncs", "1,2", *ctl]),
            *session.engine(0, "b", "--syncs", "1,2"),
        ]
        session.start(hosts, ranks, f"tcp://{hosts.name_of('a')}:{session.PORT}", timeout=timeout)
        session.go(tmp_path, 1)
        session.until(lambda: all(session.lines_for(ranks, 1)), 120, "sync 1")
        hosts.shape("c", rate_bps=2 * 10**5, burst_bytes=70 * 1024)  # each worker's read from c: over 1 s
        session.go(tmp_path, 2)
        time.sleep(0.5)
        hosts.kill("c")
        killed_at = time.monotonic()
        survivors = [ranks[0], *ranks[2:]]
        session.until(lambda: all(session.lines_for(survivors, 2)), 4 * timeout, "sync 2 on every survivor")
        failed_within = time.monotonic() - killed_at
        session.finish(survivors)
    assert failed_within < timeout + 5, failed_within
    failed = 0
    for line in session.lines_for(ranks[2:], 2):
        assert line is not None, ranks[2:]
        if "error" not in line:  # this worker's reads were all in before the kill: bit for bit, then
            assert line["wrong"] == [], line
            continue
        failed += 1
        assert "trainer rank 1" in line["error"] and hosts.address("c") in line["error"], line
        assert line["status"]["version"] == 1 and line["status"]["incomplete"] is True, line
    assert failed >= 1, session.lines_for(ranks[2:], 2)
    line = session.syncs(ranks[0])[2]
    assert "error" in line and "engine 0 worker" in line["error"], line

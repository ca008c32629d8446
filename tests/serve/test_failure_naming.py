"""Naming the peers a failed sync is to blame on (``rollout_sync.sync.roster``): pure logic, no engines."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

from rollout_sync.sync.roster import RosterEntry, blame, decode_roster, encode_roster, process_gone

ROSTER = {
    0: RosterEntry(0, None, 0, "h", 100, "h"),
    1: RosterEntry(1, None, 1, "h", 101, "h"),
    2: RosterEntry(2, 0, 0, "h", 200, "h"),
    3: RosterEntry(3, 1, 0, "h", 300, "h"),
    4: RosterEntry(4, 1, 1, "other", 301, "other"),
}


def test_a_roster_survives_the_welcome_round_trip() -> None:
    assert decode_roster(encode_roster(list(ROSTER.values()))) == ROSTER
    assert decode_roster(None) == {}


ENGINE_1 = "engine 1 (global ranks 3, 4: worker 0 pid 300 on h, worker 1 pid 301 on other)"


def test_a_dead_local_worker_names_its_whole_engine_and_which_process_is_gone() -> None:
    text = "rank 0: the plan agreement failed (a peer died or left): Connection closed by peer"
    got = blame(text, 0, ROSTER, gone=lambda pid: pid == 300, machine="h")
    assert got == f"failed peer(s): {ENGINE_1} (process gone: global rank 3)"


def test_a_peer_named_by_the_error_is_blamed_with_its_engine_when_no_local_process_is_gone() -> None:
    text = "rank 1: sending to rank 4 (round 0) made no progress within 20 s"
    got = blame(text, 1, ROSTER, gone=lambda pid: False, machine="h")
    assert got == f"failed peer(s): {ENGINE_1} (named by the error: global rank 4)"


def test_two_dead_trainer_ranks_are_each_named() -> None:
    got = blame(
        "rank 2: the sync's commit failed", 2, ROSTER, gone=lambda pid: pid in (100, 101), machine="h"
    )
    assert got == (
        "failed peer(s): trainer rank 0 (global rank 0, pid 100 on h); trainer rank 1 (global rank 1, pid 101 "
        "on h) (process gone: global ranks 0, 1)"
    )


def test_a_dead_trainer_rank_is_named_as_a_trainer_rank() -> None:
    got = blame("rank 2: the sync's commit failed", 2, ROSTER, gone=lambda pid: pid == 101, machine="h")
    assert got == "failed peer(s): trainer rank 1 (global rank 1, pid 101 on h) (process gone: global rank 1)"


def test_without_evidence_every_engine_is_listed_and_without_a_roster_nothing_is_added() -> None:
    got = blame("rank 0: the plan agreement did not complete", 0, ROSTER, gone=lambda pid: False, machine="h")
    assert got == f"the failed peer is not known; peers of this sync on other hosts: {ENGINE_1}"
    on_one_host = {r: replace(e, machine="h") for r, e in ROSTER.items()}
    got = blame(
        "rank 0: the plan agreement did not complete", 0, on_one_host, gone=lambda pid: False, machine="h"
    )
    assert got.startswith("the failed peer is not known; peers of this sync: engine 0 (global ranks 2")
    assert "engine 1 (global ranks 3, 4" in got and "trainer rank" not in got
    got = blame("rank 2: the commit did not complete", 2, on_one_host, gone=lambda pid: False, machine="h")
    assert got.startswith(
        "the failed peer is not known; peers of this sync: trainer rank 0 (global rank 0"
    ), got
    assert blame("rank 0: anything", 0, {}) == ""


def test_a_process_that_exited_is_gone_and_a_live_one_is_not() -> None:
    assert not process_gone(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(30)
    assert process_gone(child.pid)

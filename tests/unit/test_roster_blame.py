"""Who a failed sync is blamed on (``rollout_sync.sync.roster.blame``): the peers the error names, the local
peers whose process is gone, looked for again for a while where neither is seen yet (a killed peer resets its
connections before the kernel has reaped it)."""

from __future__ import annotations

from rollout_sync.sync.roster import RosterEntry, blame

HOST = "node-a"
ROSTER = {
    0: RosterEntry(0, None, 0, HOST, 100, HOST),
    1: RosterEntry(1, None, 1, HOST, 101, HOST),
    2: RosterEntry(2, 0, 0, HOST, 200, HOST),
    3: RosterEntry(3, 0, 1, HOST, 201, HOST),
    4: RosterEntry(4, 1, 0, HOST, 300, HOST),
    5: RosterEntry(5, 1, 1, HOST, 301, HOST),
}


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_a_peer_whose_process_is_gone_is_named_with_its_whole_engine() -> None:
    sentence = blame("connection reset", 0, ROSTER, gone=lambda pid: pid == 301, machine=HOST, grace=0)
    assert sentence.startswith("failed peer(s): engine 1 (global ranks 4, 5: worker 0 pid 300")
    assert "process gone: global rank 5" in sentence


def test_a_peer_reaped_only_after_the_failure_is_still_found_within_the_grace() -> None:
    clock = _Clock()
    sentence = blame(
        "Read error: Connection reset by peer",
        0,
        ROSTER,
        gone=lambda pid: pid in (300, 301) and clock.now >= 0.5,  # reaped half a second later
        machine=HOST,
        grace=3.0,
        clock=clock,
        sleep=clock.sleep,
    )
    assert sentence.startswith("failed peer(s): engine 1 (global ranks 4, 5"), sentence
    assert 0.5 <= clock.now < 0.6


def test_without_evidence_it_waits_the_grace_at_most_and_lists_every_engine() -> None:
    clock = _Clock()
    sentence = blame(
        "the allgather failed",
        0,
        ROSTER,
        gone=lambda pid: False,
        machine=HOST,
        clock=clock,
        sleep=clock.sleep,
    )
    assert sentence.startswith("the failed peer is not known; peers of this sync: engine 0"), sentence
    assert "engine 1 (global ranks 4, 5" in sentence
    assert 3.0 <= clock.now < 3.1


def test_a_peer_the_error_names_is_blamed_at_once() -> None:
    clock = _Clock()
    sentence = blame(
        "rank 0: receiving from rank 3 (round 2) failed",
        0,
        ROSTER,
        gone=lambda pid: False,
        machine=HOST,
        clock=clock,
        sleep=clock.sleep,
    )
    assert sentence.startswith("failed peer(s): engine 0 (global ranks 2, 3"), sentence
    assert "named by the error: global rank 3" in sentence
    assert clock.now == 0.0

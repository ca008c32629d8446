"""The rank runner the executor tests rely on: it returns results, re-raises a rank's error with its
traceback, and never hangs (a stuck or dead rank becomes an error, leftover children are killed)."""

from __future__ import annotations

import os
import time

import pytest

from tests.harness.ranks import RankFailed, RanksTimedOut, run_on_ranks


def _echo(rank: int, world: int, group, base: int) -> tuple[int, int, int]:
    return rank, group.size(), base + group.rank()


def _raises_on_rank_one(rank: int, world: int, group) -> int:
    if rank == 1:
        raise KeyError("missing storage on rank one")
    return rank


def _rank_one_hangs(rank: int, world: int, group, pidfile: str) -> int:
    if rank == 1:
        with open(pidfile, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)
    return rank


def _rank_one_dies(rank: int, world: int, group) -> int:
    if rank == 1:
        os._exit(9)
    return rank


def test_every_rank_s_result_comes_back_in_rank_order_over_a_group_of_the_right_size() -> None:
    assert run_on_ranks(_echo, 3, 10, timeout=120) == [(0, 3, 10), (1, 3, 11), (2, 3, 12)]


def test_a_rank_s_exception_is_raised_in_the_parent_with_its_traceback() -> None:
    with pytest.raises(KeyError, match="missing storage on rank one") as info:
        run_on_ranks(_raises_on_rank_one, 2, timeout=120)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "raised on rank 1" in notes and "_raises_on_rank_one" in notes


def test_a_hanging_rank_becomes_a_timeout_and_is_killed(tmp_path) -> None:
    pidfile = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(RanksTimedOut, match=r"ranks \[1\]"):
        run_on_ranks(_rank_one_hangs, 2, str(pidfile), timeout=25)
    assert time.monotonic() - start < 60
    pid = int(pidfile.read_text())
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_rank_that_dies_without_reporting_is_an_error_unless_allowed() -> None:
    with pytest.raises(RankFailed, match="rank 1 died without reporting"):
        run_on_ranks(_rank_one_dies, 2, timeout=120)
    assert run_on_ranks(_rank_one_dies, 2, timeout=120, may_die={1}) == [0, None]
